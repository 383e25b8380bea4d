"""Shared by the importers: unpack 32-bit nibble words, check tensors, build an exact ``QuantizedWeight``.

Every importer reduces its source format to the same three things: unsigned 4-bit codes ``u`` (K, N) in
[0, 15], integer zero points ``z`` (num_groups, N) in [0, 15] and float scales ``s`` (num_groups, N), with
the source's own dequantization ``w = (u - z) * s`` computed in the scale dtype. :func:`build_weight` turns
them into nybble's convention (signed codes ``q = u - 8``, ``w = q * scale + offset``) without changing a
single dequantized value; see its docstring for why the chosen scale dtype makes that exact.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from nybble.packing import MIN_GROUP_SIZE, check_group_size, default_layout
from nybble.quant.qweight import QuantizedWeight

# Nibble i of a 32-bit word sits at bits [4i, 4i + 4): the shift that brings it to the bottom.
NIBBLE_SHIFTS = np.arange(8, dtype=np.uint32) * 4


def as_array(x: Any, name: str) -> np.ndarray:
    """A host numpy copy of a numpy/jax array (or anything ``np.asarray`` takes), named in errors."""
    if x is None:
        raise ValueError(f"{name}: missing (got None)")
    try:
        return np.asarray(x)
    except Exception as e:  # pragma: no cover - exotic array types
        raise ValueError(f"{name}: cannot be read as an array ({type(x).__name__}): {e}") from None


def check_dtype(x: np.ndarray, name: str, kinds: str, expected: str) -> None:
    """Raises unless ``x.dtype.kind`` is one of ``kinds`` ('i' signed int, 'u' unsigned, 'f' float)."""
    if kinds == "f":  # jnp.issubdtype knows bfloat16 (numpy sees an opaque 'V' kind)
        ok = bool(jnp.issubdtype(x.dtype, jnp.floating)) and x.dtype.itemsize >= 2
    else:
        ok = x.dtype.kind in kinds
    if not ok:
        raise ValueError(f"{name}: expected dtype {expected}, got {x.dtype.name}")


def check_shape(x: np.ndarray, name: str, expected: tuple[int, ...], how: str = "") -> None:
    if tuple(x.shape) != tuple(expected):
        extra = f" ({how})" if how else ""
        raise ValueError(f"{name}: expected shape {tuple(expected)}{extra}, got {tuple(x.shape)}")


def check_2d(x: np.ndarray, name: str, what: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D tensor {what}, got shape {tuple(x.shape)}")


def check_bits(bits: int) -> None:
    if bits != 4:
        raise ValueError(
            f"bits: nybble imports 4-bit checkpoints only, got bits={bits!r} "
            "(2/3/8-bit GPTQ/AWQ weights have no int4 representation; requantize from float instead)"
        )


def read_layer(
    qweight: Any, qzeros: Any, scales: Any, *, bits: int, name: str, qweight_layout: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 4-bit layer's three tensors as numpy arrays, checked: int32 words, float scales, 2-D.

    ``qweight_layout`` describes the packed qweight in errors (e.g. ``"[K / 8, N] (int32, ...)"``).
    """
    check_bits(bits)
    qweight = as_array(qweight, f"{name}.qweight")
    qzeros = as_array(qzeros, f"{name}.qzeros")
    scales = as_array(scales, f"{name}.scales")
    for arr, what in ((qweight, "qweight"), (qzeros, "qzeros")):
        check_dtype(arr, f"{name}.{what}", "iu", "int32")
        if arr.dtype.itemsize != 4:
            raise ValueError(f"{name}.{what}: expected dtype int32, got {arr.dtype.name}")
    check_dtype(scales, f"{name}.scales", "f", "float16")
    check_2d(qweight, f"{name}.qweight", qweight_layout)
    check_2d(scales, f"{name}.scales", "[ceil(K / G), N]")
    return qweight, qzeros, scales


def unpack_words(words: np.ndarray, axis: int) -> np.ndarray:
    """Splits each 32-bit word into its 8 nibbles (nibble i = bits 4i..4i+3), expanded along ``axis``.

    A (..., M, ...) int32 array becomes (..., 8 M, ...) uint8 in [0, 15], word m giving elements
    8 m + i. The words are reinterpreted as uint32 first so the sign bit of int32 never smears.
    """
    w = np.moveaxis(words.astype(np.int32, copy=False).view(np.uint32), axis, -1)
    nibbles = (w[..., None] >> NIBBLE_SHIFTS) & 0xF  # (..., M, 8)
    nibbles = nibbles.reshape(*w.shape[:-1], w.shape[-1] * 8).astype(np.uint8)
    return np.moveaxis(nibbles, -1, axis)


def infer_group_size(k: int, num_groups: int, name: str) -> int | None:
    """The group size G (a power of two >= MIN_GROUP_SIZE) with ceil(K / G) == num_groups; None for one.

    A single group is per-column quantization (GPTQ ``group_size=-1``, or K <= G): nybble stores it as
    one scale row covering all of K, which dequantizes identically.
    """
    if num_groups == 1:
        return None
    g = MIN_GROUP_SIZE
    while g < k:
        if -(-k // g) == num_groups:
            return g
        g *= 2
    raise ValueError(
        f"{name}: {num_groups} scale rows for K={k} match no power-of-two group size >= {MIN_GROUP_SIZE} "
        "(nybble needs G in 16, 32, 64, 128, ...); pass group_size= explicitly if the checkpoint says so"
    )


def checked_group_size(k: int, num_groups: int, group_size: int | None, name: str) -> int | None:
    """``group_size`` as given (validated against the scale rows) or inferred; -1 means per column."""
    if group_size is None:
        return infer_group_size(k, num_groups, name)
    if group_size == -1 or (group_size >= k and num_groups == 1):
        if num_groups != 1:
            raise ValueError(f"{name}: per-column quantization needs 1 scale row, got {num_groups}")
        return None
    check_group_size(group_size)
    expected = -(-k // group_size)
    if num_groups != expected:
        raise ValueError(
            f"{name}: expected {expected} scale rows (ceil(K={k} / group_size={group_size})), "
            f"got {num_groups}"
        )
    return group_size


def build_weight(
    u: np.ndarray,
    zeros: np.ndarray,
    scales: np.ndarray,
    group_size: int | None,
    *,
    symmetric: bool | None,
    scale_dtype: Any = None,
    offset_dtype: Any = None,
    name: str = "weight",
) -> QuantizedWeight:
    """Unsigned codes ``u`` (K, N), zeros (groups, N) ints and scales (groups, N) -> ``QuantizedWeight``,
    packed in this machine's layout (``nybble.packing.default_layout()``).

    The source computes ``w = (u - z) * s`` in the scale dtype (one rounding of an exact product). nybble
    stores ``q = u - 8`` and computes ``q * scale + offset`` in float32, then casts:

    * symmetric (every zero is 8): ``offset`` is None and the scales keep the source dtype; ``q * s``
      is exact in float32 (4 + 11 or 8 mantissa bits), so the cast to the source dtype rounds the same
      exact product the source rounds: bit-exact.
    * asymmetric: ``offset = (8 - z) * s`` needs up to 3 more mantissa bits than a 16-bit float has, so
      scales and offsets are stored in float32. Both terms and their sum ``(u - z) * s`` are exact in
      float32 (|u - z| <= 15, 11-bit mantissa), so again the final cast is the source's one rounding.

    ``scale_dtype`` overrides the stored dtype (e.g. bfloat16 to save memory); that is no longer exact.
    ``offset_dtype`` (asymmetric only, e.g. float32): keep the scales in their source dtype and store only
    the offsets in ``offset_dtype``; still exact for 16-bit source scales (``q * s`` and ``(8 - z) * s``
    are both exact in float32), two bytes a group cheaper, and the scales keep the checkpoint's dtype.
    ``symmetric=None`` decides from the zeros; True with a zero other than 8 raises.
    """
    k, n = u.shape
    all_eight = bool(np.all(zeros == 8))
    if symmetric is None:
        symmetric = all_eight
    elif symmetric and not all_eight:
        bad = tuple(int(i) for i in np.argwhere(zeros != 8)[0])
        raise ValueError(
            f"{name}: sym=True but zero point at (group, n) = {bad} is {int(zeros[bad])}, not 8; "
            "pass sym=None (auto) or check the zero convention (v1 checkpoints store zero - 1)"
        )
    q = u.astype(np.int8) - np.int8(8)
    src_dtype = scales.dtype
    if symmetric:
        stored = np.dtype(scale_dtype) if scale_dtype is not None else src_dtype
        s, offsets = scales.astype(stored), None
    else:
        stored = np.dtype(scale_dtype) if scale_dtype is not None else np.dtype(np.float32)
        s64 = scales.astype(np.float64)
        off = (8.0 - zeros.astype(np.float64)) * s64  # exact in float64, and in float32 (see above)
        if offset_dtype is not None and scale_dtype is None:
            s, offsets = scales, off.astype(np.dtype(offset_dtype))
        else:
            s, offsets = s64.astype(stored), off.astype(stored)
    # packed once, in the layout of this machine's kernel
    return QuantizedWeight.from_codes(
        q, s, offsets, shape=(k, n), group_size=group_size, layout=default_layout()
    )


def natural_group_index(k: int, group_size: int | None) -> np.ndarray:
    """The natural group of each row of K: k // G (all zeros for per-column)."""
    if group_size is None:
        return np.zeros(k, np.int64)
    return np.arange(k) // group_size


def regroup_natural(
    g_idx: np.ndarray, k: int, group_size: int | None
) -> tuple[int | None, np.ndarray] | None:
    """An exact natural-order regrouping of an activation-order ``g_idx``, or None if there is none.

    Row k of K uses the parameters of group ``g_idx[k]``. When every run of G' consecutive rows (G' a
    power of two >= MIN_GROUP_SIZE, at most the checkpoint's own group) shares one ``g_idx`` value, the
    same weight is a plain natural-order weight at group size G' whose parameter row j is source row
    ``g_idx[j * G']``: returns ``(G', rows)`` for the largest such G'. None when rows are scattered finer
    than MIN_GROUP_SIZE (the usual GPTQ ``desc_act`` checkpoint): those need an input permutation.
    """
    g_idx = np.asarray(g_idx).astype(np.int64)
    if np.all(g_idx == natural_group_index(k, group_size)):
        return group_size, np.arange(-(-k // (group_size or k)))
    g = MIN_GROUP_SIZE
    while g * 2 <= min(k, group_size or k):
        g *= 2
    while g >= MIN_GROUP_SIZE:
        first = g_idx[(np.arange(k) // g) * g]
        if np.array_equal(first, g_idx):
            return g, g_idx[::g].copy()
        g //= 2
    return None
