"""The models ``bench.decode`` counts: their Hugging Face config.json fields, mapped by nybble's own reader.

The fields are those of the published config.json of each checkpoint (meta-llama/Meta-Llama-3-8B,
meta-llama/Meta-Llama-3-70B, Qwen/Qwen3-30B-A3B), reduced to what the decoder reads;
``nybble.models.io.hf.config.decoder_config_from_hf`` turns them into a ``LlamaConfig`` as ``from_pretrained``
would. ``tiny-llama``, ``tiny-moe`` and ``tiny-moe-softmax`` are small stand-ins for tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nybble.models.definitions.llama import LlamaConfig

_LLAMA3 = {
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}
_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_act": "silu",
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "llama3-70b": {
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "qwen3-30b-a3b": {
        **_QWEN3_MOE,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 151936,
    },
    "smollm2-135m": {  # what bench.model_bench measures (make gpu-check): its prediction beside it
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "vocab_size": 49152,
    },
    "tiny-llama": {
        **_LLAMA3,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
    },
    "tiny-moe": {  # Qwen3-30B-A3B's structure (q/k norms, top 4 of 16 experts) at a test's size
        **_QWEN3_MOE,
        "hidden_size": 1024,  # K slices of whole 128-row groups: the grouped SwiGLU epilogue runs
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "vocab_size": 512,
    },
}
# OLMoE's and Qwen1.5-MoE's routing (the softmax's top k, not renormalized) at tiny-moe's size: a batch-1 step
# that sorts for its top k (tiny-moe's routes one token by ranks, moe.route_ranked)
HF_CONFIGS["tiny-moe-softmax"] = {**HF_CONFIGS["tiny-moe"], "norm_topk_prob": False}


def config_for(name: str, num_layers: int | None = None) -> LlamaConfig:
    """The ``LlamaConfig`` of a model of :data:`HF_CONFIGS`, optionally cut to (or, a model of
    one kind of layer, grown to) ``num_layers`` layers."""
    from nybble.models.io.hf.config import decoder_config_from_hf

    if name not in HF_CONFIGS:
        raise ValueError(f"unknown model {name!r} for bench.decode; known: {sorted(HF_CONFIGS)}")
    cfg = decoder_config_from_hf(HF_CONFIGS[name])
    if num_layers is None:
        return cfg
    moe_layers = cfg.moe_layers
    if moe_layers is not None and set(moe_layers) == set(range(cfg.num_layers)):
        moe_layers = tuple(range(num_layers))  # every layer MoE, also in a deeper copy (the tests' 5 layers)
    elif moe_layers is not None:
        moe_layers = tuple(i for i in moe_layers if i < num_layers)
    return dataclasses.replace(cfg, num_layers=num_layers, moe_layers=moe_layers)


DEFAULT_MODELS = ("llama3-8b", "llama3-70b", "qwen3-30b-a3b")
