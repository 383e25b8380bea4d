"""The one reference every test and the benchmark's correctness gate compare against: float64 on the host.

Dequantization here is computed from the stored codes, scales and offsets with numpy alone: it shares no
code with ``nybble.dequantize``, the XLA path or the kernels (codes are located in the ``wgmma_int4`` words
or ``nk_int4`` bytes by the layouts' formulas, groups are indexed row by row), so a bug in any of those
cannot hide in the reference.

``reference_matmul(x, qw)`` is the exact product. ``weight_dtype`` rounds each weight once to that dtype
(what the XLA path does before its exact products), and :func:`rounding_bound` bounds what a float32
accumulation and the final rounding may add, element by element; ``terms`` widens the accumulation
allowance for computations that sum larger terms than ``x_k w_k`` (the kernel's accumulator route sums
``x_k (136 + q_k)``: tests/kernel_checks.py models each kernel route on top of this module).
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from nybble.quant.qweight import QuantizedWeight

# The float32 accumulation error allowed per output element, in units of 2^-24 * sqrt(K) * sum_k |x_k w_k|:
# the probabilistic bound of a K-term float32 sum (Higham & Mary, 2019) with a safety factor of 4, wide
# enough for tensor-core accumulation (truncating adds, split-K partials) and a fused multiply-add in the
# dequantization where the reference rounds once. Far below one output ulp for bf16/f16 outputs.
ACCUMULATION_FACTOR = 4.0


def reference_codes(qw: QuantizedWeight) -> np.ndarray:
    """The signed int4 codes of ``qw`` as an int8 (K_pad, N_pad) array, decoded from the stored words.

    ``wgmma_int4`` (uint32 (N_pad / 8, K_pad)): code (k, n) is nibble u + 4e of word 64c + 2l + q of band
    b, for n = 8b + r8, k = 64c + 32q + 8u + 2 c4 + e and l = 4 r8 + c4 (nybble.packing.fragments). Each
    (k, n) is located by that formula here, not by the layout's own unpacking.
    ``planes_int4`` (uint32 (K_pad / 8, N_pad)): code (k, n) is nibble k // P of word (k % P, n) minus 8,
    P = K_pad / 8 (offset binary); ``planes_nk_int4`` (uint32 (N_pad, K_pad / 8)): of word (n, k % P).
    ``nk_int4`` stores W^T K-major: byte (n, j) holds k = 2j in its low nibble and k = 2j + 1 in its high
    nibble. Codes already held as ``jnp.int4`` (N_pad, K_pad) are taken as they are. Nibbles are two's
    complement (8..15 is -8..-1).
    """
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"reference_codes expects a QuantizedWeight, got {type(qw).__name__}")
    codes = np.asarray(qw.codes)
    if qw.layout == "wgmma_int4":
        if codes.dtype != np.uint32:
            raise ValueError(f"wgmma_int4 codes must be uint32, got {codes.dtype}")
        k_pad, n_pad = codes.shape[1], 8 * codes.shape[0]
        k = np.arange(k_pad)[:, None]
        n = np.arange(n_pad)[None, :]
        kk = k % 64
        q, u, c4, e = kk // 32, (kk % 32) // 8, (kk % 8) // 2, kk % 2
        word = codes[n // 8, 64 * (k // 64) + 2 * (4 * (n % 8) + c4) + q].astype(np.int64)
        nibbles = (word >> (4 * (u + 4 * e))) & 0xF
        return np.where(nibbles >= 8, nibbles - 16, nibbles).astype(np.int8)
    if qw.layout in ("planes_int4", "planes_nk_int4"):
        if codes.dtype != np.uint32:
            raise ValueError(f"{qw.layout} codes must be uint32, got {codes.dtype}")
        n_major = qw.layout == "planes_nk_int4"
        n_pad, plane_rows = codes.shape if n_major else codes.shape[::-1]
        k = np.arange(8 * plane_rows)[:, None]
        n = np.arange(n_pad)[None, :]
        word = (codes[n, k % plane_rows] if n_major else codes[k % plane_rows, n]).astype(np.int64)
        return (((word >> (4 * (k // plane_rows))) & 0xF) - 8).astype(np.int8)
    if qw.layout != "nk_int4":
        raise ValueError(
            "the reference decodes the 'wgmma_int4', 'planes_int4', 'planes_nk_int4' and 'nk_int4' layouts, "
            f"got {qw.layout!r}"
        )
    if codes.dtype == np.uint8:
        nibbles = np.empty((codes.shape[0], 2 * codes.shape[1]), np.int16)
        nibbles[:, 0::2] = codes % 16
        nibbles[:, 1::2] = codes // 16
        q_nk = np.where(nibbles >= 8, nibbles - 16, nibbles)
    elif codes.dtype == np.dtype(ml_dtypes.int4):
        q_nk = codes.astype(np.int16)
    else:
        raise ValueError(f"codes must be uint8 (packed nk_int4) or int4, got {codes.dtype}")
    return q_nk.T.astype(np.int8)


def reference_dequantize(
    qw: QuantizedWeight, weight_dtype: Any = None, *, padded: bool = False
) -> np.ndarray:
    """``w[k, n] = q[k, n] * scales[k // G, n] + offsets[k // G, n]`` in float64, shape (K, N).

    G is the group size (K_pad for per-column weights); the last group may be partial. ``weight_dtype``
    (e.g. the activation dtype) rounds each weight once to that dtype, as every implementation does
    before multiplying: the exact value is rounded to float32 first (the float32 multiply-add of the
    implementations, fused or not: the product of a code and a bf16/f16 scale is exact in float32), then
    to ``weight_dtype``. ``padded=True`` returns all (K_pad, N_pad).
    """
    q = reference_codes(qw).astype(np.float64)
    k_pad, n_pad = q.shape
    group = k_pad if qw.group_size is None else qw.group_size
    rows = np.arange(k_pad) // group  # the scale row of each k
    scales = np.asarray(qw.scales, np.float64)
    if scales.shape != (rows[-1] + 1, n_pad):
        raise ValueError(f"scales have shape {scales.shape}, expected {(rows[-1] + 1, n_pad)} for G={group}")
    w = q * scales[rows]
    if qw.offsets is not None:
        w = w + np.asarray(qw.offsets, np.float64)[rows]
    if weight_dtype is not None:
        w = w.astype(np.float32).astype(np.dtype(weight_dtype)).astype(np.float64)
    if padded:
        return w
    k, n = qw.shape
    return w[:k, :n]


def reference_matmul(x: Any, qw: QuantizedWeight, *, weight_dtype: Any = None) -> np.ndarray:
    """``x @ W`` in float64 for ``x`` of shape (..., K), W from :func:`reference_dequantize` (rounded to
    ``weight_dtype`` when given: pass ``x.dtype`` to get what an implementation computes before its
    float32 accumulation error and final rounding). Returns float64 (..., N)."""
    return np.asarray(x, np.float64) @ reference_dequantize(qw, weight_dtype)


def unit_roundoff(dtype: Any) -> float:
    """Half an ulp at 1.0: the largest relative error of one round-to-nearest to ``dtype``."""
    return 2.0 ** -(jnp.finfo(dtype).nmant + 1)


def rounding_bound(
    x: Any, w: np.ndarray, out_dtype: Any, *, terms: np.ndarray | None = None
) -> np.ndarray:
    """Elementwise bound on ``|y - x @ w|`` for a ``y`` computed from exact products, float32 accumulation
    and one rounding to ``out_dtype``; ``w`` is the float64 weight multiplied (already rounded).

    Half an ulp of the output (relative ``unit_roundoff(out_dtype)``, or half the smallest subnormal near
    zero) plus the float32 accumulation allowance (``ACCUMULATION_FACTOR``), itself rounded. ``terms``
    (K, N), default ``|w|``: the magnitude of what is summed per (k, n), when larger than ``|w|``.
    """
    x = np.asarray(x, np.float64)
    ref = x @ w
    k = x.shape[-1]
    summed = np.abs(x) @ (np.abs(w) if terms is None else terms)
    accumulation = ACCUMULATION_FACTOR * math.sqrt(max(k, 1)) * 2.0**-24 * summed
    u = unit_roundoff(out_dtype)
    tiny = float(jnp.finfo(out_dtype).smallest_subnormal) / 2
    return u * (np.abs(ref) + accumulation) + accumulation + tiny


def relative_error(out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere gives inf so it never passes a tolerance."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"relative_error: shapes differ, {out.shape} vs {ref.shape}")
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
