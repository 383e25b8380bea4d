"""``ShardedWeight``: a ``QuantizedWeight`` cut into tensor-parallel shards that live on a device mesh.

``shard_weight(qw, TensorParallel(mesh, "column"))`` cuts the stored codes, scales and offsets along the
split axis without unpacking them (the layout's :class:`~nybble.packing.StoredDim` says where N and K are),
pads every shard on its own and places each block on its devices with a ``NamedSharding``. Inside
``shard_map`` each device sees a plain, kernel-ready ``QuantizedWeight`` (:meth:`ShardedWeight.local`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nybble.quant.qweight import QuantizedWeight
from nybble.sharding.base import ARRAYS, BlockSlice, SplitWeight, block_slice, cut_block
from nybble.sharding.split_plan import TensorParallel, plan_split


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedWeight(SplitWeight):
    """A (K, N) int4 weight split over a mesh axis: ``nybble.matmul`` runs the kernel once per shard.

    Arrays (pytree children) are global ``jax.Array`` s (or ``ShapeDtypeStruct`` s) whose blocks along the
    split axis are the shards (``ShardPlan.codes_shape``, ``scales_shape``), each on the devices of its
    index along ``parallel.axis`` and replicated over the mesh's other axes. Static metadata: the logical
    ``shape``, ``group_size``, ``symmetric``, ``layout`` of the whole weight, and ``parallel``.
    """

    parallel: TensorParallel = dataclasses.field(metadata=dict(static=True))

    @property
    def num_shards(self) -> int:
        return self.parallel.num_shards

    def local_problem(self, x: Any) -> tuple[jax.ShapeDtypeStruct, QuantizedWeight]:
        """Abstract (x, weight) of one shard's product for x of shape (..., K): shapes and dtypes only."""
        x_local = jax.ShapeDtypeStruct((*x.shape[:-1], self.local_shape[0]), x.dtype)
        return x_local, self.local_structs()

    def __repr__(self) -> str:
        (k, n), (kl, nl), p = self.shape, self.local_shape, self.parallel
        group = "per-column" if self.group_size is None else f"g{self.group_size}"
        return self._repr(
            f"shape=({k}, {n}), {p.split}-parallel over {p.axis!r} x{p.num_shards}: shards ({kl}, {nl}), "
            f"{group}, {'symmetric' if self.symmetric else 'asymmetric'}"
        )


def _spec(ndim: int, axis: int, name: str) -> PartitionSpec:
    parts: list[Any] = [None] * ndim
    parts[axis] = name
    return PartitionSpec(*parts)


def build_sharded(
    meta: QuantizedWeight | ShardedWeight | Any,
    parallel: TensorParallel,
    blocks: Callable[[str, int], np.ndarray] | None,
    dtypes: dict[str, Any],
    *,
    name: str = "weight",
) -> ShardedWeight:
    """A ``ShardedWeight`` of ``meta``'s logical weight whose shard ``i`` of array ``a`` is ``blocks(a, i)``.

    ``blocks`` is called only for the shards this process's devices hold (``jax.make_array_from_callback``);
    None makes an abstract weight (``ShapeDtypeStruct`` s carrying the shardings), for compiling.
    ``dtypes`` maps "codes", "scales" and, when asymmetric, "offsets" to their dtypes.
    """
    plan = parallel.plan(meta, name)
    codes_axis, scales_axis = plan.codes_axis, plan.scales_axis
    arrays: dict[str, Any] = {}
    cache: dict[tuple[str, int], np.ndarray] = {}
    for array in ARRAYS:
        if array not in dtypes:
            arrays[array] = None
            continue
        shape, axis, local = (
            (plan.codes_shape, codes_axis, plan.local_codes_shape)
            if array == "codes"
            else (plan.scales_shape, scales_axis, plan.local_scales_shape)
        )
        sharding = NamedSharding(parallel.mesh, _spec(len(shape), axis, parallel.axis))
        if blocks is None:
            arrays[array] = jax.ShapeDtypeStruct(shape, dtypes[array], sharding=sharding)
            continue

        def callback(index: tuple[slice, ...], array=array, axis=axis, run=local[axis]) -> np.ndarray:
            # A block replicated over the mesh's other axes is asked for once per device: cut it once.
            shard = (index[axis].start or 0) // run
            if (array, shard) not in cache:
                cache[(array, shard)] = blocks(array, shard)
            return cache[(array, shard)]

        arrays[array] = jax.make_array_from_callback(shape, sharding, callback)
    return ShardedWeight(
        codes=arrays["codes"],
        scales=arrays["scales"],
        offsets=arrays["offsets"],
        shape=tuple(meta.shape),
        group_size=meta.group_size,
        symmetric=meta.symmetric,
        layout=meta.layout,
        parallel=parallel,
    )


def shard_weight(qw: QuantizedWeight, parallel: TensorParallel, *, name: str = "weight") -> ShardedWeight:
    """Cuts ``qw`` into ``parallel.num_shards`` kernel-ready shards on ``parallel.mesh``.

    ``qw`` may hold arrays (each device receives its block, cut on the host from the stored arrays: no
    unpacking) or ``ShapeDtypeStruct`` s (the result is abstract, for ``jit(...).lower``). Raises
    :class:`~nybble.sharding.ShardingError` when the split would cut a byte, a layout block or a group.
    """
    if isinstance(qw, ShardedWeight):
        raise TypeError(f"{name} is already sharded ({qw!r}); gather() it first to re-shard")
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"shard_weight expects a nybble.QuantizedWeight, got {type(qw).__name__}")
    if not isinstance(parallel, TensorParallel):
        raise TypeError(f"shard_weight: parallel must be a TensorParallel, got {type(parallel).__name__}")
    dtypes = {a: getattr(qw, a).dtype for a in ARRAYS if getattr(qw, a) is not None}
    if isinstance(qw.codes, jax.ShapeDtypeStruct):
        return build_sharded(qw, parallel, None, dtypes, name=name)
    host = {a: np.asarray(jax.device_get(getattr(qw, a))) for a in dtypes}
    plan = parallel.plan(qw, name)
    return build_sharded(
        qw, parallel, lambda a, i: cut_block(host[a], block_slice(plan, a, i)), dtypes, name=name
    )


def local_weights(qw: QuantizedWeight, split: str, num_shards: int) -> list[QuantizedWeight]:
    """The ``QuantizedWeight`` of every shard, cut on the host (no devices): what each device multiplies."""
    plan = plan_split(
        qw.shape,
        group_size=qw.group_size,
        layout=qw.layout,
        split=split,  # type: ignore[arg-type]
        num_shards=num_shards,
    )
    host = {a: np.asarray(jax.device_get(getattr(qw, a))) for a in ARRAYS if getattr(qw, a) is not None}
    out = []
    for i in range(num_shards):
        blocks = {a: cut_block(v, block_slice(plan, a, i)) for a, v in host.items()}
        out.append(
            QuantizedWeight(
                codes=blocks["codes"],
                scales=blocks["scales"],
                offsets=blocks.get("offsets"),
                shape=plan.local_shape,
                group_size=qw.group_size,
                symmetric=qw.symmetric,
                layout=qw.layout,
            )
        )
    return out


__all__ = [
    "ARRAYS",
    "BlockSlice",
    "ShardedWeight",
    "block_slice",
    "build_sharded",
    "cut_block",
    "local_weights",
    "shard_weight",
]
