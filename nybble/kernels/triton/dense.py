"""The dense W4A16 kernel on Pallas' Triton backend: ``x @ dequantize(qw)`` for a ``planes_nk_int4`` weight.

Grid: (N tiles, M tiles, K splits). Program (n, m, s) owns the (block_m, block_n) output tile (n, m) and
the K steps ``s * steps/splits ... (s + 1) * steps/splits``, each step 8 planes of ``block_kw`` K rows
(``nybble.kernels.triton.dequant`` walks the bytes). Per step it reads one (block_n, block_kw) block of
uint32 words (the packed codes, 4 bits a weight, straight from HBM: no dequantized copy exists anywhere;
K-contiguous, so a thread's two K-adjacent words come in one 64-bit shared-memory load) and uses it as the
(block_kw, block_n) tile ``dequant`` walks,
8 (block_m, block_kw) x tiles and 8 scale rows (and offset rows); Triton's pipeliner keeps
``num_stages`` steps of loads in flight. One split writes y in x's dtype; more write f32 partials
(splits, M, N_pad), summed and cast by one XLA fusion (the second launch).

The blocks are whole arrays along K (x: (block_m, K_pad), words: (block_n, P), scales: (groups,
block_n)): the kernel indexes them per step with ``pl.ds``, and masks the last M tile's rows itself (Pallas'
Triton lowering masks nothing at block bounds); ``block_n`` divides N_pad.
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


def _kernel(*refs, cfg: TuningConfig, p: int, group: int, steps: int, asymmetric: bool, asm: bool, m: int):
    if asymmetric:
        x_ref, w_ref, s_ref, o_ref, y_ref = refs
    else:
        x_ref, w_ref, s_ref, y_ref = refs
        o_ref = None
    per_split = steps // cfg.splits
    first = pl.program_id(2) * per_split
    kw = cfg.block_kw
    # Rows of the last M tile past x's M: Pallas' Triton lowering masks nothing at block bounds (an
    # unmasked access there reads or writes past the array: other rows, other splits' partials), so the
    # x loads and the y store carry the row mask themselves (interpret mode drops such writes).
    row = pl.program_id(1) * cfg.block_m + jax.lax.broadcasted_iota(jnp.int32, (cfg.block_m, 1), 0)
    in_x = row < m

    def x_at(k0):
        tile = x_ref.at[:, pl.ds(pl.multiple_of(k0, kw), kw)]
        return tile[...] if m % cfg.block_m == 0 else plgpu.load(tile, mask=in_x, other=0)

    acc = dequant.k_loop(
        lambda j0: w_ref[:, pl.ds(j0, kw)].T,  # (block_n, kw) words, K-contiguous -> (kw, block_n)
        x_at,
        lambda g: s_ref[pl.ds(g, 1), :],
        None if o_ref is None else (lambda g: o_ref[pl.ds(g, 1), :]),
        first=first,
        steps=per_split,
        block_kw=kw,
        plane_rows=p,
        group=group,
        x_dtype=x_ref.dtype,
        route=cfg.route,
        tile_m=cfg.block_m,
        tile_n=cfg.block_n,
        asm=asm,
        scale_dtype=s_ref.dtype,
    )
    y = acc.astype(y_ref.dtype).reshape(y_ref.shape)
    if m % cfg.block_m == 0:
        y_ref[...] = y
    else:
        plgpu.store(y_ref, y, mask=jnp.broadcast_to(in_x, y.shape))


def dense_matmul(
    x2d: jax.Array, qw: QuantizedWeight, cfg: TuningConfig, *, interpret: bool = False
) -> jax.Array:
    """``x2d @ dequantize(qw)`` for x2d (M, K) bf16/f16/f32 and a 2-D ``planes_nk_int4`` weight: (M, N) in
    x's dtype. Arguments are checked by the caller (``nybble.kernels.triton.backend``)."""
    m = x2d.shape[0]
    n = qw.shape[1]
    k_pad, n_pad = qw.padded_shape
    p = plane_rows(k_pad)
    steps = p // cfg.block_kw
    if steps % cfg.splits:
        raise ValueError(f"TuningConfig {cfg}: splits must divide the {steps} K steps")
    if n_pad % cfg.block_n:  # no N tile may pass N_pad: the compiled kernel would write past y
        raise ValueError(f"TuningConfig {cfg}: block_n must divide N_pad = {n_pad}")
    x_pad = x2d if x2d.shape[1] == k_pad else pad_to(x2d, (m, k_pad))
    grid = (pl.cdiv(n_pad, cfg.block_n), pl.cdiv(m, cfg.block_m), cfg.splits)
    in_specs = [
        pl.BlockSpec((cfg.block_m, k_pad), lambda j, i, s: (i, 0)),
        pl.BlockSpec((cfg.block_n, p), lambda j, i, s: (j, 0)),
        pl.BlockSpec((qw.num_groups, cfg.block_n), lambda j, i, s: (0, j)),
    ]
    args = [x_pad, qw.codes, qw.scales]
    if qw.offsets is not None:
        in_specs.append(in_specs[-1])
        args.append(qw.offsets)
    if cfg.splits == 1:
        out_shape = jax.ShapeDtypeStruct((m, n_pad), x2d.dtype)
        out_spec = pl.BlockSpec((cfg.block_m, cfg.block_n), lambda j, i, s: (i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((cfg.splits, m, n_pad), jnp.float32)
        out_spec = pl.BlockSpec((None, cfg.block_m, cfg.block_n), lambda j, i, s: (s, i, j))
    kernel = functools.partial(
        _kernel,
        cfg=cfg,
        p=p,
        group=qw.group,
        steps=steps,
        asymmetric=qw.offsets is not None,
        asm=not interpret,  # inline PTX in the compiled kernel; its jnp equivalents in interpret mode
        m=m,
    )
    y = triton_pallas.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="nybble_triton_w4a16",
    )(*args)
    if cfg.splits > 1:
        y = y.sum(axis=0).astype(x2d.dtype)
    return y if n == n_pad else y[:, :n]


def reference(x2d, qw: QuantizedWeight, cfg: TuningConfig) -> np.ndarray:
    """The kernel's arithmetic in float64 numpy, in its order of steps and planes. Accumulators route:
    ``sum over (plane, step) of (x q) s + sum(x) o`` for bf16/f16 x (exact codes into the MMA); for f32
    x ``d s + sum(x) (o - 8 s)``, with ``d = x (8 + q)``. Weights route: ``x @ w``, each weight ``q s + o``
    rounded once to f32, then to x's dtype."""
    from nybble.kernels.ops.matmul.reference import reference_codes

    x = np.asarray(x2d, np.float64)
    k_pad, n_pad = qw.padded_shape
    x = np.pad(x, ((0, 0), (0, k_pad - x.shape[1])))
    q = reference_codes(qw).astype(np.float64)
    s = np.asarray(qw.scales, np.float64)
    o = np.zeros_like(s) if qw.offsets is None else np.asarray(qw.offsets, np.float64)
    b = dequant.bias(x2d.dtype)
    p, kw = plane_rows(k_pad), cfg.block_kw
    y = np.zeros((x.shape[0], n_pad))
    for j0 in range(0, p, kw):
        for plane in range(8):
            k0 = plane * p + j0
            xt = x[:, k0 : k0 + kw]
            g = k0 // qw.group
            if cfg.route == "weights":
                w = (q[k0 : k0 + kw] * s[g] + o[g]).astype(np.float32).astype(x2d.dtype)
                y += xt @ w.astype(np.float64)
                continue
            if b > 8:  # bf16/f16 x: exact codes into the MMA, then the scale (and the offset times sum(x))
                y += (xt @ q[k0 : k0 + kw]) * s[g] + xt.sum(1, keepdims=True) * o[g]
                continue
            d = xt @ (b + q[k0 : k0 + kw])  # f32 x: u = q + 8 into the MMA, the bias out in f32
            y += d * s[g] + xt.sum(1, keepdims=True) * (o[g] - b * s[g])
    return y[:, : qw.shape[1]]


__all__ = ["dense_matmul", "reference"]
