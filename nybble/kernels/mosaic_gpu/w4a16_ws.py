"""W4A16 GEMM on Hopper, warp-specialized: one TMA warpgroup feeding ``compute_wgs`` compute warpgroups.

Same math and per-step code as w4a16.py (common.dequant_wgmma_step); what changes is the CTA:

    warpgroup `compute_wgs` (memory, 40 registers): TMA codes (cta_n, tile_k), x (tile_m, tile_k) and the
        scale rows into `max_concurrent_steps` slots, each slot guarded by produced/consumed barriers;
    warpgroups 0..compute_wgs-1 (compute): each dequantizes its own tile_n rows of the codes tile and runs
        WGMMA against the shared x tile into its own (tile_n, tile_m) f32 accumulator, then stores it.

Sharing one x tile between warpgroups halves the activation traffic per weight (the prefill cost), and
while one warpgroup dequantizes the other's WGMMA keeps the tensor cores busy. The memory warpgroup never
waits on dequantization, so TMA runs ahead by the whole pipeline depth.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nybble.kernels.mosaic_gpu.common import (
    Problem,
    dequant_wgmma_step,
    operand_specs,
    store_tile,
    tile_indices,
)
from nybble.kernels.mosaic_gpu.interpret import active_params

# Registers per thread left to the TMA warpgroup (it only issues copies); the rest go to compute.
_MEMORY_REGISTERS = 40


def w4a16_warp_specialized(p: Problem, x_pad, codes, scales, offsets) -> jax.Array:
    """Runs the warp-specialized kernel on checked, padded operands (see ``w4a16_padded``)."""
    c = p.config
    num_wgs = c.compute_wgs

    def kernel(x_gmem, w_gmem, s_gmem, *rest):
        o_gmem = rest[0] if p.has_offsets else None
        out_gmem, out_smem = rest[-2:]
        mi, ni = tile_indices(p, lax.axis_index("mn"))
        k_first = lax.axis_index("split") * p.steps_per_split
        wg = lax.axis_index("wg")
        wg_rows = pl.ds(wg * c.tile_n, c.tile_n)  # this warpgroup's rows of the (cta_n, tile_k) codes tile
        specs = operand_specs(p, mi, ni, k_first, delay_release=1)
        operands = [w_gmem, x_gmem, s_gmem] + ([o_gmem] if p.has_offsets else [])

        def compute_context(run_pipeline):
            # Runs in the compute warpgroups only: the accumulator lives in their registers.
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((c.tile_n, c.tile_m), jnp.float32))
            def _(acc_ref):
                run_pipeline(acc_ref)
                acc = acc_ref[...]  # waits for the last WGMMA
                store_tile(p, acc, out_smem.at[wg], out_gmem, mi, ni * p.cta_n + wg * c.tile_n)

        def body(_, w_smem, x_smem, s_smem, *rest):
            *o_smem, acc_ref = rest
            o_rows = o_smem[0].at[:, wg_rows] if o_smem else None
            dequant_wgmma_step(p, acc_ref, w_smem.at[wg_rows], x_smem, s_smem.at[:, wg_rows], o_rows)
            return acc_ref

        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(p.steps_per_split,),
            memory_registers=_MEMORY_REGISTERS,
            in_specs=specs,
            wg_axis="wg",
            num_compute_wgs=num_wgs,
            max_concurrent_steps=c.max_concurrent_steps,
            compute_context=compute_context,
        )(*operands)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(p.out_shape, p.out_dtype),
        grid=(p.m_tiles * p.n_tiles, c.split_k),
        grid_names=("mn", "split"),
        num_threads=num_wgs + 1,
        thread_name="wg",
        scratch_types=[plgpu.SMEM((num_wgs, c.tile_m, c.tile_n), p.out_dtype)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=active_params(),
    )
    args = [x_pad, codes, scales] + ([offsets] if p.has_offsets else [])
    return call(*args)
