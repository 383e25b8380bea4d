"""Import a qwix ``QArray`` (google/qwix, ``qwix._src.core.qarray``): exact for 16-bit scales.

A QArray of a Flax kernel (K, N) = (in_features, out_features) has ``qvalue`` (K, N) of logical type
``jnp.int4`` (signed, [-8, 7]), ``scale`` and ``zero_point`` (None when symmetric) of the same rank whose
shape divides (K, N) ("generic broadcast": scale (K / G, N) is subchannel quantization with tiles of G
rows), and ``zero_point`` of the qvalue's dtype. qwix's ``dequantize`` computes, in the scale dtype::

    w = (qvalue.astype(scale.dtype) - zero_point.astype(scale.dtype)) * broadcast(scale)

qwix is not a dependency: any object with ``qvalue``, ``scale`` and ``zero_point`` attributes (and
optionally ``qtype``) is accepted, numpy or jax arrays alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nybble.packing import check_group_size
from nybble.quant.formats._common import as_array, build_weight, check_dtype
from nybble.quant.qweight import QuantizedWeight


def from_qwix(qarray: Any, *, scale_dtype: Any = None, name: str = "qarray") -> QuantizedWeight:
    """A 2-D int4 qwix ``QArray`` (K, N) -> ``QuantizedWeight``.

    Exactness: ``nybble.dequantize(qw, scale.dtype)`` equals ``qwix.dequantize(qarray)`` bit for bit
    when the scales are bfloat16 or float16 (symmetric or not) and for symmetric float32 scales.
    Asymmetric float32 scales round twice in nybble (``q * s`` and ``+ offset``) against once in qwix:
    within one float32 ulp. Symmetric arrays keep the scale dtype; asymmetric ones store float32 scales
    and offsets ``-zero_point * scale`` (exact).

    The scale may be per column ((1, N)), per group of G rows ((K / G, N), G a power of two >= 16) or
    coarser along N ((·, N / t): repeated). Per-row scales ((K, ·), tiles of 1 row of K) have no nybble
    form and raise, as do qtypes other than int4/uint4.
    """
    for attr in ("qvalue", "scale", "zero_point"):
        if not hasattr(qarray, attr):
            raise ValueError(
                f"{name}: expected a qwix QArray-like object with qvalue, scale and zero_point "
                f"attributes; {type(qarray).__name__} has no {attr!r}"
            )
    qtype = getattr(qarray, "qtype", None)
    raw = qarray.qvalue
    logical = np.dtype(qtype if qtype is not None else raw.dtype).name
    if logical not in ("int4", "uint4"):
        raise ValueError(
            f"{name}.qtype: nybble imports 4-bit integer QArrays (jnp.int4 or jnp.uint4), got {logical}"
        )
    qvalue = as_array(raw, f"{name}.qvalue").astype(np.int32)
    if qvalue.ndim != 2:
        raise ValueError(
            f"{name}.qvalue: expected a 2-D (K, N) kernel, got shape {tuple(qvalue.shape)}; "
            "reshape stacked kernels to 2-D first"
        )
    lo, hi = (-8, 7) if logical == "int4" else (0, 15)
    if qvalue.min(initial=lo) < lo or qvalue.max(initial=hi) > hi:
        raise ValueError(f"{name}.qvalue: values outside the {logical} range [{lo}, {hi}]")
    k, n = qvalue.shape
    scale = as_array(qarray.scale, f"{name}.scale")
    check_dtype(scale, f"{name}.scale", "f", "a float (bfloat16/float16/float32)")
    scale = _broadcast_params(scale, k, n, f"{name}.scale")
    if qarray.zero_point is None:
        zp = np.zeros((1, 1), np.int32)
    else:
        zp = as_array(qarray.zero_point, f"{name}.zero_point").astype(np.int32)
    zp = _broadcast_params(zp, k, n, f"{name}.zero_point")
    # Bring scale and zero point to the same (finer) group grid.
    rows = max(scale.shape[0], zp.shape[0])
    for arr, what in ((scale, "scale"), (zp, "zero_point")):
        if rows % arr.shape[0]:
            raise ValueError(f"{name}: scale and zero_point tiles along K do not nest ({what})")
    scale = np.repeat(scale, rows // scale.shape[0], axis=0)
    zp = np.repeat(zp, rows // zp.shape[0], axis=0)
    group_size = None if rows == 1 else k // rows
    if group_size is not None:
        try:
            check_group_size(group_size)
        except ValueError:
            raise ValueError(
                f"{name}.scale: tiles of {group_size} row(s) of K are not a nybble group size "
                "(None or a power of two >= 16)"
            ) from None
    # Unsigned form for the shared builder: u - z == qvalue - zero_point.
    shift = 8 if logical == "int4" else 0
    u = (qvalue + shift).astype(np.uint8)
    zeros = zp + shift
    if zeros.min() < 0 or zeros.max() > 15:
        raise ValueError(f"{name}.zero_point: values outside the {logical} range [{lo}, {hi}]")
    return build_weight(u, zeros, scale, group_size, symmetric=None, scale_dtype=scale_dtype, name=name)


def _broadcast_params(p: np.ndarray, k: int, n: int, name: str) -> np.ndarray:
    """A (a, b) per-tile parameter with a | K and b | N -> (a, N): columns repeated to full width."""
    if p.ndim != 2:
        raise ValueError(f"{name}: expected rank 2 like qvalue ({k}, {n}), got shape {tuple(p.shape)}")
    a, b = p.shape
    if a == 0 or b == 0 or k % a or n % b:
        raise ValueError(f"{name}: shape {tuple(p.shape)} must divide qvalue's shape ({k}, {n})")
    return np.repeat(p, n // b, axis=1)
