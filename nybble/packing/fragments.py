"""The ``wgmma_int4`` layout: int4 codes pre-shuffled into the order WGMMA's register A fragments use.

Hopper's ``wgmma`` takes its A operand (here: the dequantized weights, W^T, 64 rows per warpgroup) from
registers, each thread holding a fixed set of elements. Stored K-major (``nk_int4``), a thread's nibbles
are scattered over many bytes; stored in this layout, each thread finds all of its nibbles for 64 values
of K in one aligned 8-byte word pair, and each 32-bit word turns into four bf16x2 registers with three
shifts and four LOP3 (the magic-number trick), no shuffles, no byte permutes.

Shape: ``uint32 (N_pad / 8, K_pad)``. Row b is a *band* of 8 output rows, n = 8b + r8 (r8 = 0..7). Along
a band's K_pad words, each 64-value chunk of K (c = k // 64) owns 64 consecutive words:

    word 64c + 2l + q, l = 4 * r8 + c4 (the warp lane that owns row r8 in WGMMA's layout), q = 0, 1
    nibble u + 4e of that word (u = 0..3, e = 0, 1) holds code q[k, n] for
        n = 8b + r8,   k = 64c + 32q + 8u + 2 * c4 + e

This is exactly a lane's share of the A fragment (PTX ``wgmma`` m64nNk16, bf16): lane l of a warp holds
rows l // 4 and l // 4 + 8 of its 16-row slab and, in every 16-wide K step, columns 2 * (l % 4) + {0, 1}
and 8 + 2 * (l % 4) + {0, 1}. One 8-row band is one row half of one warp's slab, so a warpgroup's 64 rows
are 8 consecutive bands and lane l reads words 2l and 2l + 1 of each (an ``LDS.64``, 256 contiguous bytes
a warp: no bank conflicts). Nibbles u and u + 4 of a word land in the low and high half of one register
(``(w >> 4u) & 0x000F000F``): the pair (k, k + 1) the fragment keeps together.

Codes are two's-complement nibbles, as in ``nk_int4``. The layout is a permutation of ``nk_int4``'s nibbles:
the same bytes count, exact inverses (:func:`pack_wgmma_int4`, :func:`unpack_wgmma_int4`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

BAND_ROWS = 8  # output rows per band (one row half of a warp's 16-row WGMMA slab)
CHUNK_K = 64  # K values per chunk (64 words of a band)
# Axes of the logical (N, K) codes once reshaped as (b, r8, c, q, u, c4, e): see the module docstring.
_SPLIT = (BAND_ROWS, CHUNK_K // 64, 2, 4, 4, 2)


def _xp(x: Any) -> Any:
    return np if isinstance(x, np.ndarray | np.generic) else jnp


def check_shape(k_pad: int, n_pad: int) -> None:
    if k_pad % CHUNK_K or n_pad % BAND_ROWS:
        raise ValueError(
            f"wgmma_int4: padded shape (K_pad, N_pad) = ({k_pad}, {n_pad}) must have K_pad a multiple of "
            f"{CHUNK_K} and N_pad a multiple of {BAND_ROWS} (nybble.packing.padded_weight_dims pads to 64)"
        )


def pack_wgmma_int4(codes_kn: Any) -> Any:
    """Logical int4 codes (K_pad, N_pad) in [-8, 7] -> ``uint32 (N_pad / 8, K_pad)`` words (numpy or jax)."""
    xp = _xp(codes_kn)
    k_pad, n_pad = codes_kn.shape
    check_shape(k_pad, n_pad)
    nib = xp.asarray(codes_kn).astype(xp.int32).T & 0xF  # two's complement nibbles, (N, K)
    # (N, K) -> (b, r8, c, q, u, c4, e) -> (b, c, r8, c4, q, e, u): word = (r8, c4, q), nibble = (e, u).
    nib = nib.reshape(n_pad // BAND_ROWS, BAND_ROWS, k_pad // CHUNK_K, 2, 4, 4, 2)
    nib = nib.transpose(0, 2, 1, 5, 3, 6, 4).astype(xp.uint32)
    shifts = (4 * np.arange(8, dtype=np.uint32)).reshape(2, 4)  # nibble position u + 4e
    words = (nib << xp.asarray(shifts)).sum(axis=(-2, -1), dtype=xp.uint32)
    return words.reshape(n_pad // BAND_ROWS, k_pad)


def unpack_wgmma_int4(words: Any, k_pad: int | None = None) -> Any:
    """``uint32 (N_pad / 8, K_pad)`` words -> logical int8 codes (K_pad, N_pad); exact inverse of packing."""
    xp = _xp(words)
    bands, k_words = words.shape
    if k_pad is not None and k_pad != k_words:
        raise ValueError(f"wgmma_int4: words have K_pad = {k_words}, expected {k_pad}")
    n_pad = bands * BAND_ROWS
    check_shape(k_words, n_pad)
    w = xp.asarray(words).astype(xp.uint32).reshape(bands, k_words // CHUNK_K, BAND_ROWS, 4, 2, 1, 1)
    shifts = xp.asarray((4 * np.arange(8, dtype=np.uint32)).reshape(2, 4))
    nib = ((w >> shifts) & 0xF).astype(xp.int8)  # (b, c, r8, c4, q, e, u)
    q = xp.where(nib >= 8, nib - 16, nib).astype(xp.int8)
    q = q.transpose(0, 2, 1, 4, 6, 3, 5)  # back to (b, r8, c, q, u, c4, e)
    return q.reshape(n_pad, k_words).T
