"""The XLA path: the weight dequantized in the activation dtype, then one dot with f32 accumulation.

Each element is ``q * s + o`` computed in ``x.dtype`` (``nybble.quant.qweight.scale_codes``): for bf16 and
f16 activations the program holds no float32 copy of the weight, only the int4 codes and a 2-byte
operand that XLA may fuse into its GEMM (tests/test_api_traps.py reads the lowered program). Symmetric
groups give exactly ``nybble.dequantize(qw, x.dtype)``'s values; asymmetric ones round twice (multiply,
then add the offset), as the Mosaic kernel's exact-weights route does.

Two formulations of the same values, chosen by the platform the program is lowered for
(``jax.lax.platform_dependent``):

- CPU (``dot_kn``): the dot reads the weight as (K_pad, N_pad), N contiguous, the orientation XLA's CPU
  GEMM (YNNPACK) takes without repacking, and the codes are unpacked by broadcasts that keep N contiguous
  (``codes_kn``): the stored words are first rearranged so that a word holds K-neighbours of one column
  and columns follow each other (a permutation of whole words, an eighth of the weight's elements, kept
  out of the unpacking fusion by an optimization barrier), then each nibble plane is one shift pair over
  the whole array. XLA's CPU loop fusions vectorize that; a per-element gather of nibbles they do not.
- elsewhere (``dot_nk``): the dot contracts K where ``nk_int4`` stores it, axis 1 of (N_pad, K_pad) (the
  ``nybble.packing.nk_int4_as_int4`` view, or the layout's int8 codes turned K-minor), fused by XLA's GPU
  compiler into its dequantizing fusion.

On either, every layout gives the dot the same operand in the same orientation: the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nybble.packing import nk_int4_as_int4, pad_to
from nybble.quant.qweight import QuantizedWeight, scale_codes


def dequantized_operand(qw: QuantizedWeight, dtype: jnp.dtype) -> tuple[jax.Array, int]:
    """The padded weight in ``dtype`` as ``dot_nk`` reads it, and the axis that holds K (always 1)."""
    if qw.layout == "nk_int4":
        return scale_codes(nk_int4_as_int4(qw.codes), qw, k_axis=1, dtype=dtype), 1
    # The int8 codes turned K-minor like nk_int4's (the unpacking's own last transpose cancels), so both
    # layouts give the dot one operand orientation and the same summation order: the same bits.
    return scale_codes(qw.logical_codes().T, qw, k_axis=1, dtype=dtype), 1


def _sign_extended(words: jax.Array, shifts: np.ndarray, axes: tuple[int, ...]) -> jax.Array:
    """Nibbles of int32 ``words`` as int32 in [-8, 7]: ``shifts`` (bit offsets of the nibbles, laid along
    ``axes`` of the result) broadcast against ``words``; shifting the nibble to the top and back down
    arithmetically sign-extends it (two's complement nibbles)."""
    shape = [1] * (words.ndim + len(axes))
    for axis, size in zip(axes, shifts.shape, strict=True):
        shape[axis] = size
    w = jnp.expand_dims(words, axes)
    return (w << jnp.asarray((28 - shifts).astype(np.int32)).reshape(shape)) >> 28


def codes_kn(qw: QuantizedWeight) -> jax.Array:
    """The padded codes as int32 (K_pad, N_pad) in [-8, 7], unpacked with N contiguous (``dot_kn``)."""
    k_pad, n_pad = qw.padded_shape
    codes = qw.codes
    if qw.layout == "wgmma_int4":
        # Word (band b, chunk c, row r8, lane c4, half q) holds k = 64c + 32q + 8u + 2 c4 + e for
        # nibble u + 4e (nybble.packing.fragments): words to (c, q, c4, n), nibbles to (c, q, u, c4, e, n).
        bands = n_pad // 8
        words = codes.reshape(bands, k_pad // 64, 8, 4, 2).transpose(1, 4, 3, 0, 2)
        words = jax.lax.optimization_barrier(words.reshape(k_pad // 64, 2, 4, n_pad))
        shifts = 4 * (np.arange(4)[:, None] + 4 * np.arange(2)[None, :])  # (u, e): nibble u + 4e
        q = _sign_extended(jax.lax.bitcast_convert_type(words, jnp.int32), shifts, (2, 4))
        return q.reshape(k_pad, n_pad)
    if qw.layout == "nk_int4":
        # Byte (n, j) holds k = 2j (low nibble) and 2j + 1: bytes to (j, n), nibbles to (j, e, n).
        if codes.dtype == jnp.int4:
            codes = jax.lax.bitcast_convert_type(codes.reshape(n_pad, k_pad // 2, 2), jnp.uint8)
        words = jax.lax.optimization_barrier(codes.T.astype(jnp.int32))
        return _sign_extended(words, np.array([0, 4]), (1,)).reshape(k_pad, n_pad)
    return qw.logical_codes().astype(jnp.int32)


def dot_kn(x_pad: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """``x_pad @ w`` (f32) with the weight dequantized as (K_pad, N_pad): the CPU formulation."""
    w = scale_codes(codes_kn(qw), qw, k_axis=0, dtype=x_pad.dtype)
    dims = (((x_pad.ndim - 1,), (0,)), ((), ()))
    return jax.lax.dot_general(x_pad, w, dims, preferred_element_type=jnp.float32)


def dot_nk(x_pad: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """``x_pad @ w`` (f32) with the weight dequantized as (N_pad, K_pad): the formulation off the CPU."""
    w, k_axis = dequantized_operand(qw, x_pad.dtype)
    dims = (((x_pad.ndim - 1,), (k_axis,)), ((), ()))
    return jax.lax.dot_general(x_pad, w, dims, preferred_element_type=jnp.float32)


def dequantized_dot(x_pad: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """``x_pad (..., K_pad) @ dequantize(qw)`` in f32, (..., N_pad): ``dot_kn`` on a CPU, else ``dot_nk``."""
    return jax.lax.platform_dependent(x_pad, qw, cpu=dot_kn, default=dot_nk)


def xla_matmul(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """``x @ dequantize(qw)`` for ``x`` of shape (..., K): f32 accumulation, result in ``x.dtype``."""
    n = qw.shape[1]
    k_pad = qw.padded_shape[0]
    y = dequantized_dot(pad_to(x, (*x.shape[:-1], k_pad)), qw)
    return y[..., :n].astype(x.dtype)
