"""``nybble.matmul``: the weight-type dispatch, above the kernels and the sharding alike.

A :class:`nybble.QuantizedWeight` goes to ``nybble.kernels`` (the implementation registry: the Mosaic GPU
kernel, then XLA); a :class:`nybble.sharding.ShardedWeight` to ``nybble.sharding``, which runs that same
registry once per shard under ``jax.shard_map``. Living here, the dispatch keeps the imports pointing one
way: ``ops`` -> ``sharding`` -> ``kernels``, never back up.
"""

from __future__ import annotations

from typing import Any

import jax

from nybble.kernels.backends import Implementation
from nybble.kernels.ops.matmul import api as kernels
from nybble.kernels.ops.ragged_matmul import api as ragged
from nybble.quant.qweight import QuantizedWeight
from nybble.sharding import ShardedWeight, sharded_matmul
from nybble.sharding.experts import ExpertShardedWeight, sharded_ragged_matmul


def matmul(
    x: Any, qw: QuantizedWeight | ShardedWeight, *, implementation: Implementation | None = None
) -> jax.Array:
    """``x @ dequantize(qw)``: x of shape (..., K) in bf16/f16/f32, result (..., N) in ``x.dtype``.

    Accumulates in float32. Works under ``jit``, ``vmap`` and ``grad`` (with respect to ``x``).

    Args:
      x: activations, any leading batch dims.
      qw: the weight, from :func:`nybble.quantize`; or a :class:`nybble.sharding.ShardedWeight`, split over
        a mesh axis: then each shard runs this same op on its own shard under ``jax.shard_map`` (the
        implementation chosen per shard), with an all-reduce for a row-parallel split.
      implementation: None picks the best that can run here: the Mosaic GPU kernel on a Hopper GPU
        (or inside ``nybble.kernels.interpret()``), else XLA (on a GPU machine with a one-time warning
        saying why). ``"mosaic_gpu"`` or ``"xla"`` forces one. A forced ``"mosaic_gpu"`` raises
        ``NotImplementedError`` saying why when the kernel cannot take these arguments, and when the
        computation is run on a platform other than a CUDA GPU outside ``interpret()`` (tracing and
        lowering for CUDA work anywhere). ``nybble.kernels.explain(x, qw)`` says which runs and why.
    """
    if isinstance(qw, ShardedWeight):
        kernels.check_args(x, qw)
        kernels.check_implementation(implementation)
        return sharded_matmul(x, qw, implementation=implementation)
    return kernels.matmul(x, qw, implementation=implementation)


def ragged_matmul(
    x: Any,
    qw: QuantizedWeight | ExpertShardedWeight,
    group_sizes: Any,
    *,
    implementation: Implementation | None = None,
) -> jax.Array:
    """The grouped product of a mixture of experts (``nybble.kernels.ragged_matmul``, whose docstring
    has the contract): a stacked :class:`nybble.QuantizedWeight` goes to ``nybble.kernels``; an
    :class:`nybble.sharding.ExpertShardedWeight` (experts split over a mesh axis) to ``nybble.sharding``,
    which runs that same op on each device's experts under ``jax.shard_map``."""
    if isinstance(qw, ExpertShardedWeight):
        ragged.check_args(x, qw, group_sizes, experts=qw.num_experts)
        ragged.check_implementation(implementation)
        return sharded_ragged_matmul(x, qw, group_sizes, implementation=implementation)
    return ragged.ragged_matmul(x, qw, group_sizes, implementation=implementation)


def available_ragged_implementations(x: Any, qw: Any, group_sizes: Any) -> dict[str, str | None]:
    """``nybble.kernels.available_ragged_implementations``, for an expert-sharded weight too (the
    per-device problem)."""
    if isinstance(qw, ExpertShardedWeight):
        x, qw, group_sizes = qw.local_problem(x, group_sizes)
    return ragged.available_ragged_implementations(x, qw, group_sizes)


__all__ = ["available_ragged_implementations", "matmul", "ragged_matmul"]
