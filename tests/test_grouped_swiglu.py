"""The grouped kernels' SwiGLU epilogue (``nybble.kernels.ragged_swiglu_matmul``;
``mosaic_gpu/grouped_swiglu.py``) against float64: Hopper's and Blackwell's grouped kernel, the op's XLA
path and dispatch, the lowering of every pick at the MoE shapes.

The Hopper kernel runs where tests/test_kernel_gpu.py's do (``kernel_checks.gpu_tests_mode``: a Hopper GPU,
else GPU interpret mode with the race detector); the Blackwell one in interpret mode as a B200.
Small-integer weights (``kernel_checks.exact_weight``) and activations of small integers times 2^-9 make the
gate and up products exact in f32 and put them in SiLU's range (a few units to tens), so the only errors left
are the epilogue's f32 arithmetic and the one rounding of y: within half a unit in the last place of the
float64 value. Groups of 0 to 5 rows (empty experts, groups across M tiles) and rows past the groups' sum
(zeros: silu(0) * 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
import nybble.kernels.mosaic_gpu as mg
from bench.xray.moe_cases import MOE_SHAPES, abstract_weight
from nybble.kernels import ragged_swiglu_matmul, reference_ragged_matmul
from nybble.kernels.mosaic_gpu import grouped_swiglu
from nybble.kernels.mosaic_gpu.config import TuningConfig
from nybble.packing.gate_up import concatenated_order
from tests.kernel_checks import (
    activations,
    exact_weight,
    gpu_tests_mode,
    k_wrapping_the_pipeline,
    run_where_gpu_tests_run,
)
from tests.test_swiglu import _assert_within_half_ulp

MODE, WHY = gpu_tests_mode()
NUM_SMS = 132


def _stacked(rng, experts: int, k: int, n: int, symmetric: bool):
    ws = [exact_weight(rng, k, n, 128, symmetric) for _ in range(experts)]
    return jax.tree.map(lambda *a: jnp.stack(a), *ws)


def _x(rng, rows: int, k: int, dtype):
    """Integers in [-16, 16] times 2^-9: exact in bf16 and f16, products exact in f32, z = O(1..10)."""
    return (activations(rng, rows, k, jnp.float32, exact=True) * 2.0**-9).astype(dtype)


def _check(y, x, qw, sizes, dtype) -> None:
    ref = grouped_swiglu.reference(x, qw, sizes)
    assert y.shape == ref.shape and y.dtype == dtype
    used = int(np.sum(sizes))
    assert np.abs(ref[:used]).max() > 1.0 and np.isfinite(ref).all()  # something to check
    assert (ref[used:] == 0).all()
    _assert_within_half_ulp(y, ref, dtype)


# One config of each epilogue geometry the grouped heuristics pick (test_every_pick_lowers_for_cuda
# lowers every pick at the MoE shapes): 8, 4 and 2 K slices, M tiles of 1, 2, 4 and 32 rows, with and without
# a producer warpgroup, both scale routes; groups of several rows across M tiles, empty experts, rows past
# the groups' sum.
ACC = dict(scales_on="accumulators")
HOPPER_CASES = [
    pytest.param(
        TuningConfig(tiles=4, tile_m=1, tile_k=256, slices=8, max_concurrent_steps=2, **ACC),
        [0, 1, 1, 0, 1, 0], 3, True, jnp.bfloat16, id="s8t4m1-decode",
    ),
    pytest.param(
        TuningConfig(tiles=4, tile_m=2, tile_k=256, slices=4, max_concurrent_steps=2, **ACC),
        [3, 0, 2, 1], 8, False, jnp.bfloat16, id="s4t4m2-asym-past-sum",
    ),
    pytest.param(
        TuningConfig(tiles=4, tile_m=4, tile_k=256, slices=2, max_concurrent_steps=2, producer=True, **ACC),
        [5, 0, 0, 4, 1], 10, True, jnp.float16, id="s2t4m4-producer-f16",
    ),
    pytest.param(
        TuningConfig(
            tiles=4, tile_m=32, tile_k=256, slices=2, max_concurrent_steps=2, producer=True,
            scales_on="weights",
        ),
        [20, 0, 13, 4], 40, False, jnp.bfloat16, id="s2t4m32-weights-producer",
    ),
]  # fmt: skip


@pytest.mark.parametrize("config, sizes, rows, symmetric, dtype", HOPPER_CASES)
def test_hopper_grouped_epilogue_within_rounding_of_float64(config, sizes, rows, symmetric, dtype):
    rng = np.random.default_rng(len(sizes) * 10 + rows)
    k = k_wrapping_the_pipeline(config, 128)
    n = max(128, 2 * config.cta_rows)  # two CTAs or more; N / 2 a multiple of 64
    qw = _stacked(rng, len(sizes), k, n, symmetric)
    x = _x(rng, rows, k, dtype)
    g = jnp.asarray(sizes, jnp.int32)
    run = lambda: grouped_swiglu.mosaic_gpu_grouped_swiglu(x, qw, g, config=config, num_sms=NUM_SMS)
    y = run_where_gpu_tests_run(run, MODE)
    assert y.shape == (rows, n // 2)
    _check(y, x, qw, sizes, dtype)


# The B200 picks: the accumulator route (symmetric) and the weights route (asymmetric), each with empty
# experts and rows past the sum.
BLACKWELL_CASES = [
    pytest.param(1024, 384, [3, 0, 2, 0, 4], 12, True, id="fold-sym"),
    pytest.param(2048, 256, [0, 2, 0, 1], 7, False, id="weights-asym"),
]


@pytest.mark.parametrize("k, n, sizes, rows, symmetric", BLACKWELL_CASES)
def test_blackwell_grouped_epilogue_within_rounding_of_float64(k, n, sizes, rows, symmetric):
    rng = np.random.default_rng(k + rows)
    qw = _stacked(rng, len(sizes), k, n, symmetric)
    x = _x(rng, rows, k, jnp.bfloat16)
    g = jnp.asarray(sizes, jnp.int32)
    p, _ = grouped_swiglu.grouped_swiglu_plan(rows, qw, num_sms=148, family="blackwell")
    assert p.config.slices > 1 and p.swiglu and p.norm is None
    mg.reset_state()
    with nybble.kernels.interpret(detect_races=True, gpu="b200"):
        y = jax.block_until_ready(ragged_swiglu_matmul(x, qw, g))  # implementation=None: the kernel here
    assert not mg.races_found(), "the race detector flagged a data race"
    _check(y, x, qw, sizes, jnp.bfloat16)


def test_the_op_dispatches_and_its_xla_path_rounds_once_more():
    """implementation=None runs the kernel inside interpret() (the same numbers as calling it), and the XLA
    path elsewhere: the product rounded to x's dtype, then the SiLU product (within two roundings)."""
    rng = np.random.default_rng(3)
    sizes = [2, 0, 3, 1]
    qw = _stacked(rng, 4, 1024, 256, True)
    x = _x(rng, 7, 1024, jnp.bfloat16)
    g = jnp.asarray(sizes, jnp.int32)
    with nybble.kernels.interpret():
        op = ragged_swiglu_matmul(x, qw, g)
        kernel = grouped_swiglu.mosaic_gpu_grouped_swiglu(x, qw, g, num_sms=nybble.kernels.num_sms())
    np.testing.assert_array_equal(np.asarray(op, np.float32), np.asarray(kernel, np.float32))
    xla = ragged_swiglu_matmul(x, qw, g, implementation="xla")
    # Its reference: the float64 product rounded to bf16 (nybble.ragged_matmul's result), then float64.
    product = np.asarray(jnp.asarray(reference_ragged_matmul(x, qw, g), jnp.bfloat16), np.float64)
    gate, up = (product[:, concatenated_order(128)][:, h * 128 : (h + 1) * 128] for h in (0, 1))
    rounded_ref = gate / (1.0 + np.exp(-gate)) * up
    _assert_within_half_ulp(xla, rounded_ref, jnp.bfloat16)
    assert (np.asarray(xla[6:]) == 0).all() and np.abs(rounded_ref).max() > 1.0
    jitted = jax.jit(lambda x, g: ragged_swiglu_matmul(x, qw, g, implementation="xla"))(x, g)
    np.testing.assert_array_equal(np.asarray(jitted, np.float32), np.asarray(xla, np.float32))


def test_bad_arguments_are_refused_by_name():
    rng = np.random.default_rng(4)
    qw = _stacked(rng, 2, 256, 48, True)  # N = 48: three gate/up blocks, not 2 x a multiple of 64
    x = jnp.zeros((3, 256), jnp.bfloat16)
    g = jnp.asarray([1, 2], jnp.int32)
    assert "2 x a multiple of 64" in grouped_swiglu.unsupported(x, qw, g)
    with pytest.raises(NotImplementedError, match="2 x a multiple of 64"):
        grouped_swiglu.mosaic_gpu_grouped_swiglu(x, qw, g)
    odd = _stacked(rng, 2, 256, 40, True)
    with pytest.raises(ValueError, match="multiple of 16"):
        ragged_swiglu_matmul(x, odd, g)
    with pytest.raises(TypeError, match=r"stacked nybble\.QuantizedWeight"):
        ragged_swiglu_matmul(x, np.zeros((2, 256, 48)), g)
    with pytest.raises(ValueError, match="sum to 5"):
        ragged_swiglu_matmul(x, qw, jnp.asarray([2, 3], jnp.int32))
    with pytest.raises(ValueError, match="family"):
        grouped_swiglu.mosaic_gpu_grouped_swiglu(x, qw, g, family="ampere")
    # A config that cannot run the epilogue (no K slices), by name.
    plain = TuningConfig(tiles=2, tile_m=8, tile_k=128, slices=1, scales_on="weights", max_concurrent_steps=2)
    with pytest.raises(ValueError, match="K slices"):
        grouped_swiglu.grouped_swiglu_plan(3, qw, config=plain)
    assert ragged_swiglu_matmul(x[:0], qw, jnp.zeros((2,), jnp.int32)).shape == (0, 24)


def test_on_a_real_gpu_the_grouped_epilogue_waits_for_a_hardware_check(monkeypatch):
    from nybble.kernels.mosaic_gpu import backend, hardware

    qw = abstract_weight(128, 2048, 1536, 128, True)
    x = jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((128,), jnp.int32)
    with nybble.kernels.interpret():
        assert backend.ragged_swiglu_unsupported(x, qw, g, forced=False) is None
    monkeypatch.setattr(backend, "family", lambda: "hopper")
    monkeypatch.setattr(backend, "on_hopper_hardware", lambda: True)
    assert "SWIGLU_VERIFIED" in backend.ragged_swiglu_unsupported(x, qw, g, forced=False)
    assert backend.ragged_swiglu_unsupported(x, qw, g, forced=True) is None
    monkeypatch.setattr(hardware, "SWIGLU_VERIFIED", True)
    assert backend.ragged_swiglu_unsupported(x, qw, g, forced=False) is None
    gpt_oss = abstract_weight(128, 2880, 5760, 128, True)  # K slices of 360 rows: no whole groups of 128
    x_oss = jax.ShapeDtypeStruct((8, 2880), jnp.bfloat16)
    assert "no grouped config" in backend.ragged_swiglu_unsupported(x_oss, gpt_oss, g, forced=True)


def _picks(family: str) -> list:
    """One (rows, weight) per distinct pick at the MoE shapes' fused gate/up (N = 2 x intermediate), 1 to
    512 tokens, g128 symmetric and asymmetric."""
    sms = 148 if family == "blackwell" else NUM_SMS
    seen = {}
    for name, (hidden, inter, experts, top_k) in MOE_SHAPES.items():
        for symmetric in (True, False):
            qw = abstract_weight(experts, hidden, 2 * inter, 128, symmetric)
            for tokens in (1, 8, 32, 64, 512):
                rows = tokens * top_k
                if not grouped_swiglu.fits(rows, qw, sms, family=family):
                    continue
                p, _ = grouped_swiglu.grouped_swiglu_plan(rows, qw, num_sms=sms, family=family)
                seen.setdefault((p.config.tag, symmetric), (rows, qw, f"{name}-T{tokens}"))
    return [pytest.param(rows, qw, id=f"{tag}-{case}") for (tag, _), (rows, qw, case) in seen.items()]


@pytest.mark.sweep
@pytest.mark.parametrize("rows, qw", _picks("hopper"))
def test_every_pick_lowers_for_cuda(rows, qw):
    experts, (k, _) = qw.codes.shape[0], qw.shape
    fn = lambda x, qw, g: grouped_swiglu.mosaic_gpu_grouped_swiglu(x, qw, g, num_sms=NUM_SMS)
    args = (jax.ShapeDtypeStruct((rows, k), jnp.bfloat16), qw, jax.ShapeDtypeStruct((experts,), jnp.int32))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "_swiglu" in text and text.count("custom_call @mosaic_gpu") == 1


@pytest.mark.sweep
@pytest.mark.parametrize("rows, qw", _picks("blackwell"))
def test_blackwell_picks_lower_for_sm100a(rows, qw):
    from nybble.kernels.mosaic_gpu.blackwell.target import target_arch

    experts, (k, _) = qw.codes.shape[0], qw.shape
    fn = lambda x, qw, g: grouped_swiglu.mosaic_gpu_grouped_swiglu(x, qw, g, num_sms=148, family="blackwell")
    args = (jax.ShapeDtypeStruct((rows, k), jnp.bfloat16), qw, jax.ShapeDtypeStruct((experts,), jnp.int32))
    with target_arch(10, 0):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "_swiglu" in text and text.count("custom_call @mosaic_gpu") == 1
