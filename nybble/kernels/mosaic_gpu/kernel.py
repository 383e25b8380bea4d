"""``w4a16_padded``: check padded operands, then run the kernel variant the config names."""

from __future__ import annotations

import jax

from nybble.kernels.mosaic_gpu.common import check_operands
from nybble.kernels.mosaic_gpu.config import TuningConfig
from nybble.kernels.mosaic_gpu.w4a16 import w4a16_single_wg
from nybble.kernels.mosaic_gpu.w4a16_ws import w4a16_warp_specialized


def w4a16_padded(
    x_pad: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    *,
    group: int,
    config: TuningConfig,
) -> jax.Array:
    """y = x @ dequant(W) on padded operands, with the Hopper W4A16 kernel ``config`` describes.

    Args:
      x_pad: (M_pad, K_pad) bf16 or f16 activations, M_pad a multiple of ``config.tile_m``. With
        ``config.codes_as == "uint8"`` each 64-wide K chunk must be de-interleaved (even K, then odd K:
        :func:`deinterleave_k`).
      codes: W^T, K-major: (N_pad, K_pad) ``jnp.int4`` for ``codes_as="int4"``, the stored (N_pad,
        K_pad // 2) ``nk_int4`` bytes for ``codes_as="uint8"``.
      scales: (ceil(K_pad / group), N_pad) group scales; ``offsets``: None or the same shape.
      group: rows of K sharing one scale (K_pad for per-column quantization).
      config: the tiling; ``config.compute_wgs`` picks the variant (1: w4a16.py, 2: w4a16_ws.py).

    Returns:
      (M_pad, N_pad) in x's dtype when ``config.split_k == 1``, else the (split_k, M_pad, N_pad) float32
      partial sums (the caller adds them).
    """
    problem = check_operands(x_pad, codes, scales, offsets, group, config)
    run = w4a16_single_wg if config.compute_wgs == 1 else w4a16_warp_specialized
    return run(problem, x_pad, codes, scales, offsets)


def deinterleave_k(x: jax.Array) -> jax.Array:
    """(M, K) with K % 64 == 0 -> the same columns, each 64-chunk reordered even K first, then odd K.

    The ``codes_as="uint8"`` kernel splits every code byte into its even-K (low nibble) and odd-K (high
    nibble) halves; this puts x's columns in the same order. XLA fuses it into the padding copy.
    """
    m, k = x.shape
    return x.reshape(m, k // 64, 32, 2).swapaxes(2, 3).reshape(m, k)
