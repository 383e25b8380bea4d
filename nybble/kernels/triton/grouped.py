"""The grouped (mixture-of-experts) W4A16 kernel on Pallas' Triton backend: ``nybble.ragged_matmul``.

x (rows, K) is sorted by expert, ``group_sizes`` (E,) int32 counts each expert's rows; the weight is a
stack of E ``planes_nk_int4`` experts (E, N_pad, K_pad / 8). Grid: (N tiles, work tiles). The work tiles
are the (expert, block_m-row tile) pairs whose rows meet, in expert order, plus the tail "expert" E
that owns the rows past ``sum(group_sizes)`` (written as zeros): at most ``ceil(rows / block_m) + E``
of them, each row tile shared by at most the experts that begin in it. Each program finds its pair
with a scalar walk over the E + 1 group sizes (E scalar loads from L1, no launch to build a schedule),
then runs the dense kernel's steps (``nybble.kernels.triton.dequant``) over its expert's packed words
only: an expert with no rows is never read. Rows of the tile outside the expert are masked at the
store, so the experts sharing a row tile each write only their own rows; programs past the last pair
return at once. One launch; no dequantized weight exists anywhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from nybble.kernels.triton import dequant
from nybble.kernels.triton import pallas as triton_pallas
from nybble.kernels.triton.config import TuningConfig, plane_rows
from nybble.packing import pad_to
from nybble.quant.qweight import QuantizedWeight


def _find_tile(sizes_ref, t, *, experts: int, rows: int, bm: int):
    """(expert, row tile, first row, end row) of work tile ``t``: the walk over the clamped groups."""

    def walk(e, carry):
        cum, seen, found_e, found_tile, found_lo, found_hi = carry
        size = jnp.where(e < experts, jnp.maximum(sizes_ref[jnp.minimum(e, experts - 1)], 0), rows)
        lo = jnp.minimum(cum, rows)
        hi = jnp.where(e < experts, jnp.minimum(cum + size, rows), rows)
        tiles = jnp.where(hi > lo, (hi - 1) // bm - lo // bm + 1, 0)
        mine = (t >= seen) & (t < seen + tiles)
        found_e = jnp.where(mine, e, found_e)
        found_tile = jnp.where(mine, lo // bm + (t - seen), found_tile)
        found_lo = jnp.where(mine, lo, found_lo)
        found_hi = jnp.where(mine, hi, found_hi)
        return cum + jnp.where(e < experts, size, 0), seen + tiles, found_e, found_tile, found_lo, found_hi

    zero = jnp.int32(0)
    init = (zero, zero, jnp.int32(-1), zero, zero, zero)
    _, _, e, tile, lo, hi = jax.lax.fori_loop(0, experts + 1, walk, init)
    return e, tile, lo, hi


def _kernel(
    *refs, cfg: TuningConfig, p: int, group: int, experts: int, rows: int, asymmetric: bool, asm: bool
):
    if asymmetric:
        sizes_ref, x_ref, w_ref, s_ref, o_ref, y_ref = refs
    else:
        sizes_ref, x_ref, w_ref, s_ref, y_ref = refs
        o_ref = None
    bm, bn, kw = cfg.block_m, cfg.block_n, cfg.block_kw
    e, tile, lo, hi = _find_tile(sizes_ref, pl.program_id(1), experts=experts, rows=rows, bm=bm)
    n0 = pl.program_id(0) * bn  # read here: the interpreter substitutes program ids at the top level only

    @pl.when(e >= 0)
    def _():
        r0 = tile * bm
        row = r0 + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        in_x = row < rows
        ex = jnp.minimum(e, experts - 1)
        steps = jnp.where(
            e < experts, jnp.int32(p // kw), jnp.int32(0)
        )  # the tail "expert" multiplies nothing: zeros

        def x_at(k0):
            return plgpu.load(x_ref.at[pl.ds(r0, bm), pl.ds(pl.multiple_of(k0, kw), kw)], mask=in_x, other=0)

        acc = dequant.k_loop(
            lambda j0: w_ref[ex, :, pl.ds(j0, kw)].T,  # K-contiguous words -> (kw, block_n)
            x_at,
            lambda g: s_ref[ex, pl.ds(g, 1), :],
            None if o_ref is None else (lambda g: o_ref[ex, pl.ds(g, 1), :]),
            first=0,
            steps=steps,
            block_kw=kw,
            plane_rows=p,
            group=group,
            x_dtype=x_ref.dtype,
            route=cfg.route,
            tile_m=bm,
            tile_n=bn,
            asm=asm,
            scale_dtype=s_ref.dtype,
        )
        mine = (row >= lo) & (row < hi)
        plgpu.store(y_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], acc.astype(y_ref.dtype), mask=mine)


def work_tiles(rows: int, experts: int, block_m: int) -> int:
    """Programs along the work axis: every (expert, row tile) pair, the tail's included, fits."""
    return pl.cdiv(rows, block_m) + experts


def grouped_matmul(
    x: jax.Array, qw: QuantizedWeight, group_sizes: jax.Array, cfg: TuningConfig, *, interpret: bool = False
) -> jax.Array:
    """``ragged_dot(x, dequantize(qw), group_sizes)`` for x (rows, K) and a stacked ``planes_nk_int4`` weight:
    (rows, N) in x's dtype, rows past the groups' sum zero. Arguments are checked by the caller."""
    rows = x.shape[0]
    experts = qw.codes.shape[0]
    n = qw.shape[1]
    k_pad, n_pad = qw.padded_shape
    p = plane_rows(k_pad)
    x_pad = x if x.shape[1] == k_pad else pad_to(x, (rows, k_pad))
    grid = (n_pad // cfg.block_n, work_tiles(rows, experts, cfg.block_m))
    per_n = pl.BlockSpec((experts, cfg.block_n, p), lambda j, t: (0, j, 0))
    per_n_scales = pl.BlockSpec((experts, qw.num_groups, cfg.block_n), lambda j, t: (0, 0, j))
    in_specs = [
        pl.BlockSpec((experts,), lambda j, t: (0,)),
        pl.BlockSpec((rows, k_pad), lambda j, t: (0, 0)),
        per_n,
        per_n_scales,
    ]
    args = [group_sizes.astype(jnp.int32), x_pad, qw.codes, qw.scales]
    if qw.offsets is not None:
        in_specs.append(per_n_scales)
        args.append(qw.offsets)
    kernel = functools.partial(
        _kernel,
        cfg=cfg,
        p=p,
        group=qw.group,
        experts=experts,
        rows=rows,
        asymmetric=qw.offsets is not None,
        asm=not interpret,  # inline PTX in the compiled kernel; its jnp equivalents in interpret mode
    )
    y = triton_pallas.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, n_pad), x.dtype),
        grid=grid,
        in_specs=in_specs,
        out_specs=pl.BlockSpec((rows, n_pad), lambda j, t: (0, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="nybble_triton_w4a16_grouped",
    )(*args)
    return y if n == n_pad else y[:, :n]


def reference(x, qw: QuantizedWeight, group_sizes) -> np.ndarray:
    """float64: each expert's rows times its exact weight (``nybble.kernels.ops.matmul.reference``),
    zeros past the groups' sum (negative sizes count as zero, rows past x's end are dropped)."""
    import dataclasses

    from nybble.kernels.ops.matmul.reference import reference_dequantize

    x = np.asarray(x, np.float64)
    rows = x.shape[0]
    y = np.zeros((rows, qw.shape[1]))
    start = 0
    for e, size in enumerate(np.maximum(np.asarray(group_sizes), 0)):
        end = min(start + int(size), rows)
        if end > start:
            one = dataclasses.replace(
                qw,
                codes=qw.codes[e],
                scales=qw.scales[e],
                offsets=None if qw.offsets is None else qw.offsets[e],
            )
            y[start:end] = x[start:end] @ reference_dequantize(one)
        start = end
    return y


__all__ = ["grouped_matmul", "reference", "work_tiles"]
