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

from nybble.packing import get_layout, num_groups, padded_weight_dims
from nybble.quant.qweight import QuantizedWeight
from nybble.sharding.split_plan import ShardPlan, TensorParallel, plan_split

ARRAYS = ("codes", "scales", "offsets")


@dataclasses.dataclass(frozen=True)
class BlockSlice:
    """Where shard ``i``'s block of one array comes from in the unsharded stored array."""

    axis: int  # the axis the split cuts
    start: int  # [start, stop) along ``axis`` of the unsharded array
    stop: int
    length: int  # the block's extent along ``axis``: the slice, then zeros up to it


def block_slice(plan: ShardPlan, array: str, shard: int) -> BlockSlice:
    """The part of the unsharded ``array`` ("codes", "scales" or "offsets") that shard ``shard`` holds."""
    if not 0 <= shard < plan.num_shards:
        raise ValueError(f"shard {shard} is not in [0, {plan.num_shards})")
    k_l, n_l = plan.local_shape
    if array == "codes":
        layout = get_layout(plan.layout)
        dim = layout.n if plan.split == "column" else layout.k
        run = (n_l if plan.split == "column" else k_l) // dim.per_index
        axis = plan.codes_axis
        return BlockSlice(axis, shard * run, (shard + 1) * run, plan.local_codes_shape[axis])
    if array not in ARRAYS:
        raise ValueError(f"unknown array {array!r}; one of {ARRAYS}")
    length = plan.local_scales_shape[plan.scales_axis]
    if plan.split == "column":
        return BlockSlice(1, shard * n_l, (shard + 1) * n_l, length)
    if plan.group_size is None:  # one scale row for all of K: every shard holds a copy
        return BlockSlice(0, 0, 1, length)
    rows = k_l // plan.group_size
    return BlockSlice(0, shard * rows, (shard + 1) * rows, length)


def cut_block(a: np.ndarray, where: BlockSlice) -> np.ndarray:
    """``a[start:stop]`` along ``where.axis``, zero-padded to ``where.length`` (numpy)."""
    index = [slice(None)] * a.ndim
    index[where.axis] = slice(where.start, where.stop)
    block = np.asarray(a[tuple(index)])
    pad = [(0, 0)] * a.ndim
    pad[where.axis] = (0, where.length - block.shape[where.axis])
    return np.pad(block, pad) if pad[where.axis][1] else block


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedWeight:
    """A (K, N) int4 weight split over a mesh axis: ``nybble.matmul`` runs the kernel once per shard.

    Arrays (pytree children) are global ``jax.Array`` s (or ``ShapeDtypeStruct`` s) whose blocks along the
    split axis are the shards (``ShardPlan.codes_shape``, ``scales_shape``), each on the devices of its
    index along ``parallel.axis`` and replicated over the mesh's other axes. Static metadata: the logical
    ``shape``, ``group_size``, ``symmetric``, ``layout`` of the whole weight, and ``parallel``.
    """

    codes: Any
    scales: Any
    offsets: Any | None
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    group_size: int | None = dataclasses.field(metadata=dict(static=True))
    symmetric: bool = dataclasses.field(metadata=dict(static=True))
    layout: str = dataclasses.field(metadata=dict(static=True))
    parallel: TensorParallel = dataclasses.field(metadata=dict(static=True))

    @property
    def plan(self) -> ShardPlan:
        return self.parallel.plan(self)

    @property
    def num_shards(self) -> int:
        return self.parallel.num_shards

    @property
    def local_shape(self) -> tuple[int, int]:
        """Logical (K, N) of the weight each shard multiplies with."""
        return self.plan.local_shape

    def partition_specs(self) -> tuple[PartitionSpec, PartitionSpec]:
        """``PartitionSpec`` s of the codes and of the scales (and offsets)."""
        plan = self.plan
        return _spec(len(plan.codes_shape), plan.codes_axis, self.parallel.axis), _spec(
            2, plan.scales_axis, self.parallel.axis
        )

    def local(self, codes: Any, scales: Any, offsets: Any | None) -> QuantizedWeight:
        """The ``QuantizedWeight`` of one shard, from its blocks (inside ``shard_map``)."""
        return QuantizedWeight(
            codes=codes,
            scales=scales,
            offsets=offsets,
            shape=self.local_shape,
            group_size=self.group_size,
            symmetric=self.symmetric,
            layout=self.layout,
        )

    def local_problem(self, x: Any) -> tuple[jax.ShapeDtypeStruct, QuantizedWeight]:
        """Abstract (x, weight) of one shard's product for x of shape (..., K): shapes and dtypes only."""
        plan = self.plan
        k_l = plan.local_shape[0]
        arrays = {a: getattr(self, a) for a in ARRAYS}
        local = {
            a: None
            if v is None
            else jax.ShapeDtypeStruct(
                plan.local_codes_shape if a == "codes" else plan.local_scales_shape, v.dtype
            )
            for a, v in arrays.items()
        }
        x_local = jax.ShapeDtypeStruct((*x.shape[:-1], k_l), x.dtype)
        return x_local, self.local(local["codes"], local["scales"], local["offsets"])

    @property
    def nbytes(self) -> int:
        """Bytes of all shards together (per-shard padding included; one copy of each shard)."""
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in self._arrays())

    @property
    def nbytes_per_device(self) -> int:
        """Bytes each device holds: one shard."""
        return self.nbytes // self.num_shards

    def _arrays(self) -> list[Any]:
        return [a for a in (self.codes, self.scales, self.offsets) if a is not None]

    def gather(self) -> QuantizedWeight:
        """The unsharded ``QuantizedWeight`` (numpy arrays on the host): every shard copied back."""
        plan = self.plan
        k_pad, n_pad = padded_weight(self)
        out: dict[str, np.ndarray | None] = {}
        for name in ARRAYS:
            a = getattr(self, name)
            if a is None:
                out[name] = None
                continue
            host = np.asarray(jax.device_get(a))
            full_shape = list(host.shape)
            where0 = block_slice(plan, name, 0)
            full_shape[where0.axis] = _unsharded_extent(self, name, k_pad, n_pad)
            full = np.zeros(full_shape, host.dtype)
            for i in range(plan.num_shards):
                where = block_slice(plan, name, i)
                src = [slice(None)] * host.ndim
                src[where.axis] = slice(i * where.length, i * where.length + where.stop - where.start)
                dst = [slice(None)] * host.ndim
                dst[where.axis] = slice(where.start, where.stop)
                full[tuple(dst)] = host[tuple(src)]
            out[name] = full
        return QuantizedWeight(
            codes=out["codes"],
            scales=out["scales"],
            offsets=out["offsets"],
            shape=self.shape,
            group_size=self.group_size,
            symmetric=self.symmetric,
            layout=self.layout,
        )

    def __repr__(self) -> str:
        k, n = self.shape
        kl, nl = self.local_shape
        p = self.parallel
        group = "per-column" if self.group_size is None else f"g{self.group_size}"
        return (
            f"ShardedWeight(shape=({k}, {n}), {p.split}-parallel over {p.axis!r} x{p.num_shards}: shards "
            f"({kl}, {nl}), {group}, {'symmetric' if self.symmetric else 'asymmetric'}, "
            f"layout={self.layout!r}, {self.nbytes_per_device / 2**20:.3f} MiB per device)"
        )


def padded_weight(sw: ShardedWeight) -> tuple[int, int]:
    """(K_pad, N_pad) of the unsharded weight."""
    return padded_weight_dims(*sw.shape, sw.group_size)


def _unsharded_extent(sw: ShardedWeight, name: str, k_pad: int, n_pad: int) -> int:
    layout = get_layout(sw.layout)
    if name == "codes":
        stored = layout.stored_shape(k_pad, n_pad)
        return stored[sw.plan.codes_axis]
    if sw.parallel.split == "column":
        return n_pad
    return num_groups(k_pad, sw.group_size)


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


__all__ = ["BlockSlice", "ShardedWeight", "block_slice", "build_sharded", "local_weights", "shard_weight"]
