"""``w4a16``: check the operands against the config, then run the kernel variant the config names."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from nybble.kernels.mosaic_gpu.common import Problem, operand_views
from nybble.kernels.mosaic_gpu.config import TuningConfig
from nybble.kernels.mosaic_gpu.w4a16 import w4a16_single_wg
from nybble.kernels.mosaic_gpu.w4a16_ws import w4a16_warp_specialized
from nybble.packing.groups import num_groups


def w4a16(
    x: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    *,
    n: int,
    group: int,
    config: TuningConfig,
    m: int | None = None,
) -> jax.Array:
    """y = x @ dequant(W) with the Hopper W4A16 kernel ``config`` describes.

    Args:
      x: (M', K_pad) bf16 or f16 activations (the wrapper pads K only when it must, and M only where
        ``config.x_rows`` says; the zero rows past ``m`` are read, never stored).
      codes: ``wgmma_int4`` words, uint32 (N_pad / 8, K_pad).
      scales: (ceil(K_pad / group), N_pad) group scales; ``offsets``: None or the same shape.
      n: columns of y to store (N, or N_pad).
      group: rows of K sharing one scale (K_pad for per-column quantization).
      config: the tiling; ``config.compute_wgs`` picks the variant (1: w4a16.py, with a producer
        warpgroup when ``config.producer``; 2: w4a16_ws.py).
      m: rows of y (the first ``m`` of x); None: all of x's.

    Returns:
      (m, n) in x's dtype (under split-K the partials are summed in f32 inside the launch).
    """
    p = check_operands(x, codes, scales, offsets, n=n, group=group, config=config, m=m)
    views = operand_views(p, x, codes, scales, offsets)
    run = w4a16_single_wg if config.compute_wgs == 1 else w4a16_warp_specialized
    return run(p, views)


def check_operands(
    x: Any,
    codes: Any,
    scales: Any,
    offsets: Any,
    *,
    n: int,
    group: int,
    config: TuningConfig,
    m: int | None = None,
) -> Problem:
    """Validates operands against each other and the config; returns the problem's static facts."""
    x_rows, k_pad = x.shape
    m = x_rows if m is None else m
    if not 0 < m <= x_rows:
        raise ValueError(f"w4a16: m={m} rows of y must be in (0, rows of x = {x_rows}]")
    bands = codes.shape[0]
    n_pad = 8 * bands
    if codes.dtype != jnp.uint32 or tuple(codes.shape) != (bands, k_pad):
        raise ValueError(
            f"w4a16: codes must be wgmma_int4 words uint32 (N_pad / 8, K_pad) = (*, {k_pad}) for x of shape "
            f"{x.shape}, got {codes.dtype} {tuple(codes.shape)}"
        )
    groups = num_groups(k_pad, group)  # the last group may be partial
    if scales.shape != (groups, n_pad):
        raise ValueError(
            f"w4a16: scales have shape {scales.shape}, expected (ceil(K_pad / G), N_pad) = "
            f"({groups}, {n_pad})"
        )
    if offsets is not None and offsets.shape != scales.shape:
        raise ValueError(f"w4a16: offsets shape {offsets.shape} != scales shape {scales.shape}")
    if not 0 < n <= n_pad:
        raise ValueError(f"w4a16: n={n} must be in (0, N_pad={n_pad}]")
    config.check_problem(x_rows, n_pad, k_pad, group)
    return Problem(m, n, n_pad, k_pad, group, x.dtype, offsets is not None, config, x_rows)
