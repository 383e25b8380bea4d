"""The Mosaic GPU W4A16 kernel run on the CPU in GPU interpret mode, with the race detector on.

Numerics only (lowering for CUDA is tests/test_kernel_lowering.py, the SASS is tests/test_xray.py). Every
kernel run here:
  * is compared with the one float64 reference (nybble.kernels.ops.matmul.reference, through
    tests/kernel_checks.py):
    element by element within the rounding bound of its scale route on random data, and bit-exactly on
    small-integer data (integer x, power-of-two scales, quarter offsets: every product and partial sum is
    exact in f32 in both scale routes, so the only rounding is the final one, the same in kernel and
    reference);
  * writes every element of its output (interpret mode fills fresh buffers with NaN, and NaN fails every
    comparison);
  * is free of data races: every kernel runs under the race detector and each test ends on its verdict
    (which raises when no kernel ran with detection on; tests marked ``no_kernel`` run none by design).
The three steps written below Pallas (dequant_registers.py: the LOP3 dequantization and its register
relabelling, the per-lane row gather, the K-slice sum) run here through their jax.numpy twins; their bit
operations are checked exhaustively against the numpy model the GPU path follows, and the GPU path itself
runs in tests/test_kernel_gpu.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import nybble.kernels.mosaic_gpu as mg
from bench.xray.heuristic_cases import heuristic_cases
from bench.xray.launch import threads
from nybble.kernels.mosaic_gpu import dequant_registers, pipeline, split_k
from nybble.kernels.mosaic_gpu import interpret as mgpu_interpret
from nybble.kernels.mosaic_gpu.common import folds_bias
from nybble.kernels.mosaic_gpu.config import TuningConfig
from nybble.kernels.mosaic_gpu.config import (
    folds_bias as folds_bias_config,
)
from nybble.kernels.mosaic_gpu.cost_model import (
    DECODE_IPW_GAIN,
    DECODE_TIE,
    estimated_instructions_per_weight,
    modeled_time_us,
    modeled_times_us,
)
from nybble.kernels.mosaic_gpu.heuristics import heuristic_config
from nybble.kernels.ops.matmul.reference import reference_dequantize, rounding_bound
from nybble.kernels.ops.matmul.xla import xla_matmul
from nybble.packing import get_layout, padded_weight_dims
from nybble.packing.fragments import pack_wgmma_int4
from nybble.quant import QuantizedWeight, relayout
from tests import kernel_faults as faults
from tests.kernel_checks import (
    activations,
    assert_exact,
    assert_kernel_within_rounding,
    assert_within_rounding,
    exact_weight,
    k_wrapping_the_pipeline,
    random_weight,
)

interpret = mgpu_interpret.interpret


@pytest.fixture(autouse=True)
def _fresh_interpreter(request):
    """Each test starts from a clean interpreter and must end having run a kernel, without races."""
    mg.reset_state()
    yield
    if request.node.get_closest_marker("no_kernel") is None:
        assert not mg.races_found(), "the race detector flagged a data race"


def _check(x, qw, config, *, exact: bool) -> None:
    with interpret(detect_races=True):
        y = mg.mosaic_gpu_matmul(x, qw, config=config)
    assert y.shape == (x.shape[0], qw.shape[1]) and y.dtype == x.dtype
    # NaN (an element the kernel never wrote) fails both comparisons.
    if exact:
        assert_exact(y, x, qw)
    else:
        route = mg.plan(x.shape[0], qw, config=config).config.scales_on
        assert_kernel_within_rounding(y, x, qw, route)


# ------------------------------------------------------------------------------ the bit operations


@pytest.mark.no_kernel  # bit operations, heuristics or refusals: no kernel runs
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dequantize_bits_every_nibble(dtype):
    """The GPU's LOP3 (and 16-bit-pair subtract) on every 16-bit half: BIAS + q (or q) for each nibble."""
    halves = np.arange(1 << 16, dtype=np.uint32)
    words = halves | (halves[::-1] << 16)  # both halves, every pattern, different in each
    for exact in (False, True):
        bits = dequant_registers.reference_dequantize_words(words, exact, dtype)  # (65536, 4 u)
        for u in range(4):
            for half, src in ((0, halves), (1, halves[::-1])):
                nib = (src >> (4 * u)) & 0xF
                q = np.where(nib >= 8, nib.astype(np.int64) - 16, nib)
                got = ((bits[:, u] >> (16 * half)) & 0xFFFF).astype(np.uint16).view(np.dtype(dtype))
                np.testing.assert_array_equal(
                    got.astype(np.float64), q + (0 if exact else dequant_registers.BIAS[dtype])
                )


@pytest.mark.no_kernel  # bit operations, heuristics or refusals: no kernel runs
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_twin_places_each_code_where_wgmma_expects_it(dtype):
    """The interpret-mode twin of the relabelling puts code q[k, n] at A row n, column k of the chunk,
    with the bit patterns of the GPU's bit operations (whose registers the GPU path relabels)."""
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, (64, 64)).astype(np.int8)  # (K, N): one chunk of one A tile
    words = pack_wgmma_int4(q)  # (8 bands, 64 words)
    for exact in (False, True):
        a = np.asarray(dequant_registers._twin_dequantize(jnp.asarray(words), exact, dtype), np.float64)
        bias = 0 if exact else dequant_registers.BIAS[dtype]
        np.testing.assert_array_equal(a, q.T.astype(np.float64) + bias)
        # The same 16-bit patterns as the bit model, position by position.
        bits = dequant_registers.reference_dequantize_words(words, exact, dtype)  # (8 slots, 64 words, 4 u)
        patterns = bits.view(np.uint16).reshape(8, 64, 4, 2)  # (slot, word, u, e)
        twin = np.asarray(
            jax.lax.bitcast_convert_type(
                dequant_registers._twin_dequantize(jnp.asarray(words), exact, dtype), jnp.uint16
            )
        )
        v = patterns.reshape(8, 8, 4, 2, 4, 2).transpose(0, 1, 3, 4, 2, 5).reshape(64, 64)
        np.testing.assert_array_equal(twin, v)


@pytest.mark.no_kernel  # bit operations, heuristics or refusals: no kernel runs
@pytest.mark.parametrize("slices", [1, 2, 4, 8])
def test_slot_rows_and_slice_sum_twins(slices):
    """A tile's rows r hold slice j(r) of output row n(r); the slice sum reads acc[r, m * S + j(r)]."""
    idx = dequant_registers.slot_row_index(slices)
    width = 64 // slices
    assert sorted(map(tuple, idx)) == sorted((j, n) for j in range(slices) for n in range(width))
    rng = np.random.default_rng(slices)
    tiles, rows = 2, max(1, 8 // slices)
    acc = rng.standard_normal((tiles, 64, slices * rows)).astype(np.float32)
    want = np.zeros((rows, tiles * width), np.float32)
    for t in range(tiles):
        for r in range(64):
            j, n = idx[r]
            for m in range(rows):
                want[m, t * width + n] += acc[t, r, m * slices + j]

    class Ref:  # the twin reads a ref with [...] and writes one with [...] =
        def __init__(self, value):
            self.value, self.dtype = value, value.dtype

        def __getitem__(self, idx):
            return self.value[idx]

        def __setitem__(self, _, v):
            self.value = np.asarray(v)

    out = Ref(np.zeros((rows, tiles * width), np.float32))
    with interpret(detect_races=True):
        dequant_registers.sum_slices(Ref(jnp.asarray(acc)), out, slices=slices, tiles=tiles, rows=rows)
        np.testing.assert_allclose(out.value, want, rtol=1e-6)
        values = jnp.asarray(rng.standard_normal((slices, 1, tiles * width)), jnp.float32)
        rows_t1 = np.asarray(dequant_registers.slot_rows(Ref(values), 0, 1, slices, slices))
    np.testing.assert_array_equal(rows_t1, np.asarray(values)[idx[:, 0], 0, width + idx[:, 1]])


@pytest.mark.no_kernel  # the interpreter's callbacks, no kernel runs
def test_fast_io_callback_gives_the_callback_what_jax_does():
    """tests/conftest.py installs tests/fast_io_callback.py on jax 0.11.2 (on 0.12 jax keeps its own): the
    interpreter's callbacks must get what jax's ``io_callback_impl`` gives them, the same values as
    ``jax.Array``s on the same device, committed, and return the same numpy arrays."""
    from jax._src import callback as callback_lib

    from tests import fast_io_callback

    installed = fast_io_callback.install()
    if fast_io_callback.source_digest() != fast_io_callback._KNOWN_SOURCE:
        assert not installed and "impl" not in fast_io_callback._original  # a jax it does not know
        return
    assert installed and callback_lib.io_callback_impl is not fast_io_callback._original["impl"]
    seen: list[list[tuple]] = []

    def record(*args):
        seen.append([(type(a), a.dtype, a.shape, a.committed, a.sharding, np.asarray(a).tobytes())
                     for a in args])
        return [np.asarray(args[0]) + 1, jnp.asarray(args[1]) * 2]

    flat = callback_lib._FlatCallback(record, jax.tree.structure((tuple(range(3)), {})))
    args = (
        np.array(7, np.int32),
        np.arange(12, dtype=np.float32).reshape(3, 4).astype(jnp.bfloat16),
        np.array([True, False]),
    )
    params = {"result_avals": (), "sharding": None, "ordered": False}
    outs = [impl(*args, callback=flat, **params) for impl in (fast_io_callback._original["impl"],
                                                               callback_lib.io_callback_impl)]
    assert seen[0] == seen[1] and seen[0][0][0] is type(jnp.zeros(()))
    for ours, jaxs in zip(outs[1], outs[0], strict=True):
        assert type(ours) is type(jaxs) is np.ndarray and ours.dtype == jaxs.dtype
        np.testing.assert_array_equal(ours, jaxs)
    # Anything but numpy arrays (a Python int) goes to jax's own.
    callback_lib.io_callback_impl(3, np.array(1.0), np.array(0), callback=flat, **params)
    assert seen[2][0][0] is seen[0][0][0] and int(np.frombuffer(seen[2][0][5], np.int32)[0]) == 3


# -------------------------------------------------------------------------------- numbers, end to end


# Heuristic configs of both families at odd shapes: SmolLM2's K = 576 (N 384 of its 1536: the suite's time).
@pytest.mark.sweep
@pytest.mark.parametrize(
    "m, k, n, group, symmetric",
    [
        (1, 576, 384, 128, False),  # decode, last group half full (576 = 4.5 x 128)
        (7, 576, 384, None, True),  # decode, per-column
        (100, 576, 384, 64, True),  # prefill, one partial M tile
        (1, 1024, 256, 128, True),  # decode, 8 K slices
        (3, 2048, 128, 64, False),  # decode, K slices with M = 3 of 4
        (40, 1088, 192, 32, False),  # decode, N = 3 x 64, K = 17 x 64, groups of 32
        (2, 40, 30, None, False),  # one K step, one N tile: everything is padding but 40 x 30
    ],
)
def test_heuristic_random(m, k, n, group, symmetric):
    rng = np.random.default_rng(m * 7 + k)
    qw = random_weight(rng, k, n, group, symmetric)
    x = activations(rng, m, k)
    _check(x, qw, None, exact=False)


@pytest.mark.no_kernel  # bit operations, heuristics or refusals: no kernel runs
def test_heuristic_families():
    # The picks themselves are in tests/fixtures/golden_picks (test_golden_picks.py); here the rules.
    decode = heuristic_config(1, 4096, 4096, 128)
    assert decode.compute_wgs == 1  # decode: one compute warpgroup
    # Every step has a slot: every copy goes out up front, no producer.
    assert not decode.producer and 4096 // decode.k_span() <= decode.max_concurrent_steps
    # K = 28672 (14 steps, at most 8 slots): the pipeline refills its slots, and a producer warpgroup takes
    # the ~60 instructions of TMA issue off each step of the compute warpgroup (X-ray).
    deep = heuristic_config(1, 8192, 28672, 128)
    assert deep.producer and deep.slices == 8 and 28672 // deep.k_span() > deep.max_concurrent_steps
    alone = dataclasses.replace(deep, producer=False)
    assert estimated_instructions_per_weight(deep, 128, False) < estimated_instructions_per_weight(
        alone, 128, False
    )
    prefill = heuristic_config(4096, 4096, 4096, 128)
    assert prefill.compute_wgs == 2 and prefill.scales_on == "weights"  # prefill: warp-specialized, exact
    # A 256-wide M tile (the golden pick at M = 4096): same modeled tensor-core time as two A tiles of
    # 128-wide M, a little over half the issue time.
    narrow = TuningConfig(tiles=2, tile_m=128, tile_k=128, max_concurrent_steps=3, compute_wgs=2)
    wide_t, narrow_t = (modeled_times_us(c, 4096, 4096, 4096, 128, True, 132) for c in (prefill, narrow))
    assert wide_t["tensor"] == narrow_t["tensor"] and wide_t["issue"] < 0.6 * narrow_t["issue"]
    assert modeled_time_us(prefill, 4096, 4096, 4096, 128, True, 132) == wide_t["tensor"]


@pytest.mark.no_kernel
@pytest.mark.parametrize("symmetric", [True, False])
def test_decode_takes_fewer_instructions_nearly_as_fast(symmetric):
    """Llama-3-8B down at M = 16: two A tiles on 4 CTAs of a split-K cluster per output tile, not one A
    tile on 2: 1% slower in the model (the cluster's reduction), estimated 0.13-0.28 fewer instructions
    per weight (X-ray: 1.68 against 1.83 symmetric)."""
    has_offsets = not symmetric
    picked = heuristic_config(16, 4096, 14336, 128, 132, has_offsets=has_offsets)  # (golden: t2 x4)
    one_tile = TuningConfig(
        tiles=1, tile_m=16, tile_k=512, split_k=2, max_concurrent_steps=6, scales_on="accumulators",
        producer=True,
    )  # fmt: skip
    times = [modeled_time_us(c, 16, 4096, 14336, 128, has_offsets, 132) for c in (picked, one_tile)]
    assert times[1] < times[0] <= times[1] * (1 + DECODE_TIE)
    ipw = [estimated_instructions_per_weight(c, 128, has_offsets) for c in (picked, one_tile)]
    assert ipw[0] <= ipw[1] - DECODE_IPW_GAIN


@pytest.mark.no_kernel
@pytest.mark.parametrize("tiles", [1, 2, 4])
def test_tensor_time_counts_the_constant_tile(tiles):
    """The accumulator route's constant A tile runs one more WGMMA a chunk, shared by the A tiles: the
    model's tensor-core time is (tiles + 1) / tiles that of exact weights, so one A tile with 2 K slices
    at M = 16 (WGMMA N = 32) is tensor-bound at Llama-3-8B down, over its HBM time."""
    shape = dict(tiles=tiles, tile_m=16, tile_k=256, max_concurrent_steps=4)
    acc = TuningConfig(**shape, scales_on="accumulators")
    exact = TuningConfig(**shape, scales_on="weights")
    t_acc, t_exact = (modeled_times_us(c, 16, 4096, 14336, 128, False, 132) for c in (acc, exact))
    assert t_acc["tensor"] == pytest.approx(t_exact["tensor"] * (tiles + 1) / tiles)
    sliced = TuningConfig(
        tiles=1, tile_m=16, tile_k=256, slices=2, max_concurrent_steps=8, scales_on="accumulators"
    )
    times = modeled_times_us(sliced, 16, 4096, 14336, 128, False, 132)
    assert times["tensor"] > times["hbm"]


@pytest.mark.no_kernel
def test_accumulator_route_stays_within_64_columns():
    """The accumulator route keeps two f32 accumulators of tiles * WGMMA N columns: 128 spilled 816-856
    bytes in the X-ray (Llama-3-70B gate-up at M = 12, four A tiles at N = 32), 64 split 8 ways 16-48.
    No decode pick at any M has them."""
    for m in range(1, 65):
        for k, n in ((8192, 28672), (4096, 14336), (14336, 4096), (4096, 1024)):
            for has_offsets in (False, True):
                c = heuristic_config(m, n, k, 128, 132, has_offsets=has_offsets)
                if c.scales_on == "accumulators":
                    columns = c.tiles * c.wgmma_n
                    assert columns < 64 or (columns == 64 and c.split_k < 8), (m, k, n, c)


# Every group size, symmetric and asymmetric, both scale routes, K slices: exact.
# (M, config, K): K = 2048 gives the 8-slice config two steps; the others have 4-16 steps over 1024.
_EXACT_CONFIGS = {
    "slices8-acc": (
        1,
        TuningConfig(
            tiles=1, tile_m=1, tile_k=128, slices=8, max_concurrent_steps=2, scales_on="accumulators"
        ),
        2048,
    ),
    "slices4-wt": (2, TuningConfig(tiles=2, tile_m=2, tile_k=64, slices=4, max_concurrent_steps=3), 1024),
    "acc-split": (
        5,
        TuningConfig(
            tiles=1, tile_m=16, tile_k=128, max_concurrent_steps=2, split_k=2, scales_on="accumulators"
        ),
        1024,
    ),
    "ws": (70, TuningConfig(tiles=1, tile_m=128, tile_k=64, max_concurrent_steps=2, compute_wgs=2), 1024),
}


_GROUPS = [16, 32, 64, 128, 256, None]
# Each config x each group size once, symmetric and asymmetric alternating, so that every config meets
# both with three group sizes each, and every group size meets both with two configs each.
_GROUP_CASES = [
    (name, group, (i + j) % 2 == 0)
    for j, name in enumerate(sorted(_EXACT_CONFIGS))
    for i, group in enumerate(_GROUPS)
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_bias_folded_by_wgmma(dtype):
    """Symmetric groups, one A tile, the accumulator route: the -BIAS tile's WGMMA takes BIAS * sum(x) off
    each group's accumulator (common.folds_bias); bf16 (136) and f16 (1032). Bit-exact on small integers
    (random data: every folded heuristic config, below); with offsets or two A tiles sum(x) stays apart."""
    config = TuningConfig(
        tiles=1, tile_m=8, tile_k=128, slices=2, max_concurrent_steps=3, scales_on="accumulators"
    )
    rng = np.random.default_rng(136)
    qw = exact_weight(rng, 1024, 128, 128, True, scale_dtype=dtype)
    assert folds_bias(mg.plan(4, qw, config=config))
    _check(activations(rng, 4, 1024, exact=True, dtype=dtype), qw, config, exact=True)
    asym = exact_weight(rng, 1024, 128, 128, False, scale_dtype=dtype)
    assert not folds_bias(mg.plan(4, asym, config=config))
    assert not folds_bias(mg.plan(4, qw, config=dataclasses.replace(config, tiles=2, slices=4)))


_ACC = "accumulators"


@pytest.mark.parametrize(
    "m, config, group, symmetric",
    [
        (
            1,
            TuningConfig(tiles=1, tile_m=1, tile_k=128, slices=8, max_concurrent_steps=2, scales_on=_ACC),
            128,
            True,
        ),
        (
            3,
            TuningConfig(tiles=2, tile_m=4, tile_k=64, slices=2, max_concurrent_steps=3, scales_on=_ACC),
            128,
            False,
        ),
        (40, TuningConfig(tiles=1, tile_m=64, tile_k=128, max_concurrent_steps=3), 64, False),
        (9, TuningConfig(tiles=1, tile_m=16, tile_k=128, max_concurrent_steps=2), 32, True),
        # Split-K 4 of 16-row tiles: each CTA of the cluster sums 8 rows of one of the two A tiles.
        (
            13,
            TuningConfig(tiles=2, tile_m=16, tile_k=128, max_concurrent_steps=2, split_k=4, scales_on=_ACC),
            128,
            False,
        ),
        (40, TuningConfig(tiles=2, tile_m=64, tile_k=64, max_concurrent_steps=3, split_k=4), 64, True),
    ],
    ids=[
        "S8-sym",
        "S2-t2-asym",
        "wt-m64",
        "wt-g32",
        "acc-t2-split4",
        "wt-t2-split4",
    ],
)
def test_producer_warpgroup_exact(m, config, group, symmetric):
    """A producer warpgroup issuing the TMA: the accumulator route (Pallas' warp-specialized pipeline, the
    running total its carry) and exact weights (constant slots, or Pallas' pipeline for two A tiles and
    groups of 32), K slices and not, one and two A tiles, split-K (the cluster's reduction after the
    pipeline), both symmetries, more steps than slots, two CTA columns; bit-exact on small integers."""
    config = dataclasses.replace(config, producer=True)
    rng = np.random.default_rng([m, config.tiles, symmetric])
    k = (config.max_concurrent_steps + 1) * config.k_span() * config.split_k  # one step past the slots
    qw = exact_weight(rng, k, 2 * config.cta_rows, group, symmetric)
    assert threads(mg.plan(m, qw, config=config)) == 256
    _check(activations(rng, m, k, exact=True), qw, config, exact=True)


@pytest.mark.parametrize(
    "m, k, config, group, symmetric",
    [
        # Two K slices, the -BIAS tile folded, both steps up front.
        (
            3,
            2048,
            TuningConfig(tiles=1, tile_m=4, tile_k=512, slices=2, max_concurrent_steps=2, scales_on=_ACC),
            128,
            True,
        ),
        # Two A tiles, groups of 256 (two WGMMA calls a group), split-K 2, a producer refilling 2 slots.
        (
            13,
            4096,
            TuningConfig(
                tiles=2,
                tile_m=16,
                tile_k=512,
                max_concurrent_steps=2,
                split_k=2,
                producer=True,
                scales_on=_ACC,
            ),
            256,
            False,
        ),
        # 32-row tile, 4 groups a step, offsets.
        (
            20,
            2048,
            TuningConfig(tiles=1, tile_m=32, tile_k=512, max_concurrent_steps=2, scales_on=_ACC),
            128,
            False,
        ),
    ],
    ids=["S2-sym", "t2-split2-producer-g256-asym", "m32-asym"],
)
def test_512_deep_steps_exact(m, k, config, group, symmetric):
    """Steps of 512 K (config.WIDE_STEP_K, the accumulator route only): 2-4 groups a step, each its own
    accumulator, with and without slices, split-K and a producer. Bit-exact on small integers."""
    rng = np.random.default_rng([m, k])
    qw = exact_weight(rng, k, 2 * config.cta_rows, group, symmetric)
    _check(activations(rng, m, k, exact=True), qw, config, exact=True)


@pytest.mark.no_kernel
def test_512_deep_steps_refused_off_the_accumulator_route():
    with pytest.raises(ValueError, match="tile_k=512 runs on the accumulator route"):
        TuningConfig(tiles=1, tile_m=16, tile_k=512)
    with pytest.raises(ValueError, match="tile_k=512 runs on the accumulator route"):
        TuningConfig(tiles=1, tile_m=128, tile_k=512, compute_wgs=2, scales_on=_ACC)


@pytest.mark.no_kernel
def test_producer_needs_one_warpgroup():
    with pytest.raises(ValueError, match="producer=True"):
        TuningConfig(producer=True, compute_wgs=2)


@pytest.mark.parametrize("symmetric", [True, False])
def test_256_wide_m_tile_exact(symmetric):
    # Two M tiles, the second partial (TMA zero-fills x's rows past M and clips y's), two CTA columns.
    config = TuningConfig(tiles=1, tile_m=256, tile_k=64, max_concurrent_steps=4, compute_wgs=2)
    rng = np.random.default_rng(256 + symmetric)
    qw = exact_weight(rng, 256, 256, 128, symmetric)
    _check(activations(rng, 300, 256, exact=True), qw, config, exact=True)


@pytest.mark.sweep
@pytest.mark.parametrize(
    "name, group, symmetric",
    _GROUP_CASES,
    ids=[f"{n}-g{g}-{'sym' if s else 'asym'}" for n, g, s in _GROUP_CASES],
)
def test_groups_exact(name, group, symmetric):
    m, config, k = _EXACT_CONFIGS[name]
    if group is not None and group % 64:  # groups of 16, 32: exact weights, no K slices
        config = dataclasses.replace(config, scales_on="weights")
        if config.slices > 1:
            config = dataclasses.replace(config, slices=1, tile_m=8)
    if config.slices > 1 and group is not None and group > k // config.slices:
        config = dataclasses.replace(config, tile_k=64)
    rng = np.random.default_rng([group or 0, symmetric, len(name)])
    qw = exact_weight(rng, k, 128, group, symmetric)
    x = activations(rng, m, k, exact=True)
    _check(x, qw, config, exact=True)


@pytest.mark.no_kernel  # which pipeline a kernel gets; the exact runs above and below go through both
def test_constant_slots_where_they_pay():
    ws = TuningConfig(tiles=1, tile_m=128, tile_k=64, compute_wgs=2)
    one = TuningConfig(tiles=1, tile_m=16, tile_k=256)
    for group in (16, 32, 64, 128, 4096):
        assert pipeline.constant_slots(ws, group)  # warp-specialized: every group size
        assert pipeline.constant_slots(one, group) == (group >= 64)  # one warpgroup: whole 64-wide chunks
        assert not pipeline.constant_slots(dataclasses.replace(one, tiles=2), group)  # registers


@pytest.mark.parametrize("wgs", [1, 2])
@pytest.mark.parametrize(
    "steps, slots",
    [(1, 2), (3, 2), (5, 4), (7, 3), (8, 4)],
    ids=lambda v: str(v),
)
def test_constant_slot_pipeline_rounds_exact(steps, slots, wgs):
    """The constant-slot pipelines (pipeline.py, one warpgroup and warp-specialized) run rounds of
    ``slots`` steps, the last one cut short by a predicate: fewer steps than slots, one round and part of
    another, two and a part, whole rounds only; bit-exact."""
    config = TuningConfig(tiles=1, tile_m=16, tile_k=64, max_concurrent_steps=slots, compute_wgs=wgs)
    rng = np.random.default_rng([steps, slots])
    k = 64 * steps
    qw = exact_weight(rng, k, 128, 64, False)
    x = activations(rng, 9, k, exact=True)
    assert mg.plan(9, qw, config=config).steps_per_split == steps
    _check(x, qw, config, exact=True)


@pytest.mark.parametrize(
    "ctas, steps, slots, symmetric",
    [(4, 3, 2, False), (2, 2, 3, True), (5, 5, 4, False)],
    ids=lambda v: str(v),
)
def test_persistent_grid_exact(ctas, steps, slots, symmetric):
    """A persistent grid (``persistent_ctas``): 6 output tiles (3 M tiles, the last one partial, times 2 N
    tiles) over 4, 2 or 5 CTAs, so that CTAs run 1 to 3 tiles each; each tile's K steps start from slot 0
    again, and its first copies wait for the tile before to release their slots (fewer steps than slots,
    and more). Bit-exact and race-free: the interpreter also checks every barrier's phases."""
    config = TuningConfig(
        tiles=1, tile_m=8, tile_k=64, max_concurrent_steps=slots, compute_wgs=2, persistent_ctas=ctas
    )
    rng = np.random.default_rng([ctas, steps, slots])
    k = 64 * steps
    qw = exact_weight(rng, k, 256, 64, symmetric)
    x = activations(rng, 21, k, exact=True)
    p = mg.plan(21, qw, config=config)
    assert p.m_tiles * p.n_tiles == 6 and p.steps_per_split == steps
    _check(x, qw, config, exact=True)


# The interpreter's refusals of a barrier phase that some warpgroup never observed (jax 0.11.2,
# pallas/mosaic_gpu/interpret/shared_memory.py): at a wait ("awaiting phase 3, but barrier is already at
# phase 4"), at an arrival, at a first wait, or at deallocation.
_BARRIER_PHASE_MISSED = (
    r"phase \d+, but barrier|phase 1, but no threads observed phase 0"
    r"|for the first time, but barrier is already at phase"
)
# Or the exact comparison's: where the threads' timing lets every warpgroup observe each phase in time (seen
# on jax 0.12 with the CPU busy, 1 of 36 runs), the early TMA copies overwrite slots the compute
# warpgroups still read, and the outputs differ.
_SLOTS_OVERWRITTEN = r"outputs differ from the exact reference"


@pytest.mark.no_kernel  # the kernel is refused mid-run: no race verdict
def test_persistent_grid_without_the_release_wait_is_refused(monkeypatch):
    """The interpreter checks every barrier's phases: a TMA warpgroup that copies a later tile's first steps
    without waiting for the compute warpgroups to release those slots (told that every tile is its CTA's
    first) leaves barrier phases unobserved (whichever warpgroup notices first, and where, depends on the
    threads' timing: at an arrival, at a wait, or at the barrier's deallocation), and is refused; when
    the timing hides the missed phase, the slots it overwrote give wrong outputs, which the exact check
    refuses."""

    def every_tile_first(self, fn):
        @plgpu.nd_loop((self.count,), collective_axes=self.axis)
        def _(info):
            fn(info.index[0], 0)

    monkeypatch.setattr(pipeline.OutputTiles, "run", every_tile_first)
    jax.clear_caches()
    config = TuningConfig(
        tiles=1, tile_m=8, tile_k=64, max_concurrent_steps=2, compute_wgs=2, persistent_ctas=3
    )
    rng = np.random.default_rng(31)
    qw = exact_weight(rng, 192, 256, 64, True)
    x = activations(rng, 21, 192, exact=True)
    with pytest.raises(Exception, match=f"{_BARRIER_PHASE_MISSED}|{_SLOTS_OVERWRITTEN}"):
        _check(x, qw, config, exact=True)
    jax.clear_caches()


@pytest.mark.no_kernel  # heuristics and refusals: no kernel runs
def test_persistent_grid_where_tiles_outnumber_sms():
    """The heuristics put the warp-specialized kernel on a persistent grid of one CTA per SM exactly when
    its output tiles outnumber the SMs, and never split K there; other kernels refuse it."""
    for m, n, k in [(128, 4096, 4096), (2048, 4096, 4096), (4096, 1024, 4096), (8192, 1024, 4096)]:
        for sms in (132, 16):
            config = heuristic_config(m, n, k, 128, sms)
            tiles = -(-m // config.tile_m) * (n // config.cta_rows)
            persistent = config.compute_wgs == 2 and config.split_k == 1 and tiles > sms
            assert config.persistent_ctas == (sms if persistent else 0), (m, n, k, sms, config)
    assert heuristic_config(2048, 4096, 4096, 128).persistent_ctas == 132  # 256 tiles
    assert heuristic_config(128, 4096, 4096, 128).persistent_ctas == 0  # split-K over 128 CTAs
    # Llama-3-8B kv at M = 128: 8 output tiles; K split 8 ways (16-row slabs) keeps 64 SMs streaming, not 32.
    kv = heuristic_config(128, 1024, 4096, 128)  # (golden: split 8 ways)
    assert kv.split_k > 1 and kv.persistent_ctas == 0
    halved = dataclasses.replace(kv, split_k=4)
    assert modeled_time_us(kv, 128, 1024, 4096, 128, True, 132) < 0.7 * modeled_time_us(
        halved, 128, 1024, 4096, 128, True, 132
    )
    for bad in (dict(compute_wgs=1), dict(compute_wgs=2, split_k=2, tile_m=32)):
        with pytest.raises(ValueError, match="persistent_ctas=4 needs the warp-specialized kernel"):
            TuningConfig(tiles=1, persistent_ctas=4, **bad)
    with pytest.raises(ValueError, match="must be >= 0"):
        TuningConfig(compute_wgs=2, persistent_ctas=-1)


@pytest.mark.parametrize("group", [128, 256])
def test_partial_last_group_exact(group):
    """K = 576: the last scale row covers half (g128) or a quarter (g256) of a group."""
    rng = np.random.default_rng(group)
    qw = exact_weight(rng, 576, 128, group, False)
    x = activations(rng, 3, 576, exact=True)
    _check(x, qw, None, exact=True)


# Partial last K steps (TuningConfig.runs_past_k): K_pad an odd number of 64-wide chunks under steps of
# 128-512, whose TMA zero-fills the rows past K_pad of codes, x and scale rows. More steps than slots: the
# partial step lands in a slot an earlier step filled, so stale rows left by a partial fill would show.
# K = 576 and 1088 at g128 end in half a group; 448 at g32 in a step of four groups, one inside K.
_DECODE_ACC = dict(tile_m=8, max_concurrent_steps=2, scales_on="accumulators")


@pytest.mark.parametrize(
    "config, k, group, symmetric",
    [
        (TuningConfig(tiles=1, tile_k=512, **_DECODE_ACC), 1088, 128, True),
        (TuningConfig(tiles=1, tile_k=512, **_DECODE_ACC), 1088, 128, False),
        (TuningConfig(tiles=1, tile_k=256, producer=True, **_DECODE_ACC), 576, 128, False),
        (TuningConfig(tiles=2, tile_k=128, **_DECODE_ACC), 320, 64, False),
        (TuningConfig(tiles=1, tile_m=16, tile_k=128, max_concurrent_steps=3), 448, 32, False),
    ],
    ids=lambda v: v.tag if isinstance(v, TuningConfig) else str(v),
)
def test_partial_last_k_step_exact(config, k, group, symmetric):
    assert config.runs_past_k(k) and config.k_steps(k) > config.max_concurrent_steps
    rng = np.random.default_rng(k + group)
    qw = exact_weight(rng, k, config.cta_rows, group, symmetric)
    x = activations(rng, 2 * config.tile_m - 3, k, exact=True)
    _check(x, qw, config, exact=True)


@pytest.mark.no_kernel
def test_partial_last_k_step_rules():
    """Where a last K step may run past K_pad: the one-warpgroup kernel without slices or split-K, and
    decode's candidates only where K_pad is an odd number of 64-wide chunks (no deeper step divides it)."""
    sliced = TuningConfig(tiles=1, tile_m=1, tile_k=128, slices=8, scales_on="accumulators")
    with pytest.raises(ValueError, match="partial last K step needs slices=1"):
        sliced.check_problem(1, 64, 576, 128)
    with pytest.raises(ValueError, match="partial last K step"):
        TuningConfig(tiles=1, tile_m=128, tile_k=128, compute_wgs=2).check_problem(128, 128, 576, 128)
    TuningConfig(tiles=1, tile_m=8, tile_k=512, scales_on="accumulators").check_problem(8, 64, 576, 128)
    gpt_oss = heuristic_config(1, 2880, 2880, 128)  # K = 45 x 64: a 64-deep step divides it, no deeper one
    assert gpt_oss.tile_k > 64 and gpt_oss.runs_past_k(2880)
    assert gpt_oss.k_steps(2880) == -(-2880 // gpt_oss.tile_k)
    for m in (1, 16, 64, 128, 2048):  # K = 4096 and 1536: a dividing step, never a partial one
        for k in (4096, 1536):
            assert not heuristic_config(m, 4096, k, 128).runs_past_k(k)
    assert not heuristic_config(2048, 2880, 2880, 128).runs_past_k(2880)  # prefill: never


# Explicit configs: tiles 1..4, tile_k 64..256, pipelines of 2..5 slots, split-K 1..8, several M tiles
# walked in planar-snake order (21 rows; bands of 2 leave a partial last band).
@pytest.mark.sweep
@pytest.mark.parametrize(
    "config",
    [
        TuningConfig(tiles=4, tile_m=16, tile_k=128, max_concurrent_steps=4, split_k=2, grid_tile_m=2),
        TuningConfig(tiles=1, tile_m=32, tile_k=64, max_concurrent_steps=2, scales_on="accumulators"),
        TuningConfig(tiles=2, tile_m=8, tile_k=256, max_concurrent_steps=3, scales_on="accumulators"),
        TuningConfig(tiles=2, tile_m=32, tile_k=64, max_concurrent_steps=5, split_k=4, grid_tile_m=2),
        TuningConfig(
            tiles=2, tile_m=4, tile_k=64, slices=2, max_concurrent_steps=2, scales_on="accumulators"
        ),
        TuningConfig(tiles=2, tile_m=16, tile_k=128, max_concurrent_steps=3, split_k=2, compute_wgs=2),
        # 16-row slabs: the narrowest split the warp-specialized kernel takes (Llama-3-8B kv at M = 128).
        TuningConfig(tiles=1, tile_m=128, tile_k=64, max_concurrent_steps=3, split_k=8, compute_wgs=2),
        TuningConfig(tiles=1, tile_m=8, tile_k=64, max_concurrent_steps=4, compute_wgs=2, grid_tile_m=2),
    ],
    ids=lambda c: c.tag,
)
def test_configs_random(config):
    rng = np.random.default_rng(config.tile_m + config.split_k)
    m = 21 if config.slices == 1 else 8 // config.slices
    qw = random_weight(rng, 1536, 256, 128, False)
    x = activations(rng, m, 1536)
    _check(x, qw, config, exact=False)


def test_float16_activations_float32_scales():
    rng = np.random.default_rng(3)
    qw = random_weight(rng, 512, 128, 64, False, scale_dtype=jnp.float32)
    x = activations(rng, 9, 512, dtype=jnp.float16)
    _check(x, qw, None, exact=False)


def test_matches_xla_path_and_jit():
    rng = np.random.default_rng(4)
    qw = random_weight(rng, 384, 192, 128, True)
    x = activations(rng, 3, 384)
    with interpret(detect_races=True):
        y = jax.jit(lambda x, qw: mg.mosaic_gpu_matmul(x, qw))(x, qw)
    # Each within the rounding bound of its own computation (the kernel's route; the XLA path rounds
    # each weight once to bf16), against the one float64 reference.
    assert_kernel_within_rounding(y, x, qw, mg.plan(3, qw).config.scales_on)
    assert_within_rounding(xla_matmul(x, qw), x, qw)


def test_grad_wrt_x():
    """dx = g W^T (the backward pass: an XLA matmul with W rounded to g's dtype), elementwise."""
    rng = np.random.default_rng(5)
    qw = random_weight(rng, 256, 128, 64, False)
    x = activations(rng, 4, 256)
    g = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)

    def loss(x):
        return jnp.vdot(mg.mosaic_gpu_matmul(x, qw).astype(jnp.float32), g.astype(jnp.float32))

    with interpret(detect_races=True):
        dx = jax.grad(loss)(x)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    w_t = reference_dequantize(qw, jnp.bfloat16).T  # (N, K)
    ref = np.asarray(g, np.float64) @ w_t
    err = np.abs(np.asarray(dx, np.float64) - ref)
    assert (err <= rounding_bound(g, w_t, jnp.bfloat16)).all(), float(err.max())


def test_jit_cache_tracks_interpret_mode():
    """A function jitted inside interpret() is retraced outside it (and fails clearly on the CPU)."""
    rng = np.random.default_rng(7)
    qw = random_weight(rng, 128, 64, 64, True)
    x = activations(rng, 2, 128)
    f = jax.jit(lambda x, qw: mg.mosaic_gpu_matmul(x, qw))
    with interpret(detect_races=True):
        y = f(x, qw)
    assert_kernel_within_rounding(y, x, qw, mg.plan(2, qw).config.scales_on)
    with pytest.raises(NotImplementedError, match="interpret"):
        f(x, qw)


@pytest.mark.no_kernel  # M = 0 launches nothing
def test_empty_batch():
    qw = random_weight(np.random.default_rng(8), 128, 64, 64, True)
    with interpret(detect_races=True):
        y = mg.mosaic_gpu_matmul(jnp.zeros((0, 128), jnp.bfloat16), qw)
    assert y.shape == (0, 64) and y.dtype == jnp.bfloat16


@pytest.mark.no_kernel  # bit operations, heuristics or refusals: no kernel runs
def test_nk_int4_weight_is_refused_with_the_fix():
    qw = relayout(random_weight(np.random.default_rng(9), 256, 128, 64, True), "nk_int4")
    x = jnp.ones((2, 256), jnp.bfloat16)
    reason = mg.is_supported(x, qw)
    assert reason is not None and "relayout(qw, 'wgmma_int4')" in reason
    with pytest.raises(NotImplementedError, match="relayout"):
        mg.mosaic_gpu_matmul(x, qw)
    assert get_layout(relayout(qw, "wgmma_int4").layout).name == "wgmma_int4"


@pytest.mark.no_kernel  # the split-K scratch's shapes; the split-K kernels above use it
@pytest.mark.parametrize("wgs", [1, 2])
def test_split_k_scratch_is_the_slabs_smem_bytes_counts(wgs):
    """tile_m 64 over split_k 8: 8 slabs of (8, 64) f32 per warpgroup, 16 KiB (config.smem_bytes counts
    them so, tests/test_kernel_lowering.py); in interpret mode a copy for each of the 8 partitions (one CTA
    computes them all); each warpgroup gets its own run of them."""
    args = (64, 8, 1) if wgs == 1 else (64, 8, 1, wgs)  # one warpgroup: the callers' default
    slabs = split_k.scratch_types(*args)
    assert [(s.shape, s.dtype) for s in slabs] == [((8, 64), jnp.float32)] * 8 * wgs
    assert split_k.scratch_count(64, 8, 1, wgs) == 8 * wgs
    with interpret():
        assert len(split_k.scratch_types(*args)) == 64 * wgs
    refs = list(range(8 * wgs))
    assert [split_k.warpgroup_slabs(refs, w, wgs) for w in range(wgs)] == [
        refs[8 * w : 8 * (w + 1)] for w in range(wgs)
    ]
    # One A tile by default: an 8-row tile has one slab, too few for 2 CTAs; two A tiles have two.
    with pytest.raises(ValueError, match="8-row slabs"):
        split_k.slab_rows(8, 2)
    assert split_k.slab_rows(8, 2, 2) == 8


@pytest.mark.parametrize("m", [8, 16])
def test_split_k_slabs_from_m_on_are_not_stored(m):
    """Split-K 4 of a 32-row tile: four 8-row slabs, one a CTA; a slab starting at row m (8 or 16) is
    past y and left out, and the rows before are exact."""
    config = TuningConfig(tiles=1, tile_m=32, tile_k=128, max_concurrent_steps=2, split_k=4)
    rng = np.random.default_rng(m)
    k = 4 * 128
    qw = exact_weight(rng, k, config.cta_rows, 64, True)
    _check(activations(rng, m, k, exact=True), qw, config, exact=True)


# ------------------------------------------------------------------------------ the injected bugs


def _with_scale_rows_of(qw: QuantizedWeight, rows: dict[int, int]) -> QuantizedWeight:
    """``qw`` with scale (and offset) row r replaced by row ``rows[r]``: what a kernel reading the wrong
    rows computes, for the float64 reference."""
    index = np.arange(qw.scales.shape[0])
    for row, source in rows.items():
        index[row] = source
    offsets = None if qw.offsets is None else qw.offsets[index]
    return dataclasses.replace(qw, scales=qw.scales[index], offsets=offsets)


_BUG_CONFIG = TuningConfig(tiles=1, tile_m=16, tile_k=128, max_concurrent_steps=2)


@pytest.mark.parametrize(
    "bug, config, k, group, symmetric",
    [
        ("last-n-tile-zero", _BUG_CONFIG, 256, 64, True),
        ("split-k-partial-sum", dataclasses.replace(_BUG_CONFIG, tile_m=32, split_k=4), 1024, 128, False),
        ("last-group-scale-row", _BUG_CONFIG, 384, 64, False),  # 2 groups a step: a step's block of rows
        ("last-group-scale-row", _BUG_CONFIG, 768, 256, True),  # 2 steps a group: the group's row
        ("asym-bf16-dequant", dataclasses.replace(_BUG_CONFIG, scales_on=_ACC), 512, 128, False),
    ],
    ids=["last-n-tile", "split-k4", "scale-row-g64", "scale-row-g256", "asym-bf16"],
)
def test_injected_bugs_change_exactly_what_they_name(bug, config, k, group, symmetric):
    """Each deliberate bug of tests/kernel_faults.py (the GPU tests' proof that they fail) turns the
    bit-exact result into the float64 reference of the mistake it names, so that an injected run on the
    GPU fails for that reason: the last N tile zero; the last of 4 K partitions left out (x zero there);
    the last step's scale rows read from the step before (groups of 64: rows 4, 5 from 2, 3; of 256:
    group 2 from 1); the accumulator route's offset term rounded to bf16 (not exact; the symmetric
    weight, without offsets, stays exact). The same kernel without the bug is exact (the tests above)."""
    rng = np.random.default_rng(len(bug) + k)
    m, n = 5, 2 * config.cta_rows
    qw = exact_weight(rng, k, n, group, symmetric)
    x = activations(rng, m, k, exact=True)
    with faults.injecting(bug), interpret(detect_races=True):
        y = mg.mosaic_gpu_matmul(x, qw, config=config)
    if bug == "last-n-tile-zero":
        zero_last_tile = dataclasses.replace(qw, scales=qw.scales.at[:, n - config.cta_rows :].set(0))
        assert_exact(y, x, zero_last_tile)  # symmetric: no offsets, so zero scales make zero columns
    elif bug == "split-k-partial-sum":
        assert_exact(y, x.at[:, 3 * k // 4 :].set(0), qw)
    elif bug == "last-group-scale-row":
        assert_exact(y, x, _with_scale_rows_of(qw, {4: 2, 5: 3} if group == 64 else {2: 1}))
    else:
        with pytest.raises(AssertionError, match="differ from the exact reference"):
            assert_exact(y, x, qw)
        sym = exact_weight(rng, k, n, group, True)
        with faults.injecting(bug), interpret(detect_races=True):
            assert_exact(mg.mosaic_gpu_matmul(x, sym, config=config), x, sym)


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


def _distinct_heuristic_configs() -> list[tuple[TuningConfig, int | None, bool, bool]]:
    """Every TuningConfig the heuristics pick at the lowering tests' real-model shapes, with one group
    size and symmetry it was picked for (the lowering tests cover every combination at full size):
    symmetric where that kernel folds the bias into WGMMA (the asymmetric route runs in other configs)."""
    from tests.test_kernel_lowering import BATCHES, GROUPS, NUM_SMS, WEIGHT_SHAPES

    picked: dict[TuningConfig, tuple[int | None, bool]] = {}
    past_k: set[TuningConfig] = set()  # configs picked where their last K step runs past K_pad
    for (config, _, symmetric), case in heuristic_cases(WEIGHT_SHAPES, BATCHES, GROUPS, NUM_SMS).items():
        if config.runs_past_k(padded_weight_dims(case[1], case[2])[0]):
            past_k.add(config)
        if symmetric and folds_bias_config(config, has_offsets=False):
            picked[config] = (case[3], symmetric)
        else:
            picked.setdefault(config, (case[3], symmetric))
    return [(config, group, symmetric, config in past_k) for config, (group, symmetric) in picked.items()]


# Interpret mode checks the numbers of every config the heuristics can choose, on the smallest problem
# with that config's structure: one CTA column of N (several columns: the other tests here), one K step
# more per split than the pipeline has slots (kernel_checks.k_wrapping_the_pipeline), M filling the
# WGMMA's N (two M tiles, the last one partial, without K slices); a persistent
# grid runs 4 output tiles on 3 CTAs. (Production shapes would take minutes each in interpret mode; their
# lowering is checked in test_kernel_lowering.py and their SASS in test_xray.py.)
@pytest.mark.sweep
@pytest.mark.parametrize(
    "config, group, symmetric, past_k",
    _distinct_heuristic_configs(),
    ids=lambda v: v.tag if isinstance(v, TuningConfig) else str(v),
)
def test_every_heuristic_config_in_interpret_mode(config, group, symmetric, past_k):
    if config.persistent_ctas:  # 4 output tiles over 3 CTAs: one CTA runs two
        config = dataclasses.replace(config, persistent_ctas=3)
    # Every slot reused: the pipeline wraps; where the pick's last K step ran past K_pad, so does this one's.
    k = k_wrapping_the_pipeline(config, group, past_k=past_k)
    n = config.cta_rows * (2 if config.persistent_ctas else 1)
    m = config.tile_m if config.slices > 1 else 2 * config.tile_m - 3
    rng = np.random.default_rng(k + n + m)
    qw = random_weight(rng, k, n, group, symmetric)
    _check(activations(rng, max(m, 1), k), qw, config, exact=False)
