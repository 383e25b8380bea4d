"""The XLA backend: each op's ``xla.py`` behind the backend functions of ``nybble.kernels.backends``.

It computes whatever the ops' own argument rules accept, on any machine (CPU, GPU, TPU): the universal
fallback, last in ``IMPLEMENTATIONS``.
"""

from __future__ import annotations

from typing import Any

from nybble.kernels.ops.matmul.xla import xla_matmul as matmul
from nybble.kernels.ops.ragged_matmul.xla import xla_ragged_matmul as ragged_matmul
from nybble.kernels.ops.swiglu_matmul import xla_swiglu_matmul as swiglu_matmul


def unsupported(x: Any, qw: Any) -> None:
    """Nothing the op accepts is beyond XLA."""
    return None


def not_here() -> None:
    """XLA runs on every JAX platform."""
    return None


def describe(m: int, qw: Any) -> str:
    """What the XLA path runs (the same for every M)."""
    return "XLA: each weight dequantized to x's dtype in the program, then one dot, f32 accumulation"


def swiglu_unsupported(x: Any, qw: Any, *, forced: bool) -> None:
    """The SwiGLU op's XLA path takes every call the op accepts."""
    return None


def ragged_unsupported(x: Any, qw: Any, group_sizes: Any) -> None:
    """Nothing the op accepts is beyond XLA."""
    return None


__all__ = [
    "describe", "matmul", "not_here", "ragged_matmul", "ragged_unsupported", "swiglu_matmul",
    "swiglu_unsupported", "unsupported",
]  # fmt: skip
