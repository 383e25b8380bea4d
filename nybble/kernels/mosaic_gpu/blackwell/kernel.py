"""W4A16 GEMM on Blackwell (sm_100a) with Pallas Mosaic GPU: tcgen05 MMAs, the accumulator in TMEM.

The kernel computes y^T = W^T x^T, as the Hopper kernel does: tcgen05's M (64 or 128 rows, the tensor
core's fixed side) covers weight columns, its N (16..256) the batch, so at decode (M <= 16) no MMA row is
padding and the f32 accumulator is only ``tile_m`` TMEM columns. The weight reaches the tensor core as the
A operand, dequantized by the CTA's first warpgroups into TMEM or SMEM (tcgen05 reads A from either); x,
the B operand, stays in the swizzled SMEM slot TMA filled:

* TMEM (:func:`a_in_tmem`: the accumulator route, where A is BIAS + q with no scales to apply, and the
  A halves fit TMEM beside the accumulators, i.e. every symmetric decode tile the heuristics pick). Each
  warp owns TMEM lanes 32w..32w + 31, so it unpacks A rows 32w..32w + 31, in tcgen05's register layout
  (``dequant_registers.dequantize_rows``: WGMMA's fragment, four 8-row groups a warp), and one
  ``tcgen05.st`` 16x128b.x8 stores 16 registers (32 weights) a thread, where an ``STSM`` stores 8. X-ray
  at Llama-3-8B q/o, M = 1: a turn 341 -> 320 instructions (32 STSM -> 8 STTM), and the MMA warps' 231 ->
  203 (a TMEM A operand needs no SMEM descriptor): 1.65 -> 1.50 instructions per weight.
* SMEM, 128-byte swizzle (the weights route: scales and offsets applied to A, prefill tiles): ``STSM``
  of WGMMA's fragment (one a word of 8 weights), then a proxy fence.

The CTA is warp-specialized: the dequantizing warpgroups run only the unpacking, the stores and the fold,
and one thread of a warp of the last warpgroup issues each TMA copy or MMA, so no dequantizing warp spends
issue slots on descriptors. At decode M tiles (``dequant_warpgroups``: tile_m <= 64) two warpgroups
dequantize, taking alternate K steps: warpgroup w writes A half w for steps w, w + 2, ..., all of its rows.
Each SM scheduler then holds two dequantizing warps, which hide each other's unpacking latency (one warp
alone stalls on its own chain of dependent LOP3/SHF, whose integer pipe takes a warp instruction every two
cycles), and a step's fixed costs (barrier waits and their phase bits, slot addresses, the fence and
arrivals: ~50 instructions a warp) are paid once a step, not once by each warpgroup (X-ray at Llama-3-8B
q/o, M = 1: 217 + 187 instructions a step over 64-row halves -> 341 or 343 a turn, one turn a step).
Else one warpgroup does it all. The bytes:

    TMA warp (the last warpgroup, warp 0), for each K step, into slot ki % ``max_concurrent_steps`` once
    the slot's previous step is consumed (``x_free``: its MMAs read x; ``codes_free``: its dequantizing
    warpgroup read its codes and scales), all arriving on ``loaded[slot]`` (with alternating warpgroups
    ``loaded[ki % 2, slot]``, so each warpgroup waits every phase of the barriers it waits):
        TMA  codes (tile_n / 8 slots, tile_k) ``wgmma_int4`` words   (the layout the Hopper kernel reads)
        TMA  x     (tile_m, tile_k) bf16/f16, 128-byte swizzle      (rows past M zero-filled)
        TMA  scale [and offset] rows (tile_k / G or 1, tile_n)
    dequantizing warpgroup (0, or at decode 0 and 1 by turns), for each of its K steps, once
    ``loaded[slot]`` and (ki >= 2) ``mma_done[half]``, the MMAs of step ki - 2 that read its A half:
        [accumulator route: fold step ki - 2's group accumulators into its total (TMEM), before step ki's
            MMAs rewrite them]
        for each 64-wide chunk and its 64-row tiles: LDS.64 of 8 code words, 3 SHF + 4 LOP3 per 8 weights
            (dequant_registers.dequantize_chunk / dequantize_rows) giving BIAS + q, [4 HSUB2: exact q,]
            [w = q * s (+ o) in x's dtype,] stored into the step's half of a double-buffered A buffer:
            TMEM (tile_n lanes, 2 x tile_k packed pairs) or SMEM (2, tile_n, tile_k)
        [TMEM: commit_tmem (tcgen05.wait::st, a warpgroup barrier)] commit_smem (a proxy fence, a warpgroup
            barrier: every thread's reads and stores are done), then arrive ``a_ready[half]`` and
            ``codes_free[slot]`` (one arrival each)
    MMA warps (the last warpgroup, warps 1..3), for each K step, once ``loaded[slot]`` and ``a_ready[half]``:
        tcgen05_mma(acc, A half, x^T) (per group on the accumulator route, the groups dealt round-robin
            to the warps, each group's MMAs from one warp so they run in order), then commit-arrive on
            ``mma_done[half]`` and ``x_free[slot]``
    epilogue (warpgroup 0; on the weights route with alternating warpgroups, the one of the last step):
    wait for the last MMAs, [fold the last step, add warpgroup 1's total,] TMEM -> registers -> y^T into
    SMEM (transposed view) -> TMA to y

Mosaic's automatic warpgroup barriers are off (``unsafe_no_auto_barriers``): with them every SMEM store
is fenced by two BAR.SYNCs (each waits for the warpgroup's 4 warps), 8 more a K step in each dequantizing
loop at decode than the kernel needs (X-ray: 11 -> 3 a step at M = 1). They are safe to drop here because
no thread reads SMEM another thread of its warpgroup wrote without a barrier the kernel places itself: the
A halves, y and the zero tile are written by threads and read only by the tensor core or TMA, after
``commit_smem`` (a proxy fence and a warpgroup barrier); a TMEM A half is written by each thread in
its own lanes and read by the tensor core after ``commit_tmem`` and the tensor-core-ordered arrival; the
sliced partials are read by other threads
only after ``commit_smem`` too; codes, x and scales are written by TMA and read by threads after
``loaded``, and freed by one arrival after ``commit_smem``'s barrier; TMEM loads end in
``wait_load_tmem``'s barrier. Interpret mode runs a warpgroup as one thread, so it cannot see this order:
the argument is this paragraph, and the X-ray test counts the barriers.

Every barrier phase is waited by the warps that use it, the last ones after the loops (the interpreter
checks that no completed phase goes unobserved). Warp w of every warpgroup runs on SM scheduler w % 4, so
the issue work lands beside the dequantizing warps, spread over up to three MMA warps. (In GPU interpret
mode each warpgroup holds a host thread: three need NPROC >= 3, ``interpret.check_warpgroup_threads``.)

The grid's CTAs come from a ``work`` object, as in the Hopper kernel (``common.DenseWork``): this
module's :class:`DenseTiles` (one CTA per M tile and N tile), or the Hopper grouped kernel's
``grouped.GroupedWork`` (blackwell/grouped.py), whose CTAs find their expert and rows from the group sizes
on the device and store only those rows of y (``common.store_rows``), or zeros past the groups.

Two routes for the scales (:func:`folds_scales` picks):

* On the weights (the Hopper kernel's ``scales_on="weights"`` route): w = q * s (+ o) in x's dtype, one
  HMUL2 (and HADD2/HFMA2) a weight pair; one accumulator serves every group size, f32 accumulation spans
  all of K. Offsets, per-column scales, groups of 16/32 and the wide M tiles of prefill take it.
* On per-group accumulators, at decode (symmetric, G a multiple of 64 inside one step, tile_m small
  enough): each step's tile_k / G groups get their own MMA into their own TMEM columns
  (accumulate=False), double-buffered by step parity (2 x tile_k / G x tile_m columns), and the MMA warps'
  commits arrive on the step's barrier. The warpgroup's next step (ki + 2), once those MMAs completed,
  loads those columns and adds ``s_g * acc_g`` into its f32 total (the scales carried from the step that
  read them), which stays in TMEM (tile_m columns a warpgroup: carried in registers through the K loop
  beside two A tiles' unpacking it crowded them to 168 at M = 16, where ptxas copied the loaded
  accumulators into the total's registers, ~60 IMAD.MOV a step); warpgroup 0 adds warpgroup 1's total at
  the end. The fold works in TMEM's native layout (a thread per A row, one scale a group) and, in a dense
  call, over the columns of x's rows only (:func:`folded_columns`: 4 of 16 at M = 1 under 4 K slices).
  With bf16 x (:func:`folds_bias`) A holds BIAS + q as the LOP3 leaves it, and beside each group's MMAs,
  MMAs of a constant -BIAS tile (64 columns in TMEM, an A operand the tensor core reads without SMEM)
  times the group's x chunks take BIAS x sum(x) out of the same accumulator (every product exact in
  f32); with f16 x (BIAS 1032, a cancellation 8x larger) A holds the exact q. Under K slices each A
  row's scale is gathered for its own (band, slice) in TMEM's native row layout
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
    power_of_two_depth,
    scale_rows_per_step,
    x_rows,
)
from nybble.kernels.mosaic_gpu.common import CtaTile, kernel_name, run_tile, store_rows
from nybble.kernels.mosaic_gpu.config import CHUNK_K
from nybble.kernels.mosaic_gpu.dequant_registers import (
    BIAS,
    dequantize_chunk,
    dequantize_rows,
    slot_rows,
    sum_slices,
    tmem_rows,
)
from nybble.kernels.mosaic_gpu.interpret import active_params, check_warpgroup_threads
from nybble.kernels.mosaic_gpu.lowered_once import per_problem
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
    # The SwiGLU epilogue (nybble/kernels/mosaic_gpu/swiglu.py, as on Hopper): W's columns gate and up
    # interleaved, y (rows, n) their silu(r gate) * (r up), r from a (rows,) f32 sum of squares after the
    # other operands, ``norm`` = (dim, eps); ``norm`` None: r = 1 and no such operand (grouped_swiglu.py).
    swiglu: bool = False
    norm: tuple[float, float] | None = (1.0, 1.0)
    residual: bool = False  # the residual epilogue (residual.py) is Hopper's only: always False here

    @property
    def row_scaled(self) -> bool:
        """Whether the SwiGLU epilogue reads each row's sum of squares (the operand after the others)."""
        return self.swiglu and self.norm is not None

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
    def tmem_columns(self) -> int:
        """TMEM columns the kernel allocates (a power of two >= 32): the accumulator, or the accumulator
        route's double-buffered group accumulators and its -BIAS tile."""
        if folds_scales(self):
            used = fold_columns(self) + (BIAS_TILE_COLUMNS if folds_bias(self) else 0)
            used += self.config.tile_k if a_in_tmem(self) else 0  # the A halves, packed pairs
        else:
            used = self.config.tile_m
        return max(32, 1 << (used - 1).bit_length())

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
    grouped: bool = False,
    picked: bool = False,
) -> BlackwellProblem:
    """The launch one matmul of M rows against ``qw`` makes on a Blackwell GPU: config, padding, grid.
    ``grouped``: M rows of several experts, an M tile of up to ``x_rows_per_tile`` rows each (under K
    slices too, where a dense matmul's M must fit one tile). ``picked``: ``config`` is a heuristic's pick
    (the grouped one's), its pipeline sized here as the dense pick's is (``config.power_of_two_depth``
    where A goes through TMEM); an explicit config runs as given."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"plan: activations must be bfloat16 or float16, got {jnp.dtype(dtype)}")
    k_pad, n_pad = qw.padded_shape
    m = max(m, 1)
    has_offsets = qw.offsets is not None
    n = qw.shape[1]
    n_out = n if n % 64 == 0 else n_pad  # as the Hopper kernel: a TMA store needs whole 64-column tiles

    def problem(config: BlackwellConfig) -> BlackwellProblem:
        return BlackwellProblem(
            m, n_out, n_pad, k_pad, qw.group, jnp.dtype(dtype), has_offsets, config, x_rows(m, config)
        )

    if config is None:
        config, picked = heuristic_config(m, n_pad, k_pad, qw.group, num_sms, has_offsets=has_offsets), True
    if picked and a_in_tmem(problem(config)):  # the heuristics' tiling, its pipeline sized for A in TMEM
        config = power_of_two_depth(config, qw.group)
    p = problem(config)
    config.check_problem(
        min(m, config.x_rows_per_tile) if grouped else m, n_pad, k_pad, qw.group, a_in_smem=not a_in_tmem(p)
    )
    return p


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


# The -BIAS tile the accumulator route's MMAs multiply into each group (an A operand in TMEM: 64 bf16/f16
# columns packed two to a 32-bit column), and the widest M tile it folds.
BIAS_TILE_COLUMNS = CHUNK_K // 2
MAX_FOLD_TILE_M = 64


def group_accumulator_columns(p: BlackwellProblem) -> int:
    """TMEM columns of the accumulator route's group accumulators: tile_k / G groups a step, tile_m columns
    each, double-buffered by step parity."""
    return 2 * (p.config.tile_k // p.group) * p.config.tile_m


def fold_columns(p: BlackwellProblem) -> int:
    """TMEM columns of the accumulator route: the group accumulators, then each dequantizing warpgroup's
    f32 total (tile_m columns; kept in TMEM, not carried in registers through the K loop, where beside a
    step's unpacking it would crowd the registers)."""
    return group_accumulator_columns(p) + 2 * p.config.tile_m


def folds_scales(p: BlackwellProblem) -> bool:
    """Whether the scales go on per-group TMEM accumulators instead of the weights: symmetric groups of
    whole 64-wide chunks inside one step, and an M tile that costs less to fold than it saves. A thread
    dequantizes G weights of each group and folds tile_m accumulator columns (tile_m / 2 FFMA2 and the
    TMEM loads). With bf16 x the bias folds too (:func:`folds_bias`), saving each weight pair's HSUB2 and
    HMUL2 (G instructions): tile_m <= G, at most 64 (past it the f32 total and the loaded accumulators
    outgrow the registers); with f16 only the HMUL2 (G / 2): 4 x tile_m <= G. The double-buffered
    accumulators (2 x tile_k / G x tile_m columns) and the bias tile fit TMEM."""
    c = p.config
    if p.per_column or p.has_offsets or p.group % CHUNK_K or p.group > c.tile_k:
        return False
    if fold_columns(p) + BIAS_TILE_COLUMNS > TMEM_COLUMNS:
        return False
    if p.dtype == jnp.dtype(jnp.bfloat16):
        return c.tile_m <= min(p.group, MAX_FOLD_TILE_M)
    return 4 * c.tile_m <= p.group


def folds_bias(p: BlackwellProblem) -> bool:
    """Whether the A operand holds BIAS + q (one LOP3 a weight pair, no HSUB2) and MMAs of a -BIAS tile
    take BIAS x sum(x) out of each group's accumulator: on the accumulator route with bf16 x (BIAS 136).
    f16's BIAS is 1032, and its f32 cancellation error reaches 1e-4 of the output's RMS (measured in
    interpret mode); f16 keeps the exact q."""
    return folds_scales(p) and p.dtype == jnp.dtype(jnp.bfloat16)


def a_in_tmem(p: BlackwellProblem) -> bool:
    """Whether the A operand goes through TMEM instead of SMEM: on the accumulator route (A is BIAS + q or
    q, no scales to apply), where the double-buffered A tile (tile_k columns of packed pairs) fits TMEM
    beside the group accumulators. A TMEM store (``tcgen05.st`` 16x128b) writes many fragment registers a
    thread in one instruction, where an ``STSM`` stores one word's 8 weights; and the tensor core reads A
    there without the SMEM proxy fence."""
    if not folds_scales(p):
        return False
    return fold_columns(p) + (BIAS_TILE_COLUMNS if folds_bias(p) else 0) + p.config.tile_k <= TMEM_COLUMNS


# The fewest accumulator columns a fold loads (TMEM loads of 32-bit columns in TMEM's native layout).
MIN_FOLDED_COLUMNS = 2


def folded_columns(p: BlackwellProblem, *, dense: bool) -> int:
    """Accumulator columns the fold reads (of tile_m): a dense call's x rows are known, and the columns of
    x rows past them (TMA's zeros) hold zeros; a power of two, at least ``MIN_FOLDED_COLUMNS``. A grouped
    call's rows per M tile are found on the device: all of them. At M = 1 with 4 K slices: 4 of 16 columns
    (the columns m * S + j of x row m over slice j; the epilogue's sum reads those of its row's slice)."""
    c = p.config
    if not dense:
        return c.tile_m
    rows = p.m if p.m_tiles == 1 else c.x_rows_per_tile
    return min(c.tile_m, max(MIN_FOLDED_COLUMNS, 1 << (rows * c.slices - 1).bit_length()))


def dequantize_to_tmem(p: BlackwellProblem, codes: Any, out: Any) -> None:
    """The step's A operand, BIAS + q (or q), (tile_n, tile_k) into the TMEM half ``out``, a 64-wide chunk
    of all 128 rows at a time: each warp's 32 rows (its TMEM lanes) in tcgen05's register layout."""
    for k0 in range(0, p.config.tile_k, CHUNK_K):
        words = plgpu.load(codes.at[:, pl.ds(k0, CHUNK_K)])
        q = dequantize_rows(words, exact=not folds_bias(p), dtype=p.dtype)
        plgpu.async_store_tmem(out.at[:, pl.ds(k0, CHUNK_K)], q)


def dequantize_step(p: BlackwellProblem, codes: Any, scales: Any, offsets: Any, out: Any) -> None:
    """The step's weights w = q * s (+ o), (tile_n, tile_k) in x's dtype, into the A buffer ``out``, a
    64-wide chunk of every A row at a time (both 64-row tiles in one store: the single dequantizing
    warpgroup of prefill interleaves their unpacking, X-ray: 466 stall cycles a step against 520 one tile at
    a time)."""
    c = p.config
    dt = p.dtype
    fold, exact = folds_scales(p), not folds_bias(p)
    for k0 in range(0, c.tile_k, CHUNK_K):
        parts = []
        for t in range(c.tiles):
            words = plgpu.load(codes.at[pl.ds(8 * t, 8), pl.ds(k0, CHUNK_K)])
            q = dequantize_chunk(words, exact=exact, dtype=dt)
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
        out.at[:, pl.ds(k0, CHUNK_K)][...] = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def operand_views(p: BlackwellProblem, codes: Any, x: jax.Array, scales: Any, offsets: Any) -> list[Any]:
    """The kernel's GMEM views, by reshape (dequant_registers.py): codes in slots of 8 A rows (a 64-row A
    tile 8 of them, slot = band * S + slice); x row m * S + j is x[m] over slice j; scale rows (S,
    groups / S, N_pad), per slice. A leading expert axis of a stacked weight (``codes.ndim == 3``) is
    kept."""
    s = p.config.slices
    lead = codes.shape[:-2]
    views = [codes.reshape(*lead, p.n_pad * s // 8, p.slice_k), x.reshape(p.x_rows * s, p.slice_k)]
    for a in (scales, offsets) if p.has_offsets else (scales,):
        views.append(a.reshape(*lead, 1, 1, p.n_pad) if p.per_column else a.reshape(*lead, s, -1, p.n_pad))
    return views


def w4a16_blackwell(
    p: BlackwellProblem, codes: jax.Array, x: jax.Array, scales: Any, offsets: Any
) -> jax.Array:
    """Runs the dense kernel: ``codes`` (N_pad / 8, K_pad) words, ``x`` (x_rows, K_pad), ``scales``
    [``offsets``] (num_groups, N_pad); returns (out_rows, n) in x's dtype."""
    return launch(p, operand_views(p, codes, x, scales, offsets), DenseTiles())


# The CTA's roles: warpgroup 0 dequantizes (every step, or the even steps where warpgroup 1 takes the odd
# ones) and stores y; the last warpgroup's warp 0 issues the TMA copies and its warps 1..3 the tcgen05 MMAs
# (one thread each), so the dequantizing warps never run the issue code.
FOLD_WG = 0
TMA_WARP = 0
FIRST_MMA_WARP = 1
MAX_MMA_WARPS = 3
# The widest M tile with two dequantizing warpgroups: 384 threads leave 168 registers a thread.
MAX_TWO_WG_TILE_M = 64


def dequant_warpgroups(p: BlackwellProblem) -> int:
    """Warpgroups dequantizing: two at decode M tiles, taking alternate K steps (two warps per SM scheduler
    hide each other's unpacking latency, which one warp alone leaves exposed, and each pays a step's fixed
    costs every other step), else one."""
    return 2 if p.config.tile_m <= MAX_TWO_WG_TILE_M and p.config.tiles == 2 else 1


def mma_warps(p: BlackwellProblem) -> int:
    """Warps issuing the MMAs: one per group accumulator of a step, at most 3 (each warp shares an SM
    scheduler with a dequantizing warp, so the issue is spread); one on the weights route."""
    return min(p.config.tile_k // p.group, MAX_MMA_WARPS) if folds_scales(p) else 1


def _block(ref: Any, shape: tuple[int, ...], index: tuple[Any, ...]) -> Any:
    """``ref``'s block ``index`` of ``shape`` (a BlockSpec's blocked slices; indices traced int32, so TMA
    zero-fills a block past the end, as in ``emit_pipeline``)."""
    return ref.at[tuple(pl.ds(jnp.int32(i) * b, b) for i, b in zip(index, shape, strict=True))]


@per_problem  # one trace and lowering per problem, however many call sites
def launch(p: BlackwellProblem, operands: list[Any], work: Any) -> jax.Array:
    """The kernel over ``work``'s CTAs (:class:`DenseTiles`, or the grouped kernel's): each CTA's
    ``common.CtaTile`` gives its GMEM operands (indexed by block (mi, ki) for x, (ni, ki) for the weight),
    whether it computes or stores zeros, and which of its y rows it stores (all: ``rows`` None)."""
    c = p.config
    s = c.slices
    n_in = len(operands)
    depth = c.max_concurrent_steps
    n_weight_ops = 2 if p.has_offsets else 1

    fold, bias = folds_scales(p), folds_bias(p)
    gps = c.tile_k // p.group if fold else 1  # groups per step, each its own accumulator
    tm = c.tile_m
    issuers = mma_warps(p)
    dequant_wgs = dequant_warpgroups(p)
    issue_wg = dequant_wgs  # the last warpgroup
    alternate = dequant_wgs == 2  # the dequantizing warpgroups take alternate K steps
    if fold and not alternate:
        raise AssertionError(f"{c.tag}: the accumulator route runs on two dequantizing warpgroups")
    handing_off = fold and p.k_steps > 1  # warpgroup 1 folds steps too, and hands its total over
    tmem_a = a_in_tmem(p)
    live_columns = folded_columns(p, dense=isinstance(work, DenseTiles))
    loaded_barriers = depth * (2 if alternate else 1)  # per (step parity, slot) when alternating
    # The accumulator route's fold and K slices' accumulator: TMEM's native layout (a thread per row: one
    # scale a group, gathered for its (band, slice) under K slices, dequant_registers.tmem_rows); else
    # layout inference picks the one the transposed y store takes.
    native = plgpu.Layout.TCGEN05_TMEM_NATIVE if s > 1 or fold else None
    codes_block = (c.tiles * 8, c.tile_k)  # 8-row slots
    out_cols = c.cta_cols // 2 if p.swiglu else c.cta_cols  # the SwiGLU epilogue: a column per gate/up pair
    x_block = (c.tile_m, c.tile_k)
    scale_block = (1 if p.per_column else s, p.scale_rows, c.cta_cols)

    def kernel(*refs: Any) -> None:
        ins, y_gmem = refs[:n_in], refs[n_in]
        (a_buffer, codes_smem, x_smem, *rest) = refs[n_in + 1 :]
        weight_smem, rest = rest[:n_weight_ops], rest[n_weight_ops:]
        acc_tmem, *rest = rest
        bias_tmem, rest = (rest[0], rest[1:]) if bias else (None, rest)
        loaded, a_ready, mma_done, x_free, codes_free, y_smem, *rest = rest
        row_norm = None
        if p.row_scaled:  # the rows' sums of squares: the last operand, the last scratch
            *rest, row_norm = rest
            ins, row_norm_gmem = ins[:-1], ins[-1]
        handoff, sliced = (rest[0], rest[1:]) if handing_off else (None, rest)
        wg = lax.axis_index("wg")
        tile = work.tile(p, ins)
        mi, ni = tile.mi, tile.ni
        cols = pl.ds(ni * out_cols, out_cols)

        def stage_row_norm() -> None:
            """The SwiGLU epilogue's sums of squares into SMEM, by the warpgroup that stores y, at its start
            (scalar loads, their latency under the K loop; read after the epilogue's commit_smem): one a
            row of the tile, rows past M repeating row M - 1's (K slices: one M tile)."""
            for i in range(c.x_rows_per_tile):
                row_norm[i] = row_norm_gmem[min(i, p.m - 1)]

        def group_acc(slot: Any, gi: int) -> Any:
            return acc_tmem.at[:, pl.ds((slot * gps + gi) * tm, tm)]

        def group_scales(scales: Any, gi: int) -> Any:
            """(tile_n,) f32 scales of the step's group ``gi``, one per A row, in the accumulator's rows."""
            if s == 1:
                return plgpu.layout_cast(plgpu.load(scales.at[0, gi]).astype(jnp.float32), native.reduce(1))
            return tmem_rows(scales, gi, s, s)

        def total_columns(w: int) -> Any:
            """Dequantizing warpgroup ``w``'s f32 total of the accumulator route."""
            return acc_tmem.at[:, pl.ds(group_accumulator_columns(p) + w * tm, tm)]

        def fold_into_total(half: int, scales: Any, commit: bool = True) -> None:
            """Warpgroup ``half``'s total += each group accumulator of its last step x the group's scales;
            the total's store committed (``commit``), or by the step's commit of its A operand."""
            live = pl.ds(0, live_columns)
            parts = [plgpu.async_load_tmem(group_acc(half, g).at[:, live], layout=native) for g in range(gps)]
            total = plgpu.async_load_tmem(total_columns(half).at[:, live], layout=native)
            plgpu.wait_load_tmem()
            for v, sv in zip(parts, scales, strict=True):
                total = total + v * lax.broadcast_in_dim(sv, v.shape, [0])
            plgpu.async_store_tmem(total_columns(half).at[:, live], total)
            if commit:
                plgpu.commit_tmem()

        def a_half(half: Any) -> Any:
            """Half ``half`` of the double-buffered A operand: TMEM columns side by side, or an SMEM slot."""
            return a_buffer.at[:, pl.ds(half * c.tile_k, c.tile_k)] if tmem_a else a_buffer.at[half]

        def loaded_at(half: Any, slot: Any) -> Any:
            """The barrier step ``ki``'s copies arrive on: one per (ki % 2, slot) when the dequantizing
            warpgroups take alternate steps, so each waits every phase of its own barriers (Mosaic GPU
            tracks a barrier's phase per thread by counting its waits; a warpgroup skipping a phase would
            wait the wrong parity), one per slot else."""
            return loaded.at[half * depth + slot] if alternate else loaded.at[slot]

        def copy_step(ki: Any) -> None:
            """TMA warp: the step's codes, x tile and scale [and offset] rows into its slot."""
            slot = lax.rem(ki, depth)

            @pl.when(ki >= depth)
            def _() -> None:  # the slot's previous step: x read by its MMAs, codes and scales by the dequant
                plgpu.barrier_wait(x_free.at[slot])
                plgpu.barrier_wait(codes_free.at[slot])

            codes, x, *weight_ops = tile.gmem
            blocks = [_block(codes, codes_block, (ni, ki)), _block(x, x_block, (mi, ki))]
            blocks += [_block(g, scale_block, _scale_block(p, ki, ni)) for g in weight_ops]
            for block, smem in zip(blocks, [codes_smem, x_smem, *weight_smem], strict=True):
                plgpu.copy_gmem_to_smem(block, smem.at[slot], loaded_at(lax.rem(ki, 2), slot))

        def mma_step(ki: Any, groups: range) -> None:
            """An MMA warp: the step's MMAs (of ``groups``, on the accumulator route) once its A half is
            written, committed to the step's barriers."""
            slot, half = lax.rem(ki, depth), lax.rem(ki, 2)
            plgpu.barrier_wait(loaded_at(half, slot))
            plgpu.barrier_wait(a_ready.at[half])
            a, x = a_half(half), x_smem.at[slot]
            if fold:
                for gi in groups:
                    g = pl.ds(gi * p.group, p.group)
                    if not bias:
                        plgpu.tcgen05_mma(group_acc(half, gi), a.at[:, g], x.at[:, g].T, accumulate=False)
                        continue
                    for k0 in range(gi * p.group, (gi + 1) * p.group, CHUNK_K):  # minus BIAS x sum(x)
                        kc = pl.ds(k0, CHUNK_K)
                        chunk = x.at[:, kc].T
                        first = k0 == gi * p.group
                        plgpu.tcgen05_mma(group_acc(half, gi), a.at[:, kc], chunk, accumulate=not first)
                        plgpu.tcgen05_mma(group_acc(half, gi), bias_tmem, chunk, accumulate=True)
            else:
                plgpu.tcgen05_mma(acc_tmem, a, x.T, accumulate=ki > 0)
            plgpu.tcgen05_commit_arrive(mma_done.at[half])  # the A half (and TMEM slot) it read
            plgpu.tcgen05_commit_arrive(x_free.at[slot])

        def dequant_step(ki: Any, half: Any, carry: Any) -> Any:
            """A dequantizing warpgroup's step ``ki``: its A half (every A row), on the accumulator route with
            the fold of the step that last used the half (ki - 2), whose group accumulators step ki's MMAs
            overwrite once the half is handed over."""
            slot = lax.rem(ki, depth)
            plgpu.barrier_wait(loaded_at(half, slot))

            @pl.when(ki >= 2)
            def _() -> None:  # MMA ki - 2: it read this A half and wrote this parity's accumulators
                plgpu.barrier_wait(mma_done.at[half])
                if fold:  # step ki - 2's accumulators, before step ki's MMAs rewrite them
                    with jax.named_scope("fold"):
                        fold_into_total(half, carry, commit=not tmem_a)
            scales = weight_smem[0].at[slot]
            offsets = weight_smem[1].at[slot] if p.has_offsets else None
            with jax.named_scope("dequant"):
                if tmem_a:
                    dequantize_to_tmem(p, codes_smem.at[slot], a_half(half))
                else:
                    dequantize_step(p, codes_smem.at[slot], scales, offsets, a_half(half))
                # The accumulator route's scales, read now: the warpgroup barrier below orders every
                # thread's reads of the slot before the one arrival that frees it for TMA.
                current = tuple(group_scales(scales, gi) for gi in range(gps)) if fold else None
            if tmem_a:
                plgpu.commit_tmem()  # the TMEM stores done, every thread past them (a warpgroup barrier)
            # The SMEM A half's generic-proxy stores before the tensor core reads them; with A in TMEM, the
            # slot's reads before TMA's next writes into it (GPU interpret mode's race detector asks the
            # proxy fence of a generic read before an async-proxy write too).
            plgpu.commit_smem()
            plgpu.barrier_arrive(a_ready.at[half])
            plgpu.barrier_arrive(codes_free.at[slot])
            return current

        def store() -> None:
            """y_smem's rows to y: the whole M tile, or the tile's window of rows (grouped)."""
            if tile.rows is None:
                plgpu.copy_smem_to_gmem(y_smem, y_gmem.at[pl.ds(mi * c.tile_m, c.tile_m), cols])
            else:
                store_rows(y_smem, y_gmem, cols, tile.rows)

        def issue() -> None:
            @plgpu.warp_map
            def _(warp: Any) -> None:
                @pl.when(warp == TMA_WARP)
                def _() -> None:
                    with jax.named_scope("tma"):
                        lax.fori_loop(0, p.k_steps, lambda ki, _: copy_step(ki), None)
                        for ki in range(max(p.k_steps - depth, 0), p.k_steps):  # every phase observed
                            plgpu.barrier_wait(x_free.at[ki % depth])
                            plgpu.barrier_wait(codes_free.at[ki % depth])

                for j in range(issuers):

                    @pl.when(warp == FIRST_MMA_WARP + j)
                    def _(j: int = j) -> None:
                        with jax.named_scope("tcgen05"):
                            groups = range(j, gps, issuers)
                            lax.fori_loop(0, p.k_steps, lambda ki, _: mma_step(ki, groups), None)

        def epilogue(acc: Any) -> None:
            """The accumulated (tile_n, tile_m) f32 tile, y^T, to y."""
            with jax.named_scope("epilogue"):
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
                    sum_slices(
                        partials, y_smem, slices=s, tiles=c.tiles, rows=c.x_rows_per_tile,
                        swiglu_pairs=p.swiglu, row_norm_ref=row_norm, norm=p.norm if p.swiglu else None,
                    )  # fmt: skip
                    plgpu.commit_smem()
                    if tile.rows is None:  # the one M tile: x's rows
                        plgpu.copy_smem_to_gmem(y_smem.at[: p.out_rows], y_gmem.at[:, cols])
                    else:
                        store_rows(y_smem, y_gmem, cols, tile.rows)
                plgpu.wait_smem_to_gmem(0)

        def fold_init(w: int) -> Any:
            """The accumulator route's start: this warpgroup's total zeroed and, warpgroup 0, the -BIAS tile
            stored. Returns scales of the loop's carry before the first step (zeros, never folded)."""
            if not fold:
                return None
            plgpu.async_store_tmem(total_columns(w), jnp.zeros((c.tile_n, tm), jnp.float32))
            if bias and w == 0:  # before warpgroup 0's first arrival, which every MMA follows
                # In TMEM's native layout (32x32b stores), so the X-ray tells these constant stores from
                # the A operand's (16x128b).
                minus_bias = jnp.full(bias_tmem.shape, -BIAS[p.dtype.name], p.dtype)
                native_rows = plgpu.Layout.TCGEN05_TMEM_NATIVE
                plgpu.async_store_tmem(bias_tmem, plgpu.layout_cast(minus_bias, native_rows))
            plgpu.commit_tmem()
            scales0 = tuple(jnp.zeros((c.tile_n,), jnp.float32) for _ in range(gps))
            if native is not None:
                scales0 = tuple(plgpu.layout_cast(v, native.reduce(1)) for v in scales0)
            return scales0

        def alternating_warpgroup(w: int) -> None:
            """Dequantizing warpgroup ``w`` of two: steps w, w + 2, ... into A half w. Each folds its own
            steps' accumulators into its own total; warpgroup 0 adds warpgroup 1's and stores y (on the
            weights route the warpgroup of the last step does, once its MMAs completed)."""
            steps = (p.k_steps - w + 1) // 2
            if steps == 0:
                return
            if p.row_scaled and w == (0 if fold else (p.k_steps - 1) % 2):  # the warpgroup storing y
                stage_row_norm()
            step = lambda i, carry: dequant_step(2 * i + w, w, carry)
            last_scales = lax.fori_loop(0, steps, step, fold_init(w))
            plgpu.barrier_wait(mma_done.at[w])  # the last step's MMAs: every phase observed
            if not fold:
                if w == (p.k_steps - 1) % 2:  # the last MMAs, so the whole accumulator
                    acc = plgpu.async_load_tmem(acc_tmem)
                    plgpu.wait_load_tmem()
                    epilogue(acc)
                return
            with jax.named_scope("fold"):
                fold_into_total(w, last_scales)
            if w == 1:
                plgpu.barrier_arrive(handoff)  # its total, stored and committed
                return
            if handing_off:
                plgpu.barrier_wait(handoff)
            # Without K slices the totals load in the layout the transposed y store takes (inferred).
            layout = native if s > 1 else None
            alive = range(min(p.k_steps, 2))  # the warpgroups that took a step
            totals = [plgpu.async_load_tmem(total_columns(i), layout=layout) for i in alive]
            plgpu.wait_load_tmem()
            epilogue(sum(totals[1:], totals[0]))

        def single_warpgroup() -> None:
            """The one dequantizing warpgroup (weights route): every step, waiting for the MMAs of two steps
            back, then the last two steps' MMAs (every phase observed)."""
            if p.row_scaled:
                stage_row_norm()
            lax.fori_loop(0, p.k_steps, lambda ki, _: dequant_step(ki, lax.rem(ki, 2), None), None)
            for ki in range(max(p.k_steps - 2, 0), p.k_steps):
                plgpu.barrier_wait(mma_done.at[ki % 2])
            acc = plgpu.async_load_tmem(acc_tmem)
            plgpu.wait_load_tmem()
            epilogue(acc)

        def compute() -> None:
            pl.when(wg == issue_wg)(issue)
            if alternate:
                pl.when(wg == 0)(lambda: alternating_warpgroup(0))
                pl.when(wg == 1)(lambda: alternating_warpgroup(1))
            else:
                pl.when(wg == 0)(single_warpgroup)

        def zeros() -> None:  # the grouped kernel's rows past the groups: no weight read
            @pl.when(wg == FOLD_WG)
            def _() -> None:
                # Through the transposed view, as the accumulator is stored: a plain splat store into y_smem
                # leaves Mosaic GPU's layout inference no solution at 16- and 32-row M tiles (out of fuel).
                # Under K slices y_smem is untiled, as the slices' sum writes it: stored as it is (the
                # transposed view's minor dimension is strided there, which a vector store refuses).
                if s > 1 and p.swiglu:
                    # Its y_smem's half-width rows (one column per gate/up pair) may not make the 128
                    # elements a splat store needs (4 x 16): the epilogue of a zero accumulator
                    # stores them, silu(0) * 0.
                    epilogue(jnp.zeros((c.tile_n, c.tile_m), jnp.float32))
                    return
                if s == 1:
                    y_smem.T[...] = jnp.zeros(y_smem.T.shape, p.dtype)
                else:
                    y_smem[...] = jnp.zeros(y_smem.shape, p.dtype)
                plgpu.commit_smem()
                store()
                plgpu.wait_smem_to_gmem(0)

        run_tile(tile, compute, zeros)

    weight_ops = operands[:-1] if p.row_scaled else operands
    codes_dtype, scale_dtype = weight_ops[-n_weight_ops - 2].dtype, weight_ops[-n_weight_ops].dtype
    if active_params() is not None:  # each warpgroup holds a host thread while it waits at a barrier
        check_warpgroup_threads(dequant_wgs + 1, kernel_name(p, work.name))
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((p.out_rows, p.n), p.dtype),
        grid=(work.ctas(p),),
        grid_names=("mn",),
        num_threads=dequant_wgs + 1,
        thread_name="wg",
        scratch_types=[
            # The A operand, double-buffered: TMEM (packed pairs, halves side by side) or swizzled SMEM.
            plgpu.TMEM((c.tile_n, 2 * c.tile_k), p.dtype, packed=True)
            if tmem_a
            else plgpu.SMEM((2, c.tile_n, c.tile_k), p.dtype, transforms=_swizzled(p.dtype)),
            plgpu.SMEM((depth, *codes_block), codes_dtype),
            plgpu.SMEM((depth, *x_block), p.dtype, transforms=_swizzled(p.dtype)),
            *[plgpu.SMEM((depth, *scale_block), scale_dtype) for _ in range(n_weight_ops)],
            plgpu.TMEM((c.tile_n, fold_columns(p) if fold else c.tile_m), jnp.float32),
            *([plgpu.TMEM((c.tile_n, CHUNK_K), p.dtype, packed=True)] if bias else []),  # -BIAS, an A operand
            plgpu.Barrier(num_arrivals=2 + n_weight_ops, num_barriers=loaded_barriers),  # loaded
            plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),  # a_ready
            plgpu.Barrier(num_arrivals=issuers, num_barriers=2, orders_tensor_core=True),  # mma_done
            plgpu.Barrier(num_arrivals=issuers, num_barriers=depth, orders_tensor_core=True),  # x_free
            plgpu.Barrier(num_arrivals=1, num_barriers=depth),  # codes_free
            y_staging((c.x_rows_per_tile, out_cols), p.dtype, any_rows=s == 1),
            # handoff: warpgroup 1's total, in TMEM for warpgroup 0
            *([plgpu.Barrier(num_arrivals=1, orders_tensor_core=True)] if handing_off else []),
            *([plgpu.SMEM((c.tile_n, c.tile_m), jnp.float32)] if s > 1 else []),
            *([plgpu.SMEM((c.x_rows_per_tile,), jnp.float32)] if p.row_scaled else []),  # sums of squares
        ],
        # No automatic barriers (see the module docstring): Mosaic would fence each SMEM store with two.
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, unsafe_no_auto_barriers=True
        ),
        interpret=active_params(),
        kernel_name=kernel_name(p, work.name),
    )
    return call(*operands)
