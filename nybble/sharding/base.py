"""What every int4 weight split over a mesh shares: the blocks each shard holds of the stored arrays, and
:class:`SplitWeight`, the base of ``ShardedWeight`` (a (K, N) weight cut tensor-parallel, weight.py) and
``ExpertShardedWeight`` (an expert stack split over experts, each expert optionally cut the same way,
experts.py).

A split cuts the stored codes, scales and offsets along one axis without unpacking them (the layout's
:class:`~nybble.packing.StoredDim` says where N and K are, :class:`~nybble.sharding.split_plan.ShardPlan`
where the blocks fall), and pads every block on its own; the blocks lie side by side along that axis of
the global array, which may carry leading axes (the experts) in front of the stored ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from nybble.packing import get_layout, num_groups, padded_weight_dims
from nybble.quant.qweight import QuantizedWeight
from nybble.sharding.split_plan import ShardPlan

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


@dataclasses.dataclass(frozen=True)
class SplitWeight:
    """An int4 weight whose stored arrays are split over a mesh; each subclass says how (``parallel``).

    Arrays (pytree children, in the subclasses): global ``jax.Array`` s (or ``ShapeDtypeStruct`` s) of
    shape (*lead, *stored), the stored arrays' blocks side by side along the cut axis. Static: the logical
    ``shape`` (K, N) of one weight, ``group_size``, ``symmetric``, ``layout`` and ``parallel``.

    ``parallel`` (``TensorParallel``, ``ExpertParallel``) names the mesh axes of the leading array axes
    (``lead_axes``), the axis cutting each weight and its size (``tp_axis``, ``tp_shards``; None and 1: not
    cut), and how many devices together hold one copy (``devices_per_copy``), and plans the cut (``plan``).
    """

    codes: Any
    scales: Any
    offsets: Any | None
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    group_size: int | None = dataclasses.field(metadata=dict(static=True))
    symmetric: bool = dataclasses.field(metadata=dict(static=True))
    layout: str = dataclasses.field(metadata=dict(static=True))
    parallel: Any = dataclasses.field(metadata=dict(static=True))

    @property
    def plan(self) -> ShardPlan:
        """How each weight is cut (one shard when it is not)."""
        return self.parallel.plan(self)

    @property
    def local_shape(self) -> tuple[int, int]:
        """Logical (K, N) of the weight each shard multiplies with."""
        return self.plan.local_shape

    def partition_specs(self) -> tuple[PartitionSpec, PartitionSpec]:
        """``PartitionSpec`` s of the codes and of the scales (and offsets)."""
        plan, p = self.plan, self.parallel
        lead = list(p.lead_axes)

        def spec(ndim: int, axis: int) -> PartitionSpec:
            parts: list[Any] = [*lead] + [None] * ndim
            if p.tp_axis is not None:
                parts[len(lead) + axis] = p.tp_axis
            return PartitionSpec(*parts)

        return spec(len(plan.local_codes_shape), plan.codes_axis), spec(2, plan.scales_axis)

    def local(self, codes: Any, scales: Any, offsets: Any | None) -> QuantizedWeight:
        """The ``QuantizedWeight`` of one device's blocks (inside ``shard_map``)."""
        return QuantizedWeight(
            codes, scales, offsets, self.local_shape, self.group_size, self.symmetric, self.layout
        )

    def local_structs(self, lead: tuple[int, ...] = ()) -> QuantizedWeight:
        """One device's weight as shapes and dtypes (``ShapeDtypeStruct`` s), with ``lead`` axes in front."""
        plan = self.plan

        def struct(a: Any, shape: tuple[int, ...]) -> Any:
            return None if a is None else jax.ShapeDtypeStruct((*lead, *shape), a.dtype)

        return self.local(
            struct(self.codes, plan.local_codes_shape),
            struct(self.scales, plan.local_scales_shape),
            struct(self.offsets, plan.local_scales_shape),
        )

    @property
    def nbytes(self) -> int:
        """Bytes of all blocks together (per-block padding included; one copy of each)."""
        arrays = [a for a in (self.codes, self.scales, self.offsets) if a is not None]
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays)

    @property
    def nbytes_per_device(self) -> int:
        """Bytes each device holds."""
        return self.nbytes // self.parallel.devices_per_copy

    def _repr(self, how: str) -> str:
        """``Name(how, layout=..., X MiB per device)``: each subclass says how it is split."""
        mib = self.nbytes_per_device / 2**20
        return f"{type(self).__name__}({how}, layout={self.layout!r}, {mib:.3f} MiB per device)"

    def gather(self) -> QuantizedWeight:
        """The unsharded ``QuantizedWeight`` (numpy arrays on the host): every block copied back."""
        out = {}
        for name in ARRAYS:
            a = getattr(self, name)
            out[name] = None if a is None else self._join(name, np.asarray(jax.device_get(a)))
        return QuantizedWeight(
            out["codes"],
            out["scales"],
            out["offsets"],
            self.shape,
            self.group_size,
            self.symmetric,
            self.layout,
        )

    def _join(self, name: str, host: np.ndarray) -> np.ndarray:
        """The blocks of array ``name`` (side by side in ``host``) joined back into the unsharded array."""
        if self.parallel.tp_shards == 1:
            return host
        plan, lead = self.plan, len(self.parallel.lead_axes)
        axis = lead + block_slice(plan, name, 0).axis
        full_shape = list(host.shape)
        full_shape[axis] = self._unsharded_extent(name)
        full = np.zeros(full_shape, host.dtype)
        for i in range(self.parallel.tp_shards):
            where = block_slice(plan, name, i)
            src = [slice(None)] * host.ndim
            src[axis] = slice(i * where.length, i * where.length + where.stop - where.start)
            dst = [slice(None)] * host.ndim
            dst[axis] = slice(where.start, where.stop)
            full[tuple(dst)] = host[tuple(src)]
        return full

    def _unsharded_extent(self, name: str) -> int:
        """The extent of array ``name`` along the cut axis before the cut (padded, as stored)."""
        k_pad, n_pad = padded_weight_dims(*self.shape, self.group_size)
        if name == "codes":
            return get_layout(self.layout).stored_shape(k_pad, n_pad)[self.plan.codes_axis]
        return n_pad if self.plan.split == "column" else num_groups(k_pad, self.group_size)


__all__ = ["ARRAYS", "BlockSlice", "SplitWeight", "block_slice", "cut_block"]
