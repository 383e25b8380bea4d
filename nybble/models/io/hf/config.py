"""config.json of a Hugging Face checkpoint directory ->
:class:`~nybble.models.definitions.llama.LlamaConfig`.

Architectures (``model_type``): ``llama`` (Llama 2, 3, 3.1, 3.2), ``mistral``, ``qwen2``, ``qwen3``, and the
mixtures of experts ``mixtral`` and ``qwen3_moe`` (``LlamaConfig.moe``, ``nybble.models.definitions.moe``).
RoPE is
read in both spellings found in the wild: ``rope_theta`` + ``rope_scaling`` (transformers 4, most of the Hub)
and transformers 5's ``rope_parameters``. Every key that would change the numbers and that the decoder does
not implement is a ``ValueError`` naming the key and its value: a checkpoint is never silently run as a
different model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from nybble.models.definitions.llama import LlamaConfig, RopeScaling
from nybble.models.definitions.moe import MoEConfig
from nybble.models.io.hf.files import local_dir

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "swish")  # transformers' ACT2FN: both are x * sigmoid(x)

# transformers' defaults where config.json may omit a key (LlamaConfig / MistralConfig / Qwen2Config /
# Qwen3Config all agree on these).
_DEFAULTS: dict[str, Any] = {
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}

# Keys that other architectures use to change the numbers; on these four families each must be absent or
# hold its neutral value, else the checkpoint is not the model we would build.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "partial_rotary_factor": (None, 1, 1.0),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logits_scaling": (None, 1, 1.0),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "query_pre_attn_scalar": (None,),
    "no_rope_layers": (None,),
    "num_experts": (None, 0),
    "num_local_experts": (None, 0),
    "mlp_bias": (None, False),
    "pretraining_tp": (None, 1),
}


class ConfigError(ValueError):
    """config.json asks for something nybble's decoder does not implement (or is malformed)."""


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed config.json of the local checkpoint directory ``path`` (a hub id or URL: an error saying
    to download it first)."""
    d = local_dir(path, "read_config")
    f = d / "config.json"
    if not f.is_file():
        raise FileNotFoundError(
            f"{d} has no config.json; a Hugging Face checkpoint directory holds config.json beside its "
            "safetensors files (save_pretrained writes both)"
        )
    try:
        config = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{f} holds a {type(config).__name__}, expected a JSON object")
    return config


def _int(config: Mapping[str, Any], key: str, default: Any = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        if value is None:
            raise ConfigError(f"config.json: {key} is missing (a positive integer is required)")
        raise ConfigError(f"config.json: {key} = {value!r}, expected a positive integer")
    return value


def _float(config: Mapping[str, Any], key: str, default: Any) -> float:
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"config.json: {key} = {value!r}, expected a positive number")
    return float(value)


def _rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from either spelling."""
    scaling = config.get("rope_scaling")
    params = config.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"config.json: {key} = {value!r}, expected an object or null")
    if params is not None and params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(
            f"config.json: rope_parameters per layer type ({sorted(params)}) is not supported; "
            "nybble's decoder uses one rotary embedding for every layer"
        )
    merged: dict[str, Any] = {}
    where: dict[str, str] = {}
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        for k, v in (value or {}).items():
            k = "rope_type" if k == "type" else k  # transformers 4.3x wrote "type"
            if k in merged and merged[k] != v:
                raise ConfigError(
                    f"config.json: {where[k]}.{k} = {merged[k]!r} disagrees with {key}.{k} = {v!r}"
                )
            merged[k], where[k] = v, key
    theta_top = config.get("rope_theta")
    theta_in = merged.get("rope_theta")
    if theta_top is not None and theta_in is not None and float(theta_top) != float(theta_in):
        raise ConfigError(
            f"config.json: rope_theta = {theta_top!r} disagrees with {where['rope_theta']}.rope_theta = "
            f"{theta_in!r}"
        )
    theta = _float(
        {"rope_theta": theta_in if theta_in is not None else theta_top}, "rope_theta", _DEFAULTS["rope_theta"]
    )
    rope_type = merged.get("rope_type", "default")
    src = where.get("rope_type", "rope_scaling")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"config.json: {src}.rope_type = {rope_type!r} is not supported; supported rope types: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = merged.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ConfigError(
            f"config.json: {where['partial_rotary_factor']}.partial_rotary_factor = {partial!r} is not "
            "supported (rotary embedding over the whole head only)"
        )
    attention_factor = merged.get("attention_factor")
    if attention_factor not in (None, 1, 1.0):
        raise ConfigError(
            f"config.json: {where['attention_factor']}.attention_factor = {attention_factor!r} is not "
            "supported (only 1.0)"
        )
    if rope_type == "default":
        return theta, None
    # As transformers: a top-level original_max_position_embeddings, else max_position_embeddings, stands in.
    top_original = config.get("original_max_position_embeddings")
    inner = merged.get("original_max_position_embeddings")
    if top_original is not None and inner is not None and top_original != inner:
        raise ConfigError(
            f"config.json: original_max_position_embeddings = {top_original!r} disagrees with "
            f"{where['original_max_position_embeddings']}.original_max_position_embeddings = {inner!r}"
        )
    if inner is None:
        merged["original_max_position_embeddings"] = (
            top_original if top_original is not None else config.get("max_position_embeddings")
        )
    need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in need if merged.get(k) is None]
    if missing:
        raise ConfigError(f"config.json: {src} with rope_type 'llama3' lacks {', '.join(missing)}")
    try:
        scaled = RopeScaling(
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.json: {src} (rope_type 'llama3'): {e}") from None
    return theta, scaled


def _sliding_window(config: Mapping[str, Any], model_type: str) -> int | None:
    """Mistral's window (applied by the decoder's mask); Qwen's windowed layers are refused if enabled."""
    layer_types = config.get("layer_types")
    if layer_types is not None:
        kinds = set(layer_types)
        if not kinds <= {"full_attention", "sliding_attention"}:
            raise ConfigError(f"config.json: layer_types holds {sorted(kinds)}, only full/sliding attention")
        if kinds == {"full_attention", "sliding_attention"}:
            raise ConfigError(
                "config.json: layer_types mixes full_attention and sliding_attention layers; nybble's "
                "decoder uses one attention kind for every layer"
            )
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if config.get("use_sliding_window"):
            raise ConfigError(
                f"config.json: use_sliding_window = {config['use_sliding_window']!r} "
                f"(sliding_window = {config.get('sliding_window')!r}, max_window_layers = "
                f"{config.get('max_window_layers')!r}) is not supported; only full attention for {model_type}"
            )
        if layer_types is not None and "sliding_attention" in layer_types:
            raise ConfigError(
                f"config.json: layer_types has sliding_attention layers, not supported for {model_type}"
            )
        return None
    window = config.get("sliding_window")
    if model_type in ("mistral", "mixtral"):
        if window is None:
            return None
        return _int(config, "sliding_window")
    # llama: no sliding window in transformers' Llama; a set one would be ignored there, refuse it here.
    if window is not None or (layer_types is not None and "sliding_attention" in layer_types):
        raise ConfigError(f"config.json: sliding_window = {window!r} is not part of the llama architecture")
    return None


def _biases(config: Mapping[str, Any], model_type: str) -> bool:
    """Whether q/k/v_proj have biases (Qwen2 always, the others never)."""
    attention_bias = config.get("attention_bias")
    if model_type == "qwen2":
        # transformers' Qwen2Attention hard-codes q/k/v biases and no o_proj bias.
        if attention_bias not in (None, True, False):
            raise ConfigError(f"config.json: attention_bias = {attention_bias!r}, expected true/false")
        return True
    if attention_bias not in (None, False):
        raise ConfigError(
            f"config.json: attention_bias = {attention_bias!r} is not supported for {model_type} (biases on "
            "q/k/v/o_proj); supported: false (Qwen2's q/k/v biases come with model_type qwen2)"
        )
    return False


def decoder_config_from_hf(config: Mapping[str, Any]) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face config.json (as a dict, e.g. from :func:`read_config`).

    Raises ``ConfigError`` (a ``ValueError``) naming the key and value of anything that changes the numbers
    and is not implemented: another ``model_type`` or rope type, an unknown ``hidden_act``, bias flags the
    architecture does not have, a sliding window other than Mistral's, per-layer attention kinds.
    ``quantization_config`` is not read here (see ``nybble.quant.formats.hf_scheme``).
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a dict (parsed config.json), got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"config.json: model_type = {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = config.get("hidden_act", config.get("hidden_activation", _DEFAULTS["hidden_act"]))
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(
            f"config.json: hidden_act = {act!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    for key, neutral in _NEUTRAL.items():
        if model_type in MOE_MODEL_TYPES and key in ("num_experts", "num_local_experts"):
            continue  # read by _moe
        value = config.get(key)
        if value is not None and value not in neutral:
            raise ConfigError(
                f"config.json: {key} = {value!r} is not supported for {model_type} "
                f"(only {' / '.join(repr(n) for n in neutral if n is not None) or 'absent or null'})"
            )
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    kv_heads = heads if config.get("num_key_value_heads") is None else _int(config, "num_key_value_heads")
    head_dim = config.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(
                f"config.json: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) "
                "and head_dim is not given"
            )
        head_dim = hidden // heads
    else:
        head_dim = _int(config, "head_dim")
    if heads % kv_heads:
        raise ConfigError(
            f"config.json: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
            f"({kv_heads})"
        )
    theta, scaling = _rope(config)
    tie = config.get("tie_word_embeddings", _DEFAULTS["tie_word_embeddings"])
    if not isinstance(tie, bool):
        raise ConfigError(f"config.json: tie_word_embeddings = {tie!r}, expected true/false")
    moe, moe_layers = _moe(config, model_type, hidden)
    return LlamaConfig(
        vocab_size=_int(config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(config, "intermediate_size"),
        moe=moe,
        moe_layers=moe_layers,
        num_layers=_int(config, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_eps=_float(config, "rms_norm_eps", _DEFAULTS["rms_norm_eps"]),
        tie_embeddings=tie,
        qkv_bias=_biases(config, model_type),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope_scaling=scaling,
        sliding_window=_sliding_window(config, model_type),
    )


def _moe(config: Mapping[str, Any], model_type: str, hidden: int) -> tuple[Any, tuple[int, ...] | None]:
    """(MoEConfig, MoE layer indices or None for all) of a Mixtral / Qwen3-MoE config; (None, None) else.

    Mixtral: every layer, experts of ``intermediate_size``, top-k renormalized. Qwen3-MoE (as
    transformers' Qwen3MoeDecoderLayer): layer i is sparse when i is not in ``mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0``; experts of ``moe_intermediate_size``, ``norm_topk_prob``.
    The expert count is ``num_experts`` (the Hub's Qwen spelling) or ``num_local_experts``.
    """
    if model_type not in MOE_MODEL_TYPES:
        return None, None
    keys = [k for k in ("num_local_experts", "num_experts") if config.get(k) is not None]
    if not keys:
        raise ConfigError(f"config.json: a {model_type} config needs num_local_experts or num_experts")
    experts = {k: _int(config, k) for k in keys}
    if len(set(experts.values())) > 1:
        raise ConfigError(f"config.json: num_local_experts and num_experts disagree ({experts})")
    num_experts = next(iter(experts.values()))
    top_k = _int(config, "num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"config.json: num_experts_per_tok = {top_k} > the {num_experts} experts")
    layers = _int(config, "num_hidden_layers")
    if model_type == "mixtral":
        jitter = config.get("router_jitter_noise")
        if jitter not in (None, 0, 0.0):  # training-time noise only, but say so rather than guess
            raise ConfigError(
                f"config.json: router_jitter_noise = {jitter!r}; nybble routes without noise (only 0)"
            )
        moe = MoEConfig(hidden, _int(config, "intermediate_size"), num_experts, top_k, norm_topk_prob=True)
        return moe, None
    norm = config.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ConfigError(f"config.json: norm_topk_prob = {norm!r}, expected true/false")
    step = _int(config, "decoder_sparse_step", 1)
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < layers for i in only):
        raise ConfigError(f"config.json: mlp_only_layers = {only!r}, expected layer indices in [0, {layers})")
    for key in ("shared_expert_intermediate_size", "first_k_dense_replace", "n_shared_experts"):
        if config.get(key) not in (None, 0):
            raise ConfigError(
                f"config.json: {key} = {config[key]!r} is not part of the qwen3_moe architecture"
            )
    moe = MoEConfig(hidden, _int(config, "moe_intermediate_size"), num_experts, top_k, norm_topk_prob=norm)
    sparse = tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0)
    return moe, sparse


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def model_type_for(cfg: LlamaConfig) -> str:
    """The ``model_type`` whose architecture is ``cfg``'s (``ConfigError`` if no one of the four is)."""
    if cfg.qkv_bias and cfg.qk_norm:
        raise ConfigError("no Hugging Face architecture has both q/k/v biases (qwen2) and q/k norms (qwen3)")
    if cfg.sliding_window is not None and (cfg.qkv_bias or cfg.qk_norm):
        raise ConfigError("a sliding window goes with model_type mistral, which has no biases or q/k norms")
    if cfg.moe is not None:
        if cfg.qkv_bias or cfg.moe.shared_intermediate_size is not None:
            raise ConfigError("no supported MoE architecture has q/k/v biases or shared experts")
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    if cfg.sliding_window is not None:
        return "mistral"
    return "llama"


def hf_config_for(
    cfg: LlamaConfig, *, model_type: str | None = None, dtype: str = "bfloat16", **extra: Any
) -> dict[str, Any]:
    """A config.json dict for ``cfg`` that transformers (4 and 5) and vLLM read as the same model.

    The inverse of :func:`decoder_config_from_hf` (``decoder_config_from_hf(hf_config_for(c)) == c``).
    RoPE in the transformers 4 spelling (``rope_theta`` + ``rope_scaling``), which transformers 5 reads too.
    ``extra`` keys (``max_position_embeddings``, ``bos_token_id``, ...) are added as given.
    """
    model_type = model_type or model_type_for(cfg)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}")
    scaling = cfg.rope_scaling
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None
        if scaling is None
        else {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype,  # transformers 4's key; 5 reads it and writes "dtype"
    }
    if model_type in ("llama", "qwen3"):
        out.update(attention_bias=False)
    if model_type == "llama":
        out.update(mlp_bias=False)
    if model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        out.update(use_sliding_window=False, sliding_window=None)
    if model_type in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window
    if model_type == "mixtral":
        out.update(intermediate_size=cfg.moe.intermediate_size, num_local_experts=cfg.moe.num_experts,
                   num_experts_per_tok=cfg.moe.top_k)
    if model_type == "qwen3_moe":
        sparse = range(cfg.num_layers) if cfg.moe_layers is None else cfg.moe_layers
        out.update(
            attention_bias=False,
            num_experts=cfg.moe.num_experts,
            num_experts_per_tok=cfg.moe.top_k,
            moe_intermediate_size=cfg.moe.intermediate_size,
            norm_topk_prob=cfg.moe.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(cfg.num_layers) if i not in sparse],
        )
    out.update(extra)
    if decoder_config_from_hf(out) != cfg:
        raise ConfigError(f"config for {model_type} does not describe {cfg} (extra keys {sorted(extra)})")
    return out


__all__ = [
    "SUPPORTED_ACTIVATIONS",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "ConfigError",
    "decoder_config_from_hf",
    "hf_config_for",
    "model_type_for",
    "read_config",
]
