"""``w4a16``: check the operands against the config, then run the kernel variant the config names."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from nybble.kernels.mosaic_gpu.common import Problem, operand_views
from nybble.kernels.mosaic_gpu.config import TuningConfig, residual_reason, swiglu_reason
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
    sum_of_squares: jax.Array | None = None,
    norm: tuple[float, float] = (1.0, 1.0),
    residual: jax.Array | None = None,
    norm_weight: jax.Array | None = None,
) -> Any:
    """y = x @ dequant(W) with the Hopper W4A16 kernel ``config`` describes; with ``sum_of_squares``, the
    SwiGLU epilogue's y = silu(r (x @ W_gate)) * (r (x @ W_up)) of a gate/up weight
    (``nybble.packing.gate_up``), r = rsqrt(sum_of_squares / dim + eps) per row, ``norm`` = (dim, eps).

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
      sum_of_squares: None, or (m,) float32 (the SwiGLU epilogue; ``n`` then counts gate/up pairs: half of
        W's columns; ``config.swiglu_reason`` says which configs run it).
      norm: (dim, eps) of the epilogue's row scale.
      residual, norm_weight: None, or (m, n) in x's dtype and (n,) float (the residual epilogue,
        ``config.residual_reason``; residual.py): then two outputs, x = residual + y and h = x * w.

    Returns:
      (m, n) in x's dtype (under split-K the partials are summed in f32 inside the launch); with the
      residual epilogue the pair (x, h).
    """
    p = check_operands(
        x, codes, scales, offsets, n=n, group=group, config=config, m=m, sum_of_squares=sum_of_squares,
        norm=norm, residual=residual, norm_weight=norm_weight,
    )  # fmt: skip
    views = operand_views(p, x, codes, scales, offsets)
    if sum_of_squares is not None:
        views.append(sum_of_squares)
    if residual is not None:
        views += [residual, norm_weight.reshape(1, n)]
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
    sum_of_squares: Any = None,
    norm: tuple[float, float] = (1.0, 1.0),
    residual: Any = None,
    norm_weight: Any = None,
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
    swiglu = sum_of_squares is not None
    if swiglu:
        if (why := swiglu_reason(config)) is not None:
            raise ValueError(f"w4a16: {why}")
        if sum_of_squares.dtype != jnp.float32 or tuple(sum_of_squares.shape) != (m,):
            raise ValueError(
                f"w4a16: sum_of_squares must be float32 (m,) = ({m},), got {sum_of_squares.dtype} "
                f"{tuple(sum_of_squares.shape)}"
            )
    if not 0 < n * (2 if swiglu else 1) <= n_pad:
        raise ValueError(f"w4a16: n={n} {'pairs ' if swiglu else ''}must fit N_pad={n_pad}")
    if (residual is None) != (norm_weight is None):
        raise ValueError("w4a16: the residual epilogue takes both residual and norm_weight")
    weight_dtype = None
    if residual is not None:
        if swiglu:
            raise ValueError("w4a16: one epilogue at a time: SwiGLU (sum_of_squares) or residual")
        if (why := residual_reason(config)) is not None:
            raise ValueError(f"w4a16: {why}")
        if residual.dtype != x.dtype or tuple(residual.shape) != (m, n):
            raise ValueError(
                f"w4a16: residual must be {x.dtype} (m, n) = ({m}, {n}), got {residual.dtype} "
                f"{tuple(residual.shape)}"
            )
        weight_dtype = jnp.dtype(norm_weight.dtype)
        if tuple(norm_weight.shape) != (n,) or weight_dtype not in NORM_WEIGHT_DTYPES:
            raise ValueError(
                f"w4a16: norm_weight must be (n,) = ({n},) bf16, f16 or f32, got {weight_dtype} "
                f"{tuple(norm_weight.shape)}"
            )
    config.check_problem(x_rows, n_pad, k_pad, group)
    norm = (float(norm[0]), float(norm[1]))
    return Problem(
        m, n, n_pad, k_pad, group, x.dtype, offsets is not None, config, x_rows, swiglu, norm,
        residual is not None, weight_dtype,
    )  # fmt: skip


# The dtypes of a norm weight the residual epilogue reads (and widens to f32 itself).
NORM_WEIGHT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
