"""pytest-benchmark entry points for the matmul paths (tiny shapes: these run in CI with the tests).

``pytest bench/bench_matmul.py`` prints pytest-benchmark's table; the full sweep is ``python -m bench``.
Every benchmark checks its answer against the float64 reference before it is timed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import nybble
from bench.peers import xla_int4_matmul
from bench.runner import BF16_TOLERANCE
from nybble.kernels import available_implementations, reference_matmul, relative_error
from nybble.packing import nk_int4_as_int4
from nybble.quant import relayout

K, N, M = 576, 1536, 16  # SmolLM2-135M gate/up, a short prompt


@pytest.fixture(scope="module")
def operands():
    w = 0.02 * jax.random.normal(jax.random.key(0), (K, N), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (M, K), jnp.bfloat16)
    return x, w, nybble.quantize(w, group_size=128), nybble.quantize(w, group_size=None)


def _run(benchmark, fn, *args):
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))  # compile outside the timing
    return benchmark.pedantic(
        lambda: jax.block_until_ready(fn(*args)), rounds=20, iterations=1, warmup_rounds=2
    )


def _runnable_here() -> list[str]:
    """The implementations that can run these operands on this machine (the Mosaic kernel on Hopper)."""
    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((K, N), jnp.float32)
    qw = jax.eval_shape(lambda w: nybble.quantize(w, group_size=128), w)
    return [name for name, avail in available_implementations(x, qw).items() if avail]


@pytest.mark.parametrize("implementation", _runnable_here())
def test_nybble_matmul(benchmark, operands, implementation):
    x, _, qw, _ = operands
    y = _run(benchmark, lambda a, b: nybble.matmul(a, b, implementation=implementation), x, qw)
    assert relative_error(y, reference_matmul(x, qw)) < BF16_TOLERANCE


def test_xla_bf16_dot(benchmark, operands):
    x, w, _, _ = operands
    wb = w.astype(jnp.bfloat16)
    y = _run(benchmark, lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32), x, wb)
    assert relative_error(y, jnp.asarray(x, jnp.float32) @ wb.astype(jnp.float32)) < BF16_TOLERANCE


def test_xla_int4_per_column(benchmark, operands):
    x, _, _, qc = operands
    w4 = nk_int4_as_int4(relayout(qc, "nk_int4").codes)
    y = _run(benchmark, lambda a, b, s: xla_int4_matmul(a, b, s, N), x, w4, qc.scales[0])
    assert relative_error(y, reference_matmul(x, qc)) < BF16_TOLERANCE
