"""The one reference every test and benchmark compares against: float64 on the host."""

from __future__ import annotations

from typing import Any

import numpy as np

from nybble.quant.qweight import QuantizedWeight, dequantize


def reference_matmul(x: Any, qw: QuantizedWeight) -> np.ndarray:
    """``x @ dequantize(qw)`` in float64 with numpy, for ``x`` of shape (..., K). Returns float64."""
    w = np.asarray(dequantize(qw, np.float32), dtype=np.float64)
    return np.asarray(x, dtype=np.float64) @ w


def relative_error(out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere gives inf so it never passes a tolerance."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"relative_error: shapes differ, {out.shape} vs {ref.shape}")
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
