"""Read a llama-architecture GGUF file: config, float weights (dequantized), and the tokenizer."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nybble.extras import require
from nybble.models.definitions.llama import Llama, LlamaConfig
from nybble.models.io.gguf_file import GGUFFile, read_gguf


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"GGUF file {reader.path} has no {key!r} field")
        return default
    return value


def read_config(reader: GGUFFile) -> LlamaConfig:
    """The ``LlamaConfig`` of a llama-architecture GGUF file."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama-architecture GGUF, got {arch!r}")
    names = {t.name for t in reader.tensors}
    # Numbers-changing RoPE variants are refused, as for config.json (nybble.models.io.hf.config): llama.cpp
    # stores Llama 3.1's scaled frequencies as a rope_freqs tensor, other variants as rope.scaling fields.
    scaling = reader.fields.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF file {reader.path}: llama.rope.scaling.type = {scaling!r} is not supported")
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"GGUF file {reader.path} has a rope_freqs.weight tensor (Llama 3.1 rope scaling as llama.cpp "
            "stores it), which nybble's GGUF reader does not apply; load the Hugging Face directory instead "
            "(nybble.models.from_pretrained reads rope_scaling from config.json)"
        )
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    return LlamaConfig(
        vocab_size=int(_field(reader, "llama.vocab_size", len(_field(reader, "tokenizer.ggml.tokens")))),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
    )


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (interleaved rotary pairs -> "rotate half" halves).

    ``convert_hf_to_gguf`` stores ``W.reshape(h, 2, d/2, K).swapaxes(1, 2)``; ``w`` is (out, in).
    """
    out, k = w.shape
    return w.reshape(num_heads, out // num_heads // 2, 2, k).swapaxes(1, 2).reshape(out, k)


_LAYER_TENSORS = {
    "attn_norm.weight": ("input_norm", "weight"),
    "ffn_norm.weight": ("post_norm", "weight"),
    "attn_q.weight": ("attn", "q_proj"),
    "attn_k.weight": ("attn", "k_proj"),
    "attn_v.weight": ("attn", "v_proj"),
    "attn_output.weight": ("attn", "o_proj"),
    "ffn_gate.weight": ("mlp", "gate_proj"),
    "ffn_up.weight": ("mlp", "up_proj"),
    "ffn_down.weight": ("mlp", "down_proj"),
}


def read_params(reader: GGUFFile, cfg: LlamaConfig) -> dict[str, Any]:
    """The model's float32 weights as a pure dict in ``Llama`` layout (kernels (in, out))."""
    gguf = require("gguf", "reading GGUF files")
    params: dict[str, Any] = {"layers": {i: {} for i in range(cfg.num_layers)}}
    for t in reader.tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        name = t.name
        if name == "token_embd.weight":
            params["embed"] = {"embedding": w.reshape(cfg.vocab_size, cfg.hidden_size)}
        elif name == "output_norm.weight":
            params["norm"] = {"weight": w.reshape(-1)}
        elif name == "output.weight":
            params["lm_head"] = {"kernel": w.T}
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _LAYER_TENSORS:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            sub, leaf = _LAYER_TENSORS[rest]
            layer = params["layers"][int(idx)]
            if leaf == "weight":
                layer[sub] = {"weight": w.reshape(-1)}
                continue
            if leaf == "q_proj":
                w = unpermute_rotary(w, cfg.num_heads)
            elif leaf == "k_proj":
                w = unpermute_rotary(w, cfg.num_kv_heads)
            layer.setdefault(sub, {})[leaf] = {"kernel": np.ascontiguousarray(w.T)}
        elif name != "rope_freqs.weight":
            raise ValueError(f"unexpected GGUF tensor {name!r}")
    return params


def build_llama(cfg: LlamaConfig, params: dict[str, Any], dtype: Any = jnp.float32) -> Llama:
    """A ``Llama`` holding ``params`` (a pure dict, e.g. from :func:`read_params`), cast to ``dtype``."""
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(abstract)
    flat_expected = {tuple(p): v for p, v in nnx.to_flat_state(state)}
    flat_params = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    got = {tuple(getattr(k, "key", k) for k in p): v for p, v in flat_params.items()}
    missing = set(flat_expected) - set(got)
    extra = set(got) - set(flat_expected)
    if missing or extra:
        raise ValueError(
            f"weights do not fit the model: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
        )
    for path, var in flat_expected.items():
        value = got[path]
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"weight {path}: shape {value.shape} != expected {var.shape}")
        var.set_value(jnp.asarray(value, dtype))
    return nnx.merge(graphdef, state)


def build_tokenizer(reader: GGUFFile) -> Any:
    """A ``tokenizers.Tokenizer`` rebuilt from the GGUF vocabulary (byte-level BPE, gpt2 model)."""
    tokenizers = require("tokenizers", "the GGUF tokenizer")
    Tokenizer, decoders, models = tokenizers.Tokenizer, tokenizers.decoders, tokenizers.models
    pre_tokenizers = tokenizers.pre_tokenizers
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF tokenizers are supported, got {model!r}")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if _field(reader, "tokenizer.ggml.pre", "default") in ("smollm", "starcoder", "refact"):
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types, strict=True) if int(kind) == 3]  # CONTROL
    tok.add_special_tokens(control)
    return tok


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """``path``'s metadata and tensors (:func:`nybble.models.io.gguf_file.read_gguf`)."""
    require("gguf", "reading GGUF files")
    return read_gguf(path)


def load_gguf_llama(path: str | os.PathLike[str], dtype: Any = jnp.float32) -> tuple[Llama, Any]:
    """``(model, tokenizer)`` from a llama-architecture GGUF file, weights dequantized to float."""
    reader = open_gguf(path)
    cfg = read_config(reader)
    model = build_llama(cfg, read_params(reader, cfg), dtype)
    return model, build_tokenizer(reader)


__all__ = [
    "build_llama",
    "build_tokenizer",
    "load_gguf_llama",
    "open_gguf",
    "read_config",
    "read_params",
    "unpermute_rotary",
]
