"""``planes_int4``: the layout the portable Triton kernel reads (``nybble.kernels.triton``).

Stored: uint32 words of shape (K_pad / 8, N_pad), N-major rows like the logical (K, N) weight. With
``P = K_pad / 8`` (the plane height), word ``(j, n)`` holds eight codes of column ``n``, one per 4-bit
nibble, ``i`` = 0 (bits 0-3) to 7 (bits 28-31)::

    nibble i of word (j, n) = q[i * P + j, n] + 8          (offset binary: 0..15 for -8..7)

so nibble ``i`` of the whole array is "plane" ``i``: rows ``[i * P, (i + 1) * P)`` of K, in order. A kernel
that loads a (T, tile_n) block of words at row ``j0`` gets, with one shift and one mask per plane, eight
(T, tile_n) code tiles whose K rows are the contiguous runs ``i * P + j0 ... + T``: each is multiplied
by the contiguous x columns of the same run, so no value is permuted in registers and x is read as it
lies. A run of T rows starting at a multiple of T lies in one scale group whenever T divides the group
size and P: one scale row per (plane, tile).

Offset binary, not two's complement: ``nibble | 0x4300`` read as a bfloat16 is exactly ``128 + nibble``
(``0x6400`` in float16: ``1024 + nibble``), the magic-number conversion that turns a code into a float
with one OR. Planes i and i + 4 share a nibble position in the word's two 16-bit halves, so one shift, one
mask-and-OR and one paired ``fma`` turn both into exact codes at once (``nybble.kernels.triton.dequant``).

K is not a plain slice of this layout (plane i interleaves rows ``i * P``), so tensor-parallel cuts along
K go through another layout (``nybble.relayout``); cuts along N are plain column slices.

``planes_nk_int4``, what the Triton kernel reads: the same words transposed, uint32 (N_pad, K_pad / 8),
word ``(n, j)`` of it is word ``(j, n)`` above. A column's words are contiguous along K, so the two K rows
j and j + 1 that one MMA operand register pairs (for every plane: the same two words) sit side by side in
shared memory, and Triton reads them with one 64-bit load instead of two 32-bit ones (sm_80, 16 x 16
tiles: 67 -> 35 LDS a step, 3.05 -> 2.99 main-loop instructions per weight; docs/logs/performance-log.md,
2026-12-05). ``planes_int4`` stays readable (``nybble.relayout`` converts it): files written with it
before load as they were.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PLANES = 8  # nibbles per uint32 word


def _xp(x: Any) -> Any:
    import jax.numpy as jnp

    return np if isinstance(x, np.ndarray | np.generic) else jnp


def _check(k_pad: int, n_pad: int) -> None:
    if k_pad % (8 * PLANES) or n_pad < 1:
        raise ValueError(
            f"planes_int4: K_pad must be a multiple of 64, got (K_pad, N_pad) = ({k_pad}, {n_pad})"
        )


def pack_planes_int4(codes_kn: Any) -> Any:
    """Logical int4 codes (K_pad, N_pad) in [-8, 7] -> uint32 words (K_pad / 8, N_pad) (numpy or jax)."""
    xp = _xp(codes_kn)
    k_pad, n_pad = codes_kn.shape
    _check(k_pad, n_pad)
    nib = (xp.asarray(codes_kn).astype(xp.int32) + 8).astype(xp.uint32) & 0xF
    planes = nib.reshape(PLANES, k_pad // PLANES, n_pad)  # plane i = rows [i P, (i + 1) P)
    shifts = xp.asarray((4 * np.arange(PLANES, dtype=np.uint32)).reshape(PLANES, 1, 1))
    return (planes << shifts).sum(axis=0, dtype=xp.uint32)


def unpack_planes_int4(words: Any, k_pad: int | None = None) -> Any:
    """uint32 words (K_pad / 8, N_pad) -> logical int8 codes (K_pad, N_pad); exact inverse of packing."""
    xp = _xp(words)
    rows, n_pad = words.shape
    if k_pad is not None and k_pad != PLANES * rows:
        raise ValueError(f"planes_int4: words have K_pad = {PLANES * rows}, expected {k_pad}")
    shifts = xp.asarray((4 * np.arange(PLANES, dtype=np.uint32)).reshape(PLANES, 1, 1))
    nib = (xp.asarray(words).astype(xp.uint32)[None] >> shifts) & 0xF
    return (nib.astype(xp.int8) - 8).reshape(PLANES * rows, n_pad)


def pack_planes_nk_int4(codes_kn: Any) -> Any:
    """Logical int4 codes (K_pad, N_pad) -> uint32 words (N_pad, K_pad / 8): ``planes_int4``'s, transposed."""
    words = pack_planes_int4(codes_kn)
    return np.ascontiguousarray(words.T) if isinstance(words, np.ndarray) else words.T


def unpack_planes_nk_int4(words: Any, k_pad: int | None = None) -> Any:
    """uint32 words (N_pad, K_pad / 8) -> logical int8 codes (K_pad, N_pad); exact inverse of packing."""
    return unpack_planes_int4(words.T, k_pad)


__all__ = ["PLANES", "pack_planes_int4", "pack_planes_nk_int4", "unpack_planes_int4", "unpack_planes_nk_int4"]
