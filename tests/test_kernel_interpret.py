"""The Mosaic GPU W4A16 kernel run on the CPU in GPU interpret mode, with the race detector on.

Numerics only (lowering for CUDA is tests/test_kernel_lowering.py). Every kernel run here:
  * is compared with the float64 reference (nybble.kernels.reference): element by element within the
    rounding bound on random data (the weight rounded once to x's dtype, f32 accumulation, one rounding
    of the output), and bit-exactly on small-integer data (integer x, power-of-two scales, quarter
    offsets: every product and partial sum is exact in f32, so the only rounding is the final one);
  * writes every element of its output (interpret mode fills fresh buffers with NaN, and NaN fails every
    comparison; test_every_padded_element_written checks the padding too);
  * is free of data races: every test runs its kernels with the race detector on and ends on its verdict
    (which raises when no kernel ran with detection; test_race_check_can_fail shows the check failing).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import nybble.kernels.mosaic_gpu as mg
from nybble.kernels.mosaic_gpu import interpret as mgpu_interpret
from nybble.kernels.mosaic_gpu.config import TuningConfig
from nybble.kernels.reference import reference_dequantize, rounding_bound
from nybble.packing import nk_int4_as_int4, round_up
from tests.kernel_checks import activations, assert_exact, assert_within_rounding, exact_weight, random_weight

interpret = mgpu_interpret.interpret


@pytest.fixture(autouse=True)
def _fresh_interpreter(request):
    """Each test starts from a clean interpreter and must end having run a kernel, without races."""
    mg.reset_state()
    yield
    if request.node.get_closest_marker("no_kernel") is None:
        assert not mg.races_found(), "the race detector flagged a data race"


def _run_padded(x, qw, config) -> np.ndarray:
    """The kernel's raw padded output, to check that every element was written."""
    m, k = x.shape
    k_pad, _ = qw.padded_shape
    x_pad = jnp.pad(x, ((0, round_up(m, config.tile_m) - m), (0, k_pad - k)))
    out = mg.w4a16_padded(
        x_pad, nk_int4_as_int4(qw.codes), qw.scales, qw.offsets, group=qw.block_k, config=config
    )
    return np.asarray(out, np.float32)


def _check(x, qw, config, *, exact: bool) -> None:
    with interpret(detect_races=True):
        y = mg.mosaic_gpu_matmul(x, qw, config=config)
    assert y.shape == (x.shape[0], qw.shape[1]) and y.dtype == x.dtype
    # NaN (an element the kernel never wrote) fails both comparisons.
    if exact:
        assert_exact(y, x, qw)
    else:
        # The weight rounded once to x.dtype, f32 accumulation, one rounding to x.dtype: elementwise.
        assert_within_rounding(y, x, qw)


# Heuristic configs, both families, at the odd shapes of real models (SmolLM2's 576 x 1536).
@pytest.mark.parametrize(
    "m, k, n, group, symmetric",
    [
        (1, 576, 1536, 128, False),  # decode, last group half full (576 = 4.5 x 128)
        (7, 576, 1536, None, True),  # decode, per-column
        (100, 576, 1536, 64, True),  # prefill, M padded to 128
        (1, 1024, 256, 128, True),  # decode with split-K
        (40, 1088, 192, 32, False),  # decode, N = 3 x 64, K = 17 x 64
        (2, 40, 30, None, False),  # one K step, one N tile: everything is padding but 40 x 30
    ],
)
def test_heuristic_random(m, k, n, group, symmetric):
    rng = np.random.default_rng(m * 7 + k)
    qw = random_weight(rng, k, n, group, symmetric)
    x = activations(rng, m, k)
    _check(x, qw, None, exact=False)


# Every group size x symmetric/asymmetric x code path, exact, alternating between the decode family (one
# warpgroup, split-K, f32 partials) and the prefill family (warp-specialized, two compute warpgroups);
# each has >= 2 N tiles and >= 3 K steps per split.
_DECODE = TuningConfig(tile_n=64, tile_m=8, tile_k=128, max_concurrent_steps=3, split_k=2)
_PREFILL = TuningConfig(tile_n=64, tile_m=128, tile_k=64, max_concurrent_steps=2, split_k=1, compute_wgs=2)


@pytest.mark.parametrize("group", [16, 32, 64, 128, 256, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("codes_as", ["int4", "uint8"])
def test_groups_exact(group, symmetric, codes_as):
    rng = np.random.default_rng([group or 0, symmetric])
    decode = (symmetric == (group in (16, 64, 256))) == (codes_as == "int4")
    config, m = (_DECODE, 5) if decode else (_PREFILL, 70)
    config = dataclasses.replace(config, codes_as=codes_as)
    qw = exact_weight(rng, 768, 256, group, symmetric)
    x = activations(rng, m, 768, exact=True)
    _check(x, qw, config, exact=True)


@pytest.mark.parametrize("compute_wgs, codes_as", [(1, "int4"), (2, "uint8")])
def test_one_step_per_split(compute_wgs, codes_as):
    """A pipeline shorter than its depth: each of 2 splits runs a single K step."""
    config = TuningConfig(
        tile_n=64,
        tile_m=8,
        tile_k=64,
        max_concurrent_steps=3,
        split_k=2,
        compute_wgs=compute_wgs,
        codes_as=codes_as,
    )
    rng = np.random.default_rng(compute_wgs)
    qw = exact_weight(rng, 128, 128, 32, True)
    _check(activations(rng, 4, 128, exact=True), qw, config, exact=True)


@pytest.mark.parametrize("group", [128, 256])
def test_partial_last_group_exact(group):
    """K = 576: the last scale row covers half (g128) or a quarter (g256) of a group."""
    rng = np.random.default_rng(group)
    qw = exact_weight(rng, 576, 128, group, False)
    x = activations(rng, 3, 576, exact=True)
    _check(x, qw, None, exact=True)


# Explicit configs: both tile_n and tile_k, pipelines of 2..5 slots, split-K 1..6, several M tiles walked
# in planar-snake order (21 rows: 3, 2 or 1 M tiles; bands of 2 leave a partial last band).
@pytest.mark.parametrize(
    "config",
    [
        TuningConfig(tile_n=128, tile_m=16, tile_k=128, max_concurrent_steps=4, split_k=3, grid_tile_m=2),
        TuningConfig(tile_n=64, tile_m=32, tile_k=64, max_concurrent_steps=2, split_k=1),
        TuningConfig(tile_n=128, tile_m=64, tile_k=128, max_concurrent_steps=3, split_k=1),
        TuningConfig(tile_n=64, tile_m=8, tile_k=64, max_concurrent_steps=5, split_k=6, grid_tile_m=2),
        # Warp-specialized; bytes path.
        TuningConfig(tile_n=64, tile_m=16, tile_k=128, max_concurrent_steps=3, split_k=2, compute_wgs=2),
        TuningConfig(tile_n=128, tile_m=32, tile_k=128, max_concurrent_steps=3, codes_as="uint8"),
        TuningConfig(tile_n=128, tile_m=8, tile_k=64, max_concurrent_steps=4, compute_wgs=2, grid_tile_m=2),
    ],
    ids=lambda c: (
        f"n{c.tile_n}m{c.tile_m}k{c.tile_k}s{c.max_concurrent_steps}x{c.split_k}b{c.grid_tile_m}"
        f"w{c.compute_wgs}{c.codes_as}"
    ),
)
def test_configs_random(config):
    rng = np.random.default_rng(config.tile_m + config.split_k)
    qw = random_weight(rng, 768, 256, 128, False)
    x = activations(rng, 21, 768)
    _check(x, qw, config, exact=False)


@pytest.mark.parametrize(
    "config",
    [
        TuningConfig(tile_n=64, tile_m=16, tile_k=64, max_concurrent_steps=2, split_k=3),
        TuningConfig(tile_n=128, tile_m=32, tile_k=128, max_concurrent_steps=2, split_k=1),
        TuningConfig(tile_n=64, tile_m=8, tile_k=128, max_concurrent_steps=2, split_k=3, compute_wgs=2),
    ],
    ids=["split", "nosplit", "warp-specialized"],
)
def test_every_padded_element_written(config):
    """The raw kernel output, padding included, has no NaN left from interpret mode's fresh buffers."""
    rng = np.random.default_rng(6)
    qw = random_weight(rng, 384, 256, 64, False)
    x = activations(rng, 5, 384)
    with interpret(detect_races=True):
        raw = _run_padded(x, qw, config)
    expected_shape = (config.split_k,) * (config.split_k > 1) + (config.tile_m, 256)
    assert raw.shape == expected_shape
    assert np.isfinite(raw).all(), "the kernel left part of its padded output unwritten (NaN)"


def test_float16_activations_float32_scales():
    rng = np.random.default_rng(3)
    qw = random_weight(rng, 512, 128, 64, False, scale_dtype=jnp.float32)
    x = activations(rng, 9, 512, jnp.float16)
    _check(x, qw, None, exact=False)


def test_under_jit():
    rng = np.random.default_rng(4)
    qw = random_weight(rng, 384, 192, 128, True)
    x = activations(rng, 3, 384)
    with interpret(detect_races=True):
        y = jax.jit(lambda x, qw: mg.mosaic_gpu_matmul(x, qw))(x, qw)
    assert_within_rounding(y, x, qw)


def test_grad_wrt_x():
    """dx = g @ W^T (the backward pass is XLA's, with W rounded once to g's dtype), against float64."""
    rng = np.random.default_rng(5)
    qw = random_weight(rng, 256, 128, 64, False)
    x = activations(rng, 4, 256)
    g = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)

    def loss(x):
        return jnp.vdot(mg.mosaic_gpu_matmul(x, qw).astype(jnp.float32), g.astype(jnp.float32))

    with interpret(detect_races=True):
        dx = jax.grad(loss)(x)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    w_t = reference_dequantize(qw, g.dtype).T
    err = np.abs(np.asarray(dx, np.float64) - np.asarray(g, np.float64) @ w_t)
    assert (err <= rounding_bound(g, w_t, dx.dtype)).all(), float(err.max())


def test_jit_cache_tracks_interpret_mode():
    """A function jitted inside interpret() is retraced outside it (and fails clearly on the CPU)."""
    rng = np.random.default_rng(7)
    qw = random_weight(rng, 128, 64, 64, True)
    x = activations(rng, 2, 128)
    f = jax.jit(lambda x, qw: mg.mosaic_gpu_matmul(x, qw))
    with interpret(detect_races=True):
        y = f(x, qw)
    assert_within_rounding(y, x, qw)
    with pytest.raises(NotImplementedError, match="interpret"):
        f(x, qw)


@pytest.mark.no_kernel
def test_empty_batch():
    """M = 0 returns an empty result without launching a kernel."""
    qw = random_weight(np.random.default_rng(8), 128, 64, 64, True)
    with interpret(detect_races=True):
        y = mg.mosaic_gpu_matmul(jnp.zeros((0, 128), jnp.bfloat16), qw)
    assert y.shape == (0, 64) and y.dtype == jnp.bfloat16
    with pytest.raises(RuntimeError, match="no kernel ran"):
        mg.races_found()


def _smem_store_then_tma(commit: bool) -> jax.Array:
    """A tiny kernel writing SMEM from registers, then copying it out by TMA; racy without commit_smem."""

    def body(out_gmem, smem):
        smem[...] = jnp.full((128,), 2.0, jnp.float32)
        if commit:
            plgpu.commit_smem()  # orders the register stores before the TMA (async proxy) reads them
        plgpu.copy_smem_to_gmem(smem, out_gmem)
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
        scratch_types=[plgpu.SMEM((128,), jnp.float32)],
        interpret=mgpu_interpret.active_params(),
    )
    return call()


def test_race_check_can_fail():
    """The verdict every test here ends with: a kernel missing its commit_smem is flagged; without a
    kernel, or with one run outside detect_races=True, there is no verdict and races_found() raises."""
    with interpret(detect_races=True):
        y = _smem_store_then_tma(commit=False)
    np.testing.assert_array_equal(np.asarray(y), 2.0)  # right numbers, yet a race
    assert mg.races_found()
    mg.reset_state()
    with pytest.raises(RuntimeError, match="no kernel ran"):
        mg.races_found()
    with interpret():
        _smem_store_then_tma(commit=True)
    with pytest.raises(RuntimeError, match="without detect_races=True"):
        mg.races_found()
    mg.reset_state()
    with interpret(detect_races=True):
        _smem_store_then_tma(commit=True)  # the fixture checks this one: no race


@pytest.mark.parametrize("codes_as", ["int4", "uint8"])
def test_int4_codes_same_result(codes_as):
    """Codes stored as jnp.int4 give the same bits as the uint8 bytes, on either code path."""
    rng = np.random.default_rng(9)
    qw = exact_weight(rng, 256, 128, 64, False)
    qw4 = dataclasses.replace(qw, codes=nk_int4_as_int4(qw.codes))
    x = activations(rng, 3, 256, exact=True)
    config = TuningConfig(tile_n=64, tile_m=8, tile_k=128, max_concurrent_steps=2, codes_as=codes_as)
    with interpret(detect_races=True):
        y = mg.mosaic_gpu_matmul(x, qw, config=config)
        y4 = mg.mosaic_gpu_matmul(x, qw4, config=config)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y4, np.float32))
    assert_exact(y, x, qw)


def _distinct_heuristic_configs() -> list[tuple[TuningConfig, int | None, bool]]:
    """Every TuningConfig the heuristics pick at the lowering tests' real-model shapes, with one group
    size and symmetry it was picked for (the lowering tests cover every combination at full size)."""
    from tests.test_kernel_lowering import BATCHES, GROUPS, NUM_SMS, WEIGHT_SHAPES

    picked: dict[TuningConfig, tuple[int | None, bool]] = {}
    for (config, _, has_offsets), case in mg.heuristic_cases(WEIGHT_SHAPES, BATCHES, GROUPS, NUM_SMS).items():
        picked.setdefault(config, (case[3], not has_offsets))
    return [(config, group, symmetric) for config, (group, symmetric) in picked.items()]


# Interpret mode checks the numbers of every config the heuristics can choose, on the smallest problem
# with that config's structure: two M tiles (the last one partial), two CTA columns of N, two K steps per
# split. (Production shapes would take minutes each in interpret mode; their lowering is checked in
# test_kernel_lowering.py.)
@pytest.mark.parametrize(
    "config, group, symmetric",
    _distinct_heuristic_configs(),
    ids=lambda v: (
        f"n{v.tile_n}m{v.tile_m}k{v.tile_k}s{v.max_concurrent_steps}x{v.split_k}w{v.compute_wgs}{v.codes_as}"
        if isinstance(v, TuningConfig)
        else str(v)
    ),
)
def test_every_heuristic_config_in_interpret_mode(config, group, symmetric):
    k = config.tile_k * config.split_k * 2
    if group is not None and group > k:
        k = group * config.split_k
    n = config.tile_n * config.compute_wgs * 2
    m = 2 * config.tile_m - 3
    rng = np.random.default_rng(k + n + m)
    qw = random_weight(rng, k, n, group, symmetric)
    _check(activations(rng, m, k), qw, config, exact=False)
