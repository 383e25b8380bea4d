"""The grouped (mixture-of-experts) W4A16 kernel in GPU interpret mode: numbers, empty experts, races.

Every kernel here is compared bit for bit with an exact reference: small-integer activations and
weights whose every product and partial sum is exact in f32 (tests/kernel_checks.exact_weight), so the one
rounding is y's, in kernel and reference alike. The reference is independent of the kernel: each group's
rows times its expert's float64 weight (``nybble.kernels.ops.matmul.reference``), zeros past the groups.
Interpret mode fills fresh outputs with NaN, so an element never written fails. Kernels run under the
race detector and end on its verdict (``run``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

import nybble
import nybble.kernels.mosaic_gpu as mg
from bench.xray.moe_cases import MOE_SHAPES, TOKENS, problems
from nybble.kernels.mosaic_gpu.config import TuningConfig
from nybble.kernels.mosaic_gpu.grouped import grouped_is_supported, grouped_matmul, grouped_plan
from nybble.kernels.mosaic_gpu.grouped_config import (
    grouped_heuristic_config,
    max_m_tiles,
    planned_rows,
)
from nybble.kernels.mosaic_gpu.interpret import interpret
from nybble.kernels.ops.matmul.reference import reference_dequantize
from tests.kernel_checks import activations, exact_weight

# Configs of each family, as the heuristics pick them at the MoE shapes (K slices at decode, a producer
# warpgroup, plain one-warpgroup tiles, the warp-specialized prefill kernel).
DECODE_SLICES = TuningConfig(
    tiles=1, tile_m=2, tile_k=128, slices=4, scales_on="accumulators", max_concurrent_steps=2
)
DECODE_PRODUCER = TuningConfig(
    tiles=2, tile_m=8, tile_k=128, scales_on="accumulators", producer=True, max_concurrent_steps=2
)
SMALL_TILES = TuningConfig(tiles=1, tile_m=8, tile_k=128, scales_on="weights", max_concurrent_steps=2)
PREFILL = TuningConfig(tiles=1, tile_m=128, tile_k=64, compute_wgs=2, max_concurrent_steps=2)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    mg.reset_state()


def stacked(rng, experts, k, n, group=128, symmetric=True):
    """A stacked QuantizedWeight of exact per-expert weights (and the per-expert weights)."""
    ws = [exact_weight(rng, k, n, group, symmetric) for _ in range(experts)]
    return jax.tree.map(lambda *a: jnp.stack(a), *ws), ws


def reference(x, ws, sizes) -> np.ndarray:
    """ragged_dot of x and the experts' float64 weights, rounded once to x's dtype; zeros past the sum."""
    x64 = np.asarray(x, np.float64)
    y = np.zeros((x.shape[0], ws[0].shape[1]))
    row = 0
    for w, g in zip(ws, sizes, strict=True):
        y[row : row + g] = x64[row : row + g] @ reference_dequantize(w, x.dtype)
        row += g
    assert (y.astype(np.float32) == y).all(), "test data is not exact in f32"
    return y.astype(np.float32).astype(x.dtype).astype(np.float64)


def run(x, qw, sizes, config, *, races=True):
    """The kernel in interpret mode; with ``races`` under the race detector, asserting its verdict."""
    with interpret(detect_races=races):
        y = np.asarray(grouped_matmul(x, qw, jnp.asarray(sizes, jnp.int32), config=config), np.float64)
    if races:
        assert not mg.races_found(), "the race detector flagged a data race"
    return y


def assert_exact(y, want) -> None:
    assert y.shape == want.shape
    bad = ~(y == want)  # NaN fails
    assert not bad.any(), f"{int(bad.sum())} of {bad.size} differ, first at {np.argwhere(bad)[0]}"


# ------------------------------------------------------------------------ edge cases, race detector on


@pytest.mark.parametrize(
    "config, sizes, rows, symmetric",
    [
        (DECODE_SLICES, [3, 0, 5, 2], 10, False),  # zeros between groups, tiles of 2 rows: 3 = 2 + 1
        (DECODE_SLICES, [0, 0, 7, 0], 9, True),  # one expert holds every row; 2 rows past the sum
        (DECODE_PRODUCER, [0, 13, 0, 4], 17, False),  # 13 = 8 + 5 rows, groups across 8-row windows
        (DECODE_PRODUCER, [1, 1, 1, 1], 4, True),  # fewer rows than the 8-row tile (x read as one block)
        (SMALL_TILES, [5, 0, 0, 6], 16, False),  # 5 rows past the sum, stored as zeros
        (SMALL_TILES, [0, 0, 0, 0], 9, True),  # no rows in any group: all zeros, no weight read
        (PREFILL, [70, 0, 60, 3], 140, False),  # tiles of 128 rows; 60 rows from row 70: two tiles
    ],
)
def test_groups(config, sizes, rows, symmetric):
    rng = np.random.default_rng(rows)
    experts, k, n = len(sizes), max(128, config.k_span()), config.cta_rows
    qw, ws = stacked(rng, experts, k, n, symmetric=symmetric)
    x = activations(rng, rows, k, exact=True)
    assert_exact(run(x, qw, sizes, config), reference(x, ws, sizes))


@pytest.mark.parametrize(
    "config, k, symmetric",
    [
        # Three 256-deep steps through 2 slots over K = 576 (9 chunks): the last step's 64 rows are inside.
        (dataclasses.replace(DECODE_PRODUCER, tiles=1, tile_k=256), 576, False),
        (dataclasses.replace(SMALL_TILES, tile_k=256), 576, True),
        (None, 2880, False),  # gpt-oss-120b's K = 45 chunks: the heuristic's 512-deep steps, 6 of them
    ],
    ids=["producer-k256", "weights-k256", "heuristic-k2880"],
)
def test_partial_last_k_step(config, k, symmetric):
    """The last K step runs past K_pad (TuningConfig.runs_past_k; TMA zero-fills) in every expert's tiles,
    with groups of every kind: empty, several M tiles, rows past the sum."""
    sizes, rows = [3, 0, 9, 1], 15
    rng = np.random.default_rng(k)
    qw, ws = stacked(rng, len(sizes), k, 64, symmetric=symmetric)
    used = config or grouped_plan(rows, qw)[0].config
    assert used.runs_past_k(k), used.tag
    x = activations(rng, rows, k, exact=True)
    assert_exact(run(x, qw, sizes, config), reference(x, ws, sizes))


def test_heuristic_config_and_odd_shapes():
    """The heuristic's own pick, K and N not multiples of 64 (the wrapper pads K and slices N), per column."""
    rng = np.random.default_rng(5)
    sizes, rows, k, n = [2, 0, 3], 6, 100, 60
    qw, ws = stacked(rng, len(sizes), k, n, group=None, symmetric=False)
    x = activations(rng, rows, k, exact=True)
    assert_exact(run(x, qw, sizes, None), reference(x, ws, sizes))


# ------------------------------------------------------------------- empty experts cost no weight bytes


class _CopiedBytes:
    """Bytes TMA copies from GMEM into SMEM in interpret mode, by source buffer (dtype, shape), counting
    only the part inside the buffer (the rest is TMA's zero fill)."""

    def __init__(self):
        self.by_buffer: dict[tuple[str, tuple[int, ...]], int] = {}

    def __enter__(self):
        from jax._src.pallas.mosaic.interpret import utils as interpret_utils

        task = gpu_callbacks.AsyncCopyGmemToSmemTask
        self._saved = task.pre_read
        counter = self

        def pre_read(task_self, tma_thread_id, shared_memory):
            shape, dtype = shared_memory.buffer_shape_and_dtype(task_self.src_allocation_key)
            shape = tuple(shape)
            clipped = interpret_utils.clip_range_to_shape(task_self.src_access.range, shape)
            if clipped is not None:
                size = int(np.prod(interpret_utils.Access(clipped).shape)) * np.dtype(dtype).itemsize
                key = (np.dtype(dtype).name, shape)
                counter.by_buffer[key] = counter.by_buffer.get(key, 0) + size
            return counter._saved(task_self, tma_thread_id, shared_memory)

        task.pre_read = pre_read
        return self

    def __exit__(self, *exc):
        gpu_callbacks.AsyncCopyGmemToSmemTask.pre_read = self._saved

    def of(self, dtype, ndim) -> int:
        return sum(v for (d, s), v in self.by_buffer.items() if d == dtype and len(s) == ndim)


@pytest.mark.parametrize(
    "config, sizes",
    [
        (DECODE_SLICES, [0, 1, 0, 1, 0, 1]),  # decode: 3 of 6 experts, a row each
        (SMALL_TILES, [0, 3, 5, 0, 8, 0]),  # each group in one aligned 8-row tile
        (DECODE_PRODUCER, [0, 6, 0, 0, 0, 2]),  # a producer warpgroup issuing the copies
        (SMALL_TILES, [0] * 6),  # no rows: no weight byte at all
    ],
)
def test_empty_experts_cost_no_weight_bytes(config, sizes):
    """Codes, scales and offsets copied by TMA are exactly the active experts' (each in one M tile here),
    counted on the interpreter's copies from the weight's GMEM buffers (two K steps, so the pipeline
    refills)."""
    rng = np.random.default_rng(len(sizes))
    rows, k, n = sum(sizes) + 2, max(256, config.k_span()), config.cta_rows
    qw, ws = stacked(rng, len(sizes), k, n, symmetric=False)
    x = activations(rng, rows, k, exact=True)
    with _CopiedBytes() as copied:
        y = run(x, qw, sizes, config)
    assert_exact(y, reference(x, ws, sizes))
    active = sum(1 for g in sizes if g)
    per_expert_codes = qw.codes[0].size * 4
    per_expert_params = (qw.scales[0].size + qw.offsets[0].size) * 2  # bf16 scales and offsets
    assert copied.of("uint32", 4) == active * per_expert_codes
    assert copied.of("bfloat16", 4) == active * per_expert_params
    assert copied.of("uint32", 4) < qw.codes.size * 4 or active == len(sizes)


# ----------------------------------------------------------------------------- heuristics and refusals


def _tiles_taken(sizes, rows, tile_m, align) -> int:
    """M tiles of a grouping, counted the kernel's way in plain Python: a group of g rows from row r takes
    ceil((r % align + g) / tile_m); the rows past the sum are a group too."""
    total, row = 0, 0
    for g in [*sizes, rows - sum(sizes)]:
        total += -(-(row % align + g) // tile_m) if g else 0
        row += g
    return total


def test_m_tile_bound_holds():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        experts = int(rng.integers(1, 12))
        rows = int(rng.integers(1, 80))
        tile_m = int(2 ** rng.integers(0, 7))
        align = tile_m if rng.random() < 0.3 else int(min(tile_m, 2 ** rng.integers(0, 4)))
        cuts = np.sort(rng.integers(0, rows + 1, experts))
        sizes = np.diff(np.concatenate([[0], cuts])).tolist()
        assert _tiles_taken(sizes, rows, tile_m, align) <= max_m_tiles(rows, experts, tile_m, align)


def test_decode_picks_slices_and_no_split_k():
    # Qwen3-30B-A3B gate/up at 1 token: 8 experts of one row each, 8 K slices, one launch.
    c = grouped_heuristic_config(8, 128, 768, 2048, 128, has_offsets=False)
    assert c.slices == 8 and c.tile_m == 1 and c.split_k == 1
    for _, _, rows, e, k, n in problems(MOE_SHAPES, TOKENS):
        c = grouped_heuristic_config(rows, e, n, k, 128)
        assert c.split_k == 1 and c.persistent_ctas == 0
        # The dense families by rows per active expert: decode (one warpgroup, the accumulator route at
        # g128) up to 64, exact weights beyond (warp-specialized where N_pad is a multiple of 128).
        if planned_rows(rows, e) <= 64:
            assert c.compute_wgs == 1 and c.scales_on == "accumulators"
        else:
            assert c.scales_on == "weights" and (c.compute_wgs == 2) == (n % 128 == 0)


def test_refusals():
    rng = np.random.default_rng(1)
    qw, _ = stacked(rng, 3, 128, 64)
    x = jnp.zeros((5, 128), jnp.bfloat16)
    sizes = jnp.asarray([1, 2, 2], jnp.int32)
    assert grouped_is_supported(x, qw, sizes) is None
    one = exact_weight(rng, 128, 64, 128, True)
    assert "stacked" in grouped_is_supported(x, one, sizes)
    assert "(3,)" in grouped_is_supported(x, qw, jnp.asarray([1, 2], jnp.int32))
    assert "int32" in grouped_is_supported(
        x, qw, sizes.astype(jnp.int64 if jax.config.x64_enabled else jnp.int16)
    )
    assert "K=100" in grouped_is_supported(jnp.zeros((5, 100), jnp.bfloat16), qw, sizes)
    assert "float32" in grouped_is_supported(x.astype(jnp.float32), qw, sizes)
    with pytest.raises(ValueError, match=">= 0"):
        grouped_matmul(x, qw, jnp.asarray([3, -1, 2], jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="more than x's 5 rows"):
        grouped_matmul(x, qw, jnp.asarray([3, 2, 1], jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="split-K"):
        grouped_plan(5, qw, config=dataclasses.replace(SMALL_TILES, split_k=2, tile_m=16))


def test_traced_group_sizes_clamped():
    """Under jit group_sizes' values cannot be checked: a negative size counts as zero and rows past x's
    are dropped, as in nybble.ragged_matmul's XLA path."""
    rng = np.random.default_rng(3)
    qw, ws = stacked(rng, 3, 128, 64)
    x = activations(rng, 6, 128, exact=True)
    fn = jax.jit(lambda x, qw, s: grouped_matmul(x, qw, s, config=SMALL_TILES))
    with interpret(detect_races=True):
        y = np.asarray(fn(x, qw, jnp.asarray([2, -3, 9], jnp.int32)), np.float64)
    assert not mg.races_found()
    assert_exact(y, reference(x, ws, [2, 0, 4]))


def test_dispatched_kernel_clamps_traced_sizes_itself():
    """``nybble.ragged_matmul(implementation="mosaic_gpu")`` passes traced sizes to the kernel unclamped
    (no cumsum in the program: two launches a MoE layer of a decode step): the kernel's scan of them
    clamps them as the XLA path does."""
    rng = np.random.default_rng(4)
    qw, ws = stacked(rng, 3, 128, 64)
    x = activations(rng, 6, 128, exact=True)
    fn = jax.jit(lambda x, s: nybble.ragged_matmul(x, qw, s, implementation="mosaic_gpu"))
    for sizes, clamped in (([2, -3, 9], [2, 0, 4]), ([-1, 3, 1], [0, 3, 1]), ([4, 4, 4], [4, 2, 0])):
        mg.reset_state()
        with interpret(detect_races=True):
            text = str(jax.make_jaxpr(fn)(x, jnp.asarray(sizes, jnp.int32)))
            y = np.asarray(fn(x, jnp.asarray(sizes, jnp.int32)), np.float64)
        assert not mg.races_found()
        assert "cumsum" not in text and "nybble_grouped_w4a16" in text
        assert_exact(y, reference(x, ws, clamped))
        xla = jax.jit(lambda x, s: nybble.ragged_matmul(x, qw, s, implementation="xla"))
        np.testing.assert_array_equal(np.asarray(xla(x, jnp.asarray(sizes, jnp.int32)), np.float64), y)
