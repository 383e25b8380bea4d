"""Tensor-parallel int4 weights under ``jax.sharding``: split rules, sharded weights, the per-shard matmul.

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sw = nybble.sharding.shard_weight(qw, nybble.sharding.TensorParallel(mesh, "column"))
    y = jax.jit(nybble.matmul)(x, sw)       # the kernel once per shard, under shard_map

See :mod:`nybble.sharding.split_plan` for the rules, :mod:`~nybble.sharding.weight` for the storage and
:mod:`~nybble.sharding.matmul` for the op; ``nybble.models.shard`` places a whole model.
"""

from nybble.sharding.experts import ExpertParallel, ExpertShardedWeight, shard_experts
from nybble.sharding.matmul import sharded_matmul
from nybble.sharding.split_plan import SPLITS, ShardingError, ShardPlan, Split, TensorParallel, plan_split
from nybble.sharding.weight import ShardedWeight, local_weights, shard_weight

__all__ = [
    "SPLITS",
    "ExpertParallel",
    "ExpertShardedWeight",
    "ShardPlan",
    "ShardedWeight",
    "ShardingError",
    "Split",
    "TensorParallel",
    "local_weights",
    "plan_split",
    "shard_experts",
    "shard_weight",
    "sharded_matmul",
]
