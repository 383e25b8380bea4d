"""W4A16 GEMM on Hopper with Pallas Mosaic GPU, one warpgroup per CTA: y = x @ dequant(W).

The kernel computes the transposed product y^T = W^T x^T so that the dequantized weights are WGMMA's A
operand, held in registers, and the batch M is WGMMA's N (8..256); for M <= 8 the N columns that would
multiply padding carry S slices of K instead (dequant_registers.py), so one warpgroup covers
64 * tiles / S rows of N over all of K, and a decode GEMM needs neither split-K nor a second launch.

One CTA (one compute warpgroup) owns ``rows_per_wg`` output rows (and an M tile, and 1 / split_k of each
slice). With ``producer`` a second warpgroup (40 registers) issues every TMA and the compute warpgroup
only waits on full slots: the copies, their barriers and the slot bookkeeping (~60 instructions a step in
the X-ray) leave the compute loop, and TMA runs ahead by the whole pipeline depth; the CTA then holds the
SM's register file, one CTA per SM. Without, the compute warpgroup refills each slot itself:

    for each K step (``max_concurrent_steps`` SMEM slots, TMA running ahead; constant slots: pipeline.py):
        TMA  codes (tiles, 8, tile_k) words  (wgmma_int4: each lane's fragment in one 8-byte word pair)
        TMA  x     (S * tile_m, tile_k)       (x viewed as (M * S, K / S); rows past M * S zero-filled)
        TMA  scale / offset rows               (per slice)
        for each 64-wide K chunk and A tile:   LDS.64, 3 SHF + 4 LOP3 per 8 weights
        for each WGMMA K (config.wgmma_k: two chunks, one group at most): one WGMMA call, so the x
            tile's descriptor is derived once for 8 HGMMAs
            scales_on="accumulators": 136 + q straight into a per-group f32 accumulator; one more WGMMA
                call with a constant A tile: -136 (symmetric, one A tile: the bias folded into acc,
                per group y += s acc) or ones (the group's sum of x: y += s (acc - 136 sum x) + o sum x)
            scales_on="weights": q exact (one more bf16x2 subtract), w = q * s (+ o) in bf16
    epilogue: accumulators -> SMEM -> (S > 1: sum of the slices, or with the SwiGLU epilogue silu(r g) *
        (r u) of each gate/up pair, swiglu.py, or with the residual epilogue x = residual + y and
        h = x * w, residual.py; split-K: sum of the cluster's partials, split_k.py) -> TMA to y (and h)

w4a16_ws.py is the warp-specialized variant for prefill.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nybble.kernels.mosaic_gpu import pipeline, split_k
from nybble.kernels.mosaic_gpu.common import (
    CtaTile,
    DenseWork,
    L,
    Problem,
    accumulate,
    constant_value,
    k_step,
    kernel_name,
    operand_specs,
    reduce_split_k,
    run_tile,
    store_tiles,
)
from nybble.kernels.mosaic_gpu.config import CHUNK_K, stores_any_rows, wgmma_k
from nybble.kernels.mosaic_gpu.interpret import active_params
from nybble.kernels.mosaic_gpu.lowered_once import per_problem
from nybble.kernels.mosaic_gpu.staging import y_staging


def _smem_swizzle(dtype) -> tuple:
    bits = jnp.finfo(dtype).bits
    swizzle = plgpu.find_swizzle(CHUNK_K * bits, "ones")
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


@per_problem  # one trace and lowering per problem, however many call sites
def w4a16_single_wg(p: Problem, operands: list[jax.Array], work: Any = None) -> jax.Array:
    """Runs the one-warpgroup kernel on the operand views of ``common.operand_views``.

    ``work`` (default ``common.DenseWork()``) gives the grid and each CTA's ``common.CtaTile`` from the
    kernel's input refs (``operands``): the grouped kernel's (grouped.py) reads its tiles from the groups.

    With and without a producer the CTA runs the same K steps (``common.k_step``) into the same epilogue
    (:func:`_compute`); only the pipeline feeding the steps differs (:func:`_k_loop`).
    """
    c = p.config
    work = DenseWork() if work is None else work
    n_in = len(operands)
    scratch_types = _scratch(p)

    n_out = 2 if p.residual else 1

    def kernel(*refs):
        ins, out_gmem = refs[:n_in], refs[n_in] if n_out == 1 else refs[n_in : n_in + n_out]
        # The scratch refs come nested as _scratch lists their types (the split-K slabs: a list of refs).
        scratch = dict(zip((name for name, _ in scratch_types), refs[n_in + n_out :], strict=True))
        if p.row_scaled:  # the rows' sums of squares come last; the K loop reads the others
            ins, scratch["row_norm_gmem"] = ins[:-1], ins[-1]
        if p.residual:  # the residual stream and the norm's weight come last
            ins, scratch["residual_gmem"], scratch["norm_weight_gmem"] = ins[:-2], ins[-2], ins[-1]

        def body(tile: CtaTile) -> None:
            run_tile(
                tile,
                lambda: _compute(p, tile, scratch, out_gmem),
                lambda: _store_zeros(p, tile, scratch, out_gmem),
            )

        if c.producer:
            work.run(p, ins, body, wg=lax.axis_index("wg"), wgs=2)
        else:
            work.run(p, ins, body)

    out_type: Any = jax.ShapeDtypeStruct(p.out_shape, p.out_dtype)
    if p.residual:  # x = residual + y and h = x * w
        out_type = (out_type, out_type)
    launch = split_k.launch_args(c.split_k)
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(work.ctas(p), *launch["grid_extra"]),
        grid_names=("mn", *launch["grid_names_extra"]),
        cluster=launch["cluster"],
        cluster_names=launch["cluster_names"],
        scratch_types=[types for _, types in scratch_types],
        **(dict(num_threads=2, thread_name="wg") if c.producer else {}),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=active_params(),
        kernel_name=kernel_name(p, work.name),
    )
    return call(*operands)


def _store_zeros(p: Problem, tile: CtaTile, scratch: dict[str, Any], out_gmem: Any) -> None:
    """Zeros into the tile's y rows, no weight read (the grouped kernel's rows past the groups)."""
    c = p.config

    def store() -> None:
        zeros = plgpu.layout_cast(jnp.zeros((64 * c.tiles, c.wgmma_n), jnp.float32), L.WGMMA)
        store_tiles(p, zeros, scratch, out_gmem, tile.mi, tile.ni * c.cta_rows, rows=tile.rows)

    if c.producer:  # warpgroup 0 stores y, as after the pipeline
        pl.when(lax.axis_index("wg") == 0)(store)
    else:
        store()


def _compute(p: Problem, tile: CtaTile, scratch: dict[str, Any], out_gmem: Any) -> None:
    """The CTA's matmul: for each K partition its pipeline (:func:`_k_loop`) into the epilogue storing its
    y tile (or split-K partial), then the cluster's split-K reduction."""
    c = p.config
    mi, ni = tile.mi, tile.ni
    const = scratch.get("const")
    if c.scales_on == "accumulators" and not c.producer:  # with a producer: warpgroup 0, in _k_loop
        _fill_const(p, const)
    if p.row_scaled:
        if c.producer:  # warpgroup 0 runs the epilogue that reads them
            pl.when(lax.axis_index("wg") == 0)(lambda: _stage_row_norm(p, scratch))
        else:
            _stage_row_norm(p, scratch)
    if p.residual:
        if c.producer:  # warpgroup 0 runs the epilogue that waits for them
            pl.when(lax.axis_index("wg") == 0)(lambda: residual_copies(p, scratch, ni))
        else:
            residual_copies(p, scratch, ni)
    # One K partition: this CTA's own (split_k.py: all of them, in turn, when interpreting).
    for part in split_k.partitions(c.split_k):
        k_first = (lax.axis_index(split_k.AXIS) if part is None else part) * p.steps_per_split
        # The last WGMMA of a step still reads its x tile while the next step starts, so slots are
        # released one step late (delay_release=1).
        specs = operand_specs(p, mi, ni, k_first, delay_release=1)

        def epilogue(acc: Any, part: int | None = part) -> None:
            store_tiles(p, acc, scratch, out_gmem, mi, ni * c.cta_rows, partition=part, rows=tile.rows)

        _k_loop(p, tile.gmem, specs, const, epilogue)
    if c.split_k > 1:
        # With a producer both warpgroups join the cluster's barriers; the compute one sums.
        wg = dict(wg=lax.axis_index("wg"), wgs=1) if c.producer else {}
        reduce_split_k(p, scratch["split_k"], out_gmem, mi, ni, **wg)


def _k_loop(p: Problem, gmem: list[Any], specs: list[Any], const: Any, epilogue: Any) -> None:
    """One K partition: ``common.k_step`` over its steps, fed by one of four pipelines, then ``epilogue``
    on the accumulators (``common.accumulate``, in the compute warpgroup).

    Without a producer the compute warpgroup issues its own copies; with one, warpgroup 1
    (``pipeline.MEMORY_REGISTERS`` registers) issues every TMA and warpgroup 0 waits on full slots. Exact
    weights use constant SMEM slots where they pay (``pipeline.constant_slots``), else Pallas' pipelines.
    The accumulator route always keeps Pallas': with constant slots ptxas interleaves consecutive steps'
    group accumulators and spills (X-ray, Llama-3-8B gate-up at M = 16: 648 bytes).
    """
    c = p.config
    step = k_step(p, const)
    grid = (p.steps_per_split,)
    constant = c.scales_on == "weights" and pipeline.constant_slots(c, p.group)

    def compute(run_pipeline: Any) -> None:  # in the compute warpgroup: where the accumulators live
        if c.scales_on == "accumulators" and c.producer:
            _fill_const(p, const)
        accumulate(p, run_pipeline, epilogue)

    if c.producer:
        ws = dict(
            grid=grid,
            memory_registers=pipeline.MEMORY_REGISTERS,
            wg_axis="wg",
            num_compute_wgs=1,
            max_concurrent_steps=c.max_concurrent_steps,
        )
        if constant:  # this CTA's one tile, its specs already made
            pipeline.emit_pipeline_warp_specialized(
                step,
                in_specs=lambda _: specs,
                compute_context=lambda run_pipeline, _: compute(run_pipeline),
                output_tiles=pipeline.OutputTiles("mn"),
                **ws,
            )(*gmem)
        else:
            plgpu.emit_pipeline_warp_specialized(step, in_specs=specs, compute_context=compute, **ws)(*gmem)
        return

    def run_pipeline(carry: Any) -> Any:  # the compute warpgroup's own copies
        if c.scales_on == "accumulators":  # the running total is the pipeline's carry
            return plgpu.emit_pipeline(
                step, grid=grid, in_specs=specs, max_concurrent_steps=c.max_concurrent_steps, init_carry=carry
            )(*gmem)

        def body(indices: Any, *refs: Any) -> None:  # these pipelines carry nothing: pass the ref along
            step(indices, *refs, carry)

        emit = pipeline.emit_pipeline if constant else plgpu.emit_pipeline
        emit(body, grid=grid, in_specs=specs, max_concurrent_steps=c.max_concurrent_steps)(*gmem)
        return carry

    compute(run_pipeline)


def _stage_row_norm(p: Problem, scratch: dict[str, Any]) -> None:
    """The SwiGLU epilogue's sums of squares into SMEM at the CTA's start (scalar loads, their latency under
    the pipeline's first copies): one per row of the tile, rows past M repeating row M - 1's (K slices: one
    M tile, rows 0..tile_m - 1)."""
    src, dst = scratch["row_norm_gmem"], scratch["row_norm"]
    for i in range(p.config.tile_m):
        dst[i] = src[min(i, p.m - 1)]


def residual_copies(p: Problem, scratch: dict[str, Any], ni: Any) -> None:
    """The residual epilogue's rows into SMEM, issued at the CTA's start so that the K loop hides them: the
    residual stream's M rows and the norm weight's row at the CTA's output columns, two TMAs on one barrier
    (``common.store_tiles`` waits on it before the epilogue)."""
    cols = pl.ds(ni * p.config.cta_rows, p.config.rows_per_wg)
    barrier = scratch["residual_barrier"]
    plgpu.copy_gmem_to_smem(scratch["residual_gmem"].at[:, cols], scratch["residual"].at[: p.m], barrier)
    plgpu.copy_gmem_to_smem(scratch["norm_weight_gmem"].at[:, cols], scratch["norm_weight"], barrier)


def _fill_const(p: Problem, const: Any) -> None:
    """The accumulator route's constant A tile (-136 or ones, ``common.constant_value``), committed for
    WGMMA: once per CTA, by the warpgroup that runs the steps."""
    const[...] = plgpu.layout_cast(jnp.full(_const_shape(p), constant_value(p), p.dtype), L.WGMMA)
    plgpu.commit_smem()


def _const_shape(p: Problem) -> tuple[int, int]:
    """The accumulator route's constant A tile: 64 rows, one WGMMA call's K."""
    return (64, wgmma_k(p.config, p.group))


def _scratch(p: Problem) -> list[tuple[str, Any]]:
    """The kernel's SMEM scratch in allocation order, by name: one type, or a list (the split-K slabs)."""
    c = p.config
    scratch: list[tuple[str, Any]] = []
    if c.split_k == 1:
        width = c.rows_per_wg // 2 if p.swiglu else c.rows_per_wg  # SwiGLU: one column per gate/up pair
        y = y_staging((c.tile_m, width), p.out_dtype, any_rows=stores_any_rows(c))
        scratch.append(("out", y))
    if p.row_scaled:
        scratch.append(("row_norm", plgpu.SMEM((c.tile_m,), jnp.float32)))
    if p.residual:  # (config.residual_reason: K slices, so no split-K and the y staging above)
        scratch.append(("normed", y_staging((c.tile_m, c.rows_per_wg), p.out_dtype, any_rows=False)))
        scratch.append(("residual", plgpu.SMEM((c.tile_m, c.rows_per_wg), p.dtype)))
        scratch.append(("norm_weight", plgpu.SMEM((1, c.rows_per_wg), p.norm_weight_dtype)))
        scratch.append(("residual_barrier", plgpu.Barrier(num_arrivals=2)))
    if c.slices > 1:  # the K slices' partial sums, added in the epilogue (dequant_registers.sum_slices)
        scratch.append(("slices", plgpu.SMEM((c.tiles, 64, c.wgmma_n), jnp.float32)))
    if c.scales_on == "accumulators":
        scratch.append(("const", plgpu.SMEM(_const_shape(p), p.dtype, transforms=_smem_swizzle(p.dtype))))
    if c.split_k > 1:
        scratch.append(("split_k", split_k.scratch_types(c.tile_m, c.split_k, c.tiles)))
    return scratch
