"""``save_pretrained``: an in-memory nybble ``Llama`` (float or with ``QLinear`` layers) -> an HF directory.

The directory is what transformers and vLLM load: ``config.json`` (with ``quantization_config`` for a
quantized model), safetensors shards with an index (``max_shard_size``), tokenizer files copied from
``source``. Tensor names and the torch (out, in) layout come from ``nybble.models.hf.names``; quantized
linears are encoded by the format's writer (``nybble.quant.formats.hf_scheme.writer_for``), which refuses,
naming the layer, a weight the format cannot hold exactly. Tensors are converted and written one at a
time (``ShardedWriter``) into a temporary directory renamed on success.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from nybble.models.hf.config import decoder_config_from_hf
from nybble.models.hf.files import CONFIG_NAME, ShardedWriter
from nybble.models.hf.names import hf_module_for, hf_name_for, to_hf
from nybble.models.layers import QLinear
from nybble.models.llama import Llama, LlamaConfig
from nybble.quant.qweight import QuantizedWeight
from nybble.sharding import ShardedWeight

SAVE_FORMATS = ("float", "compressed-tensors", "gptq", "nybble")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def hf_config_for(cfg: LlamaConfig, dtype: Any = "bfloat16") -> dict[str, Any]:
    """A transformers config.json (as a dict) for ``cfg``: the inverse of ``decoder_config_from_hf``.

    The ``model_type`` is the plainest family that has ``cfg``'s switches: qwen3 for q/k norms, qwen2 for
    q/k/v biases, mistral for a sliding window, else llama. RoPE is written in the transformers 4 spelling
    (``rope_theta`` + ``rope_scaling``), which transformers 4 and 5 and vLLM all read.
    """
    if cfg.qk_norm:
        model_type = "qwen3"
    elif cfg.qkv_bias:
        model_type = "qwen2"
    elif cfg.sliding_window is not None:
        model_type = "mistral"
    else:
        model_type = "llama"
    scaling = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    max_pos = (
        8192 if scaling is None else int(scaling["factor"] * scaling["original_max_position_embeddings"])
    )
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
        "max_position_embeddings": max_pos,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": _dtype_name(dtype),
    }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if model_type in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    if model_type == "qwen3":
        out["attention_bias"] = False
    return out


def _dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    if name not in _DTYPE_NAMES:
        raise ValueError(f"save_pretrained: float dtype {name} has no safetensors/torch counterpart here")
    return _DTYPE_NAMES[name]


def _base_config(model: Llama, source: str | os.PathLike[str] | None, dtype: Any) -> dict[str, Any]:
    """``source``'s config.json when it describes this model (keeps its extra keys), else a fresh one."""
    if source is not None and (Path(source) / CONFIG_NAME).is_file():
        base = json.loads((Path(source) / CONFIG_NAME).read_text())
        base.pop("quantization_config", None)
        if decoder_config_from_hf(base) != model.config:
            raise ValueError(
                f"save_pretrained: {source}/config.json describes another model "
                f"({decoder_config_from_hf(base)}) than the one being saved ({model.config}); pass the "
                "model's own source directory, or source=None for a config made from the model"
            )
        base["torch_dtype"] = _dtype_name(dtype)
        base.pop("dtype", None)
        return base
    return hf_config_for(model.config, dtype)


def _modules(model: nnx.Module) -> Iterator[tuple[str, Any]]:
    for path, module in nnx.iter_modules(model):
        if path:
            yield ".".join(str(p) for p in path), module


def _host(a: Any) -> np.ndarray:
    return np.asarray(jax.device_get(a))


def _float_dtype(model: Llama) -> Any:
    return np.dtype(model.embed.embedding[...].dtype)


def save_pretrained(
    model: Llama,
    path: str | os.PathLike[str],
    format: str | None = None,
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    source: str | os.PathLike[str] | None = None,
    dtype: Any = None,
) -> Path:
    """Writes ``model`` as a Hugging Face checkpoint directory at ``path``; returns the path.

    Args:
      model: a nybble ``Llama`` (``from_pretrained``, ``nybble.models.smollm2.load()``...), float or
        quantized (``nybble.models.quantize``: ``QLinear`` layers).
      format: how quantized linears are stored: ``"compressed-tensors"`` (pack-quantized, what vLLM serves
        and llm-compressor writes), ``"gptq"`` (GPTQ v1) or ``"nybble"`` (nybble's own codes);
        None or ``"float"`` writes a float model (refused if the model has int4 layers). compressed-tensors
        and GPTQ store integer zero points: an asymmetric weight quantized with nybble's float offsets is
        refused (naming the layer); quantize with ``zero_point="integer"`` for them.
      max_shard_size: cap on one shard's tensor bytes (``"5GB"``, ``"500MB"``, int bytes).
      overwrite: replace an existing ``path`` (else ``FileExistsError``).
      source: a checkpoint directory to copy tokenizer / generation files from, and whose config.json
        (if it describes this model) is kept with its extra keys (bos/eos ids...).
      dtype: float dtype of the non-quantized tensors (default: the model's embedding dtype).

    Nothing appears at ``path`` unless the whole directory was written.
    """
    fmt = "float" if format is None else format
    if fmt not in SAVE_FORMATS:
        raise ValueError(
            f"save_pretrained: unknown format {format!r}; choose one of {SAVE_FORMATS} (or None)"
        )
    if not isinstance(model, Llama):
        raise TypeError(
            "save_pretrained writes nybble's Llama-family model (nybble.models.Llama), got "
            f"{type(model).__name__}"
        )
    modules = dict(_modules(model))
    quantized = [p for p, m in modules.items() if isinstance(m, QLinear)]
    if fmt == "float" and quantized:
        raise ValueError(
            f"save_pretrained: the model has {len(quantized)} int4 layers (e.g. {quantized[0]}); a float "
            f"directory cannot hold them: pass format='compressed-tensors', 'gptq' or 'nybble'"
        )
    if fmt != "float" and not quantized:
        raise ValueError(
            f"save_pretrained: format={fmt!r} stores int4 layers, but the model has none; quantize it first "
            f"(nybble.models.quantize) or pass format=None for a float directory"
        )
    dtype = _float_dtype(model) if dtype is None else np.dtype(dtype)
    writer = None
    if fmt != "float":
        from nybble.models.hf.stream import writer_for_format

        writer = writer_for_format(fmt)  # scales as each weight holds them (GPTQ: float16, exact or refused)
    config = _base_config(model, source, dtype)
    float_linears: list[str] = []
    with ShardedWriter(path, max_shard_bytes=max_shard_size, overwrite=overwrite) as out:
        for module_path, module in modules.items():
            if isinstance(module, QLinear):
                hf_module = hf_module_for(module_path)
                qw = module.weight
                if isinstance(qw, ShardedWeight):
                    qw = qw.gather()
                assert isinstance(qw, QuantizedWeight)
                for key, value in writer.write_linear(hf_module, qw).items():
                    out.add(key, np.asarray(value))
                if module.bias is not None:
                    out.add(f"{hf_module}.bias", _host(module.bias[...]).astype(dtype))
                continue
            for param, var in vars(module).items():
                if not isinstance(var, nnx.Variable) or isinstance(var.get_value(), QuantizedWeight):
                    continue
                name = hf_name_for(module_path, param)
                out.add(name, to_hf(param, _host(var[...]).astype(dtype)))
            if isinstance(module, nnx.Linear):
                float_linears.append(hf_module_for(module_path))
        if writer is not None:
            config["quantization_config"] = writer.quantization_config(ignore=sorted(float_linears))
        out.write_config(config)
        if source is not None:
            out.copy_files(source)
    return Path(path)


__all__ = ["SAVE_FORMATS", "hf_config_for", "save_pretrained"]
