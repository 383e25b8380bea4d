"""Save and load a quantized NNX model's state with ``nybble.save`` / ``nybble.load``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from nybble.checkpoint import Header, load, read_header_of, save
from nybble.models.definitions.fuse import unfused_copy
from nybble.models.definitions.layers import QLinear
from nybble.models.definitions.moe import Experts, QExperts, Router
from nybble.models.placement.shard import checkpoint_placement
from nybble.models.quantization.methods import (
    ATTRIBUTE,
    describe,
    from_description,
    get_quantization,
    to_json,
)
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.stacked import in_default_layout, num_experts
from nybble.sharding import ShardedWeight


def save_model(path: str | os.PathLike[str], model: nnx.Module) -> Path:
    """Writes ``model``'s whole state (``nnx.to_pure_dict(nnx.state(model))``) to one safetensors file.

    ``QLinear`` weights are stored as ``QuantizedWeight`` entries (``<path>.qweight``). The method config
    of the ``nybble.models.quantize`` pass that made them is saved with them (``read_metadata(path)
    ["info"]["quantization"]``) and restored by :func:`load_model`.
    """
    config = get_quantization(model)
    info = None if config is None else {"quantization": describe(config)}
    # fused projections (nybble.models.definitions.fuse) are written one by one: the checkpoint's names stay
    return save(path, nnx.to_pure_dict(nnx.state(unfused_copy(model))), info=info)


def _shapes(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """Dotted state names and shapes of ``model`` (float or abstract); ``.qweight`` by logical shape."""
    is_qw = lambda x: isinstance(x, QuantizedWeight | ShardedWeight)
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)), is_leaf=is_qw)[0]
    return {
        ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): _logical_shape(leaf)
        for path, leaf in flat
    }


def _logical_shape(leaf: Any) -> tuple[int, ...]:
    """An array's shape; a quantized weight's (K, N) after a stack's leading axes (experts, K, N)."""
    if isinstance(leaf, QuantizedWeight):
        return (*leaf.scales.shape[:-2], *leaf.shape)
    return tuple(leaf.shape)


def check_checkpoint_fits(path: str | os.PathLike[str] | Header, model: nnx.Module) -> Header:
    """Refuses, from the header alone (milliseconds), a checkpoint written for another architecture.

    A float layer's ``<path>.kernel`` matches a saved ``<path>.qweight`` of the same logical (K, N).
    Raises ValueError naming how many entries differ and the first few; returns the checked header."""
    header = path if isinstance(path, Header) else read_header_of(path)
    norm = lambda d: {k.removesuffix(".qweight").removesuffix(".kernel"): v for k, v in d.items()}
    saved, want = norm(_routers_as_now(header.shapes(), model)), norm(_shapes(model))
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - set(want))
    differ = sorted(k for k in set(want) & set(saved) if tuple(want[k]) != tuple(saved[k]))
    if missing or extra or differ:
        parts = [f"{k}: saved {saved[k]}, this model {want[k]}" for k in differ[:3]]
        parts += [f"{k}: not in the checkpoint" for k in missing[:2]]
        parts += [f"{k}: not in this model" for k in extra[:2]]
        raise ValueError(
            f"{header.path} belongs to another model: {len(differ)} entries differ in shape, {len(missing)} "
            f"missing, {len(extra)} extra, of {len(want)} ({'; '.join(parts)}). Load it into the model "
            f"it was written for (the same --model as `nybble quantize`)"
        )
    return header


def _router_paths(model: nnx.Module) -> list[tuple[Any, ...]]:
    return [tuple(p) for p, m in nnx.iter_modules(model) if p and isinstance(m, Router)]


def _routers_as_now(shapes: dict[str, tuple[int, ...]], model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """Saved shapes with each MoE router as ``model`` holds it: files written before nybble's routers
    became a :class:`Router` (2026-12-07) hold an ``nnx.Linear`` kernel (hidden, experts) there."""
    shapes = dict(shapes)
    for p in _router_paths(model):
        name = ".".join(str(k) for k in p)
        old = shapes.pop(f"{name}.kernel", None)
        if old is not None and f"{name}.weight" not in shapes:
            shapes[f"{name}.weight"] = tuple(reversed(old))
    return shapes


def _load_routers(state_dict: Any, model: nnx.Module) -> None:
    """An older file's router kernels (hidden, experts) as :class:`Router` weights (experts, hidden)."""
    for p in _router_paths(model):
        try:
            entry = _get(state_dict, p)
        except (KeyError, TypeError):
            continue
        if isinstance(entry, dict) and "kernel" in entry and "weight" not in entry:
            entry["weight"] = entry.pop("kernel").T


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def load_model(
    path: str | os.PathLike[str],
    model: nnx.Module,
    *,
    mesh: Any = None,
    axis: str = "model",
    rules: Any = None,
) -> nnx.Module:
    """Fills ``model`` (same architecture, float or abstract from ``nnx.eval_shape``) from ``path``.

    Every ``nnx.Linear`` whose checkpoint entry is a ``QuantizedWeight`` becomes a ``QLinear``; all other
    state is replaced by the saved arrays. The model is modified in place and returned. Raises
    ``ValueError`` if the checkpoint does not fit the model.

    Without a ``mesh``, every int4 weight is stored in this machine's layout
    (``nybble.packing.default_layout()``: ``planes_nk_int4`` on NVIDIA GPUs without a nybble Mosaic GPU
    kernel), converted once here if the file holds another. With a ``mesh``, the checkpoint is read
    straight into arrays placed as ``nybble.models.shard(model, mesh, axis=axis, rules=rules)`` would place
    them (quantized layers as ``ShardedWeight``), each process reading only the bytes of its own shards, in
    the layout the file holds (the shard plan cuts that layout); start from an abstract model
    (``nnx.eval_shape``) and no process ever holds a whole copy.
    """
    header = check_checkpoint_fits(path, model)
    if mesh is None:
        # each int4 weight (plain or an expert stack) in this machine's layout, converted once here
        state_dict = jax.tree.map(
            lambda x: in_default_layout(x) if isinstance(x, QuantizedWeight) else x,
            load(path),
            is_leaf=lambda x: isinstance(x, QuantizedWeight),
        )
    else:
        state_dict = load(path, placement=checkpoint_placement(model, mesh, axis=axis, rules=rules))
    if not isinstance(state_dict, dict):
        raise ValueError(f"load_model: {path} does not hold a model state dict")
    _load_routers(state_dict, model)
    modules = {tuple(p): m for p, m in nnx.iter_modules(model)}
    for p, m in modules.items():
        if p and isinstance(m, Experts):  # an MoE expert stack saved int4: a QExperts
            _load_experts(state_dict, modules, p, m)
        if not p or not isinstance(m, nnx.Linear):
            continue
        try:
            entry = _get(state_dict, p)
        except (KeyError, TypeError):
            raise ValueError(f"load_model: the checkpoint has no entry for layer {p}") from None
        qw = entry.get("qweight") if isinstance(entry, dict) else None
        if not isinstance(qw, QuantizedWeight | ShardedWeight):
            continue
        if qw.shape != tuple(m.kernel.shape):
            raise ValueError(f"load_model: layer {p}: saved shape {qw.shape} != {tuple(m.kernel.shape)}")
        bias = entry.get("bias")
        if (bias is None) != (m.bias is None):
            raise ValueError(f"load_model: layer {p}: bias presence differs from the checkpoint")
        q = QLinear(qw, bias)
        parent = modules[p[:-1]]
        if isinstance(parent, nnx.Module) and isinstance(p[-1], str):
            setattr(parent, p[-1], q)
        else:
            parent[p[-1]] = q
    state = nnx.state(model)
    expected = nnx.to_pure_dict(state)
    is_qw = lambda x: isinstance(x, QuantizedWeight | ShardedWeight)
    exp_paths = {k for k, _ in jax.tree_util.tree_flatten_with_path(expected, is_leaf=is_qw)[0]}
    got_paths = {k for k, _ in jax.tree_util.tree_flatten_with_path(state_dict, is_leaf=is_qw)[0]}
    if exp_paths != got_paths:
        missing = sorted(jax.tree_util.keystr(k) for k in exp_paths - got_paths)
        extra = sorted(jax.tree_util.keystr(k) for k in got_paths - exp_paths)
        raise ValueError(
            f"load_model: {path} does not fit this model: missing {missing[:5]}, extra {extra[:5]}"
        )
    for k, leaf in jax.tree_util.tree_flatten_with_path(expected, is_leaf=is_qw)[0]:
        saved = _get(state_dict, tuple(getattr(x, "key", getattr(x, "idx", x)) for x in k))
        if not is_qw(leaf) and tuple(saved.shape) != tuple(leaf.shape):
            raise ValueError(
                f"load_model: {jax.tree_util.keystr(k)}: saved shape {tuple(saved.shape)} != "
                f"{tuple(leaf.shape)}"
            )
    nnx.replace_by_pure_dict(state, state_dict)
    nnx.update(model, state)
    quantization = header.info.get("quantization")
    setattr(model, ATTRIBUTE, None if quantization is None else to_json(from_description(quantization)))
    return model


def _load_experts(state_dict: Any, modules: dict, p: tuple[Any, ...], m: Any) -> None:
    """Puts a ``QExperts`` where a float expert stack is, when its checkpoint entry is a stacked weight."""
    try:
        entry = _get(state_dict, p)
    except (KeyError, TypeError):
        raise ValueError(f"load_model: the checkpoint has no entry for expert stack {p}") from None
    qw = entry.get("qweight") if isinstance(entry, dict) else None
    if not isinstance(qw, QuantizedWeight):
        return
    want = tuple(m.kernel.shape)
    if (num_experts(qw), *qw.shape) != want:
        raise ValueError(
            f"load_model: expert stack {p}: saved {num_experts(qw)} experts of {qw.shape} != {want}"
        )
    setattr(modules[p[:-1]], p[-1], QExperts(qw))


__all__ = ["check_checkpoint_fits", "load_model", "save_model"]
