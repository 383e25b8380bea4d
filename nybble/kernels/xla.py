"""The XLA path: dequantize and dot, written so XLA can fuse the int4 upcast into its GEMM on GPU.

The ``nk_int4`` codes are viewed as a ``jnp.int4`` (N_pad, K_pad) array (``nybble.packing.nk_int4_as_int4``,
whose docstring says what XLA compiles that view to), upcast, scaled per group with one multiply-add,
rounded to the activation dtype and contracted over K.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nybble.packing import nk_int4_as_int4, pad_to
from nybble.quant.qweight import QuantizedWeight, dequantize, scale_codes


def dequantize_nk(qw: QuantizedWeight, dtype: jnp.dtype) -> jax.Array:
    """The padded dequantized weight transposed, (N_pad, K_pad), in ``dtype`` (math in float32)."""
    if qw.layout != "nk_int4":
        return dequantize(qw, jnp.float32, padded=True).T.astype(dtype)
    return scale_codes(nk_int4_as_int4(qw.codes), qw, k_axis=1).astype(dtype)


def xla_matmul(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """``x @ dequantize(qw)`` for ``x`` of shape (..., K): f32 accumulation, result in ``x.dtype``."""
    n = qw.shape[1]
    k_pad = qw.padded_shape[0]
    x_pad = pad_to(x, (*x.shape[:-1], k_pad))
    w_nk = dequantize_nk(qw, x.dtype)
    y = jax.lax.dot_general(
        x_pad,
        w_nk,
        dimension_numbers=(((x.ndim - 1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return y[..., :n].astype(x.dtype)
