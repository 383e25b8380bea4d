"""The Mosaic GPU W4A16 kernel run on the CPU in GPU interpret mode, with the race detector on.

Numerics only (lowering for CUDA is tests/test_kernel_lowering.py). Every kernel run here:
  * is compared with a float64 reference: within bf16 output rounding on random data, and bit-exactly on
    small-integer data (integer x, power-of-two scales, quarter offsets: every product and partial sum is
    exact in f32, so the only rounding is the final one, the same in kernel and reference);
  * writes every element of its output (interpret mode fills fresh buffers with NaN, and NaN fails every
    comparison; test_every_padded_element_written checks the padding too);
  * is free of data races.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble.kernels.mosaic_gpu as mg
from nybble.kernels.mosaic_gpu import interpret as mgpu_interpret
from nybble.kernels.mosaic_gpu.config import TuningConfig, heuristic_config
from nybble.kernels.xla import xla_matmul
from nybble.packing import get_layout, nk_int4_as_int4, padded_weight_dims, round_up
from nybble.quant import QuantizedWeight, dequantize, quantize

interpret = mgpu_interpret.interpret


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """Each test starts from a clean interpreter and must end without races."""
    mg.reset_state()
    yield
    assert not mg.races_found(), "the race detector flagged a data race"


def _random_weight(rng, k, n, group, symmetric, scale_dtype=jnp.bfloat16) -> QuantizedWeight:
    w = rng.standard_normal((k, n)).astype(np.float32)
    return quantize(w, group_size=group, symmetric=symmetric, scale_dtype=scale_dtype)


def _exact_weight(rng, k, n, group, symmetric) -> QuantizedWeight:
    """Codes in [-8, 7], scales 2^-2..2^1, offsets multiples of 1/4: every w is exact in bf16."""
    k_pad, n_pad = padded_weight_dims(k, n, group)
    g = k_pad if group is None else group
    num_groups = -(-k_pad // g)
    q = rng.integers(-8, 8, (k_pad, n_pad)).astype(np.int8)
    q[k:] = 0
    q[:, n:] = 0
    scales = jnp.asarray(2.0 ** rng.integers(-2, 2, (num_groups, n_pad)), jnp.bfloat16)
    offsets = None
    if not symmetric:
        offsets = jnp.asarray(rng.integers(-4, 5, (num_groups, n_pad)) / 4, jnp.bfloat16)
    codes = jnp.asarray(get_layout("nk_int4").pack(q))
    return QuantizedWeight(
        codes=codes, scales=scales, offsets=offsets, shape=(k, n), group_size=group, symmetric=symmetric
    )


def _reference(x, qw) -> np.ndarray:
    """x @ W in float64, W dequantized exactly as the kernel does (f32 FMA, rounded to x.dtype)."""
    w = np.asarray(dequantize(qw, x.dtype), np.float64)
    return np.asarray(x, np.float64) @ w


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
    # NaN (an element the kernel never wrote) fails both comparisons below.
    ref = _reference(x, qw)
    y = np.asarray(y, np.float64)
    if exact:
        np.testing.assert_array_equal(y, np.asarray(jnp.asarray(ref, x.dtype), np.float64))
    else:
        # f32 accumulation, one rounding to bf16/f16 at the end: within one ulp of the reference.
        eps = float(jnp.finfo(x.dtype).eps)
        np.testing.assert_allclose(y, ref, rtol=eps, atol=eps * np.abs(ref).max())
        assert np.linalg.norm(y - ref) <= eps * np.linalg.norm(ref)


def _activations(rng, m, k, dtype=jnp.bfloat16, exact=False):
    if exact:
        return jnp.asarray(rng.integers(-4, 5, (m, k)), dtype)
    return jnp.asarray(rng.standard_normal((m, k)), dtype)


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
    qw = _random_weight(rng, k, n, group, symmetric)
    x = _activations(rng, m, k)
    _check(x, qw, None, exact=False)


def test_heuristic_families():
    decode = heuristic_config(1, 256, 1024, 128)
    assert decode.split_k > 1 and decode.tile_m == 8 and decode.compute_wgs == 1
    assert decode.codes_as == "uint8"  # zero-copy weights
    assert heuristic_config(1, 256, 1024, 128, codes_dtype="int4").codes_as == "int4"
    prefill = heuristic_config(4096, 4096, 4096, 128)
    assert prefill.compute_wgs == 2 and prefill.codes_as == "int4"


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
    qw = _exact_weight(rng, 768, 256, group, symmetric)
    x = _activations(rng, m, 768, exact=True)
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
    qw = _exact_weight(rng, 128, 128, 32, True)
    _check(_activations(rng, 4, 128, exact=True), qw, config, exact=True)


@pytest.mark.parametrize("group", [128, 256])
def test_partial_last_group_exact(group):
    """K = 576: the last scale row covers half (g128) or a quarter (g256) of a group."""
    rng = np.random.default_rng(group)
    qw = _exact_weight(rng, 576, 128, group, False)
    x = _activations(rng, 3, 576, exact=True)
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
    qw = _random_weight(rng, 768, 256, 128, False)
    x = _activations(rng, 21, 768)
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
    qw = _random_weight(rng, 384, 256, 64, False)
    x = _activations(rng, 5, 384)
    with interpret(detect_races=True):
        raw = _run_padded(x, qw, config)
    expected_shape = (config.split_k,) * (config.split_k > 1) + (config.tile_m, 256)
    assert raw.shape == expected_shape
    assert np.isfinite(raw).all(), "the kernel left part of its padded output unwritten (NaN)"


def test_float16_activations_float32_scales():
    rng = np.random.default_rng(3)
    qw = _random_weight(rng, 512, 128, 64, False, scale_dtype=jnp.float32)
    x = _activations(rng, 9, 512, dtype=jnp.float16)
    _check(x, qw, None, exact=False)


def test_matches_xla_path_and_jit():
    rng = np.random.default_rng(4)
    qw = _random_weight(rng, 384, 192, 128, True)
    x = _activations(rng, 3, 384)
    with interpret():
        y = jax.jit(lambda x, qw: mg.mosaic_gpu_matmul(x, qw))(x, qw)
    y_xla = xla_matmul(x, qw)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_xla, np.float32), rtol=1e-2, atol=1e-2)


def test_grad_wrt_x():
    rng = np.random.default_rng(5)
    qw = _random_weight(rng, 256, 128, 64, False)
    x = _activations(rng, 4, 256)
    g = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)

    def loss(fn, x):
        return jnp.vdot(fn(x, qw).astype(jnp.float32), g.astype(jnp.float32))

    with interpret():
        dx = jax.grad(lambda x: loss(mg.mosaic_gpu_matmul, x))(x)
    dx_xla = jax.grad(lambda x: loss(xla_matmul, x))(x)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    np.testing.assert_allclose(
        np.asarray(dx, np.float32), np.asarray(dx_xla, np.float32), rtol=1e-2, atol=1e-2
    )


def test_jit_cache_tracks_interpret_mode():
    """A function jitted inside interpret() is retraced outside it (and fails clearly on the CPU)."""
    rng = np.random.default_rng(7)
    qw = _random_weight(rng, 128, 64, 64, True)
    x = _activations(rng, 2, 128)
    f = jax.jit(lambda x, qw: mg.mosaic_gpu_matmul(x, qw))
    with interpret():
        y = f(x, qw)
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(xla_matmul(x, qw), np.float32), rtol=1e-2
    )
    with pytest.raises(NotImplementedError, match="interpret"):
        f(x, qw)


def test_empty_batch():
    qw = _random_weight(np.random.default_rng(8), 128, 64, 64, True)
    with interpret():
        y = mg.mosaic_gpu_matmul(jnp.zeros((0, 128), jnp.bfloat16), qw)
    assert y.shape == (0, 64) and y.dtype == jnp.bfloat16


@pytest.mark.parametrize("codes_as", ["int4", "uint8"])
def test_int4_codes_same_result(codes_as):
    """Codes stored as jnp.int4 give the same bits as the uint8 bytes, on either code path."""
    rng = np.random.default_rng(9)
    qw = _exact_weight(rng, 256, 128, 64, False)
    qw4 = dataclasses.replace(qw, codes=nk_int4_as_int4(qw.codes))
    x = _activations(rng, 3, 256, exact=True)
    config = TuningConfig(tile_n=64, tile_m=8, tile_k=128, max_concurrent_steps=2, codes_as=codes_as)
    with interpret(detect_races=True):
        y = mg.mosaic_gpu_matmul(x, qw, config=config)
        y4 = mg.mosaic_gpu_matmul(x, qw4, config=config)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y4, np.float32))
    np.testing.assert_array_equal(
        np.asarray(y, np.float64), np.asarray(jnp.asarray(_reference(x, qw), x.dtype), np.float64)
    )


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
    qw = _random_weight(rng, k, n, group, symmetric)
    _check(_activations(rng, m, k), qw, config, exact=False)
