"""The one mapping between Hugging Face tensor names and nybble's ``Llama`` module paths.

HF (torch) ``nn.Linear`` weights are (out_features, in_features); nybble's ``nnx.Linear`` kernels and
``QuantizedWeight`` are (in, out). The transposes happen here, in :func:`to_nybble` / :func:`to_hf`, and
nowhere else. An MoE router's ``weight`` keeps HF's (experts, hidden) (``models.definitions.moe.Router``).

=======================================================  ==========================================
Hugging Face                                             nybble (module path, parameter)
=======================================================  ==========================================
``model.embed_tokens.weight``                            ``embed``, ``embedding``
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``     ``layers.{i}.attn.{q,k,v,o}_proj``, ``kernel``
``model.layers.{i}.self_attn.{q,k,v}_proj.bias``         ``layers.{i}.attn.{q,k,v}_proj``, ``bias``
``model.layers.{i}.self_attn.{q,k}_norm.weight``         ``layers.{i}.attn.{q,k}_norm``, ``weight``
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``      ``layers.{i}.mlp.{gate,up,down}_proj``, ``kernel``
``model.layers.{i}.input_layernorm.weight``              ``layers.{i}.input_norm``, ``weight``
``model.layers.{i}.post_attention_layernorm.weight``     ``layers.{i}.post_norm``, ``weight``
``model.norm.weight``                                    ``norm``, ``weight``
``lm_head.weight``                                       ``lm_head``, ``kernel`` (absent when tied)
=======================================================  ==========================================

Mixtures of experts (the MoE layers of ``mixtral`` / ``qwen3_moe``; :data:`MOE_NAMES`), each expert's
(out, in) weight transposed into its slice of a stacked (experts, in, out) kernel:

=========================================================  =============================================
``model.layers.{i}.block_sparse_moe.gate.weight`` (mixtral)  ``layers.{i}.mlp.router``, ``weight``
``model.layers.{i}.mlp.gate.weight`` (qwen3_moe)
``...block_sparse_moe.experts.{e}.w1/w3/w2.weight``          ``layers.{i}.mlp.experts.{gate,up,down}_proj``
(mixtral), ``...mlp.experts.{e}.{gate,up,down}_proj.weight``  ``kernel[e]`` (a stack (E, in, out))
(qwen3_moe)
``...mlp.experts.gate_up_proj`` (E, 2I, H) and                the same stacks (transformers 5's fused
``...mlp.experts.down_proj`` (E, H, I)                        in-memory names; gate first, then up)
=========================================================  =============================================
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np

from nybble.models.definitions.layers import QuantizedParam
from nybble.models.definitions.llama import LlamaConfig

# HF module-name suffix (inside model.layers.{i}.) -> nybble module-path suffix (inside layers.{i}.).
_LAYER_MODULES = {
    "self_attn.q_proj": "attn.q_proj",
    "self_attn.k_proj": "attn.k_proj",
    "self_attn.v_proj": "attn.v_proj",
    "self_attn.o_proj": "attn.o_proj",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_norm",
}
_LAYER_MODULES_INV = {v: k for k, v in _LAYER_MODULES.items()}
# MoE routers: both HF spellings read to one module (written back by the model_type: moe_router_names).
_ROUTER_MODULES = {"block_sparse_moe.gate": "mlp.router", "mlp.gate": "mlp.router"}
# Top-level HF module -> nybble module path.
_TOP_MODULES = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}
_TOP_MODULES_INV = {v: k for k, v in _TOP_MODULES.items()}

# The linear layers of a decoder block, as HF module-name suffixes (inside model.layers.{i}.).
LINEAR_MODULE_SUFFIXES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# (A router's ``weight`` is not one of them: it keeps HF's name and layout.)
_LINEARS = frozenset(_LAYER_MODULES[s] for s in LINEAR_MODULE_SUFFIXES) | {"lm_head"}

# Tensors some checkpoints carry that hold no weights of the model (old transformers saved the rotary
# inverse frequencies as a buffer): readers skip these.
IGNORED_TENSOR_PATTERNS = (re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"),)

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_NB_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def module_path_for_module(hf_module: str) -> str | None:
    """nybble module path of an HF module name (``model.layers.0.self_attn.q_proj`` ->
    ``layers.0.attn.q_proj``), or None if it is not part of the decoder."""
    if hf_module in _TOP_MODULES:
        return _TOP_MODULES[hf_module]
    m = _HF_LAYER.match(hf_module)
    if m and m.group(2) in _LAYER_MODULES:
        return f"layers.{int(m.group(1))}.{_LAYER_MODULES[m.group(2)]}"
    if m and m.group(2) in _ROUTER_MODULES:
        return f"layers.{int(m.group(1))}.{_ROUTER_MODULES[m.group(2)]}"
    return None


def hf_module_for(module_path: str) -> str:
    """HF module name of a nybble module path (the inverse of :func:`module_path_for_module`)."""
    if module_path in _TOP_MODULES_INV:
        return _TOP_MODULES_INV[module_path]
    m = _NB_LAYER.match(module_path)
    if m and m.group(2) in _LAYER_MODULES_INV:
        return f"model.layers.{int(m.group(1))}.{_LAYER_MODULES_INV[m.group(2)]}"
    raise KeyError(f"no Hugging Face name for nybble module path {module_path!r}")


def _param_of(module_path: str, hf_leaf: str) -> str | None:
    leaf_module = module_path.rsplit(".", 1)[-1]
    if leaf_module == "embed":
        return "embedding" if hf_leaf == "weight" else None
    is_linear = module_path.split(".", 2)[-1] in _LINEARS or module_path == "lm_head"
    if is_linear:
        return {"weight": "kernel", "bias": "bias"}.get(hf_leaf)
    return "weight" if hf_leaf == "weight" else None  # RMSNorm


def module_path_for(hf_name: str) -> tuple[str, str] | None:
    """``(module_path, param_name)`` of an HF tensor name (``model.layers.0.mlp.up_proj.weight`` ->
    ``("layers.0.mlp.up_proj", "kernel")``), or None for a name outside the float decoder (quantized
    tensors such as ``weight_packed``, ignored buffers, unknown names)."""
    if "." not in hf_name:
        return None
    module, leaf = hf_name.rsplit(".", 1)
    path = module_path_for_module(module)
    if path is None:
        return None
    param = _param_of(path, leaf)
    return None if param is None else (path, param)


def hf_name_for(module_path: str, param_name: str) -> str:
    """HF tensor name of a nybble parameter (``("layers.0.attn.q_proj", "kernel")`` ->
    ``model.layers.0.self_attn.q_proj.weight``)."""
    module = hf_module_for(module_path)
    leaf = {"kernel": "weight", "embedding": "weight", "weight": "weight", "bias": "bias"}.get(param_name)
    if leaf is None or module_path_for(f"{module}.{leaf}") != (module_path, param_name):
        raise KeyError(f"no Hugging Face name for {module_path}.{param_name}")
    return f"{module}.{leaf}"


def is_ignored(hf_name: str) -> bool:
    """True for tensors that hold no model weights (e.g. old checkpoints' ``rotary_emb.inv_freq``)."""
    return any(p.match(hf_name) for p in IGNORED_TENSOR_PATTERNS)


def to_nybble(param_name: str, array: np.ndarray) -> np.ndarray:
    """An HF tensor in nybble's layout: linear weights (out, in) -> kernels (in, out); others unchanged."""
    if param_name == "kernel":
        if array.ndim != 2:
            raise ValueError(f"a linear weight must be 2-D (out, in), got shape {array.shape}")
        return np.ascontiguousarray(array.T)
    return array


def to_hf(param_name: str, array: np.ndarray) -> np.ndarray:
    """A nybble parameter in HF's layout: kernels (in, out) -> linear weights (out, in); others unchanged."""
    if param_name == "kernel":
        if array.ndim != 2:
            raise ValueError(f"a kernel must be 2-D (in, out), got shape {array.shape}")
        return np.ascontiguousarray(array.T)
    return array


def float_hf_tensors(model: Any, *, skip_modules: Collection[str] = ()) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array in torch layout) for every float parameter of a ``Llama``, one at a time, in the
    model's order; parameters of the nybble module paths in ``skip_modules`` (e.g. the ``QLinear`` layers a
    quantized-format writer handles) are left out. Raises ``TypeError`` for a ``QLinear`` not skipped."""
    from flax import nnx

    for key_path, var in nnx.to_flat_state(nnx.state(model)):
        module_path = ".".join(str(k) for k in key_path[:-1])
        if module_path in skip_modules:
            continue
        if isinstance(var, QuantizedParam):
            raise TypeError(
                f"{module_path} is quantized (QLinear); pass it in skip_modules and write it "
                "with the quantized format's writer"
            )
        param = str(key_path[-1])
        moe = moe_path(module_path)
        if moe is not None and moe[1] == "router" and param == "weight":  # HF's layout, its model_type's name
            yield moe_router_names(moe[0], moe_model_type(model.config))[0], np.asarray(var.get_value())
            continue
        if moe is not None and param == "kernel":  # MoE: a float stack, expert by expert
            layer, what = moe
            model_type = moe_model_type(model.config)
            value = np.asarray(var.get_value())
            for e, module in enumerate(hf_expert_modules(layer, what, value.shape[0], model_type)):
                yield f"{module}.weight", np.ascontiguousarray(value[e].T)
            continue
        yield hf_name_for(module_path, param), to_hf(param, np.asarray(var.get_value()))


def hf_modules_of(cfg: LlamaConfig, module_path: str) -> list[str]:
    """HF module names a nybble module stands for: one, or each expert of an MoE expert stack."""
    moe = moe_path(module_path)
    if moe is None:
        return [hf_module_for(module_path)]
    layer, what = moe
    if what == "router":
        return [moe_router_names(layer, moe_model_type(cfg))[0].removesuffix(".weight")]
    return hf_expert_modules(layer, what, cfg.moe.num_experts, moe_model_type(cfg))


# Per MoE model_type: the HF module of a layer's MoE block, and each nybble expert stack's HF linear name.
MOE_NAMES: dict[str, dict[str, str]] = {
    "mixtral": {"block": "block_sparse_moe", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
    "qwen3_moe": {"block": "mlp", "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
}
EXPERT_STACKS = ("gate_proj", "up_proj", "down_proj")
_MOE_PATH = re.compile(r"^layers\.(\d+)\.mlp\.(router|experts\.(gate_proj|up_proj|down_proj))$")


def moe_model_type(cfg: LlamaConfig) -> str:
    """The MoE ``model_type`` (naming) of ``cfg``: qwen3_moe with q/k norms, else mixtral."""
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


def moe_router_names(layer: int, model_type: str) -> list[str]:
    """HF names a layer's router weight (experts, hidden) may have: the architecture's, then
    transformers 5's ``mlp.gate`` (the same for qwen3_moe)."""
    block = MOE_NAMES[model_type]["block"]
    names = [f"model.layers.{layer}.{block}.gate.weight", f"model.layers.{layer}.mlp.gate.weight"]
    return list(dict.fromkeys(names))


def hf_expert_modules(layer: int, stack: str, num_experts: int, model_type: str) -> list[str]:
    """HF module names of the experts of one stack (``gate_proj``/``up_proj``/``down_proj``), by expert."""
    names = MOE_NAMES[model_type]
    return [f"model.layers.{layer}.{names['block']}.experts.{e}.{names[stack]}" for e in range(num_experts)]


def fused_expert_names(layer: int) -> tuple[str, str]:
    """transformers 5's fused expert tensors of a layer: gate_up_proj (E, 2I, H), down_proj (E, H, I)."""
    return f"model.layers.{layer}.mlp.experts.gate_up_proj", f"model.layers.{layer}.mlp.experts.down_proj"


def is_router_module(hf_module: str) -> bool:
    """Whether an HF module name is an MoE router (``...block_sparse_moe.gate``, ``...mlp.gate``)."""
    m = _HF_LAYER.match(hf_module)
    return bool(m) and m.group(2) in _ROUTER_MODULES


def moe_path(module_path: str) -> tuple[int, str] | None:
    """(layer, "router" or the stack name) of a nybble MoE module path, or None."""
    m = _MOE_PATH.match(module_path)
    if m is None:
        return None
    return int(m.group(1)), m.group(3) or "router"


def hf_linear_modules(cfg: LlamaConfig) -> list[str]:
    """HF module names of every linear layer of ``cfg``'s decoder, in order (``lm_head`` last, if untied).

    An MoE layer lists its router (:func:`is_router_module`) and every expert's linears, expert by expert
    (:func:`hf_expert_modules`), instead of the dense MLP."""
    names = []
    for i in range(cfg.num_layers):
        for s in LINEAR_MODULE_SUFFIXES:
            if cfg.is_moe_layer(i) and s.startswith("mlp."):
                continue
            names.append(f"model.layers.{i}.{s}")
        if cfg.is_moe_layer(i):
            model_type = moe_model_type(cfg)
            names.append(moe_router_names(i, model_type)[0].removesuffix(".weight"))
            for stack in EXPERT_STACKS:
                names.extend(hf_expert_modules(i, stack, cfg.moe.num_experts, model_type))
    if not cfg.tie_embeddings:
        names.append("lm_head")
    return names


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every float tensor a checkpoint of ``cfg`` holds, HF name -> HF (torch) shape."""
    hd = cfg.head_dim
    assert hd is not None
    q, kv, h, f = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.hidden_size, cfg.intermediate_size
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    linear = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    mlp = {"gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        for name, shape in linear.items():
            out[f"{p}.self_attn.{name}.weight"] = shape
            if cfg.qkv_bias and name != "o_proj":
                out[f"{p}.self_attn.{name}.bias"] = (shape[0],)
        if cfg.is_moe_layer(i):  # router and per-expert weights, the architecture's own names
            moe, model_type = cfg.moe, moe_model_type(cfg)
            out[moe_router_names(i, model_type)[0]] = (moe.num_experts, h)
            shapes = {"gate_proj": (moe.intermediate_size, h), "up_proj": (moe.intermediate_size, h)}
            shapes["down_proj"] = (h, moe.intermediate_size)
            for stack, shape in shapes.items():
                for module in hf_expert_modules(i, stack, moe.num_experts, model_type):
                    out[f"{module}.weight"] = shape
        else:
            for name, shape in mlp.items():
                out[f"{p}.mlp.{name}.weight"] = shape
        if cfg.qk_norm:
            out[f"{p}.self_attn.q_norm.weight"] = (hd,)
            out[f"{p}.self_attn.k_norm.weight"] = (hd,)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


__all__ = [
    "EXPERT_STACKS",
    "IGNORED_TENSOR_PATTERNS",
    "LINEAR_MODULE_SUFFIXES",
    "MOE_NAMES",
    "expected_shapes",
    "float_hf_tensors",
    "fused_expert_names",
    "hf_expert_modules",
    "hf_linear_modules",
    "hf_module_for",
    "hf_modules_of",
    "hf_name_for",
    "is_ignored",
    "is_router_module",
    "module_path_for",
    "module_path_for_module",
    "moe_model_type",
    "moe_path",
    "moe_router_names",
    "to_hf",
    "to_nybble",
]
