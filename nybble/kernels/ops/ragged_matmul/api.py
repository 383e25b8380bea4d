"""``nybble.ragged_matmul``: the grouped int4 matmul of a mixture of experts, dispatched as ``nybble.matmul``.

    qw = nybble.quantize(w_experts)                        # (E, K, N) float -> stacked QuantizedWeight
    y = nybble.ragged_matmul(x_sorted, qw, group_sizes)    # == lax.ragged_dot(x, dequantize(qw), sizes)

Implementations, chosen as ``nybble.matmul`` chooses (``nybble.kernels.backends``): the grouped Mosaic
GPU kernel on a Hopper GPU or inside ``nybble.kernels.interpret()``, else the XLA path (:mod:`.xla`), which
runs everywhere. The float64 reference is :mod:`.reference`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nybble.kernels import backends
from nybble.kernels.backends import Implementation
from nybble.kernels.ops.matmul.api import check_x_dtype
from nybble.quant.stacked import check_stacked

WHAT = "nybble.ragged_matmul"
OP = backends.Op(
    WHAT, unsupported="ragged_unsupported", compute="ragged_matmul", unverified="ragged_unverified"
)


def check_implementation(implementation: Any) -> None:
    """Raises unless ``implementation`` is None or one of ``IMPLEMENTATIONS``."""
    backends.check_implementation(WHAT, implementation)


def check_group_sizes(group_sizes: Any, experts: int, rows: int) -> None:
    """``group_sizes``: an int32 (experts,) array; when concrete, each >= 0 and summing to at most ``rows``.

    Traced values (under ``jit``) are checked for shape and dtype only; their values are clamped by the
    implementations instead: a negative size counts as zero and rows past ``rows`` are dropped.
    """
    if not hasattr(group_sizes, "shape") or not hasattr(group_sizes, "dtype"):
        raise TypeError(
            f"{WHAT}: group_sizes must be an int32 array of shape (experts,) = ({experts},), got "
            f"{type(group_sizes).__name__}; e.g. jnp.asarray(sizes, jnp.int32)"
        )
    if np.dtype(group_sizes.dtype) != np.int32:
        raise TypeError(
            f"{WHAT}: group_sizes must be int32 (as lax.ragged_dot takes), got "
            f"{np.dtype(group_sizes.dtype).name}; cast with group_sizes.astype(jnp.int32)"
        )
    if tuple(group_sizes.shape) != (experts,):
        raise ValueError(
            f"{WHAT}: group_sizes has shape {tuple(group_sizes.shape)} but the weight stacks {experts} "
            f"experts: it must be ({experts},), one row count per expert, in the stack's order"
        )
    if isinstance(group_sizes, jax.core.Tracer):
        return
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
        (bad,) = np.nonzero(sizes < 0)
        raise ValueError(
            f"{WHAT}: group_sizes[{int(bad[0])}] = {int(sizes[bad[0]])} is negative ({len(bad)} negative in "
            f"all): each is a count of rows of x (>= 0)"
        )
    if int(sizes.sum(dtype=np.int64)) > rows:
        raise ValueError(
            f"{WHAT}: group_sizes sum to {int(sizes.sum(dtype=np.int64))} but x has {rows} rows: the groups "
            f"cover x's first sum(group_sizes) rows, so the sum must be at most {rows}"
        )


def check_args(x: Any, qw: Any, group_sizes: Any, *, experts: int | None = None) -> None:
    """Raises, naming the rule, unless x (rows, K), the weight and ``group_sizes`` fit together.

    ``experts``: the expert count of a weight that is not a stacked ``QuantizedWeight`` (the expert-sharded
    one of ``nybble.sharding``, which ``nybble.ops`` dispatches); None: ``qw`` is checked as a stack."""
    if experts is None:
        experts = check_stacked(qw, WHAT)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{WHAT}: x must be an array of shape (rows, K), got {type(x).__name__}")
    k, n = qw.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(
            f"{WHAT}: x has shape {tuple(x.shape)} but each expert's weight has shape (K, N) = ({k}, {n}); x "
            f"must be (rows, K) = (rows, {k}), its rows sorted by expert (reshape batch axes away first)"
        )
    check_x_dtype(WHAT, x)
    check_group_sizes(group_sizes, experts, x.shape[0])


def ragged_matmul(
    x: Any, qw: Any, group_sizes: Any, *, implementation: Implementation | None = None
) -> jax.Array:
    """The grouped product of a mixture of experts: x's rows, sorted by expert, times their expert's weight.

    Returns the same numbers as ``jax.lax.ragged_dot(x, nybble.dequantize(qw, x.dtype), group_sizes)``:
    row r of the result is ``x[r] @ dequantize(qw)[e]`` for the expert e whose group holds row r, and rows
    past ``sum(group_sizes)`` are zero. Float32 accumulation, result (rows, N) in ``x.dtype``.

    Args:
      x: (rows, K) in bf16/f16/f32, rows sorted by expert (expert 0's first).
      qw: a stacked ``QuantizedWeight`` (``nybble.quantize`` of an (experts, K, N) float array), or a
        ``nybble.sharding.ExpertShardedWeight`` (experts split over a mesh axis, optionally tensor-parallel
        inside each expert; each device runs this op on its own experts under ``jax.shard_map``).
      group_sizes: int32 (experts,), rows per expert, summing to at most ``rows``. Concrete values are
        checked (none negative, sum <= rows); traced ones (under ``jit``) only for shape and dtype, and
        then clamped (a negative size counts as zero, rows past ``rows`` are dropped).
      implementation: as in :func:`nybble.matmul`: None picks the grouped Mosaic GPU kernel on a Hopper GPU
        or inside ``nybble.kernels.interpret()`` when it can take the arguments, else XLA (on a GPU
        machine with a one-time warning saying why); a name of ``IMPLEMENTATIONS`` forces one (a forced
        kernel that cannot take the arguments raises ``NotImplementedError`` saying why).

    The XLA path reads and dequantizes only the experts that have rows, one at a time (see
    :mod:`.xla`); it supports forward-mode differentiation only.
    """
    check_args(x, qw, group_sizes)
    check_implementation(implementation)
    return backends.run(OP, implementation, (x, qw, group_sizes))


def available_ragged_implementations(x: Any, qw: Any, group_sizes: Any) -> dict[str, str | None]:
    """Each implementation mapped to None (it can run these arguments here) or the reason it cannot."""
    check_args(x, qw, group_sizes)
    return {name: a.reason for name, a in backends.availability(OP, (x, qw, group_sizes)).items()}


__all__ = [
    "available_ragged_implementations",
    "check_args",
    "check_group_sizes",
    "check_implementation",
    "ragged_matmul",
]
