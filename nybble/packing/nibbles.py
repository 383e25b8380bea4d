"""Two int4 values per byte, in XLA's and ml_dtypes' own memory order.

Element ``2i`` of the packed axis goes to the LOW nibble of byte ``i`` and element ``2i + 1`` to the HIGH
nibble, so a packed ``uint8`` array of shape ``(..., n // 2)`` is byte-for-byte the memory of a ``jnp.int4``
array of shape ``(..., n)``. An odd length is padded with one zero nibble. Signed values are stored as
two's-complement nibbles (-1 -> 0xF), unsigned values as plain nibbles.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ArrayLike = Any  # numpy or jax array


def _namespace(x: ArrayLike):
    """numpy for numpy inputs, jax.numpy for jax arrays and tracers: the result is of the input's kind."""
    return np if isinstance(x, np.ndarray | np.generic) else jnp


def _is_concrete(x: ArrayLike) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _normalize_axis(axis: int, ndim: int, what: str) -> int:
    try:
        axis = operator.index(axis)
    except TypeError:
        raise ValueError(f"{what}: axis must be an integer, got {axis!r}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}: axis {axis} is out of bounds for an array of {ndim} dimension(s)")
    return axis % ndim


def _check_range(values: ArrayLike, signed: bool) -> None:
    lo, hi = (-8, 7) if signed else (0, 15)
    v = np.asarray(values)
    if v.size == 0 or (v.min() >= lo and v.max() <= hi):  # the fast path: two reductions
        return
    bad = (v < lo) | (v > hi)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        kind = "signed" if signed else "unsigned"
        raise ValueError(
            f"pack_int4: {int(bad.sum())} value(s) outside the {kind} int4 range [{lo}, {hi}]; "
            f"first at index {where}: {v[where]}. Use signed={not signed} if the codes are "
            f"{'unsigned' if signed else 'signed'}, or clip/quantize them first."
        )


def pack_int4(values: ArrayLike, *, axis: int = -1, signed: bool = True) -> ArrayLike:
    """Packs integer values in [-8, 7] (``signed=False``: [0, 15]) two per byte along ``axis``.

    Args:
      values: integer numpy or jax array.
      axis: the axis to pack; its length ``n`` becomes ``ceil(n / 2)`` (an odd ``n`` gets one zero nibble).
      signed: whether the values are two's-complement int4 codes or unsigned nibbles.

    Returns:
      A ``uint8`` array of the input's kind (numpy in, numpy out; jax in, jax out). Works under ``jit``
      (the value-range check then cannot run and out-of-range values are truncated to their low nibble).

    Raises:
      ValueError: a non-integer dtype, an axis out of bounds, or (for concrete inputs) values out of range.
    """
    xp = _namespace(values)
    dtype = np.dtype(values.dtype)
    if dtype.kind not in "iu" and dtype.name not in ("int4", "uint4"):
        raise ValueError(f"pack_int4: values must have an integer dtype, got {dtype.name}")
    if values.ndim == 0:
        raise ValueError("pack_int4: values must have at least one dimension, got a scalar")
    axis = _normalize_axis(axis, values.ndim, "pack_int4")
    if _is_concrete(values):
        _check_range(values, signed)
    # uint8 all the way: the cast wraps two's complement (-1 -> 0xFF), the mask keeps its low nibble.
    v = xp.moveaxis(values, axis, -1).astype(xp.uint8) & 0xF
    if v.shape[-1] % 2:
        v = xp.concatenate([v, xp.zeros((*v.shape[:-1], 1), v.dtype)], axis=-1)
    packed = v[..., 0::2] | (v[..., 1::2] << 4)
    return xp.moveaxis(packed, -1, axis)


def unpack_int4(packed: ArrayLike, length: int, *, axis: int = -1, signed: bool = True) -> ArrayLike:
    """Exact inverse of :func:`pack_int4`: ``uint8`` bytes back to ``length`` int8 values along ``axis``.

    Raises:
      ValueError: ``packed`` is not uint8, the axis is out of bounds, or ``length`` does not fit
        the packed size (``ceil(length / 2)`` must equal ``packed.shape[axis]``).
    """
    xp = _namespace(packed)
    dtype = np.dtype(packed.dtype)
    if dtype != np.uint8:
        raise ValueError(f"unpack_int4: packed must be uint8 (as pack_int4 returns), got {dtype.name}")
    if packed.ndim == 0:
        raise ValueError("unpack_int4: packed must have at least one dimension, got a scalar")
    axis = _normalize_axis(axis, packed.ndim, "unpack_int4")
    length = operator.index(length)
    n_bytes = packed.shape[axis]
    if length < 0 or (length + 1) // 2 != n_bytes:
        raise ValueError(
            f"unpack_int4: length {length} does not fit {n_bytes} packed byte(s) on axis {axis} "
            f"(rule: ceil(length / 2) == {n_bytes}, so length must be {2 * n_bytes - 1} or {2 * n_bytes})"
        )
    p = xp.moveaxis(packed, axis, -1)
    lo, hi = p & 0xF, p >> 4
    if signed:  # sign-extend a nibble in int8: 0..7 stay, 8..15 become -8..-1
        lo, hi = (lo.astype(xp.int8) ^ 8) - 8, (hi.astype(xp.int8) ^ 8) - 8
    else:
        lo, hi = lo.astype(xp.int8), hi.astype(xp.int8)
    if xp is np:  # interleave into a preallocated array: no stacked temporary
        values = np.empty((*p.shape[:-1], 2 * n_bytes), np.int8)
        values[..., 0::2], values[..., 1::2] = lo, hi
    else:
        values = xp.stack([lo, hi], axis=-1).reshape(*p.shape[:-1], 2 * n_bytes)
    return xp.moveaxis(values[..., :length], -1, axis)
