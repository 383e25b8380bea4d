"""The float64 reference of ``nybble.ragged_matmul``: each expert's weight from the dense op's reference
(numpy alone, sharing no code with the implementations), multiplied row group by row group on the host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nybble.kernels.ops.matmul.reference import reference_dequantize
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.stacked import unstack_weight


def reference_ragged_matmul(
    x: Any, qw: QuantizedWeight, group_sizes: Sequence[int] | Any, *, weight_dtype: Any = None
) -> np.ndarray:
    """``ragged_dot(x, W, group_sizes)`` in float64 for x (rows, K) and a stacked ``qw``: row r times the
    weight of the expert whose group holds it, zero past the groups' sum. ``weight_dtype`` rounds each
    weight once to that dtype, as :func:`~nybble.kernels.ops.matmul.reference.reference_dequantize` does.
    Sizes must be concrete, none negative, summing to at most the rows."""
    x = np.asarray(x, np.float64)
    sizes = np.asarray(group_sizes, np.int64)
    if (sizes < 0).any() or sizes.sum() > x.shape[0]:
        raise ValueError(
            f"reference_ragged_matmul: group sizes {sizes.tolist()} must be >= 0 and sum to <= {x.shape[0]}"
        )
    y = np.zeros((x.shape[0], qw.shape[1]))
    start = 0
    for e, size in enumerate(sizes.tolist()):
        if size:
            w = reference_dequantize(unstack_weight(qw, e), weight_dtype)
            y[start : start + size] = x[start : start + size] @ w
        start += size
    return y


__all__ = ["reference_ragged_matmul"]
