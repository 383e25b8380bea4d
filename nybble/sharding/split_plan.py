"""How a ``QuantizedWeight`` is cut into tensor-parallel shards: the rules, the shapes, and the errors.

Two splits, Megatron-style, over one mesh axis of size tp:

* ``"column"``: N (output features) is cut into tp equal runs. Codes, scales and offsets are cut alike; every
  shard multiplies the whole x and returns its own columns of y.
* ``"row"``: K (input features) is cut into tp equal runs of whole groups. Every shard multiplies its slice
  of x's K and returns a partial y; an all-reduce over the axis sums them.

Every shard is a kernel-ready weight of its own: its logical shape is (K, N / tp) or (K / tp, N), padded on
its own to ``nybble.packing.padded_weight_dims`` (N / tp = 72 is stored as 128 columns on every shard), so
its K_pad and N_pad are multiples of 64, all the Hopper kernel asks of a weight (its configs tile any such
shape), and its group geometry is the weight's (``nybble.packing.groups``).
The global arrays of a sharded weight are those per-shard blocks laid side by side along the split axis, so
that ``NamedSharding`` hands each device exactly its block; when tp divides the dimension in multiples of
64 no padding is added and the global arrays equal the unsharded weight's.

A split is refused, with the rule and a fix, when it would cut what is stored together: a layout block
(``StoredDim.granule``: in ``wgmma_int4``, the default and what the kernel reads, an 8-row band of N, so
N / tp a multiple of 8, and a 64-K chunk, so K / tp a multiple of 64; in ``nk_int4`` a byte, two values of
K) or a quantization group (K / tp must be a multiple of the group size), or when tp does not divide the
dimension.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from nybble.packing import LAYOUTS, get_layout, group_rows, num_groups, padded_weight_dims

Split = Literal["column", "row"]
SPLITS: tuple[str, ...] = ("column", "row")


class ShardingError(ValueError):
    """A weight cannot be split as asked: the message names the rule that fails and how to fix it."""


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Where a sharded weight lives: a mesh, the tensor-parallel axis of it, and the split.

    Attributes:
      mesh: a ``jax.sharding.Mesh``; the weight is replicated over its other axes, and the matmul splits the
        rows of x over them (data parallelism) when they divide M.
      split: ``"column"`` (cut N) or ``"row"`` (cut K; partial outputs summed by an all-reduce).
      axis: the mesh axis whose devices hold the shards.
    """

    mesh: Any
    split: Split
    axis: str = "model"

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"TensorParallel: split must be one of {SPLITS}, got {self.split!r}")
        names = tuple(getattr(self.mesh, "axis_names", ()))
        if self.axis not in names:
            raise ValueError(
                f"TensorParallel: mesh axis {self.axis!r} is not in the mesh's axes {names}; name the "
                f"tensor-parallel axis with axis=..."
            )

    @property
    def num_shards(self) -> int:
        """tp: the size of the mesh axis."""
        return int(self.mesh.shape[self.axis])

    # The placement as ``nybble.sharding.base.SplitWeight`` reads it (ExpertParallel answers the same).
    @property
    def lead_axes(self) -> tuple[str | None, ...]:
        """Mesh axes of the arrays' leading axes: none (the stored arrays are the weight's)."""
        return ()

    @property
    def tp_axis(self) -> str:
        return self.axis

    @property
    def tp_shards(self) -> int:
        return self.num_shards

    @property
    def devices_per_copy(self) -> int:
        """Devices that together hold one copy of the weight: the shards."""
        return self.num_shards

    def plan(self, weight: Any, name: str = "weight") -> ShardPlan:
        """The :class:`ShardPlan` of ``weight`` (anything with ``shape``, ``group_size`` and ``layout``)."""
        return plan_split(
            weight.shape,
            group_size=weight.group_size,
            layout=weight.layout,
            split=self.split,
            num_shards=self.num_shards,
            name=name,
        )

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh's other axes of size > 1: the weight is replicated over them, the rows of x split."""
        return tuple(a for a in self.mesh.axis_names if a != self.axis and self.mesh.shape[a] > 1)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """The shapes of one weight cut into ``num_shards`` kernel-ready shards (no arrays)."""

    shape: tuple[int, int]  # logical (K, N) of the whole weight
    group_size: int | None
    layout: str
    split: Split
    num_shards: int

    @property
    def local_shape(self) -> tuple[int, int]:
        """Logical (K, N) of one shard."""
        k, n = self.shape
        return (k, n // self.num_shards) if self.split == "column" else (k // self.num_shards, n)

    @property
    def local_padded_shape(self) -> tuple[int, int]:
        """(K_pad, N_pad) of one shard, padded on its own."""
        return padded_weight_dims(*self.local_shape, self.group_size)

    @property
    def local_group(self) -> int:
        """Rows of K per scale row in a shard (its own K_pad when quantized per column)."""
        return group_rows(self.local_padded_shape[0], self.group_size)

    @property
    def local_num_groups(self) -> int:
        """Scale rows of one shard."""
        return num_groups(self.local_padded_shape[0], self.group_size)

    @property
    def local_codes_shape(self) -> tuple[int, ...]:
        return tuple(get_layout(self.layout).stored_shape(*self.local_padded_shape))

    @property
    def local_scales_shape(self) -> tuple[int, int]:
        return (self.local_num_groups, self.local_padded_shape[1])

    @property
    def codes_axis(self) -> int:
        """The axis of the stored codes the split cuts."""
        layout = get_layout(self.layout)
        return (layout.n if self.split == "column" else layout.k).axis

    @property
    def scales_axis(self) -> int:
        """The axis of scales and offsets (groups, N_pad) the split cuts."""
        return 1 if self.split == "column" else 0

    @property
    def codes_shape(self) -> tuple[int, ...]:
        """Global stored codes: the shards' blocks side by side along ``codes_axis``."""
        return _times(self.local_codes_shape, self.codes_axis, self.num_shards)

    @property
    def scales_shape(self) -> tuple[int, ...]:
        """Global scales (and offsets): the shards' blocks side by side along ``scales_axis``."""
        return _times(self.local_scales_shape, self.scales_axis, self.num_shards)


def _times(shape: tuple[int, ...], axis: int, factor: int) -> tuple[int, ...]:
    out = list(shape)
    out[axis] *= factor
    return tuple(out)


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0][:6]


def _tp_fix(size: int, multiple: int) -> str:
    """Which tensor-parallel sizes leave ``size / tp`` a multiple of ``multiple``."""
    tps = _divisors(size // multiple) if size % multiple == 0 else []
    if tps:
        return f"a tensor-parallel size in {tps}"
    return f"no tensor-parallel size > 1 ({size} / tp is never a multiple of {multiple})"


def _layout_fix(local: int, split: Split, layout: str, group_size: int | None) -> str:
    """Other layouts whose blocks a ``local``-wide shard would not cut (nor its groups), with what running
    them means."""
    if split == "row" and group_size is not None and local % group_size:
        return ""  # the groups would be cut in any layout
    try:  # the kernel's layouts, named only in this message (importing the kernel package is lazy)
        from nybble.kernels.mosaic_gpu.dense import SUPPORTED_LAYOUTS as kernel_layouts
    except ImportError:
        kernel_layouts = ()
    fits = [
        name
        for name, other in LAYOUTS.items()
        if name != layout and local % (other.n if split == "column" else other.k).granule == 0
    ]
    if not fits:
        return ""
    runs = (
        f"; the Hopper kernel reads only {tuple(kernel_layouts)}, other layouts run on the XLA path"
        if kernel_layouts and not set(fits) <= set(kernel_layouts)
        else ""
    )
    return f"store the weight in layout {fits[0]!r} (nybble.quant.relayout(qw, {fits[0]!r}), exact{runs}), "


def plan_split(
    shape: tuple[int, int],
    *,
    group_size: int | None,
    layout: str,
    split: Split,
    num_shards: int,
    name: str = "weight",
) -> ShardPlan:
    """The :class:`ShardPlan` of a (K, N) weight cut ``split``-wise into ``num_shards``.

    Raises :class:`ShardingError` naming the rule and a fix when the cut would split a byte, a layout block
    or a quantization group, or when ``num_shards`` does not divide the dimension. ``name`` prefixes the
    message (a layer path).
    """
    if split not in SPLITS:
        raise ValueError(f"{name}: split must be one of {SPLITS}, got {split!r}")
    if num_shards < 1:
        raise ValueError(f"{name}: num_shards must be >= 1, got {num_shards}")
    k, n = shape
    dim_name, size = ("N", n) if split == "column" else ("K", k)
    what = f"{name}: {split}-parallel split of {dim_name}={size} over {num_shards} shards"
    replicate = "or keep this layer replicated (a ShardRule with placement='replicate')"
    if size % num_shards:
        raise ShardingError(
            f"{what}: {dim_name} is not a multiple of {num_shards} (rule: every shard holds {dim_name} / tp "
            f"values). Fix: use a tensor-parallel axis whose size divides {size}, {replicate}"
        )
    local = size // num_shards
    stored = get_layout(layout)
    dim = stored.n if split == "column" else stored.k
    # What each shard's extent must be a multiple of: the layout's block, and for a row split the group.
    whole = math.lcm(dim.granule, group_size) if split == "row" and group_size is not None else dim.granule
    if num_shards > 1 and local % dim.granule:
        unit = dim.unit or f"{dim.granule}-value block"
        raise ShardingError(
            f"{what} gives {local} per shard, not a multiple of {dim.granule}: a shard boundary would split "
            f"a {unit} of layout {layout!r} (rule: {dim_name} / tp must be a multiple of {dim.granule}, the "
            f"values of {dim_name} it stores together). Fix: use {_tp_fix(size, whole)}, "
            f"{_layout_fix(local, split, layout, group_size)}{replicate}"
        )
    if split == "row" and num_shards > 1 and group_size is not None and local % group_size:
        raise ShardingError(
            f"{what} gives {local} rows of K per shard, not a multiple of the group size {group_size}: a "
            f"shard boundary would split a quantization group (rule: K / tp must be a multiple of the group "
            f"size). Fix: quantize with a group size dividing {local} (or per column, group_size=None), "
            f"use {_tp_fix(k, whole)}, {replicate}"
        )
    return ShardPlan((k, n), group_size, layout, split, num_shards)


__all__ = ["SPLITS", "ShardPlan", "ShardingError", "Split", "TensorParallel", "plan_split"]
