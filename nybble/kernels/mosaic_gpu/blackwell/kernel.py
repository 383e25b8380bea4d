"""W4A16 GEMM on Blackwell (sm_100a) with Pallas Mosaic GPU: tcgen05 MMAs, the accumulator in TMEM.

The kernel computes y^T = W^T x^T, as the Hopper kernel does: tcgen05's M (64 or 128 rows, the tensor
core's fixed side) covers weight columns, its N (16..256) the batch, so at decode (M <= 16) no MMA row is
padding and the f32 accumulator is only ``tile_m`` TMEM columns. The weight reaches the tensor core as the
A operand in SMEM, dequantized there by the CTA's warpgroup: tcgen05 reads A from SMEM or TMEM, and a TMEM
A operand would need a TMEM store (tcgen05.st) per step plus its own fences, where an SMEM store feeds the
MMA's descriptor directly; x, the B operand, stays in the swizzled SMEM slot TMA filled. The bytes:

    for each K step (``max_concurrent_steps`` slots, TMA running ahead):
        TMA  codes (tile_n / 64, 8, tile_k) ``wgmma_int4`` words   (the layout the Hopper kernel reads)
        TMA  x     (tile_m, tile_k) bf16/f16, 128-byte swizzle      (rows past M zero-filled)
        TMA  scale [and offset] rows (tile_k / G or 1, tile_n)
        for each 64-wide chunk and 64-row tile: LDS.64 of 8 code words, 3 SHF + 4 LOP3 + 4 HSUB2 per 8
            weights (dequant_registers.dequantize_chunk, exact q), w = q * s (+ o) in x's dtype (or q
            itself on the group-accumulator route, below), stored into the step's half of a
            double-buffered (2, tile_n, tile_k) A buffer (128-byte swizzle)
        wait for the previous step's MMA (its TMEM barrier), then one tcgen05_mma(acc, A, x^T)
            arriving on that barrier: it runs while the next step dequantizes; the A half it reads is
            rewritten two steps later, the x slot released one step later (delay_release=1)
    epilogue: wait for the last MMA, TMEM -> registers -> y^T into SMEM (transposed view) -> TMA to y

The grid's CTAs come from a ``work`` object, as in the Hopper kernel (``common.DenseWork``): this
module's :class:`DenseTiles` (one CTA per M tile and N tile), or the Hopper grouped kernel's
``grouped.GroupedWork`` (blackwell/grouped.py), whose CTAs find their expert and rows from the group sizes
on the device and store only those rows of y (``common.store_rows``), or zeros past the groups.

Two routes for the scales (:func:`folds_scales` picks):

* On the weights (the Hopper kernel's ``scales_on="weights"`` route): w = q * s (+ o) in x's dtype, one
  HMUL2 (and HADD2/HFMA2) a weight pair; one accumulator serves every group size, f32 accumulation spans
  all of K. Offsets, per-column scales, groups of 16/32 and the wide M tiles of prefill take it.
* On per-group accumulators, at decode (symmetric, G a multiple of 64 inside one step, 4 x tile_m <= G):
  A holds the exact q; each step's tile_k / G groups get their own MMA into their own TMEM columns
  (accumulate=False), double-buffered by step parity (2 x tile_k / G x tile_m columns), and one
  ``tcgen05_commit_arrive`` after them arrives on the step's barrier. The next step, after issuing its
  own MMAs, loads those columns and adds ``s_g * acc_g`` into an f32 register total (the scales carried
  from the step that read them; the first step folds a zeroed slot with zero scales). Per thread and
  group, tile_m FFMAs replace G / 2 HMUL2s (figures in docs/logs/performance-log.md). Under K slices
  each A row's scale is gathered for its own (band, slice) in TMEM's native row layout
  (``dequant_registers.tmem_rows``); the slices' partial sums are then added as on the other route.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nybble.kernels.mosaic_gpu import compat
from nybble.kernels.mosaic_gpu.blackwell.config import (
    DEFAULT_NUM_SMS,
    TMEM_COLUMNS,
    BlackwellConfig,
    heuristic_config,
    scale_rows_per_step,
    x_rows,
)
from nybble.kernels.mosaic_gpu.common import CtaTile, kernel_name, run_tile, store_rows
from nybble.kernels.mosaic_gpu.config import CHUNK_K
from nybble.kernels.mosaic_gpu.dequant_registers import dequantize_chunk, slot_rows, sum_slices, tmem_rows
from nybble.kernels.mosaic_gpu.interpret import active_params
from nybble.kernels.mosaic_gpu.staging import y_staging
from nybble.quant.qweight import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class BlackwellProblem:
    """Static facts about one problem and config."""

    m: int  # rows of y
    n: int  # columns of y as stored (N, or N_pad)
    n_pad: int
    k_pad: int
    group: int  # K rows per scale row (K_pad for per-column)
    dtype: Any
    has_offsets: bool
    config: BlackwellConfig
    x_rows: int

    @property
    def per_column(self) -> bool:
        return self.group >= self.k_pad

    @property
    def out_rows(self) -> int:
        """Rows of the kernel's y: M, or x's rows under K slices (Mosaic's 8-row staging tiles need y
        rows that fill them, as in the Hopper kernel; the wrapper slices the zero rows off)."""
        return self.m if self.config.slices == 1 else self.x_rows

    @property
    def slice_k(self) -> int:
        return self.k_pad // self.config.slices

    @property
    def k_steps(self) -> int:
        return self.slice_k // self.config.tile_k

    @property
    def n_tiles(self) -> int:
        return -(-self.n_pad // self.config.cta_cols)  # the last one past N_pad: TMA reads zeros there

    @property
    def m_tiles(self) -> int:
        return self.config.m_tiles(self.m)

    @property
    def scale_rows(self) -> int:
        return 1 if self.per_column else scale_rows_per_step(self.config, self.group)

    @property
    def kernel_name(self) -> str:
        return kernel_name(self)

    @property
    def scales_on(self) -> str:
        """Where the kernel applies the scales: "accumulators" (:func:`folds_scales`) or "weights"."""
        return "accumulators" if folds_scales(self) else "weights"


def plan(
    m: int,
    qw: QuantizedWeight,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    config: BlackwellConfig | None = None,
    dtype: Any = jnp.bfloat16,
) -> BlackwellProblem:
    """The launch one matmul of M rows against ``qw`` makes on a Blackwell GPU: config, padding, grid."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"plan: activations must be bfloat16 or float16, got {jnp.dtype(dtype)}")
    k_pad, n_pad = qw.padded_shape
    m = max(m, 1)
    has_offsets = qw.offsets is not None
    if config is None:
        config = heuristic_config(m, n_pad, k_pad, qw.group, num_sms, has_offsets=has_offsets)
    config.check_problem(m, n_pad, k_pad, qw.group)
    n = qw.shape[1]
    n_out = n if n % 64 == 0 else n_pad  # as the Hopper kernel: a TMA store needs whole 64-column tiles
    return BlackwellProblem(
        m, n_out, n_pad, k_pad, qw.group, jnp.dtype(dtype), has_offsets, config, x_rows(m, config)
    )


@dataclasses.dataclass(frozen=True)
class DenseTiles:
    """The dense kernel's CTAs: one per (M tile, N tile), N fastest, every one computing its whole tile."""

    name: str = "nybble_w4a16"

    def ctas(self, p: BlackwellProblem) -> int:
        return p.m_tiles * p.n_tiles

    def tile(self, p: BlackwellProblem, ins: Any) -> CtaTile:
        lin = lax.axis_index("mn")
        return CtaTile(lin // p.n_tiles, lin % p.n_tiles, list(ins))


def _swizzled(dtype: Any) -> tuple[Any, ...]:
    bits = jnp.finfo(dtype).bits
    swizzle = plgpu.find_swizzle(CHUNK_K * bits, "64-wide chunks")
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _scale_block(p: BlackwellProblem, ki: Any, ni: Any) -> tuple[Any, Any, Any]:
    tile_k = p.config.tile_k
    if p.per_column:
        return 0, (ki * tile_k) // p.k_pad, ni  # row 0, written in ki
    if p.group >= tile_k:
        return 0, (ki * tile_k) // p.group, ni  # one row (of each slice), the block index is the row
    return 0, ki, ni  # tile_k / G rows: the block index is the step


def _row_values(p: BlackwellProblem, ref: Any, g: int, t: int) -> Any:
    """Per-row values (scales or offsets) of 64-row A tile ``t`` for the step's group row ``g``."""
    s = p.config.slices
    if s == 1:
        return plgpu.load(ref.at[0, g, pl.ds(t * 64, 64)])
    return slot_rows(ref, g, t, 1 if p.per_column else s, s)


def folds_scales(p: BlackwellProblem) -> bool:
    """Whether the scales go on per-group TMEM accumulators instead of the weights: symmetric groups
    of whole 64-wide chunks inside one step, and an M tile narrow enough that the per-group
    fold (``tile_m`` FFMAs a thread per group of G weights) costs less than the HMUL2 a weight pair it
    saves: 4 x tile_m <= G. The double-buffered accumulators (2 x tile_k / G x tile_m columns) fit TMEM."""
    c = p.config
    if p.per_column or p.has_offsets or p.group % CHUNK_K or p.group > c.tile_k:
        return False
    return 4 * c.tile_m <= p.group and 2 * (c.tile_k // p.group) * c.tile_m <= TMEM_COLUMNS


def dequantize_step(p: BlackwellProblem, codes: Any, scales: Any, offsets: Any, out: Any) -> None:
    """The step's weights w = q * s (+ o), (tile_n, tile_k) in x's dtype, into the A buffer ``out``."""
    c = p.config
    dt = p.dtype
    fold = folds_scales(p)
    for k0 in range(0, c.tile_k, CHUNK_K):
        parts = []
        for t in range(c.tiles):
            q = dequantize_chunk(plgpu.load(codes.at[t, :, pl.ds(k0, CHUNK_K)]), exact=True, dtype=dt)
            if fold:
                parts.append(q)
                continue
            cols = []
            span = min(CHUNK_K, p.group)
            for c0 in range(0, CHUNK_K, span):
                g = 0 if p.group >= c.tile_k else (k0 + c0) // p.group
                qp = q if span == CHUNK_K else q[:, c0 : c0 + span]
                s = _row_values(p, scales, g, t).astype(dt)
                w = qp * lax.broadcast_in_dim(s, qp.shape, [0])
                if offsets is not None:
                    o = _row_values(p, offsets, g, t).astype(dt)
                    w = w + lax.broadcast_in_dim(o, qp.shape, [0])
                cols.append(w)
            parts.append(cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=1))
        a = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
        out.at[:, pl.ds(k0, CHUNK_K)][...] = a


def operand_views(p: BlackwellProblem, codes: Any, x: jax.Array, scales: Any, offsets: Any) -> list[Any]:
    """The kernel's GMEM views, by reshape (dequant_registers.py): a 64-row A tile is 8 slots of 8 rows,
    slot = band * S + slice; x row m * S + j is x[m] over slice j; scale rows (S, groups / S, N_pad), per
    slice. A leading expert axis of a stacked weight (``codes.ndim == 3``) is kept."""
    s = p.config.slices
    lead = codes.shape[:-2]
    views = [codes.reshape(*lead, p.n_pad // (64 // s), 8, p.slice_k), x.reshape(p.x_rows * s, p.slice_k)]
    for a in (scales, offsets) if p.has_offsets else (scales,):
        views.append(a.reshape(*lead, 1, 1, p.n_pad) if p.per_column else a.reshape(*lead, s, -1, p.n_pad))
    return views


def w4a16_blackwell(
    p: BlackwellProblem, codes: jax.Array, x: jax.Array, scales: Any, offsets: Any
) -> jax.Array:
    """Runs the dense kernel: ``codes`` (N_pad / 8, K_pad) words, ``x`` (x_rows, K_pad), ``scales``
    [``offsets``] (num_groups, N_pad); returns (out_rows, n) in x's dtype."""
    return launch(p, operand_views(p, codes, x, scales, offsets), DenseTiles())


def launch(p: BlackwellProblem, operands: list[Any], work: Any) -> jax.Array:
    """The kernel over ``work``'s CTAs (:class:`DenseTiles`, or the grouped kernel's): each CTA's
    ``common.CtaTile`` gives its GMEM operands (indexed by block (mi, ki) for x, (ni, ki) for the weight),
    whether it computes or stores zeros, and which of its y rows it stores (all: ``rows`` None)."""
    c = p.config
    s = c.slices
    n_in = len(operands)

    fold = folds_scales(p)
    gps = c.tile_k // p.group if fold else 1  # groups per step, each its own accumulator
    tm = c.tile_m
    # K slices: the accumulators load in TMEM's native layout (a thread per row), whose rows the sliced
    # scales are gathered in (dequant_registers.tmem_rows); without, layout inference picks the one the
    # transposed y store takes.
    native = plgpu.Layout.TCGEN05_TMEM_NATIVE if s > 1 else None

    def kernel(*refs: Any) -> None:
        ins, y_gmem = refs[:n_in], refs[n_in]
        w_smem, acc_tmem, mma_done, y_smem, *sliced = refs[n_in + 1 :]
        tile = work.tile(p, ins)
        mi, ni = tile.mi, tile.ni
        cols = pl.ds(ni * c.cta_cols, c.cta_cols)

        def group_acc(slot: Any, gi: int) -> Any:
            return acc_tmem.at[:, pl.ds((slot * gps + gi) * tm, tm)]

        def group_scales(scales: Any, gi: int) -> Any:
            """(tile_n,) f32 scales of the step's group ``gi``, one per A row, in the accumulator's rows."""
            if s == 1:
                return plgpu.load(scales.at[0, gi]).astype(jnp.float32)
            return tmem_rows(scales, gi, s, s)

        def fold_groups(slot: Any, total: Any, scales: Any) -> Any:
            parts = [plgpu.async_load_tmem(group_acc(slot, gi), layout=native) for gi in range(gps)]
            plgpu.wait_load_tmem()
            for v, sv in zip(parts, scales, strict=True):
                total = total + v * lax.broadcast_in_dim(sv, v.shape, [0])
            return total

        def step(indices: Any, codes: Any, x: Any, scales: Any, *rest: Any) -> Any:
            (ki,) = indices
            carry = rest[-1] if fold else None
            offsets = rest[:-1] if fold else rest
            a = w_smem.at[lax.rem(ki, 2)]
            with jax.named_scope("dequant"):
                dequantize_step(p, codes, scales, offsets[0] if offsets else None, a)
            plgpu.commit_smem()  # the generic-proxy stores, before the tensor core reads them

            @pl.when(ki > 0)
            def _() -> None:  # the previous MMA: done before its x slot is released and its A half rewritten
                plgpu.barrier_wait(mma_done)

            if not fold:
                with jax.named_scope("tcgen05"):
                    plgpu.tcgen05_mma(acc_tmem, a, x.T, mma_done, accumulate=ki > 0)
                return None
            slot = lax.rem(ki, 2)
            with jax.named_scope("tcgen05"):
                for gi in range(gps):
                    g = pl.ds(gi * p.group, p.group)
                    plgpu.tcgen05_mma(group_acc(slot, gi), a.at[:, g], x.at[:, g].T, accumulate=False)
                plgpu.tcgen05_commit_arrive(mma_done)  # all of the step's MMAs
            total, previous = carry
            with jax.named_scope("fold"):
                total = fold_groups(lax.rem(ki + 1, 2), total, previous)
                current = tuple(group_scales(scales, gi) for gi in range(gps))
            return total, current

        def store() -> None:
            """y_smem's rows to y: the whole M tile, or the tile's window of rows (grouped)."""
            if tile.rows is None:
                plgpu.copy_smem_to_gmem(y_smem, y_gmem.at[pl.ds(mi * c.tile_m, c.tile_m), cols])
            else:
                store_rows(y_smem, y_gmem, cols, tile.rows)

        def compute() -> None:
            specs = [
                plgpu.BlockSpec((c.tiles, 8, c.tile_k), lambda ki: (ni, 0, ki), delay_release=1),
                plgpu.BlockSpec(
                    (c.tile_m, c.tile_k), lambda ki: (mi, ki), transforms=_swizzled(p.dtype), delay_release=1
                ),
            ]
            scale_spec = plgpu.BlockSpec(
                (1 if p.per_column else s, p.scale_rows, c.cta_cols),
                lambda ki: _scale_block(p, ki, ni),
                delay_release=1,
            )
            specs += [scale_spec] * (len(tile.gmem) - 2)
            init = None
            if fold:  # the "previous" slot of step 0 holds zeros, its scales are zero
                zeros = jnp.zeros((c.tile_n, gps * tm), jnp.float32)
                plgpu.async_store_tmem(acc_tmem.at[:, pl.ds(gps * tm, gps * tm)], zeros)
                plgpu.commit_tmem()
                total0 = jnp.zeros((c.tile_n, tm), jnp.float32)
                scales0 = tuple(jnp.zeros((c.tile_n,), jnp.float32) for _ in range(gps))
                if native is not None:
                    total0 = plgpu.layout_cast(total0, native)
                    scales0 = tuple(plgpu.layout_cast(v, native.reduce(1)) for v in scales0)
                init = (total0, scales0)
            final = plgpu.emit_pipeline(
                step,
                grid=(p.k_steps,),
                in_specs=specs,
                max_concurrent_steps=c.max_concurrent_steps,
                init_carry=init,
            )(*tile.gmem)
            plgpu.barrier_wait(mma_done)  # the last MMA
            with jax.named_scope("epilogue"):
                if fold:
                    total, last_scales = final
                    acc = fold_groups((p.k_steps - 1) % 2, total, last_scales)
                else:
                    acc = plgpu.async_load_tmem(acc_tmem)
                    plgpu.wait_load_tmem()
                if s == 1:
                    y_smem.T[...] = acc.astype(p.dtype)  # y^T into the transposed view: y itself
                    plgpu.commit_smem()
                    store()
                else:  # the S slices' partial sums of each column, added (dequant_registers.sum_slices)
                    (partials,) = sliced
                    compat.store_unoptimized(partials, acc)  # untiled f32 SMEM (jax 0.12 asks to say so)
                    plgpu.commit_smem()
                    # The GPU sum reads (tile, row, column); the interpreter has no reshaped refs, and its
                    # twin of the sum reshapes the values itself.
                    if active_params() is None:
                        partials = partials.reshape(c.tiles, 64, c.tile_m)
                    sum_slices(partials, y_smem, slices=s, tiles=c.tiles, rows=c.x_rows_per_tile)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(y_smem.at[: p.out_rows], y_gmem.at[:, cols])
                plgpu.wait_smem_to_gmem(0)

        def zeros() -> None:  # the grouped kernel's rows past the groups: no weight read
            # Through the transposed view, as the accumulator is stored: a plain splat store into y_smem
            # leaves Mosaic GPU's layout inference no solution at 16- and 32-row M tiles (out of fuel).
            y_smem.T[...] = jnp.zeros(y_smem.T.shape, p.dtype)
            plgpu.commit_smem()
            store()
            plgpu.wait_smem_to_gmem(0)

        run_tile(tile, compute, zeros)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((p.out_rows, p.n), p.dtype),
        grid=(work.ctas(p),),
        grid_names=("mn",),
        scratch_types=[
            plgpu.SMEM((2, c.tile_n, c.tile_k), p.dtype, transforms=_swizzled(p.dtype)),
            plgpu.TMEM((c.tile_n, 2 * gps * tm if fold else c.tile_m), jnp.float32),
            plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
            y_staging((c.x_rows_per_tile, c.cta_cols), p.dtype, any_rows=s == 1),
            *([plgpu.SMEM((c.tile_n, c.tile_m), jnp.float32)] if s > 1 else []),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=active_params(),
        kernel_name=kernel_name(p, work.name),
    )
    return call(*operands)
