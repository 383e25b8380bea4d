"""What the W4A16 kernel variants share: the problem's facts, the operands' block specs, one K step of
dequantization and WGMMA for either route, and the epilogue.

Operands, as the wrapper hands them over (all views by reshape, no copies):
  * codes: ``wgmma_int4`` words (N_pad / 8, K_pad) viewed as (N_pad / W, 8, K_pad / S), W = 64 / S: one
    64-row A tile is 8 slots of 8 rows, slot = band * S + slice (dequant_registers.py); a step's block is
    (A tiles, 8, tile_k) words, 32 * tile_k bytes per A tile;
  * x: (M', K) viewed as (M' * S, K / S): B row m * S + j is x[m] over slice j; a block of WGMMA's N rows,
    rows past M' * S zero-filled by TMA (M' >= M: the wrapper's zero rows where M * S would not fill whole
    8-row SMEM tiles, config.x_rows);
  * scales (offsets): (num_groups, N_pad) viewed as (S, num_groups / S, N_pad), or (1, 1, N_pad) for one
    group per column; a step reads one row (group >= tile_k) or tile_k / group rows per slice;
  * y: (M, N); TMA stores clip the rows and columns past M and N. Under split-K the CTAs of one output
    tile form a cluster and sum their f32 partials in SMEM (split_k.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nybble.kernels.mosaic_gpu import split_k
from nybble.kernels.mosaic_gpu.compat import store_unoptimized
from nybble.kernels.mosaic_gpu.config import (
    CHUNK_K,
    TuningConfig,
    scale_rows_per_step,
    stores_any_rows,
    wgmma_k,
)
from nybble.kernels.mosaic_gpu.config import folds_bias as config_folds_bias
from nybble.kernels.mosaic_gpu.dequant_registers import BIAS, dequantize_chunk, slot_rows, sum_slices

L = plgpu.Layout


@dataclasses.dataclass(frozen=True)
class Problem:
    """Static facts about one problem and config, derived once and shared by the kernel bodies."""

    m: int  # rows of y (the batch)
    n: int  # columns of y as stored (N, or N_pad when N's row stride would not suit TMA)
    n_pad: int
    k_pad: int
    group: int  # K rows per scale row (K_pad for per-column)
    dtype: Any  # activations and WGMMA operands
    has_offsets: bool
    config: TuningConfig
    # Rows of x as handed over: m, or more zero rows (config.x_rows); y keeps m (TMA stores clip the rest).
    x_rows: int
    # The SwiGLU epilogue (config.swiglu_reason): W's columns are gate and up interleaved
    # (nybble.packing.gate_up), y (M, n) holds silu(r gate) * (r up), n = half of W's columns, and r =
    # rsqrt(s / dim + eps) per row from a (M,) f32 operand s after the others (an RMSNorm's sum of
    # squares), ``norm`` = (dim, eps); ``norm`` None: r = 1 and no such operand (the grouped kernels').
    swiglu: bool = False
    norm: tuple[float, float] | None = (1.0, 1.0)
    # The residual epilogue (config.residual_reason): two (M, n) outputs, x = residual + y and h = x * w,
    # from two operands after the others, the residual stream (M, n) and a norm's weight (1, n)
    # (epilogue.residual_norm: the next layer's input norm, whose product XLA would launch).
    residual: bool = False
    norm_weight_dtype: Any = None  # the residual epilogue's w: bf16, f16 or f32

    @property
    def row_scaled(self) -> bool:
        """Whether the SwiGLU epilogue reads each row's sum of squares (the operand after the others)."""
        return self.swiglu and self.norm is not None

    @property
    def out_dtype(self) -> Any:
        """y's dtype: the activation dtype (split-K partials are summed in the cluster, split_k.py)."""
        return self.dtype

    @property
    def m_tiles(self) -> int:
        return self.config.m_tiles(self.m)

    @property
    def n_tiles(self) -> int:
        return self.n_pad // self.config.cta_rows

    @property
    def slice_k(self) -> int:
        return self.k_pad // self.config.slices

    @property
    def steps_per_split(self) -> int:
        """K steps of one CTA; the last one partial where the config runs past K_pad (its TMA zero-fills)."""
        return self.config.k_steps(self.k_pad)

    @property
    def scale_rows(self) -> int:
        return scale_rows_per_step(self.config, self.group)

    @property
    def per_column(self) -> bool:
        return self.group >= self.k_pad

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.m, self.n)


@dataclasses.dataclass(frozen=True)
class RowWindow:
    """The y rows one CTA stores when they are not its whole M tile (the grouped kernel, grouped.py): SMEM
    rows ``[offset, offset + count)`` of its y tile go to y rows ``[start, start + count)``, ``count`` in
    ``[1, max_rows]`` (traced values but ``max_rows``, a static bound: min(tile_m, y rows))."""

    offset: Any
    start: Any
    count: Any
    max_rows: int

    def read(self) -> RowWindow:
        """The window's values (a stashed window loads them here: :class:`StashedRows`)."""
        return self


@dataclasses.dataclass(frozen=True)
class StashedRows(RowWindow):
    """A :class:`RowWindow` kept in SMEM (``ref[index] = (offset, start, count)``, int32) from the CTA's
    start to its epilogue: registers live across the K loop are what a warpgroup at its register limit
    spills (X-ray of the grouped kernel, a producer's compute warpgroup: 16-80 bytes)."""

    ref: Any = None
    index: Any = 0

    @classmethod
    def stash(cls, ref: Any, index: Any, offset: Any, start: Any, count: Any, max_rows: int) -> StashedRows:
        for j, v in enumerate((offset, start, count)):
            ref[index, j] = v
        return cls(None, None, None, max_rows, ref, index)

    def read(self) -> RowWindow:
        r, i = self.ref, self.index
        return RowWindow(r[i, 0], r[i, 1], r[i, 2], self.max_rows)


@dataclasses.dataclass(frozen=True)
class CtaTile:
    """What one CTA computes: M tile ``mi`` of x and y (its block index), columns of N tile ``ni``, from
    the GMEM operands ``gmem`` (codes, x, scales[, offsets], as :func:`operand_specs` indexes them).
    ``rows``: None (y rows ``mi * tile_m ..``, clipped at M by TMA) or the window of y rows to store.
    ``compute`` / ``zeros``: whether this CTA runs the matmul, or stores zeros into its rows without
    reading a weight (Python True / False, or traced bools)."""

    mi: Any
    ni: Any
    gmem: list[Any]
    rows: RowWindow | None = None
    compute: Any = True
    zeros: Any = False


@dataclasses.dataclass(frozen=True)
class DenseWork:
    """The dense kernel's CTAs: one per (M tile, N tile) in :func:`tile_indices`' order, every one computing.
    The grouped kernel has its own (grouped.py): the kernel bodies ask their ``work`` for the grid and for
    each CTA's :class:`CtaTile`."""

    name: str = "nybble_w4a16"

    def ctas(self, p: Problem) -> int:
        return p.m_tiles * p.n_tiles

    def tile(self, p: Problem, ins: Any) -> CtaTile:
        mi, ni = tile_indices(p, lax.axis_index("mn"))
        return CtaTile(mi, ni, list(ins))

    def run(self, p: Problem, ins: Any, body: Any, wg: Any = None, wgs: int = 1) -> None:
        """``body(tile)`` with this CTA's :meth:`tile` (``wg``, ``wgs``: the calling warpgroup and the CTA's
        warpgroups, for work that keeps per-warpgroup state)."""
        body(self.tile(p, ins))


def run_tile(tile: CtaTile, compute: Any, zeros: Any) -> None:
    """``compute()`` where ``tile.compute``, ``zeros()`` where ``tile.zeros`` (Python bools decide now)."""
    for cond, fn in ((tile.compute, compute), (tile.zeros, zeros)):
        if cond is True:
            fn()
        elif cond is not False:
            pl.when(cond)(fn)


def store_rows(src: Any, out_gmem: Any, cols: Any, rows: RowWindow) -> None:
    """TMA stores of SMEM rows ``rows.offset + [0, rows.count)`` of ``src`` into y rows ``rows.start + ..``,
    columns ``cols``: a TMA's shape is static, so one store per set bit of the count, largest first (the
    ladder of jax's ragged_dot_mgpu.py): at most log2(max_rows) + 1 stores, the others skipped."""
    rows = rows.read()
    offset, remaining = rows.offset, rows.max_rows
    while remaining > 0:
        size = 1 << (remaining.bit_length() - 1)
        remaining //= 2

        @pl.when(rows.count & size != 0)
        def _(offset=offset, size=size):
            dst = out_gmem.at[pl.ds(rows.start + offset - rows.offset, size), cols]
            plgpu.copy_smem_to_gmem(src.at[pl.ds(offset, size)], dst)

        offset = offset + (rows.count & size)


def kernel_name(p: Problem, base: str = "nybble_w4a16") -> str:
    """``<base>_<config tag>``, ``_o`` with offsets, ``_swiglu`` or ``_residual`` with those epilogues: what a
    profiler and the X-ray show (``base``: the kernel family, ``nybble_w4a16`` dense, ``nybble_grouped_w4a16``
    grouped)."""
    epilogue = "_swiglu" if p.swiglu else "_residual" if p.residual else ""
    return f"{base}_{p.config.tag}{'_o' if p.has_offsets else ''}{epilogue}"


def operand_views(p: Problem, x: jax.Array, codes: jax.Array, scales: Any, offsets: Any) -> list[Any]:
    """The GMEM arrays the kernel's TMA reads, as reshapes of the wrapper's operands."""
    c = p.config
    s = c.slices
    views = [
        codes.reshape(p.n_pad // (64 // s), 8, p.slice_k),
        x.reshape(p.x_rows * s, p.slice_k),
    ]
    for a in (scales, offsets) if p.has_offsets else (scales,):
        views.append(a.reshape(1, 1, p.n_pad) if p.per_column else a.reshape(s, -1, p.n_pad))
    return views


def scale_row(p: Problem, step: Any) -> Any:
    """The block row of the scales (and offsets) K step ``step`` of a slice reads, for grouped weights: one
    row when a group spans >= tile_k (row step * tile_k / G), else tile_k / G rows (block = step)."""
    tile_k = p.config.tile_k
    return (step * tile_k) // p.group if p.group >= tile_k else step


def operand_specs(p: Problem, mi: Any, ni: Any, k_first: Any, delay_release: int) -> list[Any]:
    """BlockSpecs of one K step: codes (A tiles, 8, tile_k) words, x (WGMMA N, tile_k), scale [and
    offset] rows (slices, rows, CTA rows)."""
    c = p.config
    x_bits = jnp.finfo(p.dtype).bits
    swizzle = plgpu.find_swizzle(CHUNK_K * x_bits, "activations")
    x_transforms = (plgpu.TilingTransform((8, swizzle * 8 // x_bits)), plgpu.SwizzleTransform(swizzle))
    scale_slices = 1 if p.per_column else c.slices

    def scale_block(ki):
        if p.per_column:  # row 0 always; written in ki because warp-specialized pipelines require it
            return 0, ((k_first + ki) * c.tile_k) // p.k_pad, ni
        return 0, scale_row(p, k_first + ki), ni

    scale_spec = plgpu.BlockSpec(
        (scale_slices, p.scale_rows, c.cta_rows), scale_block, delay_release=delay_release
    )
    specs = [
        plgpu.BlockSpec(
            (c.tiles * c.compute_wgs, 8, c.tile_k),
            lambda ki: (ni, 0, k_first + ki),
            delay_release=delay_release,
        ),
        plgpu.BlockSpec(
            (c.wgmma_n, c.tile_k),
            lambda ki: (mi, k_first + ki),
            transforms=x_transforms,
            delay_release=delay_release,
        ),
        scale_spec,
    ]
    if p.has_offsets:
        specs.append(scale_spec)
    return specs


def tile_indices(p: Problem, lin: Any) -> tuple[Any, Any]:
    """(M tile, N tile) of the CTA with linear index ``lin``.

    Launch order: CTAs that run together cover a band of ``grid_tile_m`` M tiles sweeping along N (a
    "planar snake"), so each wave reads a few x tiles and a run of W tiles, both reused from L2, instead
    of all of x (N fastest) or all of W (M fastest).
    """
    if p.m_tiles == 1:
        return jnp.int32(0), lin
    band = min(p.config.grid_tile_m, p.m_tiles)
    return plgpu.planar_snake(lin, (p.m_tiles, p.n_tiles), 0, band)


# SMEM loads name no layout where their use fixes it: scale rows take the layout of a WGMMA tile's rows
# from the product they scale (broadcast along K it lines up with the tile element for element, so scaling
# needs no shuffles), code words the dequantizer's operand layout. ``plgpu.load(..., layout=)`` is a load
# plus a layout cast, which leaves the load's own layout to Mosaic's layout search, one full pass over the
# kernel's constraints per load (a quarter to a third of a lowering; the same SASS either way, X-ray of
# every gate case).
def _row_values(p: Problem, ref: Any, g: int, t: int, row0: Any, dtype: Any) -> Any:
    """Per-row values (scales or offsets) of A tile ``t``'s 64 rows for group row ``g`` of the step."""
    if p.config.slices == 1:
        return plgpu.load(ref.at[0, g, pl.ds(row0 + t * 64, 64)]).astype(dtype)
    ref_slices = 1 if p.per_column else p.config.slices
    return slot_rows(ref, g, t, ref_slices, p.config.slices).astype(dtype)


def _chunk_groups(p: Problem, k0: int) -> list[tuple[int, int, int]]:
    """(first column, columns, group row in the step) runs of one 64-wide chunk starting at step column k0."""
    if p.group >= CHUNK_K:
        return [(0, CHUNK_K, (k0 // p.group) if p.group < p.config.tile_k else 0)]
    return [(c, p.group, (k0 + c) // p.group) for c in range(0, CHUNK_K, p.group)]


def _chunk_words(p: Problem, codes: Any, t: int, k0: int) -> Any:
    return plgpu.load(codes.at[t, :, pl.ds(k0, CHUNK_K)])


def _tiles_chunk(p: Problem, codes: Any, k0: int, *, exact: bool, scale: Any = None) -> Any:
    """The (64 * tiles, 64) A operand of one chunk: every A tile dequantized, stacked along rows (a
    relabelling: one WGMMA call then runs all tiles against the same B descriptors)."""
    parts = []
    for t in range(p.config.tiles):
        a = dequantize_chunk(_chunk_words(p, codes, t, k0), exact=exact, dtype=p.dtype)
        parts.append(a if scale is None else scale(t, a))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _wide_operand(chunks: list[Any]) -> Any:
    """The A operand of one WGMMA call (``config.wgmma_k``): its 64-wide chunks side by side along K."""
    return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, axis=1)


def exact_weights_step(
    p: Problem, acc_ref: Any, codes: Any, x: Any, scales: Any, offsets: Any, row0: Any
) -> None:
    """acc += dequant(codes) @ x^T for one K step, weights dequantized exactly: w = q * s (+ o) in bf16.

    ``codes`` holds this warpgroup's A tiles (tiles, 8, tile_k); ``row0`` its first row in the scale
    rows. One WGMMA left in flight (the next chunk's dequantization overlaps it).
    """
    dt = p.dtype

    def scale(t: int, q: Any, k0: int) -> Any:
        parts = []
        for c0, cols, g in _chunk_groups(p, k0):
            qp = q if cols == CHUNK_K else q[:, c0 : c0 + cols]
            w = qp * lax.broadcast_in_dim(_row_values(p, scales, g, t, row0, dt), qp.shape, [0])
            if offsets is not None:
                w = w + lax.broadcast_in_dim(_row_values(p, offsets, g, t, row0, dt), qp.shape, [0])
            parts.append(w)
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)

    width = wgmma_k(p.config, p.group)
    for k1 in range(0, p.config.tile_k, width):
        with jax.named_scope("dequant"):
            w = _wide_operand(
                [
                    _tiles_chunk(p, codes, k0, exact=True, scale=lambda t, q, k0=k0: scale(t, q, k0))
                    for k0 in range(k1, k1 + width, CHUNK_K)
                ]
            )
        with jax.named_scope("wgmma"):
            plgpu.wgmma(acc_ref, w, x.at[:, pl.ds(k1, width)].T)
            plgpu.wgmma_wait(1)
    # Orders this step's SMEM reads before the slots are refilled by TMA (the async proxy).
    plgpu.commit_smem()


def folds_bias(p: Problem) -> bool:
    """Whether this problem's accumulator route folds the bias into WGMMA (``config.folds_bias``)."""
    return config_folds_bias(p.config, p.has_offsets)


def constant_value(p: Problem) -> float:
    """The accumulator route's constant 64 x 64 A tile in SMEM: -BIAS when :func:`folds_bias`, else 1
    (sum(x), shared by the A tiles)."""
    return -float(BIAS[jnp.dtype(p.dtype).name]) if folds_bias(p) else 1.0


def scaled_accumulators_step(
    p: Problem, total: Any, codes: Any, x: Any, const: Any, scales: Any, offsets: Any
) -> Any:
    """total += sum over the step's groups of s * (acc_g - BIAS sum(x)) (+ o sum(x)), per A row.

    acc_g = (BIAS + q) @ x^T over the group, straight from the LOP3 (no per-weight arithmetic). The
    constant A tile ``const`` (SMEM, :func:`constant_value`) meets the same x columns. Where
    :func:`folds_bias` it is -BIAS, accumulated into acc_g itself, so acc_g = q @ x^T and a group costs one
    FMA per accumulator element. Else it is all ones, giving sum(x) in an accumulator of its own:
    total += s * acc_g + (o - BIAS s) * sum(x), two FMAs.
    """
    c = p.config
    span = min(c.tile_k, p.group)  # K of one accumulator: a group, or the step when groups span steps
    width = wgmma_k(c, p.group)  # K of one WGMMA call, and of the constant tile
    rows = 64 * c.tiles
    shape = (rows, c.wgmma_n)
    fold = folds_bias(p)
    for g0 in range(0, c.tile_k, span):
        g = g0 // p.group if p.group < c.tile_k else 0

        def chunks(acc, xs, g0=g0):
            for k1 in range(g0, g0 + span, width):
                xk = x.at[:, pl.ds(k1, width)].T
                plgpu.wgmma(acc if fold else xs, const, xk)
                with jax.named_scope("dequant"):
                    a = _wide_operand(
                        [_tiles_chunk(p, codes, k0, exact=False) for k0 in range(k1, k1 + width, CHUNK_K)]
                    )
                plgpu.wgmma(acc, a, xk)
                if k1 + width < g0 + span:  # the group's last call is awaited by reading its accumulators
                    plgpu.wgmma_wait(1)

        s = jnp.concatenate([_row_values(p, scales, g, t, 0, jnp.float32) for t in range(c.tiles)])
        if fold:

            def group(acc):
                chunks(acc, None)
                return acc[...]

            acc = pl.run_scoped(group, plgpu.ACC(shape, jnp.float32))
            with jax.named_scope("scale_groups"):
                total = total + acc * lax.broadcast_in_dim(s, shape, [0])
            continue

        def group(acc, xs):
            chunks(acc, xs)
            # One wait for both: every WGMMA of the group is done once the first read returns.
            return plgpu.wgmma_accumulator_load(acc), plgpu.wgmma_accumulator_load(xs, wait_n=None)

        acc, xsum = pl.run_scoped(
            group, plgpu.ACC(shape, jnp.float32), plgpu.ACC((64, c.wgmma_n), jnp.float32)
        )
        with jax.named_scope("scale_groups"):
            total = add_scaled_group(p, total, acc, xsum, s, offsets, g)
    plgpu.commit_smem()
    return total


def add_scaled_group(p: Problem, total: Any, acc: Any, xsum: Any, s: Any, offsets: Any, g: int) -> Any:
    """``total + s * acc + (o - BIAS s) * sum(x)`` per A row, for group ``g`` of the step (its scales
    ``s``; ``offsets`` None: none): the bias and the offset are one per-row coefficient."""
    c = p.config
    coef = s * -float(BIAS[jnp.dtype(p.dtype).name])
    if offsets is not None:
        coef = coef + jnp.concatenate([_row_values(p, offsets, g, t, 0, jnp.float32) for t in range(c.tiles)])
    xsum = jnp.concatenate([xsum] * c.tiles) if c.tiles > 1 else xsum
    shape = acc.shape
    return total + acc * lax.broadcast_in_dim(s, shape, [0]) + xsum * lax.broadcast_in_dim(coef, shape, [0])


def k_step(p: Problem, const: Any = None, wg: Any = None) -> Callable[..., Any]:
    """One K step, as every kernel's pipeline calls it: ``(step, codes, x, s[, o], carry) -> carry``.

    The accumulator route (:func:`scaled_accumulators_step`, ``const`` its constant A tile) carries the
    running f32 total, a value; exact weights (:func:`exact_weights_step`) accumulate into a WGMMA
    accumulator ref, the carry, returned as is. ``wg``: a warp-specialized CTA's compute warpgroup, which
    dequantizes its own A tiles of the step's codes, with their rows of the scales.
    """
    c = p.config
    if c.scales_on == "accumulators":

        def scaled(_: Any, codes: Any, x: Any, s: Any, *rest: Any) -> Any:
            *o, total = rest
            return scaled_accumulators_step(p, total, codes, x, const, s, o[0] if o else None)

        return scaled

    def exact(_: Any, codes: Any, x: Any, s: Any, *rest: Any) -> Any:
        *o, acc_ref = rest
        row0 = 0
        if wg is not None:
            codes = codes.at[pl.ds(wg * c.tiles, c.tiles)]  # this warpgroup's A tiles
            row0 = wg * c.rows_per_wg
        exact_weights_step(p, acc_ref, codes, x, s, o[0] if o else None, row0)
        return acc_ref

    return exact


def accumulate(p: Problem, run_pipeline: Callable[[Any], Any], epilogue: Callable[[Any], None]) -> None:
    """A compute warpgroup's K loop and epilogue: ``run_pipeline(carry)`` runs :func:`k_step` over the
    steps, ``epilogue(acc)`` stores the accumulators ((64 * tiles, WGMMA N), f32).

    Exact weights: the carry is a WGMMA accumulator ref, read once the loop is done (reading it waits for
    the last WGMMA). The accumulator route: the carry is the running total, from zeros.
    """
    c = p.config
    shape = (64 * c.tiles, c.wgmma_n)
    if c.scales_on == "weights":

        def scoped(acc_ref: Any) -> None:
            run_pipeline(acc_ref)
            epilogue(acc_ref[...])

        pl.run_scoped(scoped, plgpu.ACC(shape, jnp.float32))
        return
    epilogue(run_pipeline(plgpu.layout_cast(jnp.zeros(shape, jnp.float32), L.WGMMA)))


def reduce_split_k(
    p: Problem, slabs: list[Any], out_gmem: Any, mi: Any, ni: Any, wg: Any = None, wgs: int = 1
) -> None:
    """The cluster's split-K reduction of this CTA's output tile (``split_k.reduce``), called by every
    warpgroup of the CTA after :func:`store_tiles` put its partial in ``slabs`` (``wg``: a
    warp-specialized CTA's warpgroup index; its warpgroups past ``wgs`` only join the barriers)."""
    c = p.config
    split_k.reduce(
        slabs,
        out_gmem,
        m=p.m,
        tile_m=c.tile_m,
        tiles=c.tiles,
        split_k=c.split_k,
        any_rows=stores_any_rows(c),
        row0=mi * c.tile_m,
        col0=ni * c.cta_rows,
        wg=wg,
        wgs=wgs,
    )


def store_tiles(
    p: Problem,
    acc: Any,
    smem: dict[str, Any],
    out_gmem: Any,
    mi: Any,
    n_start: Any,
    partition: int | None = None,
    overlap: bool = False,
    rows: RowWindow | None = None,
) -> None:
    """Writes the warpgroup's accumulator ((64 * tiles, WGMMA N), f32) to y. Under split-K it is K
    partition ``partition``'s partial (None: this CTA's own), stored into the slabs of
    ``smem["split_k"]`` (split_k.warpgroup_slabs) for the kernel's split_k.reduce.

    ``overlap`` (a persistent CTA, one y tile after another through the same SMEM): wait until the last
    store has read the staging tile before writing it, and return with this store in flight; the kernel
    waits for the last one before it ends. ``rows``: store only that window of the tile's rows
    (:func:`store_rows`; not under split-K)."""
    c = p.config
    accs = [acc[64 * t : 64 * (t + 1)] for t in range(c.tiles)]
    with jax.named_scope("epilogue"):
        if c.slices > 1:
            red, y_tile = smem["slices"], smem["out"]
            for t, acc in enumerate(accs):
                store_unoptimized(red.at[t], acc)
            if p.residual:  # its two rows, copied in at the CTA's start (residual_copies)
                plgpu.barrier_wait(smem["residual_barrier"])
                names = ("residual", "norm_weight", "normed")
                residual = {f"{name}_ref": smem[name] for name in names}
            else:
                residual = {}
            sum_slices(
                red, y_tile, slices=c.slices, tiles=c.tiles, rows=c.tile_m, swiglu_pairs=p.swiglu,
                row_norm_ref=smem.get("row_norm"), norm=p.norm if p.swiglu else None, **residual,
            )  # fmt: skip
            plgpu.commit_smem()
            if p.residual:  # x and h: the same columns of two outputs
                cols = pl.ds(n_start, c.rows_per_wg)
                for src, dst in ((y_tile, out_gmem[0]), (smem["normed"], out_gmem[1])):
                    plgpu.copy_smem_to_gmem(src.at[: p.m], dst.at[:, cols])
                plgpu.wait_smem_to_gmem(0)
                return
            # The SwiGLU epilogue stores one column per gate/up pair: half the tile, from half the offset.
            width = c.rows_per_wg // 2 if p.swiglu else c.rows_per_wg
            cols = pl.ds(n_start // 2 if p.swiglu else n_start, width)
            if rows is None:
                plgpu.copy_smem_to_gmem(y_tile.at[: p.m], out_gmem.at[:, cols])
            else:
                store_rows(y_tile, out_gmem, cols, rows)
            plgpu.wait_smem_to_gmem(0)
            return
        if c.split_k > 1:
            split_k.store_partial(accs, smem["split_k"], partition)
            return
        out_smem = smem["out"]
        if overlap:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for t, acc in enumerate(accs):
            # Storing y^T through the transposed view of a (tile_m, 64) SMEM slice writes y itself.
            out_smem.at[:, pl.ds(t * 64, 64)].T[...] = plgpu.layout_cast(
                acc.astype(p.out_dtype), L.WGMMA_TRANSPOSED
            )
        plgpu.commit_smem()
        if rows is None:
            dst = out_gmem.at[pl.ds(mi * c.tile_m, c.tile_m), pl.ds(n_start, c.rows_per_wg)]
            plgpu.copy_smem_to_gmem(out_smem, dst)
        else:
            store_rows(out_smem, out_gmem, pl.ds(n_start, c.rows_per_wg), rows)
        if not overlap:
            plgpu.wait_smem_to_gmem(0)
