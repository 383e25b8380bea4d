"""Tensor-parallel placement of a Flax NNX model on a device mesh: ``nybble.models.shard``.

Megatron-style by default, for our Llama (and any model whose module names match): attention's q/k/v and
the MLP's gate/up are column-parallel (their outputs stay split along features), o and down row-parallel
(their partial outputs summed by one all-reduce per block), the embedding table split along the vocabulary,
an untied LM head column-parallel (logits split along the vocabulary; a tied head uses the embedding's
split), everything else replicated. ``QLinear`` weights become :class:`nybble.sharding.ShardedWeight`
(the kernel runs once per shard); float ``nnx.Linear``/``nnx.Embed`` parameters get a ``NamedSharding`` and
XLA's SPMD partitioner does the rest. The same decisions place a checkpoint as it is read
(``nybble.models.load_model(path, model, mesh=mesh)``), each process reading only its shards.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from nybble.models.definitions.fuse import unfuse_projections
from nybble.models.definitions.layers import QLinear
from nybble.models.definitions.moe import Experts, QExperts
from nybble.models.quantization.rules import warn_unmatched
from nybble.sharding import ShardedWeight, ShardingError, TensorParallel, shard_weight
from nybble.sharding.experts import ExpertParallel, ExpertShardedWeight, shard_experts

Placement = Literal["column", "row", "replicate"]
PLACEMENTS: tuple[str, ...] = ("column", "row", "replicate")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardRule:
    """Where the layers whose module path matches ``pattern`` go; rules are searched in order.

    Attributes:
      pattern: a regular expression searched in the dotted module path (``"layers.3.attn.q_proj"``).
      placement: ``"column"`` splits a layer's output features (an ``nnx.Embed``: its hidden features),
        ``"row"`` its input features (an ``nnx.Embed``: its vocabulary rows), ``"replicate"`` keeps a
        whole copy on every device.
    """

    pattern: str
    placement: Placement

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"ShardRule: invalid regular expression {self.pattern!r}: {e}") from None
        if self.placement not in PLACEMENTS:
            raise ValueError(f"ShardRule: placement must be one of {PLACEMENTS}, got {self.placement!r}")

    def matches(self, path: str) -> bool:
        return re.search(self.pattern, path) is not None


DEFAULT_SHARD_RULES: tuple[ShardRule, ...] = (
    ShardRule(pattern=r"(^|\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)$", placement="column"),
    ShardRule(pattern=r"(^|\.)(o_proj|down_proj)$", placement="row"),
    ShardRule(pattern=r"(^|\.)(embed|embed_tokens|wte)$", placement="row"),  # vocabulary-parallel table
    ShardRule(pattern=r"(^|\.)(lm_head|output)$", placement="column"),  # logits split along the vocabulary
)
"""Checked after the caller's rules. Layers no rule matches are replicated."""

SHARDABLE = (QLinear, nnx.Linear, nnx.Embed, QExperts, Experts)


@dataclasses.dataclass(frozen=True)
class ShardedLayer:
    """One layer's placement: its module path, type, placement and bytes per device."""

    path: str
    kind: str
    placement: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    bytes_per_device: int


@dataclasses.dataclass
class ShardReport:
    """What ``shard`` did: each shardable layer's placement, and the bytes one device holds."""

    mesh_shape: dict[str, int]
    axis: str
    layers: list[ShardedLayer] = dataclasses.field(default_factory=list)
    bytes_per_device: int = 0
    unmatched_rules: list[ShardRule] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.placement] = counts.get(layer.placement, 0) + 1
        lines = [
            f"nybble.models.shard: mesh {self.mesh_shape}, tensor-parallel axis {self.axis!r}: "
            + ", ".join(f"{n} {p}" for p, n in sorted(counts.items()))
            + f"; {self.bytes_per_device / 2**20:.2f} MiB of parameters per device"
        ]
        lines += [f"  warning: rule {r.pattern!r} matched no layer" for r in self.unmatched_rules]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _path(p: Sequence[Any]) -> str:
    return ".".join(str(k) for k in p)


def decide(path: str, rules: Sequence[ShardRule]) -> str:
    """The placement of the layer at ``path``: the first matching rule of ``rules``, then the defaults."""
    for rule in (*rules, *DEFAULT_SHARD_RULES):
        if rule.matches(path):
            return rule.placement
    return "replicate"


def check_rules(rules: Sequence[ShardRule] | ShardRule | None) -> tuple[ShardRule, ...]:
    if rules is None:
        return ()
    rules = (rules,) if isinstance(rules, ShardRule) else tuple(rules)
    for r in rules:
        if not isinstance(r, ShardRule):
            raise TypeError(f"rules must be ShardRule instances, got {type(r).__name__}: {r!r}")
    return rules


def array_spec(kind: str, attr: str, placement: str, axis: str) -> PartitionSpec:
    """The ``PartitionSpec`` of parameter ``attr`` of a ``kind`` layer ("Linear", "QLinear", "Embed")."""
    if placement == "replicate":
        return PartitionSpec()
    if attr == "bias":  # (N,): split with the outputs of a column-parallel layer, else whole
        return PartitionSpec(axis) if placement == "column" else PartitionSpec()
    if attr in ("kernel", "embedding"):  # (K, N) / (vocab, hidden): "row" splits axis 0
        return PartitionSpec(None, axis) if placement == "column" else PartitionSpec(axis, None)
    return PartitionSpec()


def _check_divisible(path: str, attr: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Any) -> None:
    for dim, name in enumerate(spec):
        if name is None:
            continue
        size = mesh.shape[name]
        if shape[dim] % size:
            raise ShardingError(
                f"{path}.{attr}: dimension {dim} of shape {shape} is not a multiple of the {size} devices of "
                f"mesh axis {name!r} (rule: equal shards). Fix: a ShardRule(pattern=..., "
                f"placement='replicate') for this layer, or a mesh axis of a size dividing {shape[dim]}"
            )


def leaf_placement(
    kind: str, attr: str, placement: str, mesh: Any, axis: str, *, path: str, shape: tuple[int, ...]
) -> Any:
    """Where one parameter goes: a ``TensorParallel`` for a quantized weight that is split, else a
    ``NamedSharding`` (checked for equal shards)."""
    if attr == "qweight" and placement in ("column", "row"):
        return TensorParallel(mesh, placement, axis)  # type: ignore[arg-type]
    spec = array_spec(kind, attr, placement, axis)
    _check_divisible(path, attr, shape, spec, mesh)
    return NamedSharding(mesh, spec)


def check_mesh(mesh: Any, axis: str) -> Any:
    """The mesh the model is placed on: ``mesh`` itself when its axes are ``AxisType.Auto``, else the same
    devices and names with Auto axes. ``jax.make_mesh``'s default is Explicit axes; the model's float ops
    (embedding gather, attention) are partitioned by XLA's sharding propagation, which Auto axes leave
    to it, so an Explicit mesh is taken as its Auto twin rather than refused."""
    if axis not in getattr(mesh, "axis_names", ()):
        raise ValueError(
            f"mesh axis {axis!r} is not among the mesh's axes {tuple(mesh.axis_names)}; name the "
            f"tensor-parallel axis with axis=..."
        )
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _layers(model: nnx.Module) -> list[tuple[str, Any]]:
    return [(_path(p), m) for p, m in nnx.iter_modules(model) if p and isinstance(m, SHARDABLE)]


def _kind(module: Any) -> str:
    if isinstance(module, QExperts | Experts):
        return type(module).__name__
    return (
        "QLinear" if isinstance(module, QLinear) else "Embed" if isinstance(module, nnx.Embed) else "Linear"
    )


def _nbytes_local(a: Any) -> int:
    shards = a.sharding.shard_shape(a.shape) if hasattr(a, "sharding") else a.shape
    return int(np.prod(shards)) * np.dtype(a.dtype).itemsize


def shard(
    model: nnx.Module,
    mesh: Any,
    *,
    axis: str = "model",
    rules: Sequence[ShardRule] | ShardRule | None = None,
    return_report: bool = False,
    expert_axis: str | None = None,
) -> Any:
    """Places ``model``'s parameters on ``mesh``, tensor-parallel over mesh axis ``axis``; in place.

    Args:
      model: a Flax NNX model (``QLinear`` layers after ``nybble.models.quantize``, or float ones).
      mesh: a ``jax.sharding.Mesh``, Auto or Explicit axes (``jax.make_mesh``'s default; the model is then
        placed on the same devices with Auto axes: its float ops rely on sharding propagation). The axis
        ``axis`` is the tensor-parallel
        one; the weights are replicated over the others (and ``nybble.matmul`` splits the rows of x over
        them).
      axis: the tensor-parallel mesh axis.
      rules: :class:`ShardRule` s checked before :data:`DEFAULT_SHARD_RULES` (Megatron placement);
        layers no rule matches, and all other parameters (norms), are replicated.
      return_report: return ``(model, ShardReport)``.
      expert_axis: MoE expert stacks (``nybble.models.definitions.moe``; paths
      ``...experts.{gate,up,down}_proj``) are
        split over this mesh axis, E / size whole experts a device (expert parallelism), and inside each
        expert by their rule's placement over ``axis`` (the defaults: gate/up column, down row), unless
        ``axis`` is ``expert_axis`` itself. None: experts are only tensor-parallel, over ``axis``. Int4 stacks
        become :class:`nybble.sharding.ExpertShardedWeight` s; float ones get a ``NamedSharding``.

    Raises :class:`nybble.sharding.ShardingError` naming the layer, the rule and a fix when a placement
    cannot be honoured (a split through a quantization group, uneven shards): nothing is silently replicated.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"shard expects a flax.nnx.Module, got {type(model).__name__}")
    unfuse_projections(model)  # the rules place q/k/v and gate/up one by one (exact)
    mesh = check_mesh(mesh, axis)
    if expert_axis is not None:
        check_mesh(mesh, expert_axis)
    rules = check_rules(rules)
    layers = _layers(model)
    report = ShardReport(dict(mesh.shape), axis)
    report.unmatched_rules = warn_unmatched(rules, [p for p, _ in layers], "layer")  # type: ignore[arg-type]
    # Decide and check every layer first, so that an error leaves the model as it was.
    planned = []
    for path, module in layers:
        placement = decide(path, rules)
        kind = _kind(module)
        if kind in ("QExperts", "Experts"):
            planned.append(_plan_experts(path, module, kind, placement, mesh, axis, expert_axis))
            continue
        if kind == "QLinear":
            qw = module.weight
            qw = qw.gather() if isinstance(qw, ShardedWeight) else qw
            target = leaf_placement(kind, "qweight", placement, mesh, axis, path=path, shape=qw.shape)
            new = shard_weight(qw, target, name=path) if isinstance(target, TensorParallel) else None
            planned.append((path, module, kind, placement, qw, new, target))
        else:
            attr = "embedding" if kind == "Embed" else "kernel"
            shape = tuple(getattr(module, attr).shape)
            target = leaf_placement(kind, attr, placement, mesh, axis, path=path, shape=shape)
            planned.append((path, module, kind, placement, None, None, target))
        bias = getattr(module, "bias", None)
        if bias is not None:
            leaf_placement(kind, "bias", placement, mesh, axis, path=path, shape=tuple(bias.shape))
    for path, module, kind, placement, qw, new, target in planned:
        if kind in ("QExperts", "Experts"):
            report.layers.append(_place_experts(path, module, kind, placement, new, target))
            continue
        if kind == "QLinear":
            value = new if new is not None else jax.device_put(qw, target)
            module.qweight.set_value(value)
            local = value.local_shape if isinstance(value, ShardedWeight) else value.shape
            nbytes = value.nbytes_per_device if isinstance(value, ShardedWeight) else value.nbytes
            shape = value.shape
        else:
            var = module.embedding if kind == "Embed" else module.kernel
            var.set_value(jax.device_put(var.get_value(), target))
            a = var.get_value()
            shape, local, nbytes = tuple(a.shape), tuple(target.shard_shape(a.shape)), _nbytes_local(a)
        if getattr(module, "bias", None) is not None:
            b = module.bias.get_value()
            module.bias.set_value(
                jax.device_put(b, NamedSharding(mesh, array_spec(kind, "bias", placement, axis)))
            )
        report.layers.append(ShardedLayer(path, kind, placement, tuple(shape), tuple(local), nbytes))
    _replicate_rest(model, mesh)
    report.bytes_per_device = sum(
        _nbytes_local(a) for a in jax.tree.leaves(nnx.state(model)) if hasattr(a, "dtype")
    )
    return (model, report) if return_report else model


def _plan_experts(
    path: str, module: Any, kind: str, placement: str, mesh: Any, axis: str, expert_axis: str | None
) -> tuple:
    """An expert stack's entry of ``shard``'s plan (checked now, placed later): experts over
    ``expert_axis``, each expert cut over ``axis`` by its placement."""
    split = placement if placement in ("column", "row") and axis != expert_axis else None
    if kind == "QExperts":
        qw = module.weight
        qw = qw.gather() if isinstance(qw, ExpertShardedWeight) else qw
        if split is None and expert_axis is None:
            return (path, module, kind, "replicate", qw, None, NamedSharding(mesh, PartitionSpec()))
        par = ExpertParallel(mesh, expert_axis, axis if split else None, split)  # type: ignore[arg-type]
        new = shard_experts(qw, par, name=path)
        label = ("expert" if expert_axis else "") + (f"+{split}" if expert_axis and split else split or "")
        return (path, module, kind, label, qw, new, None)
    shape = tuple(module.kernel.shape)
    parts: list[Any] = [expert_axis, None, None]
    if split is not None:
        parts[2 if split == "column" else 1] = axis
    spec = PartitionSpec(*parts)
    _check_divisible(path, "kernel", shape, spec, mesh)
    return (path, module, kind, placement, None, None, NamedSharding(mesh, spec))


def _place_experts(path: str, module: Any, kind: str, placement: str, new: Any, target: Any) -> ShardedLayer:
    if kind == "QExperts":
        value = new if new is not None else jax.device_put(module.weight, target)
        module.qweight.set_value(value)
        local = value.local_shape if isinstance(value, ExpertShardedWeight) else value.shape
        nbytes = value.nbytes_per_device if isinstance(value, ExpertShardedWeight) else value.nbytes
        shape = (
            value.num_experts if isinstance(value, ExpertShardedWeight) else module.num_experts,
            *value.shape,
        )
        return ShardedLayer(path, kind, placement, shape, tuple(local), nbytes)
    module.kernel.set_value(jax.device_put(module.kernel.get_value(), target))
    a = module.kernel.get_value()
    return ShardedLayer(
        path, kind, placement, tuple(a.shape), tuple(target.shard_shape(a.shape)), _nbytes_local(a)
    )


def _replicate_rest(model: nnx.Module, mesh: Any) -> None:
    """Every array of the model not yet on ``mesh`` gets a whole copy on each of its devices."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(a: Any) -> Any:
        if isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding) and a.sharding.mesh == mesh:
            return a
        return jax.device_put(a, replicated) if hasattr(a, "dtype") else a

    state = nnx.state(model)
    nnx.update(model, jax.tree.map(place, state))


def checkpoint_placement(
    model: nnx.Module, mesh: Any, *, axis: str = "model", rules: Sequence[ShardRule] | ShardRule | None = None
) -> Any:
    """A ``placement`` function for ``nybble.load`` placing a checkpoint of ``model`` as :func:`shard`
    would place the model: every leaf under a shardable layer by that layer's placement, the rest
    replicated."""
    mesh = check_mesh(mesh, axis)
    rules = check_rules(rules)
    layers = dict(_layers(model))

    def placement(leaf: Any) -> Any:
        *module_path, attr = leaf.path
        path = _path(module_path)
        module = layers.get(path)
        if module is None or isinstance(module, QExperts | Experts):  # expert stacks: whole, then shard()
            return NamedSharding(mesh, PartitionSpec())
        kind = "QLinear" if leaf.kind == "quantized" else _kind(module)
        return leaf_placement(kind, str(attr), decide(path, rules), mesh, axis, path=path, shape=leaf.shape)

    return placement


__all__ = [
    "DEFAULT_SHARD_RULES",
    "PLACEMENTS",
    "ShardReport",
    "ShardRule",
    "ShardedLayer",
    "checkpoint_placement",
    "shard",
]
