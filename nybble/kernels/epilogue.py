"""The arithmetic of nybble's matmul epilogues, one definition for the kernels' interpret paths, their
references and the XLA paths (the kernels' GPU code computes the same in MLIR: ``dequant_registers``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from nybble.packing.gate_up import split_gate_up


def norm_scale(sum_of_squares: Any, dim: float, eps: float) -> Any:
    """rsqrt(s / dim + eps) in f32: an RMSNorm's row scale from its sum of squares."""
    return jax.lax.rsqrt(sum_of_squares / jnp.float32(dim) + jnp.float32(eps))


def silu_product(gate: Any, up: Any, row_scale: Any) -> Any:
    """``silu(r g) * (r u)`` in f32, silu(z) = z / (1 + exp(-z)): the SwiGLU epilogue's product."""
    z = gate * row_scale
    return z / (1.0 + jnp.exp(-z)) * (up * row_scale)


def swiglu(y: Any, sum_of_squares: Any, norm: tuple[float, float]) -> Any:
    """The SwiGLU epilogue of y (rows, 2 n) f32, gate and up interleaved (``nybble.packing.gate_up``):
    (rows, n) ``silu(r g) * (r u)``, r = :func:`norm_scale` of each row's ``sum_of_squares`` ((rows,) f32)
    with ``norm`` = (dim, eps), or 1 where it is None."""
    gate, up = split_gate_up(y)
    r = 1.0 if sum_of_squares is None else norm_scale(sum_of_squares[:, None], *norm)
    return silu_product(gate, up, r)


def residual_norm(y: Any, residual: Any, norm_weight: Any, dtype: Any) -> tuple[Any, Any]:
    """The residual epilogue of y (rows, n) f32: ``(x, h)`` in ``dtype``, x = residual + y and h = x * w,
    rounded where a model's unfused step rounds them (y to ``dtype`` as the projection returns it, the sum
    to ``dtype`` as the residual stream holds it, the product to ``dtype`` as ``RMSNorm.deferred_sum``
    returns the next norm's input), each sum and product in f32. ``residual`` (rows, n) and ``norm_weight``
    (n,) or (1, n) in any float dtype."""
    y = y.astype(dtype).astype(jnp.float32)
    x = (residual.astype(jnp.float32) + y).astype(dtype)
    h = (x.astype(jnp.float32) * jnp.reshape(norm_weight, (1, -1)).astype(jnp.float32)).astype(dtype)
    return x, h


__all__ = ["norm_scale", "residual_norm", "silu_product", "swiglu"]
