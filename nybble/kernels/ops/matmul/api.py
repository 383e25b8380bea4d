"""``nybble.kernels.matmul``: ``x @ dequantize(qw)`` for one ``QuantizedWeight``, by the backend asked for.

``nybble.matmul`` (``nybble/ops.py``) sends a plain weight here and a ``ShardedWeight`` to
``nybble.sharding``, which calls :func:`matmul` once per shard: this package never imports the sharding
one. :func:`available_implementations` and :func:`explain` also take a sharded weight, by its
``local_problem(x)`` (each shard's product), without importing its type. The backends and the choice
between them are ``nybble.kernels.backends``'; the float64 reference is :mod:`.reference`, the XLA path
:mod:`.xla`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nybble.kernels import backends
from nybble.kernels.backends import Availability, Implementation
from nybble.quant.qweight import QuantizedWeight

WHAT = "nybble.matmul"
MATMUL_X_DTYPES = ("bfloat16", "float16", "float32")
OP = backends.Op(WHAT, unsupported="unsupported", compute="matmul", unverified="unverified")


def _is_sharded(qw: Any) -> bool:
    """A weight split over a mesh (``nybble.sharding.ShardedWeight``), known by its per-shard problem."""
    return callable(getattr(qw, "local_problem", None))


def check_args(x: Any, qw: Any) -> None:
    """The argument rules of ``nybble.matmul``: a weight of nybble's, x of shape (..., K) in a supported
    dtype. Raises TypeError / ValueError naming the shape or dtype and the fix."""
    if not (isinstance(qw, QuantizedWeight) or _is_sharded(qw)):
        raise TypeError(
            f"{WHAT}: the weight must be a nybble.QuantizedWeight (from nybble.quantize) or a "
            f"nybble.sharding.ShardedWeight, got {type(qw).__name__}"
        )
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{WHAT}: x must be an array of shape (..., K), got {type(x).__name__}")
    k, n = qw.shape
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(
            f"{WHAT}: x has shape {tuple(x.shape)} but the weight has shape (K, N) = ({k}, {n}); "
            f"x.shape[-1] must equal K = {k}"
        )
    check_x_dtype(WHAT, x)


def check_x_dtype(what: str, x: Any) -> None:
    """x's dtype is one every implementation takes (bf16, f16, f32), else a TypeError saying how to cast."""
    if np.dtype(x.dtype).name not in MATMUL_X_DTYPES:
        raise TypeError(
            f"{what}: x has dtype {np.dtype(x.dtype).name}; supported: {MATMUL_X_DTYPES} "
            f"(cast x first, e.g. x.astype(jnp.bfloat16))"
        )


def check_implementation(implementation: Any) -> None:
    """Refuses an implementation name that is not one of :data:`IMPLEMENTATIONS` (or None)."""
    backends.check_implementation(WHAT, implementation)


def matmul(x: Any, qw: QuantizedWeight, *, implementation: Implementation | None = None) -> jax.Array:
    """``x @ dequantize(qw)``: x of shape (..., K) in bf16/f16/f32, result (..., N) in ``x.dtype``.

    Accumulates in float32. Works under ``jit``, ``vmap`` and ``grad`` (with respect to ``x``).

    Args:
      x: activations, any leading batch dims.
      qw: the weight, from :func:`nybble.quantize` (a ``ShardedWeight`` goes through ``nybble.matmul``).
      implementation: None picks the first of ``nybble.kernels.IMPLEMENTATIONS`` that can run here: the
        Mosaic GPU kernel on a Hopper GPU (or inside ``nybble.kernels.interpret()``), else XLA (on a GPU
        machine with a one-time warning saying why). A name forces one.
        A forced ``"mosaic_gpu"`` raises ``NotImplementedError`` saying why when the kernel cannot take
        these arguments, and when the computation is run on a platform other than a CUDA GPU outside
        ``interpret()`` (tracing and lowering for CUDA work anywhere).
    """
    check_args(x, qw)
    check_implementation(implementation)
    if _is_sharded(qw):
        raise TypeError(
            "nybble.kernels.matmul multiplies one QuantizedWeight; a ShardedWeight goes through "
            "nybble.matmul (nybble/ops.py), which runs this once per shard"
        )
    y = backends.run(OP, implementation, (x.reshape(-1, x.shape[-1]), qw))
    return y.reshape(*x.shape[:-1], qw.shape[1])


def available_implementations(x: Any, qw: Any) -> dict[str, Availability]:
    """Each implementation, in dispatch order, and whether it can run these arguments here (with the reason
    when it cannot): ``{'mosaic_gpu': unavailable: it needs a Hopper GPU ..., 'xla': available}``.

    For a ``ShardedWeight``: whether it can run each shard's product (x cut like the weight).
    """
    check_args(x, qw)
    if _is_sharded(qw):
        x, qw = qw.local_problem(x)
    return backends.availability(OP, (x, qw))


def explain(x: Any, qw: Any, *, implementation: Implementation | None = None) -> str:
    """What ``nybble.matmul(x, qw, implementation=...)`` runs here, and why, in a few lines.

    Names the implementation chosen, why the others were passed over, and the chosen backend's own line
    (for the Mosaic GPU kernel, the ``TuningConfig`` its heuristics pick for this shape and SM count).
    """
    avail = available_implementations(x, qw)
    sharded = _is_sharded(qw)
    if sharded:
        x, qw = qw.local_problem(x)
    dtype = np.dtype(x.dtype).name
    head = (
        f"{WHAT}(x: {dtype}{list(x.shape)}, {'each shard: ' if sharded else ''}{qw.shape[0]}x"
        f"{qw.shape[1]} int4, {'per-column' if qw.group_size is None else f'g{qw.group_size}'} "
        f"{'symmetric' if qw.symmetric else 'asymmetric'}, layout {qw.layout!r})"
    )
    lines = [head]
    if implementation is not None and not avail[implementation]:
        why = avail[implementation].reason
        lines.append(f"  implementation={implementation!r} is forced and raises: {why}")
        return "\n".join(lines)
    if implementation is None:
        x2d = jax.ShapeDtypeStruct((int(np.prod(x.shape[:-1])), x.shape[-1]), x.dtype)
        chosen, passed_over = backends.default_choice(OP, (x2d, qw))
    else:
        chosen, passed_over = implementation, []
    lines.append(f"  runs {chosen!r}" + (" (forced)" if implementation else " (implementation=None)"))
    lines.append(f"  {backends.describe(chosen, int(np.prod(x.shape[:-1])), qw)}")
    lines += [f"  {line}" for line in passed_over]
    for name in avail:
        if name != chosen and not avail[name] and not any(p.startswith(f"not {name!r}") for p in passed_over):
            lines.append(f"  not {name!r}: {avail[name].reason}")
    return "\n".join(lines)


__all__ = [
    "MATMUL_X_DTYPES",
    "Availability",
    "available_implementations",
    "check_args",
    "check_implementation",
    "check_x_dtype",
    "explain",
    "matmul",
]
