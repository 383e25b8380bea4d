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


__all__ = ["norm_scale", "silu_product", "swiglu"]
