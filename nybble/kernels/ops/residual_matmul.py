"""``nybble.kernels.residual_matmul``: a layer's last projection, its residual add and the next norm's
product, one op.

    x = residual + x_in @ W,    h = x * w

for a pre-norm transformer's down projection (``residual``: the residual stream; ``w``: the next layer's
input-norm weight, whose per-row scale is deferred past the projections that read h). On a Hopper GPU at
decode sizes (M <= 8) it is one launch of the Mosaic GPU kernel with the residual epilogue
(``mosaic_gpu/residual.py``), where XLA spent a launch of its own on the add and the product; everywhere
else ``nybble.kernels.matmul`` (whatever it runs there) and the same arithmetic after it. Both round alike
(``nybble.kernels.epilogue.residual_norm``): the product to x's dtype first, as an unfused step does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nybble.kernels import backends
from nybble.kernels.backends import Implementation
from nybble.kernels.epilogue import residual_norm
from nybble.kernels.ops.matmul import api as matmul_api
from nybble.quant.qweight import QuantizedWeight

WHAT = "nybble.kernels.residual_matmul"


def _check(x: Any, qw: Any, residual: Any, norm_weight: Any) -> None:
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"{WHAT}: the weight must be a nybble.QuantizedWeight, got {type(qw).__name__}")
    matmul_api.check_args(x, qw)
    n = qw.shape[1]
    out_shape, shape = (*x.shape[:-1], n), tuple(np.shape(residual))
    if shape != out_shape:
        raise ValueError(f"{WHAT}: residual has shape {shape}; expected x @ W's {out_shape}")
    if (dtype := getattr(residual, "dtype", None)) != x.dtype:
        raise ValueError(f"{WHAT}: residual is {dtype}; expected x's dtype {x.dtype}")
    if (shape := tuple(np.shape(norm_weight))) != (n,):
        raise ValueError(f"{WHAT}: norm_weight has shape {shape}; expected (N,) = ({n},)")
    if not jnp.issubdtype(getattr(norm_weight, "dtype", np.float32), jnp.floating):
        raise ValueError(f"{WHAT}: norm_weight must be floating point, got {norm_weight.dtype}")


def residual_matmul(
    x: Any,
    qw: QuantizedWeight,
    residual: Any,
    norm_weight: Any,
    *,
    implementation: Implementation | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(x', h)``: x' = residual + x @ W and h = x' * norm_weight, both (..., N) in ``x.dtype``.

    Args:
      x: activations (..., K), bf16/f16/f32, any leading batch dims.
      qw: the weight (K, N).
      residual: (..., N) in x's dtype, the residual stream the product is added to.
      norm_weight: (N,) float: the weight of the RMSNorm that reads x' next (its row scale is left to the
        consumer of h, as ``RMSNorm.deferred_sum`` leaves it).
      implementation: as ``nybble.matmul``'s. The Hopper kernel runs the whole op in one launch where a
        config with the epilogue fits (M <= 8); otherwise the product runs as ``nybble.matmul`` runs it and
        the add and the product after it.

    x @ W is rounded to x's dtype before the add, and the sum and the product each once more, as a model's
    unfused step rounds them. Differentiable with respect to x, residual and norm_weight.
    """
    _check(x, qw, residual, norm_weight)
    matmul_api.check_implementation(implementation)
    k, n = qw.shape
    lead = tuple(x.shape[:-1])
    x2d = x.reshape(-1, k)
    residual2d = jnp.asarray(residual).reshape(-1, n)
    norm_weight = jnp.asarray(norm_weight)
    if x2d.shape[0] == 0:
        empty = jnp.zeros((*lead, n), x.dtype)
        return empty, empty
    backend = _fusing_backend(x2d, qw, implementation)
    if backend is not None:
        out, normed = backend.residual_matmul(x2d, qw, residual2d, norm_weight)
    else:
        y = matmul_api.matmul(x2d, qw, implementation=implementation)
        out, normed = residual_norm(y, residual2d, norm_weight, x.dtype)
    return out.reshape(*lead, n), normed.reshape(*lead, n)


def _fusing_backend(x2d: Any, qw: QuantizedWeight, implementation: Implementation | None) -> Any:
    """The backend ``nybble.matmul`` would run for (M, K) ``x2d``, where it has a residual op of its own
    that takes this call; else None."""
    name = implementation or backends.default_choice(matmul_api.OP, (x2d, qw))[0]
    backend = backends.load(name)
    if getattr(backend, "residual_matmul", None) is None:
        return None
    why = backend.residual_unsupported(x2d, qw, forced=implementation is not None)
    return backend if why is None else None


def fuses(x: Any, qw: Any, *, implementation: Implementation | None = None) -> bool:
    """Whether :func:`residual_matmul` of x (..., K) (an array or a ShapeDtypeStruct) against ``qw`` runs as
    one launch here (a kernel's residual epilogue), where a model gains from calling it: else the op is
    ``nybble.matmul`` and XLA's add and product after it, which a model's own code gets as well."""
    if not isinstance(qw, QuantizedWeight) or getattr(x, "ndim", 0) < 1:
        return False
    x2d = jax.ShapeDtypeStruct((int(np.prod(x.shape[:-1])), x.shape[-1]), x.dtype)
    return x2d.shape[0] > 0 and _fusing_backend(x2d, qw, implementation) is not None


__all__ = ["fuses", "residual_matmul"]
