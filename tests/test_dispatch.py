"""nybble.matmul's dispatch checks the arguments against the Mosaic GPU kernel once per call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
import nybble.kernels.mosaic_gpu as mg
import nybble.kernels.mosaic_gpu.dense as mg_api


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


@pytest.fixture
def with_missing_backend(monkeypatch):
    """The registry with a backend registered between the kernel and XLA whose module this build lacks
    (as "triton" before its kernel lands): one line in BACKENDS."""
    from nybble.kernels import backends

    registry = {
        "mosaic_gpu": backends.BACKENDS["mosaic_gpu"],
        "absent": "nybble.kernels.no_such_backend",
        "xla": backends.BACKENDS["xla"],
    }
    monkeypatch.setattr(backends, "BACKENDS", registry)
    monkeypatch.setattr(backends, "IMPLEMENTATIONS", tuple(registry))
    monkeypatch.setattr(backends, "_LOADED", {})


def test_a_backend_missing_from_the_build_says_so(with_missing_backend):
    qw = nybble.quantize(np.arange(256 * 128, dtype=np.float32).reshape(256, 128) % 7 - 3, group_size=64)
    x = jnp.asarray(np.arange(4 * 256).reshape(4, 256) % 5 - 2, jnp.float32)
    avail = nybble.kernels.available_implementations(x, qw)
    assert list(avail) == ["mosaic_gpu", "absent", "xla"]
    assert not avail["absent"] and "'absent' backend is not installed in this build" in avail["absent"].reason
    assert "not 'absent': the 'absent' backend is not installed" in nybble.kernels.explain(x, qw)
    # implementation=None passes it over; the result is XLA's, bit for bit.
    from nybble.kernels.ops.matmul.xla import xla_matmul

    np.testing.assert_array_equal(np.asarray(nybble.matmul(x, qw)), np.asarray(xla_matmul(x, qw)))
    with pytest.raises(NotImplementedError, match=r"implementation='absent'\) cannot run: .*not installed"):
        nybble.matmul(x, qw, implementation="absent")
    sizes = jnp.asarray([2, 2], jnp.int32)
    stack = jax.tree.map(lambda a: jnp.stack([a, a]), qw)
    assert "not installed" in nybble.kernels.available_ragged_implementations(x, stack, sizes)["absent"]
