"""``nybble.kernels.swiglu_matmul``: a SwiGLU MLP's gate/up product and its SiLU product, one op.

    y = silu(r * (x @ W_gate)) * (r * (x @ W_up))

for a weight holding gate and up interleaved (``nybble.packing.gate_up``; ``nybble.models``' fused MLPs
hold theirs so), r a per-row scale rsqrt(s / dim + eps) from an RMSNorm's sum of squares s, deferred past
the projection (or 1). On a Hopper GPU at decode sizes (M <= 8; a Blackwell one: the K-sliced tiles) it is
one launch of the Mosaic GPU kernel with the SwiGLU epilogue (``mosaic_gpu/swiglu.py``); everywhere else
``nybble.kernels.matmul`` (whatever it runs there) and the same arithmetic in f32 after it, which XLA fuses
into one elementwise launch. The XLA path keeps the dot's f32 result, as the kernel does, so the two differ
by summation order and one rounding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nybble.kernels import backends
from nybble.kernels.backends import Implementation
from nybble.kernels.epilogue import swiglu
from nybble.kernels.ops.matmul import api as matmul_api
from nybble.kernels.ops.matmul.xla import dequantized_dot
from nybble.packing import pad_to
from nybble.packing.gate_up import GATE_UP_BLOCK
from nybble.quant.qweight import QuantizedWeight

WHAT = "nybble.kernels.swiglu_matmul"


def _check(x: Any, qw: Any, sum_of_squares: Any) -> None:
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(
            f"{WHAT}: the weight must be one nybble.QuantizedWeight holding gate and up interleaved "
            f"(nybble.packing.gate_up), got {type(qw).__name__}"
        )
    matmul_api.check_args(x, qw)
    check_gate_up_columns(WHAT, qw.shape[1])
    if sum_of_squares is not None:
        shape = tuple(np.shape(sum_of_squares))
        if shape not in (tuple(x.shape[:-1]), (*x.shape[:-1], 1)):
            raise ValueError(
                f"{WHAT}: sum_of_squares has shape {shape}; expected x's rows {tuple(x.shape[:-1])} "
                f"(or {(*x.shape[:-1], 1)})"
            )


def check_gate_up_columns(what: str, n: int) -> None:
    """Refuses a gate/up weight (each expert's, for the grouped op) of N columns that are not whole blocks
    of gate and up (``nybble.packing.gate_up``)."""
    if n % (2 * GATE_UP_BLOCK):
        raise ValueError(
            f"{what}: the weight has N={n} columns; a gate/up weight holds whole blocks of {GATE_UP_BLOCK} "
            f"gate and {GATE_UP_BLOCK} up columns (N a multiple of {2 * GATE_UP_BLOCK}: "
            "nybble.packing.gate_up)"
        )


def xla_swiglu_matmul(
    x2d: jax.Array, qw: QuantizedWeight, sum_of_squares: jax.Array | None, norm: tuple[float, float]
) -> jax.Array:
    """The XLA path: the dot's f32 result (``dequantized_dot``, as the kernel's accumulators: no rounding
    before the epilogue), then the epilogue's arithmetic; (M, N / 2) in x's dtype."""
    rows = x2d.shape[0]
    y = dequantized_dot(pad_to(x2d, (rows, qw.padded_shape[0])), qw)[:, : qw.shape[1]]
    return swiglu(y, sum_of_squares, norm).astype(x2d.dtype)


def swiglu_matmul(
    x: Any,
    qw: QuantizedWeight,
    *,
    sum_of_squares: Any = None,
    norm: tuple[float, float] = (1.0, 1.0),
    implementation: Implementation | None = None,
) -> jax.Array:
    """``silu(r (x @ W_gate)) * (r (x @ W_up))``: x (..., K) bf16/f16/f32 -> (..., N / 2) in ``x.dtype``.

    Args:
      x: activations, any leading batch dims.
      qw: a gate/up weight (K, N): gate and up of N / 2 columns each, interleaved in blocks of 8
        (``nybble.packing.gate_up``; ``nybble.models.fuse_projections`` builds them).
      sum_of_squares: None (r = 1), or each row's sum of squares s, shape x.shape[:-1] (or with a trailing
        1), float32: r = rsqrt(s / dim + eps), an RMSNorm's scale deferred past the projection.
      norm: (dim, eps) of that scale.
      implementation: as ``nybble.matmul``'s. The Hopper kernel runs the whole op in one launch where a
        config with the epilogue fits (M <= 8); otherwise the product runs as ``nybble.matmul`` runs it and
        the SiLU product after it.

    Differentiable with respect to x and sum_of_squares.
    """
    _check(x, qw, sum_of_squares)
    matmul_api.check_implementation(implementation)
    k, n = qw.shape
    lead = tuple(x.shape[:-1])
    x2d = x.reshape(-1, k)
    rows = x2d.shape[0]
    s = None if sum_of_squares is None else jnp.asarray(sum_of_squares, jnp.float32).reshape(rows)
    norm = (float(norm[0]), float(norm[1]))
    if rows == 0:
        return jnp.zeros((*lead, n // 2), x.dtype)
    # The backend nybble.matmul would run, with its own SwiGLU op where it has one that takes this call.
    name = implementation or backends.default_choice(matmul_api.OP, (x2d, qw))[0]
    backend = backends.load(name)
    fused = getattr(backend, "swiglu_matmul", None)
    if fused is not None and backend.swiglu_unsupported(x2d, qw, forced=implementation is not None) is None:
        return fused(x2d, qw, s, norm).reshape(*lead, n // 2)
    y = matmul_api.matmul(x2d, qw, implementation=implementation).astype(jnp.float32)
    return swiglu(y, s, norm).astype(x.dtype).reshape(*lead, n // 2)


__all__ = ["check_gate_up_columns", "swiglu_matmul", "xla_swiglu_matmul"]
