"""Expert stacks on a device mesh: expert-parallel (experts split over an axis), tensor-parallel inside them.

    ep = ExpertParallel(mesh, expert_axis="expert", tp_axis="model", split="column")
    sw = shard_experts(qw, ep)                          # qw: a stacked QuantizedWeight (E, ...)
    y = jax.jit(nybble.ragged_matmul)(x, sw, group_sizes)

Storage: the stacked codes, scales and offsets keep their leading expert axis, split over ``expert_axis``
(each device holds E / ep whole experts); with a tensor-parallel split each expert is also cut along N
(``"column"``) or K (``"row"``) over ``tp_axis`` by the dense rules of :mod:`nybble.sharding.split_plan`
(the same blocks and refusals), the shards' blocks side by side on that axis.

The product (:func:`sharded_ragged_matmul`, under ``jax.shard_map``): x (rows, K) sorted by expert and the
small ``group_sizes`` are replicated over the expert axis (x split along K over ``tp_axis`` for a row split).
Device d's experts own one contiguous run of rows, starting at the rows of all experts before its own; it
shifts x by that offset (a dynamic slice), runs ``nybble.ragged_matmul`` on its experts (the kernel or the
XLA path, as chosen per shard), shifts its rows back, and a ``psum`` over the expert axis (and over
``tp_axis`` for a row split) adds the devices' outputs: every row comes from exactly one expert shard, so
that sum adds zeros to it. Each device reads only its own experts' bytes; the all-reduce moves
(rows, N) in x's dtype, as the dense row-parallel product does. Rows are not split over other mesh axes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from nybble.kernels.ops.ragged_matmul.api import ragged_matmul
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.stacked import check_stacked
from nybble.sharding.base import ARRAYS, SplitWeight, block_slice, cut_block
from nybble.sharding.split_plan import ShardingError, ShardPlan, plan_split


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Where an expert stack lives: a mesh, the axis splitting the experts, and a split inside each expert.

    Attributes:
      mesh: a ``jax.sharding.Mesh``; the weight is replicated over the axes not named here.
      expert_axis: the mesh axis whose devices hold E / size experts each (None: every device all experts).
      tp_axis: the mesh axis cutting each expert (None: experts whole), by ``split``.
      split: ``"column"`` (cut N) or ``"row"`` (cut K, partial outputs summed), with ``tp_axis``.
    """

    mesh: Any
    expert_axis: str | None = "expert"
    tp_axis: str | None = None
    split: Literal["column", "row"] | None = None

    def __post_init__(self) -> None:
        names = tuple(getattr(self.mesh, "axis_names", ()))
        for what, axis in (("expert_axis", self.expert_axis), ("tp_axis", self.tp_axis)):
            if axis is not None and axis not in names:
                raise ValueError(f"ExpertParallel: {what} {axis!r} is not in the mesh's axes {names}")
        if (self.tp_axis is None) != (self.split is None):
            raise ValueError("ExpertParallel: give tp_axis and split together (or neither)")
        if self.split not in (None, "column", "row"):
            raise ValueError(f"ExpertParallel: split must be 'column', 'row' or None, got {self.split!r}")
        if self.tp_axis is not None and self.tp_axis == self.expert_axis:
            raise ValueError(f"ExpertParallel: expert_axis and tp_axis are both {self.tp_axis!r}")
        if self.expert_axis is None and self.tp_axis is None:
            raise ValueError("ExpertParallel: name an expert_axis, a tp_axis, or both")

    @property
    def expert_shards(self) -> int:
        return 1 if self.expert_axis is None else int(self.mesh.shape[self.expert_axis])

    @property
    def tp_shards(self) -> int:
        return 1 if self.tp_axis is None else int(self.mesh.shape[self.tp_axis])

    @property
    def lead_axes(self) -> tuple[str | None, ...]:
        """Mesh axes of the arrays' leading axes: the experts'."""
        return (self.expert_axis,)

    @property
    def devices_per_copy(self) -> int:
        """Devices that together hold one copy of the stack: each its experts' block."""
        return self.expert_shards * self.tp_shards

    def plan(self, weight: Any, name: str = "experts") -> ShardPlan:
        """The per-expert tensor-parallel :class:`ShardPlan` (one shard when there is no split)."""
        return plan_split(
            weight.shape,
            group_size=weight.group_size,
            layout=weight.layout,
            split=self.split or "column",
            num_shards=self.tp_shards,
            name=name,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertShardedWeight(SplitWeight):
    """A stacked (E experts of (K, N)) int4 weight split over a mesh (see the module docstring).

    Arrays (pytree children): global ``jax.Array`` s (or ``ShapeDtypeStruct`` s) of shape (E, *per-expert
    global), the expert axis split over ``parallel.expert_axis``. Static: the per-expert logical ``shape``,
    ``group_size``, ``symmetric``, ``layout`` and ``parallel``.
    """

    parallel: ExpertParallel = dataclasses.field(metadata=dict(static=True))

    @property
    def num_experts(self) -> int:
        return int(self.codes.shape[0])

    def local_problem(self, x: Any, group_sizes: Any) -> tuple[Any, QuantizedWeight, Any]:
        """Abstract (x, weight, group_sizes) of one device's product: shapes and dtypes only."""
        e_l = self.num_experts // self.parallel.expert_shards
        x_local = jax.ShapeDtypeStruct((x.shape[0], self.local_shape[0]), x.dtype)
        return x_local, self.local_structs((e_l,)), jax.ShapeDtypeStruct((e_l,), group_sizes.dtype)

    def __repr__(self) -> str:
        p = self.parallel
        inside = "" if p.tp_axis is None else f", {p.split}-parallel over {p.tp_axis!r} x{p.tp_shards}"
        return self._repr(
            f"{self.num_experts} experts of {self.shape}, expert-parallel over {p.expert_axis!r} "
            f"x{p.expert_shards}{inside}"
        )


def shard_experts(
    qw: QuantizedWeight, parallel: ExpertParallel, *, name: str = "experts"
) -> ExpertShardedWeight:
    """Places a stacked weight on ``parallel.mesh``: experts over ``expert_axis``, each cut by ``split``.

    ``qw`` may hold arrays (cut on the host, no unpacking: the dense split's blocks per expert) or
    ``ShapeDtypeStruct`` s (the result is abstract, for ``jit(...).lower``). Raises
    :class:`~nybble.sharding.ShardingError` when the experts do not divide evenly over the expert axis, or
    when the tensor-parallel cut would split a byte, a layout block or a group (the dense rules).
    """
    if isinstance(qw, ExpertShardedWeight):
        raise TypeError(f"{name} is already sharded ({qw!r}); gather() it first to re-shard")
    e = check_stacked(qw, "shard_experts")
    if not isinstance(parallel, ExpertParallel):
        raise TypeError(f"shard_experts: parallel must be an ExpertParallel, got {type(parallel).__name__}")
    ep = parallel.expert_shards
    if e % ep:
        raise ShardingError(
            f"{name}: {e} experts do not split over the {ep} devices of mesh axis {parallel.expert_axis!r} "
            f"(rule: every device holds experts / ep whole experts). Fix: an expert axis whose size "
            f"divides {e}"
        )
    plan = parallel.plan(qw, name)  # raises for a tensor-parallel cut through a byte, block or group
    tp = parallel.tp_shards
    probe = ExpertShardedWeight(None, None, None, qw.shape, qw.group_size, qw.symmetric, qw.layout, parallel)
    codes_spec, scales_spec = probe.partition_specs()
    arrays: dict[str, Any] = {}
    for array in ARRAYS:
        a = getattr(qw, array)
        if a is None:
            arrays[array] = None
            continue
        sharding = NamedSharding(parallel.mesh, codes_spec if array == "codes" else scales_spec)
        local = plan.local_codes_shape if array == "codes" else plan.local_scales_shape
        axis = plan.codes_axis if array == "codes" else plan.scales_axis
        shape = list(local)
        shape[axis] *= tp
        if isinstance(a, jax.ShapeDtypeStruct):
            arrays[array] = jax.ShapeDtypeStruct((e, *shape), a.dtype, sharding=sharding)
            continue
        host = np.asarray(jax.device_get(a))
        if tp > 1:  # each expert cut into its tp blocks (padded on their own), laid side by side
            per_expert = [
                np.concatenate([cut_block(h, block_slice(plan, array, i)) for i in range(tp)], axis=axis)
                for h in host
            ]
            host = np.stack(per_expert)
        arrays[array] = jax.device_put(host, sharding)
    return ExpertShardedWeight(
        arrays["codes"],
        arrays["scales"],
        arrays["offsets"],
        qw.shape,
        qw.group_size,
        qw.symmetric,
        qw.layout,
        parallel,
    )


def sharded_ragged_matmul(
    x: Any, sw: ExpertShardedWeight, group_sizes: Any, *, implementation: str | None = None
) -> jax.Array:
    """``ragged_matmul`` of an :class:`ExpertShardedWeight` (module docstring): (rows, N) in x.dtype."""
    p = sw.parallel
    rows = x.shape[0]
    e_l = sw.num_experts // p.expert_shards
    codes_spec, scales_spec = sw.partition_specs()
    if p.split == "row":
        x_spec, out_spec = PartitionSpec(None, p.tp_axis), PartitionSpec()
    elif p.split == "column":
        x_spec, out_spec = PartitionSpec(), PartitionSpec(None, p.tp_axis)
    else:
        x_spec, out_spec = PartitionSpec(), PartitionSpec()
    if any(t == AxisType.Explicit for t in getattr(p.mesh, "axis_types", ())):
        x = jax.reshard(x, NamedSharding(p.mesh, x_spec))
        group_sizes = jax.reshard(group_sizes, NamedSharding(p.mesh, PartitionSpec()))
    arrays = (sw.codes, sw.scales) + (() if sw.offsets is None else (sw.offsets,))
    specs = (codes_spec, scales_spec) + (() if sw.offsets is None else (scales_spec,))
    sum_axes = tuple(a for a in (p.expert_axis, p.tp_axis if p.split == "row" else None) if a is not None)

    def per_device(x_l: jax.Array, gs: jax.Array, *local: jax.Array) -> jax.Array:
        qw = sw.local(local[0], local[1], local[2] if len(local) > 2 else None)
        first = 0 if p.expert_axis is None else jax.lax.axis_index(p.expert_axis) * e_l
        mine = jax.lax.dynamic_slice_in_dim(gs, first, e_l)
        # This device's rows start after every earlier expert's (clamped like ragged_matmul's own sizes).
        offset = jnp.minimum(jnp.sum(jnp.where(jnp.arange(gs.shape[0]) < first, jnp.maximum(gs, 0), 0)), rows)
        x_pad = jnp.pad(x_l, ((0, rows), (0, 0)))
        y = ragged_matmul(
            jax.lax.dynamic_slice_in_dim(x_pad, offset, rows), qw, mine, implementation=implementation
        )
        y = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((2 * rows, y.shape[1]), y.dtype), y, offset, 0)[
            :rows
        ]
        return jax.lax.psum(y, sum_axes) if sum_axes else y

    # check_vma=False: the per-device op's loops start from fresh zeros that then take device-varying
    # rows; the psum above makes the result replicated where out_specs says so. Jitted: called eagerly,
    # shard_map would run op by op, and one such per-op compile crashed XLA's CPU backend (jax 0.11.2).
    y = jax.jit(
        jax.shard_map(
            per_device,
            mesh=p.mesh,
            in_specs=(x_spec, PartitionSpec(), *specs),
            out_specs=out_spec,
            check_vma=False,
        )
    )(x, group_sizes, *arrays)
    return y


__all__ = ["ExpertParallel", "ExpertShardedWeight", "shard_experts", "sharded_ragged_matmul"]
