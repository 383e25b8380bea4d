"""W4A16 GEMM on Hopper, warp-specialized: one TMA warpgroup feeding ``compute_wgs`` compute warpgroups.

Same per-step code as w4a16.py (common.exact_weights_step: weights dequantized exactly, w = q * s (+ o) in
bf16); what changes is the CTA:

    warpgroup `compute_wgs` (memory, 40 registers): TMA codes (tiles * compute_wgs A tiles), x (tile_m,
        tile_k) and the scale rows into `max_concurrent_steps` slots, each guarded by produced/consumed
        barriers;
    warpgroups 0..compute_wgs-1 (compute): each dequantizes its own A tiles and runs WGMMA against the
        shared x tile into its own f32 accumulators, then stores them.

Sharing one x tile between warpgroups halves the activation traffic per weight (the prefill cost), and
while one warpgroup dequantizes the other's WGMMA keeps the tensor cores busy. The memory warpgroup never
waits on dequantization, so TMA runs ahead by the whole pipeline depth. The pipeline's slots are
constants in the code (pipeline.py).

With ``persistent_ctas`` the grid is min(persistent_ctas, output tiles) CTAs, each looping over tiles cta,
cta + CTAs, ... (pipeline.OutputTiles): the TMA warpgroup starts the next tile's copies as soon as the
compute warpgroups release the last tile's slots, i.e. while they are still storing its y tile, and that
store (SMEM to GMEM by TMA) is only waited for before the staging tile is written again.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nybble.kernels.mosaic_gpu import pipeline, split_k
from nybble.kernels.mosaic_gpu.common import (
    DenseWork,
    Problem,
    accumulate,
    k_step,
    kernel_name,
    operand_specs,
    reduce_split_k,
    run_tile,
    store_tiles,
    tile_indices,
)
from nybble.kernels.mosaic_gpu.config import stores_any_rows
from nybble.kernels.mosaic_gpu.interpret import active_params
from nybble.kernels.mosaic_gpu.lowered_once import per_problem
from nybble.kernels.mosaic_gpu.staging import y_staging


@per_problem  # one trace and lowering per problem, however many call sites
def w4a16_warp_specialized(p: Problem, operands: list[jax.Array], work: Any = None) -> jax.Array:
    """Runs the warp-specialized kernel on the operand views of ``common.operand_views``.

    ``work`` (default ``common.DenseWork()``) gives the grid and each CTA's ``common.CtaTile`` from the
    kernel's input refs (``operands``); other than the dense kernel's, it runs without a persistent grid.
    """
    c = p.config
    dense = work is None
    work = DenseWork() if dense else work
    if not dense and (c.persistent_ctas or c.split_k > 1):
        raise ValueError(f"a CTA of its own work runs without a persistent grid or split-K, got {c}")
    n_in = len(operands)
    if c.slices > 1 or c.scales_on != "weights":
        raise ValueError(f"the warp-specialized kernel runs slices=1, scales_on='weights' only, got {c}")
    num_wgs = c.compute_wgs
    acc_shape = (64 * c.tiles, c.wgmma_n)
    tiles = work.ctas(p)
    # A persistent grid: min(persistent_ctas, tiles) CTAs loop over the output tiles (pipeline.OutputTiles).
    persistent = c.persistent_ctas > 0
    ctas = min(c.persistent_ctas, tiles) if persistent else tiles
    output_tiles = pipeline.OutputTiles("mn", tiles if persistent else None)

    def kernel(*refs):
        ins, out_gmem, rest = refs[:n_in], refs[n_in], list(refs[n_in + 1 :])
        out_smem = rest.pop(0) if c.split_k == 1 else None
        reduce_scratch = rest
        wg = lax.axis_index("wg")

        def run(mine):
            """The CTA's work: the dense kernel's tiles from the persistent loop (or the CTA index), another
            work's from ``mine``."""
            gmem = list(ins) if dense else mine.gmem
            rows = None if dense else mine.rows

            def store(acc, part, mi, ni):
                n_start = ni * p.config.cta_rows + wg * c.rows_per_wg
                if c.split_k == 1:
                    smem = {"out": out_smem.at[wg]}
                    store_tiles(p, acc, smem, out_gmem, mi, n_start, overlap=persistent, rows=rows)
                    return
                for w in range(num_wgs):  # each warpgroup sums its own columns with its own slabs

                    @pl.when(wg == w)
                    def _(w=w):
                        smem = {"split_k": split_k.warpgroup_slabs(reduce_scratch, w, num_wgs)}
                        store_tiles(p, acc, smem, out_gmem, mi, n_start, partition=part)

            def compute_context(run_pipeline, tile, part):
                # Runs in the compute warpgroups only: the accumulators live in their registers.
                def epilogue(acc):
                    store(acc, part, *(tile_indices(p, tile) if dense else (mine.mi, mine.ni)))

                accumulate(p, run_pipeline, epilogue)

            def specs(tile, k_first):
                mi, ni = tile_indices(p, tile) if dense else (mine.mi, mine.ni)
                return operand_specs(p, mi, ni, k_first, delay_release=1)

            def compute():
                # One K partition: this CTA's own (split_k.py: all of them, in turn, when interpreting).
                for part in split_k.partitions(c.split_k):
                    k_first = (lax.axis_index(split_k.AXIS) if part is None else part) * p.steps_per_split
                    pipeline.emit_pipeline_warp_specialized(
                        k_step(p, wg=wg),  # each compute warpgroup its own A tiles
                        grid=(p.steps_per_split,),
                        memory_registers=pipeline.MEMORY_REGISTERS,
                        in_specs=functools.partial(specs, k_first=k_first),
                        wg_axis="wg",
                        num_compute_wgs=num_wgs,
                        max_concurrent_steps=c.max_concurrent_steps,
                        compute_context=functools.partial(compute_context, part=part),
                        output_tiles=output_tiles,
                    )(*gmem)

            def zeros():  # each compute warpgroup its own columns, no weight read
                zero = plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA)
                pl.when(wg < num_wgs)(lambda: store(zero, None, mine.mi, mine.ni))

            if dense:
                compute()
            else:
                run_tile(mine, compute, zeros)
            if c.split_k > 1:  # every warpgroup joins the cluster's barriers; the compute ones sum
                mi, ni = tile_indices(p, lax.axis_index("mn"))
                reduce_split_k(p, reduce_scratch, out_gmem, mi, ni, wg=wg, wgs=num_wgs)
            if persistent:  # the last y tile's store (the others were waited for before the next)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        if dense:
            run(None)
        else:
            work.run(p, ins, run, wg=wg, wgs=num_wgs + 1)

    out_type = jax.ShapeDtypeStruct(p.out_shape, p.out_dtype)
    if c.split_k == 1:
        scratch = [y_staging((num_wgs, c.tile_m, c.rows_per_wg), p.out_dtype, any_rows=stores_any_rows(c))]
    else:
        scratch = split_k.scratch_types(c.tile_m, c.split_k, c.tiles, wgs=num_wgs)
    launch = split_k.launch_args(c.split_k)
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(ctas, *launch["grid_extra"]),
        grid_names=("mn", *launch["grid_names_extra"]),
        cluster=launch["cluster"],
        cluster_names=launch["cluster_names"],
        num_threads=num_wgs + 1,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=active_params(),
        kernel_name=kernel_name(p, work.name),
    )
    return call(*operands)
