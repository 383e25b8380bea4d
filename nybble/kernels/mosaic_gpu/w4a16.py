"""W4A16 GEMM on Hopper with Pallas Mosaic GPU, one warpgroup per CTA: y = x @ dequant(W).

The kernel computes the transposed product y^T = W^T x^T so that the dequantized weights are WGMMA's A
operand, held in registers, and the batch M is WGMMA's N (8..256); for M <= 8 the N columns that would
multiply padding carry S slices of K instead (dequant_registers), so one warpgroup covers 64 * tiles / S rows
of N over all of K, and a decode GEMM needs neither split-K nor a second launch.

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
    epilogue: accumulators -> SMEM -> (S > 1: sum of the slices; split-K: sum of the cluster's
        partials, split_k.py) -> TMA to y

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
    L,
    Problem,
    constant_value,
    exact_weights_step,
    operand_specs,
    reduce_split_k,
    scaled_accumulators_step,
    store_tiles,
    tile_indices,
)
from nybble.kernels.mosaic_gpu.config import CHUNK_K, stores_any_rows, wgmma_k
from nybble.kernels.mosaic_gpu.interpret import active_params
from nybble.kernels.mosaic_gpu.staging import y_staging


def _smem_swizzle(dtype) -> tuple:
    bits = jnp.finfo(dtype).bits
    swizzle = plgpu.find_swizzle(CHUNK_K * bits, "ones")
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def w4a16_single_wg(p: Problem, operands: list[jax.Array]) -> jax.Array:
    """Runs the one-warpgroup kernel on the operand views of ``common.operand_views``.

    With and without a producer the kernel is the same steps (:func:`_steps`) and the same epilogue
    (``store_tiles``, then the split-K reduction); only the pipeline that feeds the steps differs: the
    compute warpgroup's own (Pallas' or pipeline.py's constant slots), or the producer's warp-specialized
    one (:func:`_run_partition`)."""
    c = p.config

    def kernel(*refs):
        codes_gmem, x_gmem, s_gmem, *rest = refs
        o_gmem = rest.pop(0) if p.has_offsets else None
        out_gmem = rest.pop(0)
        scratch = {}
        for name, types in _scratch(p):
            if isinstance(types, list):  # the split-K reduction's refs
                scratch[name], rest = rest[: len(types)], rest[len(types) :]
            else:
                scratch[name], rest = rest[0], rest[1:]
        mi, ni = tile_indices(p, lax.axis_index("mn"))
        gmem = [codes_gmem, x_gmem, s_gmem] + ([o_gmem] if p.has_offsets else [])
        if c.scales_on == "accumulators" and not c.producer:  # with a producer: warpgroup 0, in compute
            _fill_const(p, scratch["const"])
        # One K partition: this CTA's own (split_k.py: all of them, in turn, when interpreting).
        for part in split_k.partitions(c.split_k):
            _run_partition(p, gmem, scratch, out_gmem, mi, ni, part)
        if c.split_k > 1:
            # With a producer both warpgroups join the cluster's barriers; the compute one sums.
            wg = dict(wg=lax.axis_index("wg"), wgs=1) if c.producer else {}
            reduce_split_k(p, scratch["split_k"], out_gmem, mi, ni, **wg)

    out_type = jax.ShapeDtypeStruct(p.out_shape, p.out_dtype)
    launch = split_k.launch_args(c.split_k)
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(p.m_tiles * p.n_tiles, *launch["grid_extra"]),
        grid_names=("mn", *launch["grid_names_extra"]),
        cluster=launch["cluster"],
        cluster_names=launch["cluster_names"],
        scratch_types=[
            t for _, types in _scratch(p) for t in (types if isinstance(types, list) else [types])
        ],
        **(dict(num_threads=2, thread_name="wg") if c.producer else {}),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=active_params(),
        kernel_name=f"nybble_w4a16_{_config_tag(p)}",
    )
    return call(*operands)


def _fill_const(p: Problem, const: Any) -> None:
    """The accumulator route's constant A tile (-136 or ones), written once and committed for WGMMA."""
    const[...] = plgpu.layout_cast(jnp.full(_const_shape(p), constant_value(p), p.dtype), L.WGMMA)
    plgpu.commit_smem()


def _steps(p: Problem, const: Any) -> Any:
    """One K step's body, as both pipelines call it: ``(step, codes, x, s[, o], carry) -> carry``.

    The accumulator route carries the running f32 total (a value); exact weights accumulate into a WGMMA
    accumulator ref, which Pallas' own pipeline does not carry (``carry`` is then absent) and the
    warp-specialized one does (it is returned)."""
    if p.config.scales_on == "accumulators":

        def accumulate(_, codes, x, s, *rest):
            *o, total = rest
            return scaled_accumulators_step(p, total, codes, x, const, s, o[0] if o else None)

        return accumulate

    def exact(acc_ref, carried):
        def body(_, codes, x, s, *rest):
            *o, ref = rest if carried else (*rest, acc_ref)
            exact_weights_step(p, ref, codes, x, s, o[0] if o else None, 0)
            return ref if carried else None

        return body

    return exact


def _run_partition(
    p: Problem, gmem: list[Any], scratch: dict[str, Any], out_gmem: Any, mi: Any, ni: Any, part: int | None
) -> None:
    """K partition ``part`` (None: this CTA's own) of one output tile, from its steps to ``store_tiles``.

    Without a producer the compute warpgroup runs the pipeline itself; with one, warpgroup 1 (the
    producer, ``pipeline.MEMORY_REGISTERS`` registers) issues every TMA and warpgroup 0 waits on full
    slots, computes and stores."""
    c = p.config
    acc_shape = (64 * c.tiles, c.wgmma_n)
    const = scratch.get("const")
    k_first = (lax.axis_index(split_k.AXIS) if part is None else part) * p.steps_per_split
    # The last WGMMA of a step still reads its x tile while the next step starts, so slots are released
    # one step late (delay_release=1).
    specs = operand_specs(p, mi, ni, k_first, delay_release=1)
    steps = _steps(p, const)
    # Constant SMEM slots where they pay (pipeline.constant_slots), else Pallas' pipelines.
    constant = c.scales_on == "weights" and pipeline.constant_slots(c, p.group)

    def store(acc: Any) -> None:
        store_tiles(p, acc, scratch, out_gmem, mi, ni * c.cta_rows, partition=part)

    if not c.producer:
        if c.scales_on == "accumulators":
            # Pallas' pipeline: with constant slots (pipeline.py) ptxas interleaves consecutive steps'
            # group accumulators and spills (X-ray, Llama-3-8B gate-up at M = 16: 648 bytes).
            acc = plgpu.emit_pipeline(
                steps,
                grid=(p.steps_per_split,),
                in_specs=specs,
                max_concurrent_steps=c.max_concurrent_steps,
                init_carry=plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), L.WGMMA),
            )(*gmem)
        else:

            def mainloop(acc_ref):
                emit = pipeline.emit_pipeline if constant else plgpu.emit_pipeline
                emit(
                    steps(acc_ref, carried=False),
                    grid=(p.steps_per_split,),
                    in_specs=specs,
                    max_concurrent_steps=c.max_concurrent_steps,
                )(*gmem)
                return acc_ref[...]  # waits for the last WGMMA

            acc = pl.run_scoped(mainloop, plgpu.ACC(acc_shape, jnp.float32))
        store(acc)
        return
    args = dict(
        grid=(p.steps_per_split,),
        memory_registers=pipeline.MEMORY_REGISTERS,
        in_specs=specs,
        wg_axis="wg",
        num_compute_wgs=1,
        max_concurrent_steps=c.max_concurrent_steps,
    )
    if c.scales_on == "accumulators":

        def compute(run_pipeline: Any) -> None:  # warpgroup 0 only
            _fill_const(p, const)
            store(run_pipeline(plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), L.WGMMA)))

        plgpu.emit_pipeline_warp_specialized(steps, compute_context=compute, **args)(*gmem)
        return

    def compute_exact(run_pipeline: Any) -> None:  # warpgroup 0 only
        def scoped(acc_ref: Any) -> None:
            run_pipeline(acc_ref)
            store(acc_ref[...])

        pl.run_scoped(scoped, plgpu.ACC(acc_shape, jnp.float32))

    exact_body = steps(None, carried=True)
    if constant:  # this CTA's one tile, its specs already made
        pipeline.emit_pipeline_warp_specialized(
            exact_body,
            compute_context=lambda run_pipeline, _: compute_exact(run_pipeline),
            output_tiles=pipeline.OutputTiles("mn"),
            **dict(args, in_specs=lambda _: specs),
        )(*gmem)
    else:
        plgpu.emit_pipeline_warp_specialized(exact_body, compute_context=compute_exact, **args)(*gmem)


def _const_shape(p: Problem) -> tuple[int, int]:
    """The accumulator route's constant A tile: 64 rows, one WGMMA call's K."""
    return (64, wgmma_k(p.config, p.group))


def _scratch(p: Problem) -> list[tuple[str, Any]]:
    """The kernel's scratch, in order, by name: one SMEM type, or a list of them (the split-K slabs)."""
    c = p.config
    out: list[tuple[str, Any]] = []
    if c.split_k == 1:
        out.append(("out", y_staging((c.tile_m, c.rows_per_wg), p.out_dtype, any_rows=stores_any_rows(c))))
    if c.slices > 1:
        out.append(("slices", plgpu.SMEM((c.tiles, 64, c.wgmma_n), jnp.float32)))
    if c.scales_on == "accumulators":
        out.append(("const", plgpu.SMEM(_const_shape(p), p.dtype, transforms=_smem_swizzle(p.dtype))))
    if c.split_k > 1:
        out.append(("split_k", list(split_k.scratch_types(c.tile_m, c.split_k, c.tiles))))
    return out


def _config_tag(p: Problem) -> str:
    c = p.config
    return (
        f"t{c.tiles}m{c.tile_m}k{c.tile_k}s{c.slices}x{c.split_k}w{c.compute_wgs}"
        f"{'acc' if c.scales_on == 'accumulators' else 'wt'}{'o' if p.has_offsets else ''}"
        f"{'p' if c.producer else ''}"
    )
