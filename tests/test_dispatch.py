"""nybble.matmul's dispatch checks the arguments against the Mosaic GPU kernel once per call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
import nybble.kernels.mosaic_gpu as mg
import nybble.kernels.mosaic_gpu.api as mg_api


@pytest.fixture
def count(monkeypatch):
    """Counts every call of ``is_supported``, through the package or the api module."""
    calls = []
    real = mg_api.is_supported

    def counting(x, qw):
        calls.append(1)
        return real(x, qw)

    monkeypatch.setattr(mg, "is_supported", counting)
    monkeypatch.setattr(mg_api, "is_supported", counting)
    return calls


def _args(k=256, n=128, dtype=jnp.bfloat16):
    qw = nybble.quantize(np.random.default_rng(0).normal(size=(k, n)).astype(np.float32), group_size=64)
    return jax.ShapeDtypeStruct((4, k), dtype), qw


@pytest.mark.parametrize("implementation", [None, "mosaic_gpu"])
def test_kernel_path_checks_once(count, implementation):
    x, qw = _args()
    with nybble.kernels.interpret():  # the kernel is chosen on a CPU; tracing is enough to count
        out = jax.eval_shape(lambda x: nybble.matmul(x, qw, implementation=implementation), x)
    assert out.shape == (4, 128) and out.dtype == jnp.bfloat16
    assert len(count) == 1


def test_xla_paths_check_at_most_once(count):
    x, qw = _args()
    jax.eval_shape(lambda x: nybble.matmul(x, qw), x)  # no Hopper, not interpreting: XLA, after one check
    assert len(count) == 1
    jax.eval_shape(lambda x: nybble.matmul(x, qw, implementation="xla"), x)
    assert len(count) == 1  # a forced XLA asks nothing of the kernel


def test_unsupported_arguments_fall_back_or_raise_after_one_check(count):
    x, qw = _args(dtype=jnp.float32)  # the kernel multiplies bf16/f16 only
    with nybble.kernels.interpret():
        assert jax.eval_shape(lambda x: nybble.matmul(x, qw), x).dtype == jnp.float32
        assert len(count) == 1
        with pytest.raises(NotImplementedError, match="float32"):
            jax.eval_shape(lambda x: nybble.matmul(x, qw, implementation="mosaic_gpu"), x)
    assert len(count) == 2
