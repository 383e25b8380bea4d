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
from typing import Any

import jax.numpy as jnp
from flax import nnx

from nybble.extras import require
from nybble.models.hf.config import decoder_config_from_hf
from nybble.models.hf.files import CheckpointDir, CheckpointError, local_dir
from nybble.models.hf.names import (
    expected_shapes,
    hf_linear_modules,
    hf_name_for,
    is_ignored,
    module_path_for_module,
)
from nybble.models.layers import QLinear
from nybble.models.llama import Llama, LlamaConfig

TOKENIZER_FILE = "tokenizer.json"
# What a directory may hold instead of tokenizer.json (named in the error, with how to convert).
_OTHER_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")


def _scheme(config: dict[str, Any]) -> Any:
    """The quantization scheme of config.json's ``quantization_config`` (None: a float checkpoint)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    try:
        from nybble.quant.formats.hf_scheme import scheme_from_config
    except ImportError as e:  # pragma: no cover - the reader ships with nybble
        raise NotImplementedError(
            f"quantized checkpoints need nybble.quant.formats.hf_scheme ({e})"
        ) from None
    return scheme_from_config(qc)


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
        assert path is not None
        parent, key, linear = _module_at(model, path)
        names = list(scheme.tensor_names(hf_module))
        missing = [n for n in names if n not in ckpt]
        if missing:
            raise CheckpointError(
                f"{ckpt.path}: quantized layer {hf_module!r} lacks {missing} (its quantization_config "
                f"names this layer as quantized; expected tensors {names})"
            )
        qw = scheme.read_linear(
            hf_module, ckpt.get, in_features=linear.in_features, out_features=linear.out_features
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
        _set_module(parent, key, QLinear(qw, bias))
        quantized.add(path)
    return used, quantized


def from_pretrained(
    path: str | os.PathLike[str],
    dtype: Any = jnp.bfloat16,
    mesh: Any = None,
    *,
    axis: str = "model",
    rules: Any = None,
) -> Llama:
    """A Llama-family model from a local Hugging Face checkpoint directory.

    ``path`` holds config.json and ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``); ``model_type`` llama, mistral, qwen2 or qwen3 (see
    :func:`nybble.models.hf.config.decoder_config_from_hf`). Float weights are cast to ``dtype``; with a
    ``quantization_config`` the quantized linears become ``QLinear`` layers (compressed-tensors, GPTQ, AWQ,
    AutoRound: see ``nybble.quant.formats.hf_scheme``) and the rest is float in ``dtype``.
    ``model(token_ids)`` returns float32 logits (batch, length, vocab); ``init_cache`` / ``prefill`` /
    ``decode_step`` work as on any ``Llama``. With ``mesh``, the model is placed by
    ``nybble.models.shard(model, mesh, axis=axis, rules=rules)``.

    A hub id or URL is refused (download it first); a directory whose tensors do not fit config.json
    (missing, extra, mis-shaped, non-float where float is expected) raises ``CheckpointError`` naming the
    tensor. The tokenizer is separate: :func:`load_tokenizer`.
    """
    ckpt = CheckpointDir(path)
    cfg = decoder_config_from_hf(ckpt.config)
    scheme = _scheme(ckpt.config)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    expected = expected_shapes(cfg)
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

    graphdef, state = nnx.split(model)
    for key_path, var in nnx.to_flat_state(state):
        module_path = ".".join(str(k) for k in key_path[:-1])
        param = str(key_path[-1])
        if module_path in quantized:
            continue  # QLinear's qweight and bias are already concrete
        name = hf_name_for(module_path, param)
        value = ckpt.get(name)
        if param == "kernel":
            value = value.T  # torch (out, in) -> (in, out); see nybble.models.hf.names.to_nybble
        var.set_value(jnp.asarray(value, dtype))
        del value  # one tensor at a time
    model = nnx.merge(graphdef, state)
    if mesh is not None:
        from nybble.models.sharding import shard

        shard(model, mesh, axis=axis, rules=rules)
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
