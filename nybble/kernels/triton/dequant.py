"""The register work shared by the Triton kernels: one step of 8 plane tiles, from packed words to f32 sums.

Walking the bytes. A step at word row ``j0`` holds a (T, tile_n) block of uint32 words (T = ``block_kw``),
4 bytes per word, 8 nibbles per word: 8 T tile_n codes in 4 T tile_n bytes, the only weight bytes read
from HBM. Nibble i of every word is plane i: the codes of K rows ``i P + j0 ... i P + j0 + T`` (P =
K_pad / 8, ``nybble.packing.planes``), stored offset binary ``u = q + 8`` in 0..15. Plane i sits in bits
4i..4i+3 and plane i + 4 in bits 16+4i..16+4i+3: the same nibble of the word's two 16-bit halves.

Accumulators route (decode, bf16/f16 x), per word and per pair of planes (i, i + 4), i = 0..3, in
registers (``plane_pair_codes``; thread-instructions per weight on sm_80 in brackets):
  1. ``w >> 4 i`` (none for i = 0; 3 SHF per word [0.375]): both planes' nibbles to bits 0-3 and 16-19;
  2. ``lop3(w, 0x000F000F, 0x43004300, 0xEA)`` = ``(w & mask) | magic`` (one LOP3 [0.5]): the two halves
     read as bfloat16 are exactly ``128 + u`` each (``0x64006400`` in float16: ``1024 + u``), Marlin's
     magic-number conversion, no integer-to-float instruction and no per-half work;
  3. ``fma.rn.bf16x2(t, 1.0, -136.0)`` (one HFMA2 for both halves [0.5]): ``u - 8 = q``, exact (small
     integers), so no bias is left for the f32 side to take out;
  4. the halves become the two planes' 16-bit codes; the MMA's B operand pairs K rows j and j + 1, which
     sit in two different words, so Triton packs each pair with one PRMT [0.5];
  5. the MMA of the x tile (tile_m, T) by the (T, tile_n) code tile, f32 accumulation (HMMA [0.25]);
then per (plane, step), once per output element and not per weight, the group's scale: ``acc = fma(d,
s, acc)`` (one FFMA per output element [0.25 at T = 64, 0.125 at T = 128]), plus ``sum_k(x_k) o`` for
asymmetric groups. A plane tile never straddles a group (T divides P and the group), so one scale row
serves it. The planes run in the order 0, 4, 1, 5, ...: a pair's codes live in registers together for the
shortest time. Steps 2 and 3 and the FFMA are inline PTX in the compiled kernel (Pallas' lowering leaves
an AND and an OR, a multiply and an add, that ptxas does not fuse); interpret mode computes the same
bits with jnp (``pair_codes_word``, checked bit for bit against a numpy model of the PTX).

f32 x skips the magic (it would cost 23 bits): ``u`` is converted to f32, the dot runs in IEEE f32 (no
TF32) and ``acc += d s + sum_k(x_k) (o - 8 s)``. The weights route (prefill) dequantizes each weight to
x's dtype once per CTA and lets the MMA accumulate. Symmetric groups with scales in x's 16-bit dtype take
the pair trick's steps 1-3 and then one ``fma.rn.{b}f16x2(q, s, -0.0)`` a word (``scaled_pair_word``: each
half's scale is its own plane's group's, packed once per step and column): ``q s`` rounded once, the value
``nybble.dequantize`` holds, in about 2.4 thread-instructions a weight (per word of two: the shift, LOP3,
HFMA2, the multiply and Triton's PRMT) where converting each code to f32, scaling and rounding took about 6
(docs/logs/performance-log.md, 2026-12-05). Asymmetric groups and other scale dtypes keep
``(u - 8) s + o`` in f32 (``plane_weights``: the offset's add rounds in f32 first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

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


# Per 16-bit activation dtype, the constants of the exact-code trick (``plane_pair_codes``), each as a pair
# of 16-bit halves: the magic exponent OR'ed onto a nibble (``magic | u`` reads as ``B + u``), the float's
# 1.0 and ``-(B + 8)``, so that one ``fma(x, 1.0, -(B + 8))`` per half turns ``B + u`` into ``u - 8 = q``.
PAIR_TRICK = {
    "bfloat16": {"magic": 0x43004300, "one": 0x3F803F80, "minus_bias": 0xC308C308, "ptx": "bf16x2"},
    "float16": {"magic": 0x64006400, "one": 0x3C003C00, "minus_bias": 0xE408E408, "ptx": "f16x2"},
}
NIBBLE_PAIR_MASK = 0x000F000F
# The exact-code route multiplies plane i + 4 right after plane i: both come from the same words, so their
# codes live in registers together for the shortest time.
PLANE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # bits 0-3 and 16-19: plane i's nibble and plane i + 4's, once shifted


def pair_codes_word(shifted: jax.Array, x_dtype, asm: bool) -> jax.Array:
    """Per uint32 word already shifted right by ``4 i``: the word whose low half holds plane i's exact code
    ``q`` and whose high half holds plane i + 4's, both in x's 16-bit float format. Compiled: two PTX
    instructions on the whole word, for two weights (a ``lop3`` and a ``fma.rn.{b}f16x2``); interpret
    mode: the same bits from jnp integer arithmetic."""
    name = np.dtype(x_dtype).name
    trick = PAIR_TRICK[name]
    if not asm:
        u = shifted & jnp.uint32(NIBBLE_PAIR_MASK)
        lo = (u & jnp.uint32(0xF)).astype(jnp.int32) - 8
        hi = (u >> jnp.uint32(16)).astype(jnp.int32) - 8
        bits = [
            jax.lax.bitcast_convert_type(h.astype(jnp.float32).astype(x_dtype), jnp.uint16).astype(jnp.uint32)
            for h in (lo, hi)
        ]
        return bits[0] | (bits[1] << jnp.uint32(16))
    (out,) = plgpu.elementwise_inline_asm(
        "{ .reg .b32 t, one, nb;\n"
        # t = (w & 0x000F000F) | magic: each half B + u (LUT 0xEA: (a & b) | c, one LOP3)
        f"lop3.b32 t, $1, {NIBBLE_PAIR_MASK:#010x}, {trick['magic']:#010x}, 0xEA;\n"
        f"mov.b32 one, {trick['one']:#010x};\n"
        f"mov.b32 nb, {trick['minus_bias']:#010x};\n"
        # each half (B + u) * 1 - (B + 8) = u - 8 = q, exact (one HFMA2 for both planes)
        f"fma.rn.{trick['ptx']} $0, t, one, nb;\n"
        "}",
        args=[jax.lax.bitcast_convert_type(shifted, jnp.int32)],  # Triton's asm takes signless integers
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shifted.shape, jnp.int32)],
    )
    return jax.lax.bitcast_convert_type(out, jnp.uint32)


def fma(a: jax.Array, b: jax.Array, c: jax.Array, asm: bool) -> jax.Array:
    """``a * b + c`` in f32, one FFMA where ``asm`` (Triton's Pallas lowering leaves a multiply and an add
    that ptxas does not contract); ``b`` broadcasts to ``a``'s shape."""
    b = jnp.broadcast_to(b, a.shape)
    if not asm:
        return a * b + c
    (out,) = plgpu.elementwise_inline_asm(
        "fma.rn.f32 $0, $1, $2, $3;",
        args=[a, b, c],
        constraints="=f,f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return out


def plane_pair_word(words: jax.Array, plane: int, x_dtype, asm: bool) -> jax.Array:
    """Planes ``plane`` and ``plane + 4`` (``plane`` < 4) of a (T, tile_n) word tile as one word of two
    exact codes ``q`` in x's dtype (bf16/f16): a shift (none for plane 0), then ``pair_codes_word``."""
    shifted = jax.lax.shift_right_logical(words, jnp.uint32(4 * plane)) if plane else words
    return pair_codes_word(shifted, x_dtype, asm)


def plane_pair_codes(words: jax.Array, plane: int, x_dtype, asm: bool) -> tuple[jax.Array, jax.Array]:
    """:func:`plane_pair_word` split into the two planes' code tiles (Triton packs the MMA operand's
    K-adjacent pairs with one PRMT per two codes)."""
    return split_pair(plane_pair_word(words, plane, x_dtype, asm), x_dtype)


def scale_pair_word(lo_row: jax.Array, hi_row: jax.Array) -> jax.Array:
    """Two (1, tile_n) 16-bit scale rows as one uint32 row: ``lo`` in the low half, ``hi`` in the high half
    (the operand of one ``fma.rn`` on a ``pair_codes_word``: plane i's code times its group's scale in the
    low half, plane i + 4's in the high half)."""
    bits = [jax.lax.bitcast_convert_type(r, jnp.uint16).astype(jnp.uint32) for r in (lo_row, hi_row)]
    return bits[0] | (bits[1] << jnp.uint32(16))


def scaled_pair_word(pair: jax.Array, scale_pair: jax.Array, x_dtype, asm: bool) -> jax.Array:
    """The weights route of the exact-code trick: per half, ``q s`` rounded once to x's 16-bit format (one
    ``fma.rn.{b}f16x2(q, s, -0.0)`` for two weights: the product of a 4-bit integer and a scale is exact
    before its one rounding, the value ``(u - 8) s`` in f32 then rounded holds). ``pair``: a
    ``pair_codes_word``; ``scale_pair``: a ``scale_pair_word`` row, broadcast over the tile's rows."""
    scale_pair = jnp.broadcast_to(scale_pair, pair.shape)
    if not asm:
        halves = []
        for shift in (0, 16):
            a, b = (
                jax.lax.bitcast_convert_type(
                    jax.lax.shift_right_logical(v, jnp.uint32(shift)).astype(jnp.uint16), x_dtype
                ).astype(jnp.float32)
                for v in (pair, scale_pair)
            )
            halves.append(
                jax.lax.bitcast_convert_type((a * b).astype(x_dtype), jnp.uint16).astype(jnp.uint32)
            )
        return halves[0] | (halves[1] << jnp.uint32(16))
    trick = PAIR_TRICK[np.dtype(x_dtype).name]
    # fma with -0.0: mul.rn.bf16x2 needs sm_90, fma.rn.bf16x2 runs from sm_80 (the same single rounding).
    (out,) = plgpu.elementwise_inline_asm(
        "{ .reg .b32 nz;\n"
        "mov.b32 nz, 0x80008000;\n"
        f"fma.rn.{trick['ptx']} $0, $1, $2, nz;\n"
        "}",
        args=[jax.lax.bitcast_convert_type(v, jnp.int32) for v in (pair, scale_pair)],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(pair.shape, jnp.int32)],
    )
    return jax.lax.bitcast_convert_type(out, jnp.uint32)


def split_pair(word: jax.Array, x_dtype) -> tuple[jax.Array, jax.Array]:
    """A word of two 16-bit halves as two tiles of x's dtype (low half, high half)."""
    lo = jax.lax.bitcast_convert_type(word.astype(jnp.uint16), x_dtype)
    high_bits = jax.lax.shift_right_logical(word, jnp.uint32(16)).astype(jnp.uint16)
    return lo, jax.lax.bitcast_convert_type(high_bits, x_dtype)


def pairs_weights(route: str, x_dtype, scale_dtype, asymmetric: bool) -> bool:
    """Whether the weights route dequantizes two planes a word with the exact-code trick and one
    ``fma.rn`` of x's 16-bit format (:func:`scaled_pair_word`): symmetric groups whose scales are already
    in x's dtype (bf16 or f16). Otherwise each plane apart in f32 (:func:`plane_weights`)."""
    same_dtype = np.dtype(scale_dtype) == np.dtype(x_dtype)
    return route == "weights" and not asymmetric and np.dtype(x_dtype).name in PAIR_TRICK and same_dtype


def step(
    acc,
    words,
    x_at,
    scale_at,
    offset_at,
    *,
    j0,
    plane_rows: int,
    group: int,
    x_dtype,
    route: str,
    asm: bool = False,
    scale_dtype=None,
):
    """Adds one step's 8 plane products to ``acc`` (tile_m, tile_n) f32.

    ``x_at(k0)``: the (tile_m, T) x tile at K column ``k0``; ``scale_at(g)`` / ``offset_at(g)`` (or None):
    the (1, tile_n) row of group ``g``. ``route``: "accumulators" (decode: the codes straight into the
    MMA, the group's scale applied to the f32 product once per plane tile: a few instructions per weight,
    and per output element a multiply-add per plane, cheap at 16 rows) or "weights" (prefill: each weight
    dequantized once per CTA, ``(u - 8) s + o``, then the MMA accumulates in place: the per-output-element
    work of the other route would grow with the tile's rows and bind on the CUDA cores at 64 rows and
    more). The weights route accumulates y^T, (tile_n, tile_m): the dequantized weights are the MMA's A
    operand, whose warps split its rows, so each warp dequantizes its own rows of W^T; as the B operand
    every warp along M would dequantize the same weights again (on sm_80, 50 against 10.6
    thread-instructions per weight at 128 x 128 tiles and 8 warps). ``asm``: the inline-PTX forms of
    ``_mask_or`` and ``fma`` (compiled kernels; interpret mode runs their jnp equivalents).
    ``scale_dtype``: the scales' dtype; where :func:`pairs_weights` allows, the weights route dequantizes
    planes i and i + 4 together (:func:`scaled_pair_word`)."""
    exact_codes = route == "accumulators" and MAGIC[np.dtype(x_dtype).name][0] is not None
    paired = scale_dtype is not None and pairs_weights(route, x_dtype, scale_dtype, offset_at is not None)
    codes = {}
    order = PLANE_ORDER if exact_codes or paired else range(PLANES)
    for plane in order:
        k0 = plane * plane_rows + j0
        x_tile = x_at(k0)
        g = k0 // group
        offset_row = None if offset_at is None else offset_at(g)
        if route == "weights":  # acc holds y^T: the weights are the MMA's A operand (see step's docstring)
            if paired:  # planes i and i + 4 from one shift, one LOP3, one HFMA2 and one multiply a word
                if plane not in codes:
                    both = plane_pair_word(words, plane, x_dtype, asm)
                    hi_group = (k0 + PLANES // 2 * plane_rows) // group
                    scales = scale_pair_word(scale_at(g), scale_at(hi_group))
                    codes[plane], codes[plane + PLANES // 2] = split_pair(
                        scaled_pair_word(both, scales, x_dtype, asm), x_dtype
                    )
                w = codes[plane]
            else:
                w = plane_weights(words, plane, scale_at(g), offset_row, x_dtype)
            precision = jax.lax.Precision.HIGHEST if x_tile.dtype == jnp.float32 else None
            acc = acc + jax.lax.dot_general(
                w, x_tile, (((0,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )
            continue
        if exact_codes:  # acc += (x q) s (+ sum(x) o): no bias left to take out
            if plane not in codes:  # bf16/f16 x: planes i and i + 4 share their word's shift and mask
                codes[plane], codes[plane + PLANES // 2] = plane_pair_codes(words, plane, x_dtype, asm)
            acc = fma(plane_dot(x_tile, codes[plane]), scale_at(g).astype(jnp.float32), acc, asm)
            if offset_row is not None:
                xsum = jnp.sum(x_tile.astype(jnp.float32), axis=1, keepdims=True)
                acc = fma(jnp.broadcast_to(xsum, acc.shape), offset_row.astype(jnp.float32), acc, asm)
            continue
        d = plane_dot(x_tile, plane_codes(words, plane, x_dtype))  # f32 x: u as f32, bias 8
        xsum = jnp.sum(x_tile.astype(jnp.float32), axis=1, keepdims=True)
        s, shift = scale_terms(scale_at(g), offset_row, x_dtype)
        acc = acc + d * s + xsum * shift
    return acc


__all__ = [
    "MAGIC",
    "PLANES",
    "bias",
    "pairs_weights",
    "plane_codes",
    "plane_dot",
    "plane_weights",
    "scale_pair_word",
    "scale_terms",
    "scaled_pair_word",
    "split_pair",
    "step",
]


def k_loop(
    words_at,
    x_at,
    scale_at,
    offset_at,
    *,
    first,
    steps,
    block_kw: int,
    plane_rows: int,
    group: int,
    x_dtype,
    route: str,
    tile_m: int,
    tile_n: int,
    asm: bool = False,
    scale_dtype=None,
) -> jax.Array:
    """The K loop of both Triton kernels (dense and grouped): ``steps`` steps of ``block_kw`` words from
    step ``first``, ``words_at(j0)`` the step's (block_kw, tile_n) words; returns the (tile_m, tile_n) f32
    product y (the weights route accumulates y^T, turned back here)."""
    transposed = route == "weights"

    def body(t, acc):
        j0 = pl.multiple_of((first + t) * block_kw, block_kw)
        return step(
            acc,
            words_at(j0),
            x_at,
            scale_at,
            offset_at,
            j0=j0,
            plane_rows=plane_rows,
            group=group,
            x_dtype=x_dtype,
            route=route,
            asm=asm,
            scale_dtype=scale_dtype,
        )

    zeros = jnp.zeros((tile_n, tile_m) if transposed else (tile_m, tile_n), jnp.float32)
    lower = 0 if isinstance(steps, int) else jnp.int32(0)  # a static trip count stays static
    acc = jax.lax.fori_loop(lower, steps, body, zeros)
    return acc.T if transposed else acc
