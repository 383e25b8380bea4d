"""The grouped (mixture-of-experts) W4A16 kernel: ``ragged_dot(x, dequantize(qw), group_sizes)``, one launch.

x (rows, K) is sorted by expert: its first ``group_sizes[0]`` rows go to expert 0, the next
``group_sizes[1]`` to expert 1, ...; the rows past the sum are zero in y, as in ``jax.lax.ragged_dot``. The
weight is a stacked ``wgmma_int4`` QuantizedWeight (every array with a leading expert axis, the same packing
per expert), so each expert is read exactly as the dense kernel reads its one weight.

The CTAs are the dense kernels' (w4a16.py, w4a16_ws.py: the same config, K pipeline, dequantization and
epilogue) over work items computed on the device from ``group_sizes``:

    M tiles: expert e's rows cut into ceil(g_e / tile_m) tiles, expert after expert, then the rows past
        the sum (a group of their own, stored as zeros); at most ``grouped_config.max_m_tiles`` of them,
        whatever the grouping, so the grid is that bound times the N tiles (N fastest);
    CTA (t, n): reads group_sizes (one scalar load per expert, every thread), finds the expert owning M
        tile t (the last whose first tile is at or before t), then
          * runs the dense CTA on expert e's codes and scales (a GMEM view ``codes.at[e]``: TMA reads only
            that expert), and x rows from the tile's first, through a window of tile_m rows (clamped to
            x's end: TMA never reads past x, the tile's rows sit at an offset in it);
          * stores only the tile's rows of y: one TMA per set bit of the row count (``common.store_rows``),
            so no padding row of an expert lands on the next expert's rows;
        a tile of rows past the sum stores zeros without reading a weight; t past the last tile does
        nothing. Experts without rows own no tile: their weights are never read.

What it costs besides the dense CTA's work (X-ray, bench/xray/moe_cases.py; not timed): every CTA scans
the group sizes, ~12 scalar instructions an expert (E = 128: ~1.5k instructions a thread, once); the grid
is the worst case's M tiles, so the CTAs past the real tiles scan and exit (at decode with WGMMA N = 8
the bound is exact for one row per expert; at Qwen3-30B-A3B down, 8 tokens: 568 CTAs of which 512 work
when the rows spread evenly). A parallel scan (the warpgroup's lanes over the experts) or a persistent
grid reading a tile table would remove both; neither is done yet.

An expert's rows are padded to the M tile only inside the kernel (TMA zero-fills x past its end; the rows
of the next expert in a tile's window are multiplied and never stored). The wrapper pads x only where the
dense kernel does (K not a multiple of 64; rows that would not fill whole 8-row SMEM tiles of the x view:
``config.x_rows``). Decode (a few rows per expert) and prefill (hundreds) configs come from the dense cost
model (grouped_config.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nybble.device import DEFAULT_NUM_SMS
from nybble.jax_range import outside_reason
from nybble.kernels.mosaic_gpu.common import CtaTile, Problem, RowWindow, StashedRows
from nybble.kernels.mosaic_gpu.config import TuningConfig
from nybble.kernels.mosaic_gpu.dense import kernel_x, problem, weight_options, weight_reason, x_reason
from nybble.kernels.mosaic_gpu.grouped_config import (
    grouped_heuristic_config,
    grouped_refusal,
    max_m_tiles,
)
from nybble.kernels.mosaic_gpu.interpret import active_params
from nybble.kernels.mosaic_gpu.interpret import interpret as interpret_context
from nybble.kernels.mosaic_gpu.w4a16 import w4a16_single_wg
from nybble.kernels.mosaic_gpu.w4a16_ws import w4a16_warp_specialized
from nybble.quant.qweight import QuantizedWeight

__all__ = ["GroupedWork", "grouped_is_supported", "grouped_matmul", "grouped_plan"]


@dataclasses.dataclass(frozen=True)
class GroupedWork:
    """The grouped kernel's CTAs (``common.DenseWork``'s counterpart): the kernel's first input is
    group_sizes (experts,) int32, then the stacked views of :func:`_views`."""

    experts: int
    rows: int  # rows of x and y (x may carry zero rows more: Problem.x_rows)
    m_tiles: int  # the bound on M tiles (grouped_config.max_m_tiles)
    name: str = "nybble_grouped_w4a16"
    # Rows of x an M tile holds: the config's tile_m (0), or the Blackwell kernel's tile_m / slices (its
    # tile_m counts the x view's rows, x rows times the K slices).
    tile_rows: int = 0

    def ctas(self, p: Problem) -> int:
        return self.m_tiles * p.n_tiles

    def run(self, p: Problem, ins: Any, body: Any, wg: Any = None, wgs: int = 1) -> None:
        """``body(tile)`` with this CTA's tile, its y rows kept in SMEM (one slot per warpgroup: each
        writes and reads its own) until the epilogue (``common.StashedRows``)."""

        def scoped(stash: Any) -> None:
            body(self.tile(p, ins, stash=stash, wg=0 if wg is None else wg))

        collective = {} if wg is None else {"collective_axes": "wg"}
        pl.run_scoped(scoped, plgpu.SMEM((wgs, 3), jnp.int32), **collective)

    def tile(self, p: Problem, ins: Any, stash: Any = None, wg: Any = 0) -> CtaTile:
        c = p.config
        tm = self.tile_rows or c.tile_m
        sizes, codes, x, scales, *offsets = ins
        lin = lax.axis_index("mn")
        t, ni = lin // p.n_tiles, lin % p.n_tiles
        align = x_alignment(p, tm)
        e, first_tile, first_row, size, tiles_end = _find_tile(sizes, t, self.experts, self.rows, tm, align)
        # The group's tiles start at its first row rounded down to the alignment, tm rows apart; this
        # one stores the group's rows in it.
        tile_start = first_row - (first_row & (align - 1)) + (t - first_tile) * tm
        start = jnp.maximum(first_row, tile_start)
        # (Past y's rows, where sizes traced under jit sum past them: nothing to store.)
        count = jnp.minimum(jnp.minimum(first_row + size, tile_start + tm), self.rows) - start
        # x rows [window, window + tm) (in the x view: times the slices), clamped to x's end; where x
        # has fewer rows than the tile, the dense kernel's one block from row 0, zero-filled by TMA.
        s = c.slices
        if p.x_rows >= tm:
            window = jnp.minimum(tile_start, p.x_rows - tm)
            # A multiple of 8 rows of the x view (SMEM tiles of 8 rows; Mosaic cannot prove it itself).
            x = x.at[pl.ds(pl.multiple_of(window * s, 8), tm * s)]
        else:
            window = jnp.int32(0)
        active = (t < tiles_end) & (count > 0)
        tail = e == self.experts  # rows past the groups' sum: zeros
        own = jnp.minimum(e, self.experts - 1)  # a valid view for the tail's CTAs, which read nothing
        gmem = [codes.at[own], x, scales.at[own]] + [o.at[own] for o in offsets]
        max_rows = min(tm, self.rows)
        if stash is None:
            rows = RowWindow(start - window, start, count, max_rows)
        else:
            rows = StashedRows.stash(stash, wg, start - window, start, count, max_rows)
        return CtaTile(jnp.int32(0), ni, gmem, rows, compute=active & ~tail, zeros=active & tail)


def x_alignment(p: Problem, tile_rows: int = 0) -> int:
    """Rows of x at which an M tile's window may start: where the x view's row (times the slices) is a
    multiple of 8, as Mosaic slices GMEM by whole 8-row SMEM tiles; 1 where x is read as one block.
    ``tile_rows``: x rows an M tile holds (0: the config's tile_m; ``GroupedWork.tile_rows``)."""
    c = p.config
    if p.x_rows < (tile_rows or c.tile_m):
        return 1
    return 8 // math.gcd(c.slices, 8)


def _find_tile(sizes: Any, t: Any, experts: int, rows: int, tile_m: int, align: int) -> tuple[Any, ...]:
    """(group, its first M tile, its first row, its rows, M tiles of all groups) for M tile ``t``: the last
    group whose first tile is at or before t (one that has rows: an empty group's successor starts at the
    same tile). A group of g rows from row r takes ceil((r % align + g) / tile_m) tiles (none if empty).
    Group ``experts`` is the rows past the sum. Scalar code, unrolled over the experts (each size one load;
    ~12 instructions an expert, once per CTA before its first copy)."""
    shift = tile_m.bit_length() - 1  # tile_m is a power of two
    zero = jnp.int32(0)
    tiles_end, rows_end = zero, zero
    e_sel, first_tile, first_row, size = zero, zero, zero, zero
    for e in range(experts + 1):
        # A negative size (only possible under jit) counts as zero, as in nybble.ragged_matmul's XLA path.
        g = jnp.maximum(sizes[e], 0) if e < experts else jnp.maximum(rows - rows_end, 0)
        mine = tiles_end <= t
        e_sel = jnp.where(mine, jnp.int32(e), e_sel)
        first_tile = jnp.where(mine, tiles_end, first_tile)
        first_row = jnp.where(mine, rows_end, first_row)
        size = jnp.where(mine, g, size)
        lead = (rows_end & (align - 1)) if align > 1 else zero
        tiles = lax.shift_right_logical(lead + g + (tile_m - 1), jnp.int32(shift))
        tiles_end = tiles_end + (jnp.where(g > 0, tiles, zero) if align > 1 else tiles)
        rows_end = rows_end + g
    return e_sel, first_tile, first_row, size, tiles_end


def _views(p: Problem, experts: int, x: jax.Array, qw: QuantizedWeight) -> list[Any]:
    """The stacked GMEM views (``common.operand_views`` with a leading expert axis): codes (E, N_pad / W,
    8, K_pad / S), x (rows' * S, K_pad / S), scales [offsets] (E, S, groups / S, N_pad) or (E, 1, 1, N_pad)
    per column. Reshapes, no copies."""
    s = p.config.slices
    views = [
        qw.codes.reshape(experts, p.n_pad // (64 // s), 8, p.slice_k),
        x.reshape(p.x_rows * s, p.slice_k),
    ]
    for a in (qw.scales, qw.offsets) if p.has_offsets else (qw.scales,):
        views.append(
            a.reshape(experts, 1, 1, p.n_pad) if p.per_column else a.reshape(experts, s, -1, p.n_pad)
        )
    return views


def grouped_is_supported(x: Any, qw: Any, group_sizes: Any) -> str | None:
    """None when the grouped kernel computes ``ragged_dot(x, dequantize(qw), group_sizes)``, else why not
    (the shape or value, the rule, the fix).

    Checks shapes and dtypes only (values may be traced): group_sizes' values (non-negative, summing to at
    most x's rows) are checked by :func:`grouped_matmul` where they are concrete. Says nothing about the
    device (a Hopper GPU, or ``nybble.kernels.interpret()``). Refuses every argument under a jax outside
    nybble's range (``nybble.jax_range``).
    """
    if (reason := outside_reason()) is not None:
        return reason
    if not isinstance(qw, QuantizedWeight):
        return f"the weight is a {type(qw).__name__}, not a nybble.QuantizedWeight"
    if getattr(qw.codes, "ndim", 0) != 3:
        return (
            f"the weight's codes have shape {tuple(getattr(qw.codes, 'shape', ()))}: a stacked expert weight "
            f"has codes (experts, N_pad / 8, K_pad) (nybble.quantize of an (experts, K, N) weight, or the "
            f"per-expert QuantizedWeights stacked with jax.tree.map(jnp.stack, *weights))"
        )
    experts = qw.codes.shape[0]
    if (reason := weight_reason(qw)) is not None:
        return reason
    for name in ("scales", "offsets"):
        a = getattr(qw, name)
        if a is not None and (a.ndim != 3 or a.shape[0] != experts):
            return f"the weight's {name} have shape {tuple(a.shape)}: expected ({experts}, groups, N_pad)"
    if getattr(x, "ndim", None) != 2:
        return f"x has shape {tuple(getattr(x, 'shape', ()))}: expected (rows, K), rows sorted by expert"
    if (reason := x_reason(x, qw)) is not None:
        return reason
    shape = tuple(getattr(group_sizes, "shape", ()))
    if shape != (experts,):
        return f"group_sizes has shape {shape}: expected ({experts},), one size per expert of the weight"
    if np.dtype(group_sizes.dtype) != np.int32:
        return f"group_sizes has dtype {np.dtype(group_sizes.dtype).name}: expected int32 (cast it)"
    return None


def _check_values(group_sizes: Any, rows: int) -> None:
    """group_sizes' values where they are concrete (under jit they are not, and are not checked: a sum
    past the rows computes the rows that exist, TMA clipping the rest)."""
    if isinstance(group_sizes, jax.core.Tracer):
        return
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
        raise ValueError(f"grouped_matmul: group_sizes must be >= 0, got {sizes.tolist()}")
    if int(sizes.sum()) > rows:
        raise ValueError(
            f"grouped_matmul: group_sizes sum to {int(sizes.sum())}, more than x's {rows} rows: the groups "
            f"must fit in x (rows past the sum are zeros)"
        )


def grouped_plan(
    rows: int,
    qw: QuantizedWeight,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    config: TuningConfig | None = None,
    allow: Callable[[TuningConfig], bool] | None = None,
) -> tuple[Problem, GroupedWork]:
    """The launch one grouped matmul of ``rows`` rows against the stacked ``qw`` makes: the problem
    (config, padding) and its CTAs. ``config`` None: ``grouped_config.grouped_heuristic_config``'s pick
    among the configs ``allow`` accepts (None: every one the grouped kernel runs)."""
    experts = qw.codes.shape[0]
    k_pad, n_pad = qw.padded_shape
    if config is None:
        config = grouped_heuristic_config(
            rows, experts, n_pad, k_pad, qw.group_size, num_sms, allow=allow, **weight_options(qw)
        )
    if (why := grouped_refusal(config)) is not None:
        raise ValueError(f"grouped_matmul: {why}: {config}")
    config.check_problem(min(rows, config.tile_m), n_pad, k_pad, qw.group)
    p = problem(rows, qw, config, jnp.bfloat16)
    align = x_alignment(p)
    return p, GroupedWork(experts, rows, max_m_tiles(rows, experts, config.tile_m, align))


def grouped_matmul(
    x: jax.Array,
    qw: QuantizedWeight,
    group_sizes: jax.Array,
    *,
    config: TuningConfig | None = None,
    interpret: bool = False,
    num_sms: int = DEFAULT_NUM_SMS,
) -> jax.Array:
    """``jax.lax.ragged_dot(x, dequantize(qw), group_sizes)`` with the grouped Hopper W4A16 kernel.

    Args:
      x: (rows, K) bf16/f16, sorted by expert.
      qw: a stacked ``wgmma_int4`` QuantizedWeight: codes (experts, N_pad / 8, K_pad), scales (and
        offsets) (experts, groups, N_pad), ``shape`` (K, N) per expert.
      group_sizes: (experts,) int32, rows of x per expert, summing to at most rows.
      config: a TuningConfig (without split-K or a persistent grid); None: the heuristic's.
      interpret: run in GPU interpret mode on the CPU (as inside ``nybble.kernels.interpret()``).
      num_sms: SMs of the target GPU (132 on H100/H200).

    Returns:
      (rows, N) in x's dtype; rows past the sum of group_sizes are zero. Forward only (no gradient).

    group_sizes' values are checked where concrete (none negative, sum at most rows); under jit they are
    not: a negative size counts as zero, and a sum past the rows computes the rows there are (TMA clips
    the rest).
    """
    if (reason := grouped_is_supported(x, qw, group_sizes)) is not None:
        raise NotImplementedError(f"grouped_matmul cannot run these arguments: {reason}")
    if config is not None and not isinstance(config, TuningConfig):
        raise TypeError(f"grouped_matmul: config must be a TuningConfig, got {type(config).__name__}")
    rows = x.shape[0]
    _check_values(group_sizes, rows)
    if rows == 0:
        return jnp.zeros((0, qw.shape[1]), x.dtype)
    ctx = interpret_context() if interpret and active_params() is None else contextlib.nullcontext()
    with ctx:
        return _forward(x, qw, group_sizes, config, int(num_sms))


def _forward(x, qw, group_sizes, config, num_sms) -> jax.Array:
    p, work = grouped_plan(x.shape[0], qw, num_sms=num_sms, config=config)
    p = dataclasses.replace(p, dtype=x.dtype)
    x = kernel_x(x, p)
    operands = [group_sizes, *_views(p, work.experts, x, qw)]
    run = w4a16_single_wg if p.config.compute_wgs == 1 else w4a16_warp_specialized
    y = run(p, operands, work)
    return y if p.n == qw.shape[1] else y[:, : qw.shape[1]]
