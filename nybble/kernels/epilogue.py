"""The arithmetic of nybble's matmul epilogues, one definition for the kernels' interpret paths, their
references and the XLA paths (the kernels' GPU code computes the same in MLIR: ``dequant_registers``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def norm_scale(sum_of_squares: Any, dim: float, eps: float) -> Any:
    """rsqrt(s / dim + eps) in f32: an RMSNorm's row scale from its sum of squares."""
    return jax.lax.rsqrt(sum_of_squares / jnp.float32(dim) + jnp.float32(eps))


def silu_product(gate: Any, up: Any, row_scale: Any) -> Any:
    """``silu(r g) * (r u)`` in f32, silu(z) = z / (1 + exp(-z)): the SwiGLU epilogue's product."""
    z = gate * row_scale
    return z / (1.0 + jnp.exp(-z)) * (up * row_scale)


__all__ = ["norm_scale", "silu_product"]
