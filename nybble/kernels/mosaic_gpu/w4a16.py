"""W4A16 GEMM on Hopper with Pallas Mosaic GPU, one warpgroup per CTA: y = x @ dequant(W).

The kernel computes the transposed product y^T = W^T x^T so that the dequantized weights are WGMMA's A
operand, held in registers, and the batch M is WGMMA's N (8..256): a decode step with M = 1 pads M to 8
only, not to 64, and the int4 codes never take a round trip through SMEM as bf16 (Machete's trick).

One CTA (one warpgroup) owns a (tile_n x tile_m) output tile and a contiguous 1/split_k of K:

    for each K step (emit_pipeline, `max_concurrent_steps` SMEM slots, TMA running ahead):
        TMA  codes (tile_n, tile_k / 2 bytes)  gmem -> swizzled smem  (W^T rows are K-major: whole bytes)
        TMA  x     (tile_m, tile_k)            gmem -> swizzled smem
        TMA  scales / offsets rows (tile_k // G or 1, tile_n)
        for each 64-wide K chunk:                         (common.dequant_wgmma_step)
            codes -> registers: codes_as="int4": WGMMA_UPCAST_4X load of the int4 view;
                                codes_as="uint8": byte load, nibbles split by i32 shifts (even / odd K)
            w = q * s + o   (f32, one FMA per element) -> x.dtype
            wgmma(acc (tile_n, tile_m) f32, w, x_chunk^T), one WGMMA left in flight
    acc -> smem (transposed) -> TMA to out[m, n] (or to the f32 split-K partial out[split, m, n])

This is the decode workhorse: with M <= 64 the work per weight byte is tiny, and many small CTAs (split-K
over a grid of N tiles) keep every SM streaming weights. w4a16_ws.py is the warp-specialized variant.
"""

from __future__ import annotations

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


def w4a16_single_wg(p: Problem, x_pad, codes, scales, offsets) -> jax.Array:
    """Runs the one-warpgroup kernel on checked, padded operands (see ``w4a16_padded``)."""
    c = p.config

    def kernel(x_gmem, w_gmem, s_gmem, *rest):
        o_gmem = rest[0] if p.has_offsets else None
        out_gmem, out_smem = rest[-2:]
        mi, ni = tile_indices(p, lax.axis_index("mn"))
        k_first = lax.axis_index("split") * p.steps_per_split
        # The last WGMMA of a step still reads its x tile while the next step is dequantized, so slots
        # are released one step late (delay_release=1).
        specs = operand_specs(p, mi, ni, k_first, delay_release=1)
        operands = [w_gmem, x_gmem, s_gmem] + ([o_gmem] if p.has_offsets else [])

        def mainloop(acc_ref):
            def body(_, w_smem, x_smem, s_smem, *o_smem):
                dequant_wgmma_step(p, acc_ref, w_smem, x_smem, s_smem, o_smem[0] if o_smem else None)

            plgpu.emit_pipeline(
                body, grid=(p.steps_per_split,), in_specs=specs, max_concurrent_steps=c.max_concurrent_steps
            )(*operands)
            return acc_ref[...]  # waits for the last WGMMA

        acc = pl.run_scoped(mainloop, plgpu.ACC((c.tile_n, c.tile_m), jnp.float32))
        store_tile(p, acc, out_smem, out_gmem, mi, ni * c.tile_n)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(p.out_shape, p.out_dtype),
        grid=(p.m_tiles * p.n_tiles, c.split_k),
        grid_names=("mn", "split"),
        scratch_types=[plgpu.SMEM((c.tile_m, c.tile_n), p.out_dtype)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=active_params(),
    )
    args = [x_pad, codes, scales] + ([offsets] if p.has_offsets else [])
    return call(*args)
