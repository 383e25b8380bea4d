"""``from_pretrained``: a local Hugging Face checkpoint directory -> nybble's ``Llama``; ``load_tokenizer``.

The model is built abstract (``nnx.eval_shape``, no memory) and filled one tensor at a time from
``CheckpointDir`` (positioned reads, never a whole file): peak host memory is the model in ``dtype`` plus
one tensor. With ``quantization_config`` in config.json, each quantized linear is read by the format's
reader (``nybble.quant.formats.hf_scheme``) straight into a ``QuantizedWeight`` and becomes a ``QLinear``:
no float copy of it is ever made.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nybble.extras import require
from nybble.models.definitions.fuse import fuse_projections as fuse
from nybble.models.definitions.layers import QLinear
from nybble.models.definitions.llama import Llama, LlamaConfig
from nybble.models.definitions.moe import QExperts
from nybble.models.io.hf.config import decoder_config_from_hf
from nybble.models.io.hf.files import CheckpointDir, CheckpointError, local_dir
from nybble.models.io.hf.names import (
    EXPERT_STACKS,
    expected_shapes,
    fused_expert_names,
    hf_expert_modules,
    hf_linear_modules,
    hf_name_for,
    is_ignored,
    module_path_for_module,
    moe_model_type,
    moe_path,
    moe_router_names,
)
from nybble.models.placement.shard import checkpoint_placement, shard
from nybble.quant.formats.hf_scheme import scheme_from_config
from nybble.quant.stacked import stack_weights

TOKENIZER_FILE = "tokenizer.json"
# What a directory may hold instead of tokenizer.json (named in the error, with how to convert).
_OTHER_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")


def _scheme(config: dict[str, Any]) -> Any:
    """The quantization scheme of config.json's ``quantization_config`` (None: a float checkpoint)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    return scheme_from_config(qc)


def _getter(ckpt: CheckpointDir) -> Any:
    """``get(name)`` for the scheme's readers: the tensor, or None when absent (optional tensors)."""
    return lambda name: ckpt.get(name) if name in ckpt else None


def _module_at(model: nnx.Module, path: str) -> tuple[Any, str | int, Any]:
    """(parent, key, module) at dotted ``path`` (``layers.0.attn.q_proj``)."""
    parent: Any = None
    key: str | int = ""
    node: Any = model
    for part in path.split("."):
        parent, key = node, int(part) if part.isdigit() else part
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return parent, key, node


def _set_module(parent: Any, key: str | int, module: nnx.Module) -> None:
    if isinstance(key, int):
        parent[key] = module
    else:
        setattr(parent, key, module)


def _check_shape(ckpt: CheckpointDir, name: str, expected: tuple[int, ...]) -> None:
    got = ckpt.shape(name)
    if tuple(got) != tuple(expected):
        raise CheckpointError(
            f"{ckpt.path}: tensor {name!r} has shape {list(got)}, but config.json implies {list(expected)} "
            "(hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, "
            "vocab_size); "
            "the config and the weights come from different models"
        )


def _load_quantized(
    model: Llama, ckpt: CheckpointDir, cfg: LlamaConfig, scheme: Any, dtype: Any, expected: dict[str, Any]
) -> tuple[set[str], set[str]]:
    """Replaces every quantized linear by a ``QLinear`` read straight from the files.

    Returns (HF tensor names consumed, nybble module paths now quantized); removes the float weights of
    those layers from ``expected``.
    """
    used: set[str] = set()
    quantized: set[str] = set()
    for hf_module in hf_linear_modules(cfg):
        if not scheme.is_quantized(hf_module):
            continue
        path = module_path_for_module(hf_module)
        if path is None:  # an MoE expert's linear: its whole stack is read by _load_quantized_experts
            continue
        parent, key, linear = _module_at(model, path)
        names = list(scheme.tensor_names(hf_module, available=ckpt))
        missing = [n for n in names if n not in ckpt]
        if missing:
            raise CheckpointError(
                f"{ckpt.path}: quantized layer {hf_module!r} lacks {missing} (its quantization_config "
                f"names this layer as quantized; expected tensors {names})"
            )
        # perm: activation order with groups scattered over K (see QLinear.input_perm)
        qw, perm = scheme.read_linear_with_perm(
            hf_module, _getter(ckpt), in_features=linear.in_features, out_features=linear.out_features
        )
        if tuple(qw.shape) != (linear.in_features, linear.out_features):
            raise CheckpointError(
                f"{ckpt.path}: quantized layer {hf_module!r} reads as (in, out) {qw.shape}, but config.json "
                f"implies {(linear.in_features, linear.out_features)}"
            )
        bias = None
        bias_name = f"{hf_module}.bias"
        if bias_name in expected:
            _check_shape(ckpt, bias_name, expected.pop(bias_name))
            bias = jnp.asarray(ckpt.get_float(bias_name), dtype)
            used.add(bias_name)
        expected.pop(f"{hf_module}.weight", None)
        used.update(names)
        _set_module(parent, key, QLinear(qw, bias, input_perm=perm))
        quantized.add(path)
    _load_quantized_experts(model, ckpt, cfg, scheme, expected, used, quantized)
    return used, quantized


def _load_quantized_experts(
    model: Llama,
    ckpt: CheckpointDir,
    cfg: LlamaConfig,
    scheme: Any,
    expected: dict[str, Any],
    used: set[str],
    quantized: set[str],
) -> None:
    """Each MoE expert stack whose experts the scheme quantizes: read expert by expert (no float copy),
    stacked into one ``QExperts``. A stack with some experts quantized and some not is refused."""
    if cfg.moe is None:
        return
    model_type, e = moe_model_type(cfg), cfg.moe.num_experts
    for layer in range(cfg.num_layers):
        if not cfg.is_moe_layer(layer):
            continue
        for stack in EXPERT_STACKS:
            modules = hf_expert_modules(layer, stack, e, model_type)
            flags = [scheme.is_quantized(m) for m in modules]
            if not any(flags):
                continue
            if not all(flags):
                raise CheckpointError(
                    f"{ckpt.path}: of the experts {modules[0]} ... {modules[-1]}, "
                    f"{sum(flags)} of {e} are quantized: a stack of experts is held as one int4 weight, so "
                    "all or none of its experts must be quantized (quantization_config targets/ignore)"
                )
            path = f"layers.{layer}.mlp.experts.{stack}"
            parent, key, stacked = _module_at(model, path)
            weights = []
            for m in modules:
                names = list(scheme.tensor_names(m))
                missing = [n for n in names if n not in ckpt]
                if missing:
                    raise CheckpointError(f"{ckpt.path}: quantized expert {m!r} lacks {missing}")
                qw = scheme.read_linear(
                    m, ckpt.get, in_features=stacked.in_features, out_features=stacked.out_features
                )
                if tuple(qw.shape) != (stacked.in_features, stacked.out_features):
                    raise CheckpointError(
                        f"{ckpt.path}: quantized expert {m!r} reads as (in, out) {qw.shape}, but config.json "
                        f"implies {(stacked.in_features, stacked.out_features)}"
                    )
                weights.append(qw)
                used.update(names)
                expected.pop(f"{m}.weight", None)
            _set_module(parent, key, QExperts(stack_weights(weights)))
            quantized.add(path)


def _moe_names(ckpt: CheckpointDir, cfg: LlamaConfig, expected: dict[str, Any]) -> None:
    """``expected`` adjusted to the MoE spelling the checkpoint uses: a router under transformers 5's
    ``mlp.gate``, experts fused (``mlp.experts.gate_up_proj`` / ``down_proj``) instead of per expert."""
    if cfg.moe is None:
        return
    moe, model_type = cfg.moe, moe_model_type(cfg)
    for layer in range(cfg.num_layers):
        if not cfg.is_moe_layer(layer):
            continue
        router, *others = moe_router_names(layer, model_type)
        if router not in ckpt and router in expected:
            for other in others:
                if other in ckpt:
                    expected[other] = expected.pop(router)
        gate_up, down = fused_expert_names(layer)
        if gate_up in ckpt or down in ckpt:
            for stack in EXPERT_STACKS:
                for m in hf_expert_modules(layer, stack, moe.num_experts, model_type):
                    expected.pop(f"{m}.weight", None)
            h, i = cfg.hidden_size, moe.intermediate_size
            expected[gate_up] = (moe.num_experts, 2 * i, h)
            expected[down] = (moe.num_experts, h, i)


def _moe_value(ckpt: CheckpointDir, cfg: LlamaConfig, module_path: str, param: str) -> Any:
    """The nybble value of an MoE parameter from the checkpoint's tensors: a router's weight (E, hidden) as
    stored, an expert stack (E, in, out) transposed from torch's (out, in); None for any other parameter."""
    where = moe_path(module_path)
    if where is not None and where[1] == "router" and param == "weight":
        names = moe_router_names(where[0], moe_model_type(cfg))
        name = next((n for n in names if n in ckpt), None)
        return None if name is None else ckpt.get(name)
    if where is None or param != "kernel":
        return None
    layer, what = where
    model_type = moe_model_type(cfg)
    gate_up, down = fused_expert_names(layer)
    if gate_up in ckpt or down in ckpt:  # transformers 5's fused (E, out, in) tensors
        i = cfg.moe.intermediate_size
        if what == "down_proj":
            return np.transpose(ckpt.get(down), (0, 2, 1))
        fused = ckpt.get(gate_up)
        part = fused[:, :i] if what == "gate_proj" else fused[:, i:]
        return np.transpose(part, (0, 2, 1))
    modules = hf_expert_modules(layer, what, cfg.moe.num_experts, model_type)
    return np.stack([ckpt.get(f"{m}.weight").T for m in modules])


def from_pretrained(
    path: str | os.PathLike[str],
    dtype: Any = jnp.bfloat16,
    mesh: Any = None,
    *,
    axis: str = "model",
    rules: Any = None,
    expert_axis: str | None = None,
    fuse_projections: bool = False,
) -> Llama:
    """A Llama-family model from a local Hugging Face checkpoint directory.

    ``path`` holds config.json and ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``); ``model_type`` llama, mistral, qwen2, qwen3, mixtral or qwen3_moe (see
    :func:`nybble.models.io.hf.config.decoder_config_from_hf`). Float weights are cast to ``dtype``; with a
    ``quantization_config`` the quantized linears become ``QLinear`` layers (compressed-tensors, GPTQ, AWQ,
    AutoRound: see ``nybble.quant.formats.hf_scheme``) and the rest is float in ``dtype``.
    ``model(token_ids)`` returns float32 logits (batch, length, vocab); ``init_cache`` / ``prefill`` /
    ``decode_step`` work as on any ``Llama``. With ``mesh``, the model is placed by
    ``nybble.models.shard(model, mesh, axis=axis, rules=rules, expert_axis=expert_axis)`` (MoE expert
    stacks: whole on every device as read, then split over ``expert_axis`` and ``axis``).

    A hub id or URL is refused (download it first); a directory whose tensors do not fit config.json
    (missing, extra, mis-shaped, non-float where float is expected) raises ``CheckpointError`` naming the
    tensor. The tokenizer is separate: :func:`load_tokenizer`.

    ``fuse_projections=True`` (opt-in, for serving) builds q/k/v and gate/up as one layer each
    (``models.definitions.fuse``: one launch each in a decode step, the same numbers; ``attn.q_proj``
    still reads); not with ``mesh`` (the shard rules name the parts). Off by default: the model has the
    checkpoint's modules, one per Hugging Face projection.
    """
    if fuse_projections and mesh is not None:
        raise ValueError(
            "from_pretrained: fuse_projections=True cannot be combined with mesh= (the shard rules place "
            "q/k/v and gate/up one by one); load without fusing, or without a mesh"
        )
    ckpt = CheckpointDir(path)
    cfg = decoder_config_from_hf(ckpt.config)
    scheme = _scheme(ckpt.config)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    expected = expected_shapes(cfg)
    _moe_names(ckpt, cfg, expected)
    used: set[str] = set()
    quantized: set[str] = set()
    if scheme is not None:
        used, quantized = _load_quantized(model, ckpt, cfg, scheme, dtype, expected)
    missing = sorted(n for n in expected if n not in ckpt)
    if missing:
        raise CheckpointError(
            f"{ckpt.path}: {len(missing)} tensor(s) that config.json's architecture needs are missing, e.g. "
            f"{missing[:4]}; the weights are incomplete or belong to another model"
        )
    # A tied head may still be saved (older transformers did); transformers ignores it, and so do we.
    tolerated = {"lm_head.weight"} if cfg.tie_embeddings else set()
    extra = sorted(
        n
        for n in ckpt.names()
        if n not in expected and n not in used and n not in tolerated and not is_ignored(n)
    )
    if extra:
        raise CheckpointError(
            f"{ckpt.path}: {len(extra)} tensor(s) that the {ckpt.config.get('model_type')} decoder has no "
            f"place for, e.g. {extra[:4]}; the checkpoint is a variant nybble does not implement (or its "
            "quantization_config does not describe these tensors)"
        )
    for name, shape in expected.items():
        _check_shape(ckpt, name, shape)
    ckpt.require_float(list(expected), "a float weight of this checkpoint")

    place = None
    if mesh is not None:  # each float tensor goes straight to its shards, placed as shard() places it
        place = checkpoint_placement(model, mesh, axis=axis, rules=rules)
    graphdef, state = nnx.split(model)
    for key_path, var in nnx.to_flat_state(state):
        module_path = ".".join(str(k) for k in key_path[:-1])
        param = str(key_path[-1])
        if module_path in quantized:
            continue  # QLinear's qweight and bias are already concrete
        value = _moe_value(ckpt, cfg, module_path, param)  # router and expert stacks (MoE layers)
        if value is None:
            name = hf_name_for(module_path, param)
            value = ckpt.get(name)
            if param == "kernel":
                value = value.T  # torch (out, in) -> (in, out); see nybble.models.io.hf.names.to_nybble
        if place is None:
            var.set_value(jnp.asarray(value, dtype))
        else:
            leaf = SimpleNamespace(path=tuple(key_path), kind="float", shape=tuple(value.shape))
            var.set_value(jax.device_put(np.ascontiguousarray(value.astype(jnp.dtype(dtype))), place(leaf)))
        del value  # one tensor at a time
    model = nnx.merge(graphdef, state)
    if fuse_projections:
        fuse(model)
    if mesh is not None:
        # the QLinear layers and expert stacks; other float arrays are in place already
        shard(model, mesh, axis=axis, rules=rules, expert_axis=expert_axis)
    return model


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The ``tokenizers.Tokenizer`` of ``path``/tokenizer.json.

    Without tokenizer.json: ``FileNotFoundError`` naming the directory, what it holds instead, and how to
    write tokenizer.json (the model itself loads without it).
    """
    d = local_dir(path, "load_tokenizer")
    f = d / TOKENIZER_FILE
    if not f.is_file():
        others = [n for n in _OTHER_TOKENIZER_FILES if (d / n).is_file()]
        found = f"it holds {others}" if others else "it holds no tokenizer files at all"
        raise FileNotFoundError(
            f"{d}: no {TOKENIZER_FILE} ({found}); nybble reads the tokenizer from tokenizer.json only. The "
            "model loads without it (from_pretrained), but text in and out needs it: write it with "
            "transformers, `AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)`, or copy tokenizer.json "
            "from where the weights came from"
        )
    tokenizers = require("tokenizers", "load_tokenizer")
    return tokenizers.Tokenizer.from_file(str(f))


def read_generation_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``path``/generation_config.json as a dict (``bos_token_id``, ``eos_token_id``...), {} if absent."""
    f = local_dir(path, "read_generation_config") / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        out = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    return out if isinstance(out, dict) else {}


__all__ = ["from_pretrained", "load_tokenizer", "read_generation_config"]
