"""The register work shared by the Triton kernels: one step of 8 plane tiles, from packed words to f32 sums.

Walking the bytes. A step at word row ``j0`` holds a (T, tile_n) block of uint32 words (T = ``block_kw``),
4 bytes per word, 8 nibbles per word: 8 T tile_n codes in 4 T tile_n bytes, the only weight bytes read
from HBM. Nibble i of every word is plane i: the codes of K rows ``i P + j0 ... i P + j0 + T`` (P =
K_pad / 8, ``nybble.packing.planes``), stored offset binary ``u = q + 8`` in 0..15.

Per plane i, per word, in registers (what the SASS shows per weight on sm_80):
  1. ``(w >> 4 i) & 0xF``: one shift and one mask (Triton folds them and the OR below into one LOP3
     where it can);
  2. ``| 0x4300`` then read as bfloat16: exactly ``128 + u`` = ``136 + q`` (``0x6400`` as float16: ``1024
     + u``), Marlin's magic-number conversion: no integer-to-float instruction, the 16-bit value is
     truncated from the 32-bit lane and two of them are packed into one MMA register;
  3. the MMA of the x tile (tile_m, T) by that (T, tile_n) tile, f32 accumulation, ``d = sum_k x_k (B + 8
     + q_k)`` with B the magic bias (128 or 1024);
then per (plane, step), once per output element and not per weight, the group's scale and offset:
``acc += d s + sum_k(x_k) (o - (B + 8) s)``, which equals ``sum_k x_k (q_k s + o)``: the dequantized
weight's product, the bias taken out in f32. A plane tile never straddles a group (T divides P and the
group), so one scale row serves it. f32 x skips the magic (it would cost 23 bits): ``u`` is converted
to f32 and the dot runs in IEEE f32 (no TF32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from nybble.packing.planes import PLANES

# The magic OR and the value it adds to u, per activation dtype (None: convert, no bias).
MAGIC = {"bfloat16": (0x4300, 128.0), "float16": (0x6400, 1024.0), "float32": (None, 0.0)}


def bias(x_dtype) -> float:
    """The constant the kernel's dot adds to each code: B + 8 (136 for bf16, 1032 for f16, 8 for f32)."""
    return MAGIC[np.dtype(x_dtype).name][1] + 8.0


def plane_codes(words: jax.Array, plane: int, x_dtype) -> jax.Array:
    """Plane ``plane`` of a (T, tile_n) uint32 word tile as x's dtype: ``B + u`` (bf16/f16) or ``u`` (f32)."""
    u = jax.lax.shift_right_logical(words, jnp.uint32(4 * plane)) & jnp.uint32(0xF)
    magic, _ = MAGIC[np.dtype(x_dtype).name]
    if magic is None:
        return u.astype(jnp.int32).astype(jnp.float32)
    return jax.lax.bitcast_convert_type((u | jnp.uint32(magic)).astype(jnp.uint16), x_dtype)


def plane_dot(x_tile: jax.Array, codes: jax.Array) -> jax.Array:
    """``x_tile @ codes`` with f32 accumulation; IEEE f32 for f32 operands (Triton's default is TF32)."""
    precision = jax.lax.Precision.HIGHEST if x_tile.dtype == jnp.float32 else None
    return jnp.dot(x_tile, codes, preferred_element_type=jnp.float32, precision=precision)


def scale_terms(scale_row: jax.Array, offset_row: jax.Array | None, x_dtype) -> tuple[jax.Array, jax.Array]:
    """(s, o - (B + 8) s) in f32 for one (1, tile_n) scale row and its offset row (None: symmetric)."""
    s = scale_row.astype(jnp.float32)
    shift = -bias(x_dtype) * s
    return s, shift if offset_row is None else shift + offset_row.astype(jnp.float32)


def plane_weights(words: jax.Array, plane: int, scale_row, offset_row, x_dtype) -> jax.Array:
    """The weights route: plane ``plane`` dequantized to x's dtype, ``(u - 8) s + o`` in f32 then rounded
    once (the value ``nybble.dequantize(qw, x.dtype)`` holds: ``q s`` is exact in f32, so the offset's add
    is the only f32 rounding, fused or not)."""
    u = jax.lax.shift_right_logical(words, jnp.uint32(4 * plane)) & jnp.uint32(0xF)
    w = (u.astype(jnp.int32) - 8).astype(jnp.float32) * scale_row.astype(jnp.float32)
    if offset_row is not None:
        w = w + offset_row.astype(jnp.float32)
    return w.astype(x_dtype)


def step(acc, words, x_at, scale_at, offset_at, *, j0, plane_rows: int, group: int, x_dtype, route: str):
    """Adds one step's 8 plane products to ``acc`` (tile_m, tile_n) f32.

    ``x_at(k0)``: the (tile_m, T) x tile at K column ``k0``; ``scale_at(g)`` / ``offset_at(g)`` (or None):
    the (1, tile_n) row of group ``g``. ``route``: "accumulators" (decode: the magic-number codes straight
    into the MMA, the group's scale applied to the f32 product once per plane tile: a few instructions
    per weight, and per output element a multiply-add per plane, cheap at 16 rows) or "weights"
    (prefill: each weight dequantized once per CTA, ``(u - 8) s + o``, then the MMA accumulates in place:
    the per-output-element work of the other route would grow with the tile's rows and bind on the CUDA
    cores at 64 rows and more). The weights route accumulates y^T, (tile_n, tile_m): the dequantized
    weights are the MMA's A operand, whose warps split its rows, so each warp dequantizes its own rows of
    W^T; as the B operand every warp along M would dequantize the same weights again (on sm_80, 50 against
    10.6 thread-instructions per weight at 128 x 128 tiles and 8 warps)."""
    for plane in range(PLANES):
        k0 = plane * plane_rows + j0
        x_tile = x_at(k0)
        g = k0 // group
        offset_row = None if offset_at is None else offset_at(g)
        if route == "weights":  # acc holds y^T: the weights are the MMA's A operand (see step's docstring)
            w = plane_weights(words, plane, scale_at(g), offset_row, x_dtype)
            precision = jax.lax.Precision.HIGHEST if x_tile.dtype == jnp.float32 else None
            acc = acc + jax.lax.dot_general(
                w, x_tile, (((0,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )
            continue
        d = plane_dot(x_tile, plane_codes(words, plane, x_dtype))
        xsum = jnp.sum(x_tile.astype(jnp.float32), axis=1, keepdims=True)
        s, shift = scale_terms(scale_at(g), offset_row, x_dtype)
        acc = acc + d * s + xsum * shift
    return acc


__all__ = ["MAGIC", "PLANES", "bias", "plane_codes", "plane_dot", "plane_weights", "scale_terms", "step"]


def k_loop(
    words_at, x_at, scale_at, offset_at, *, first, steps, block_kw: int, plane_rows: int, group: int,
    x_dtype, route: str, tile_m: int, tile_n: int,
) -> jax.Array:
    """The K loop of both Triton kernels (dense and grouped): ``steps`` steps of ``block_kw`` words from
    step ``first``, ``words_at(j0)`` the step's (block_kw, tile_n) words; returns the (tile_m, tile_n) f32
    product y (the weights route accumulates y^T, turned back here)."""
    transposed = route == "weights"

    def body(t, acc):
        j0 = pl.multiple_of((first + t) * block_kw, block_kw)
        return step(
            acc, words_at(j0), x_at, scale_at, offset_at,
            j0=j0, plane_rows=plane_rows, group=group, x_dtype=x_dtype, route=route,
        )

    zeros = jnp.zeros((tile_n, tile_m) if transposed else (tile_m, tile_n), jnp.float32)
    lower = 0 if isinstance(steps, int) else jnp.int32(0)  # a static trip count stays static
    acc = jax.lax.fori_loop(lower, steps, body, zeros)
    return acc.T if transposed else acc
