"""``save_pretrained``: an in-memory nybble ``Llama`` (float or with ``QLinear`` layers) -> an HF directory.

The directory is what transformers and vLLM load: ``config.json`` (with ``quantization_config`` for a
quantized model), safetensors shards with an index (``max_shard_size``), tokenizer files copied from
``source``. Tensor names and the torch (out, in) layout come from ``nybble.models.io.hf.names``; quantized
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

from nybble.models.definitions.fuse import unfused_copy
from nybble.models.definitions.layers import QLinear
from nybble.models.definitions.llama import Llama
from nybble.models.definitions.moe import Experts, QExperts, Router
from nybble.models.io.hf.config import decoder_config_from_hf, hf_config_for
from nybble.models.io.hf.files import CONFIG_NAME, ShardedWriter
from nybble.models.io.hf.names import float_hf_tensors, hf_modules_of
from nybble.models.io.hf.stream import writer_for_format
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.stacked import unstack_weight
from nybble.sharding import ShardedWeight
from nybble.sharding.experts import ExpertShardedWeight

SAVE_FORMATS = ("float", "compressed-tensors", "gptq", "nybble")
_DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


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
    cfg = model.config
    scaling = cfg.rope_scaling  # transformers wants a context length; llama3 scaling implies one
    max_pos = 8192 if scaling is None else int(scaling.factor * scaling.original_max_position_embeddings)
    return hf_config_for(cfg, dtype=_dtype_name(dtype), max_position_embeddings=max_pos)


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
    model = unfused_copy(model)  # checkpoints hold q/k/v and gate/up one by one
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
    quantized = [p for p, m in modules.items() if isinstance(m, QLinear | QExperts)]
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
        writer = writer_for_format(fmt)  # scales as each weight holds them (GPTQ: float16, exact or refused)
    config = _base_config(model, source, dtype)
    float_linears = [
        name
        for p, m in modules.items()
        if isinstance(m, nnx.Linear | Experts | Router)
        for name in hf_modules_of(model.config, p)
    ]
    with ShardedWriter(path, max_shard_bytes=max_shard_size, overwrite=overwrite) as out:
        for name, array in float_hf_tensors(model, skip_modules=quantized):
            out.add(name, array.astype(dtype))
        for module_path in quantized:
            module = modules[module_path]
            if isinstance(module, QExperts):  # an MoE expert stack: each expert one quantized linear
                _write_experts(out, writer, model, module_path, module)
                continue
            (hf_module,) = hf_modules_of(model.config, module_path)
            if getattr(module, "input_perm", None) is not None:  # (hf-models) act-order layer as read
                raise ValueError(
                    f"save_pretrained: {module_path} multiplies permuted inputs (an activation-order layer "
                    "read from a checkpoint, QLinear.input_perm); writing it back is not supported"
                )
            qw = module.weight
            if isinstance(qw, ShardedWeight):
                qw = qw.gather()
            assert isinstance(qw, QuantizedWeight)
            for key, value in writer.write_linear(hf_module, qw).items():
                out.add(key, np.asarray(value))
            if module.bias is not None:
                out.add(f"{hf_module}.bias", _host(module.bias[...]).astype(dtype))
        if writer is not None:
            config["quantization_config"] = writer.quantization_config(ignore=sorted(float_linears))
        out.write_config(config)
        if source is not None:
            out.copy_files(source)
    return Path(path)


def _write_experts(out: Any, writer: Any, model: Llama, module_path: str, module: Any) -> None:
    """The experts of a stacked int4 stack, each under its own HF linear name (as checkpoints hold them)."""
    qw = module.weight
    if isinstance(qw, ExpertShardedWeight):
        qw = qw.gather()
    for e, hf_module in enumerate(hf_modules_of(model.config, module_path)):
        for key, value in writer.write_linear(hf_module, unstack_weight(qw, e)).items():
            out.add(key, np.asarray(value))


__all__ = ["SAVE_FORMATS", "save_pretrained"]
