"""The XLA path: the weight dequantized in the activation dtype, then one dot with f32 accumulation.

Each element is ``q * s + o`` computed in ``x.dtype`` (``nybble.quant.qweight.scale_codes``): for bf16 and
f16 activations the program holds no float32 copy of the weight, only the int4 codes and a 2-byte
operand that XLA may fuse into its GEMM (tests/test_api_traps.py reads the lowered program). Symmetric
groups give exactly ``nybble.dequantize(qw, x.dtype)``'s values; asymmetric ones round twice (multiply,
then add the offset), as the Mosaic kernel's exact-weights route does. The dot contracts K where the
layout stores it, axis 1 of (N_pad, K_pad): the ``nk_int4`` view (``nybble.packing.nk_int4_as_int4``) or
``wgmma_int4``'s int8 codes, so no float value is transposed. (XLA's CPU backend then upcasts a bf16
dot's operands to f32 on its own; GPUs multiply bf16.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nybble.packing import nk_int4_as_int4, pad_to
from nybble.quant.qweight import QuantizedWeight, scale_codes


def dequantized_operand(qw: QuantizedWeight, dtype: jnp.dtype) -> tuple[jax.Array, int]:
    """The padded weight in ``dtype`` as the dot reads it, and the axis that holds K (0 or 1)."""
    if qw.layout == "nk_int4":
        return scale_codes(nk_int4_as_int4(qw.codes), qw, k_axis=1, dtype=dtype), 1
    # The int8 codes turned K-minor like nk_int4's (the unpacking's own last transpose cancels), so both
    # layouts give the dot one operand orientation and the same summation order: the same bits.
    return scale_codes(qw.logical_codes().T, qw, k_axis=1, dtype=dtype), 1


def xla_matmul(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """``x @ dequantize(qw)`` for ``x`` of shape (..., K): f32 accumulation, result in ``x.dtype``."""
    n = qw.shape[1]
    k_pad = qw.padded_shape[0]
    x_pad = pad_to(x, (*x.shape[:-1], k_pad))
    w, k_axis = dequantized_operand(qw, x.dtype)
    y = jax.lax.dot_general(
        x_pad,
        w,
        dimension_numbers=(((x.ndim - 1,), (k_axis,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return y[..., :n].astype(x.dtype)
