"""How a ``QuantizedWeight`` is cut into tensor-parallel shards: the rules, the shapes, and the errors.

Two splits, Megatron-style, over one mesh axis of size tp:

* ``"column"``: N (output features) is cut into tp equal runs. Codes, scales and offsets are cut alike; every
  shard multiplies the whole x and returns its own columns of y.
* ``"row"``: K (input features) is cut into tp equal runs of whole groups. Every shard multiplies its slice
  of x's K and returns a partial y; an all-reduce over the axis sums them.

Every shard is a kernel-ready weight of its own: its logical shape is (K, N / tp) or (K / tp, N), padded on
its own to ``nybble.packing.padded_weight_dims`` (N / tp = 72 is stored as 128 columns on every shard).
The global arrays of a sharded weight are those per-shard blocks laid side by side along the split axis, so
that ``NamedSharding`` hands each device exactly its block; when tp divides the dimension in multiples of
64 no padding is added and the global arrays equal the unsharded weight's.

A split is refused, with the rule and a fix, when it would cut what is stored together: a byte (two values of
K in ``nk_int4``), a layout block (an 8-row band or a 64-K chunk of ``wgmma_int4``: ``StoredDim.granule``)
or a quantization group (K / tp must be a multiple of the group size), or when tp does not divide the
dimension.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from nybble.packing import get_layout, padded_weight_dims

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
    def local_block_k(self) -> int:
        """Rows of K per scale row in a shard (its own K_pad when quantized per column)."""
        return self.local_padded_shape[0] if self.group_size is None else self.group_size

    @property
    def local_num_groups(self) -> int:
        """Scale rows of one shard."""
        return -(-self.local_padded_shape[0] // self.local_block_k)

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
    if num_shards > 1 and local % dim.granule:
        unit = dim.unit or f"{dim.granule}-value block"
        raise ShardingError(
            f"{what} gives {local} per shard, not a multiple of {dim.granule}: a shard boundary would split "
            f"a {unit} of layout {layout!r} (it stores {dim.granule} values of {dim_name} together). Fix: "
            f"use a tensor-parallel size dividing {size // math.gcd(size, dim.granule)}, store the weight in "
            f"another layout (nybble.quant.relayout(qw, 'nk_int4')), {replicate}"
        )
    if split == "row" and num_shards > 1 and group_size is not None and local % group_size:
        tps = _divisors(k // group_size) if k % group_size == 0 else []
        tp_fix = f"a tensor-parallel size in {tps}" if tps else "another tensor-parallel size"
        raise ShardingError(
            f"{what} gives {local} rows of K per shard, not a multiple of the group size {group_size}: a "
            f"shard boundary would split a quantization group (rule: K / tp must be a multiple of the group "
            f"size). Fix: quantize with a group size dividing {local} (or per column, group_size=None), "
            f"use {tp_fix}, {replicate}"
        )
    return ShardPlan((k, n), group_size, layout, split, num_shards)


__all__ = ["SPLITS", "ShardPlan", "ShardingError", "Split", "TensorParallel", "plan_split"]
