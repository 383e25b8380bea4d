"""The Blackwell (tcgen05, TMEM) kernels, dense and grouped, on a real Blackwell GPU against float64.

Where it runs:
  * on a GPU of compute capability 10.x (B200, GB200, B300; ``make gpu-check`` picks this file there):
    every case below, compiled by Mosaic GPU for the GPU, which interpret mode only emulates (TMEM, the
    tcgen05 MMA's asynchrony, TMA, barriers);
  * without one (CI, or a Hopper GPU): the first case of each test in GPU interpret mode as a B200 (a smoke
    check of this module; tests/test_blackwell_interpret.py and tests/test_blackwell_grouped.py are CI's
    full check of the numbers);
  * ``NYBBLE_GPU_TESTS_REQUIRE_GPU=1`` (bench/gpu_check.sh sets it): the module refuses to be collected
    unless a Blackwell GPU runs it, so a GPU check never passes on interpret mode.

What is checked: every tiling the B200 heuristics can pick, dense (tests/test_blackwell_interpret.CASES) and
grouped (tests/test_blackwell_grouped.CASES), on the problems that pick it, bit-exact on small integers or
within the rounding bound of the float64 reference; ``nybble.matmul`` / ``nybble.ragged_matmul`` with
``implementation=None`` take these kernels; Llama-3-8B q/o at M = 1, 16, 64, 2048 on random data.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
import nybble.kernels.mosaic_gpu as mg
from nybble import device
from nybble.kernels.mosaic_gpu.blackwell import blackwell_grouped_matmul, blackwell_matmul, plan
from nybble.kernels.mosaic_gpu.interpret import interpret
from tests import test_blackwell_grouped as grouped_cases
from tests import test_blackwell_interpret as dense_cases
from tests.kernel_checks import (
    activations,
    assert_exact,
    assert_kernel_within_rounding,
    env_flag,
    exact_weight,
    random_weight,
)
from tests.test_grouped_interpret import assert_exact as assert_grouped_exact
from tests.test_grouped_interpret import reference as grouped_reference


def _mode() -> tuple[str, str]:
    """("gpu", the device) on a Blackwell GPU (compute capability 10.x), else ("interpret", why not)."""
    gpu = device.gpu_device()
    cc = str(getattr(gpu, "compute_capability", "")) if gpu is not None else ""
    if cc.startswith("10."):
        return "gpu", str(gpu.device_kind)
    why = f"the GPU here has compute capability {cc}" if gpu is not None else "no GPU here"
    if env_flag("NYBBLE_GPU_TESTS_REQUIRE_GPU"):
        raise RuntimeError(
            f"NYBBLE_GPU_TESTS_REQUIRE_GPU=1 but the Blackwell GPU tests would run in interpret mode ({why})"
        )
    return "interpret", why


MODE = _mode()
ON_GPU = MODE[0] == "gpu"


def _cases(cases: list) -> list:
    """Every case on a Blackwell GPU; the first one (a smoke check) in interpret mode."""
    return cases if ON_GPU else cases[:1]


def _running():
    """The kernels as they run here: on the GPU itself, or interpreted as a B200 with races checked."""
    return contextlib.nullcontext() if ON_GPU else interpret(detect_races=True, gpu="b200")


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    mg.reset_state()
    yield
    assert not mg.races_found(), "the race detector flagged a data race"


@pytest.mark.parametrize("case,tiling", _cases(dense_cases.CASES), ids=str)
def test_dense_heuristic_configs(case, tiling):
    m, k, n, group, symmetric, x_dtype, scale_dtype, exact = case
    rng = np.random.default_rng(m * 1000 + k + n)
    make = exact_weight if exact else random_weight
    qw = make(rng, k, n, group, symmetric, scale_dtype=scale_dtype)
    c = plan(m, qw).config
    assert (c.tile_m, c.tile_k, c.slices) == tiling
    x = activations(rng, m, k, x_dtype, exact=exact)
    with _running():
        y = blackwell_matmul(x, qw)
    assert y.shape == (m, n) and y.dtype == x.dtype
    if exact:
        assert_exact(y, x, qw)
    else:
        assert_kernel_within_rounding(y, x, qw, plan(m, qw).scales_on)


@pytest.mark.parametrize("case,tiling", _cases(grouped_cases.CASES), ids=str)
def test_grouped_heuristic_configs(case, tiling):
    sizes, rows, k, n, group, symmetric, dtype, exact = case
    rng = np.random.default_rng(rows * 100 + k)
    qw, ws = grouped_cases._stacked(rng, len(sizes), k, n, group, symmetric, exact)
    x = activations(rng, rows, k, dtype, exact=exact)
    with _running():
        y = blackwell_grouped_matmul(x, qw, jnp.asarray(sizes, jnp.int32))
    assert y.shape == (rows, n) and y.dtype == x.dtype
    if exact:
        assert_grouped_exact(np.asarray(y, np.float64), grouped_reference(x, ws, sizes))
    else:
        grouped_cases._assert_random_close(y, x, qw, ws, sizes)


def test_the_dispatcher_takes_the_blackwell_kernels():
    """``implementation=None`` runs the tcgen05 kernels here (their names are in the program), exact."""
    rng = np.random.default_rng(5)
    qw = exact_weight(rng, 256, 128, 64, False)
    x = activations(rng, 3, 256, exact=True)
    stack, ws = grouped_cases._stacked(rng, 2, 256, 128, 64, True, True)
    sizes = jnp.asarray([1, 2], jnp.int32)
    implementation = None if ON_GPU else "mosaic_gpu"  # interpret mode is only ever asked for by name
    with _running():
        dense_text = str(jax.make_jaxpr(lambda x: nybble.matmul(x, qw, implementation=implementation))(x))
        y = nybble.matmul(x, qw, implementation=implementation)
        ragged = lambda x: nybble.ragged_matmul(x, stack, sizes, implementation=implementation)
        grouped_text = str(jax.make_jaxpr(ragged)(x))
        yg = ragged(x)
    assert "nybble_w4a16_bw_" in dense_text and "nybble_grouped_w4a16_bw_" in grouped_text
    assert_exact(y, x, qw)
    assert_grouped_exact(np.asarray(yg, np.float64), grouped_reference(x, ws, [1, 2]))


# Llama-3-8B q/o (4096 x 4096, g128) on a GPU; a shrunk problem of the same kind in interpret mode.
_LLAMA = [(m, 4096, 4096) for m in (1, 16, 64, 2048)] if ON_GPU else [(1, 256, 128)]


@pytest.mark.parametrize("m,k,n", _LLAMA)
@pytest.mark.parametrize("symmetric", [True, False])
def test_llama_shapes_random(m, k, n, symmetric):
    rng = np.random.default_rng(m + k)
    qw = random_weight(rng, k, n, 128, symmetric)
    x = activations(rng, m, k, jnp.bfloat16, exact=False)
    with _running():
        y = blackwell_matmul(x, qw)
    assert_kernel_within_rounding(y, x, qw, plan(m, qw).scales_on)
