"""Quantize a Hugging Face checkpoint directory to another one, streamed: memory does not grow with the model.

``quantize_directory(model_dir, out_dir, format="compressed-tensors")`` reads ONE tensor at a time
(``CheckpointDir``: positioned reads, no whole-file read, no memory map), quantizes each linear weight
with round to nearest (``nybble.quantize``), encodes it in the output format (the format's writer from
``nybble.quant.formats.hf_scheme.writer_for``), passes every other tensor through unchanged, and appends
the result to ``ShardedWriter``, which writes shards to disk as they fill. Peak memory is about one input
tensor and its quantized form, plus the writer's I/O buffers; it does not depend on the number of layers.
The directory is written to a temporary path and renamed on success.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nybble.models.io.hf.config import decoder_config_from_hf
from nybble.models.io.hf.files import CheckpointDir, CheckpointError, ShardedWriter
from nybble.models.io.hf.names import (
    expected_shapes,
    hf_linear_modules,
    is_ignored,
    is_router_module,
    to_nybble,
)
from nybble.quant.formats.hf_scheme import writer_for
from nybble.quant.rtn import quantize

FORMATS = ("compressed-tensors", "gptq", "nybble")


def linear_modules(config: dict[str, Any], ckpt: CheckpointDir) -> list[str]:
    """HF module names of the linear layers to quantize (``lm_head`` stays float), in checkpoint order.

    ``names.hf_linear_modules`` of config.json's decoder decides (the one mapping of HF names); every
    float tensor's shape is checked against config.json first (``names.expected_shapes``), so a config
    from another model is refused before any work.
    """
    cfg = decoder_config_from_hf(config)
    expected = expected_shapes(cfg)
    for name, shape in expected.items():
        if name not in ckpt:
            if name == "lm_head.weight":
                continue  # some checkpoints tie the head without saying so; from_pretrained decides
            raise CheckpointError(
                f"{ckpt.path}: no tensor {name!r}, which config.json's model "
                f"({config.get('model_type')!r}, {cfg.num_layers} layers) has; the weights and config.json "
                f"come from different models"
            )
        if tuple(ckpt.shape(name)) != tuple(shape):
            raise CheckpointError(
                f"{ckpt.path}: tensor {name!r} has shape {list(ckpt.shape(name))}, but config.json implies "
                f"{list(shape)} (hidden_size, intermediate_size, heads, head_dim, vocab_size); the config "
                f"and the weights come from different models"
            )
    # MoE routers stay float (as nybble.models.quantize's DEFAULT_RULES and llm-compressor keep them).
    chosen = [
        m
        for m in hf_linear_modules(cfg)
        if m != "lm_head" and not is_router_module(m) and f"{m}.weight" in ckpt
    ]
    order = {n: i for i, n in enumerate(ckpt.names())}
    return sorted(chosen, key=lambda m: order[m + ".weight"])


def scale_dtype_for(format: str, config: dict[str, Any]) -> Any:
    """The scale dtype each format stores: GPTQ fp16; compressed-tensors the model's dtype; nybble bf16."""
    import jax.numpy as jnp

    if format == "gptq":
        return jnp.float16
    if format == "compressed-tensors":
        dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        return {"float16": jnp.float16, "float32": jnp.float32}.get(str(dtype), jnp.bfloat16)
    return jnp.bfloat16


@dataclass
class StreamReport:
    """What ``quantize_directory`` did: counts, bytes, seconds, this process's peak RSS."""

    output: Path
    tensors: int = 0
    quantized: list[str] = field(default_factory=list)
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    files: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        """Input bytes read per second (10**9 bytes per GB)."""
        return self.bytes_read / 1e9 / max(self.seconds, 1e-9)

    def summary(self) -> str:
        others = self.tensors - len(self.quantized)
        return (
            f"{len(self.quantized)} linear layers quantized, {others} other tensors passed through; "
            f"read {self.bytes_read / 1e9:.2f} GB, wrote {self.bytes_written / 1e9:.2f} GB in "
            f"{self.seconds:.1f} s ({self.gb_per_s:.2f} GB/s); peak RSS {self.peak_rss_bytes / 2**20:.0f} MiB"
        )


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024


def writer_for_format(format: str, *, scale_dtype: Any = None) -> Any:
    """The HF format writer (``nybble.quant.formats.hf_scheme.writer_for``) for ``format``.

    ``scale_dtype``: what compressed-tensors and GPTQ store scales as (None: each weight's own dtype for
    compressed-tensors, float16 for GPTQ); nybble stores the weight's scales as they are.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown output format {format!r}; choose one of {FORMATS}")
    if format == "nybble" or scale_dtype is None:
        return writer_for(format)
    return writer_for(format, scale_dtype=scale_dtype)


def quantize_directory(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    format: str = "compressed-tensors",
    group_size: int | None = 128,
    symmetric: bool = True,
    max_shard_size: int | str = "2GB",
    overwrite: bool = False,
    progress: bool = True,
    quantize_fn: Callable[..., Any] | None = None,
) -> StreamReport:
    """Round-to-nearest int4 quantization of a local HF checkpoint directory into ``out_dir``, streamed.

    Args:
      model_dir: a float checkpoint directory (config.json, safetensors weights; tokenizer files are
        copied when present).
      out_dir: the directory to write; refused if it exists unless ``overwrite``.
      format: ``"compressed-tensors"`` (pack-quantized, what vLLM and llm-compressor use), ``"gptq"``
        (GPTQ v1) or ``"nybble"`` (nybble's own codes). compressed-tensors and GPTQ store an integer
        zero point, so asymmetric quantization for them uses nybble's integer-zero-point mode.
      group_size, symmetric: as ``nybble.quantize``.
      max_shard_size: cap on one shard's tensor bytes (``"2GB"``, ``"500MiB"`` or an int).
      progress: a tqdm bar over the input bytes (its rate is the read throughput).
      quantize_fn: ``(w (K, N) float32, module_name) -> QuantizedWeight``; default ``nybble.quantize``
        with the options above.

    Returns a :class:`StreamReport`. Raises ``CheckpointError`` (a ``ValueError``) for a bad directory
    or an already quantized one, ``FileExistsError`` for an existing ``out_dir``.
    """
    from tqdm.auto import tqdm

    ckpt = CheckpointDir(model_dir)
    config = dict(ckpt.config)
    if "quantization_config" in config:
        method = (config["quantization_config"] or {}).get("quant_method", "?")
        raise CheckpointError(
            f"{ckpt.path}: already quantized (config.json has a quantization_config, quant_method "
            f"{method!r}); quantize the float checkpoint it came from"
        )
    writer = writer_for_format(format, scale_dtype=scale_dtype_for(format, config))
    names = [n for n in ckpt.names() if not is_ignored(n)]  # e.g. old checkpoints' rotary buffers
    linears = linear_modules(config, ckpt)
    linear_weights = {m + ".weight": m for m in linears}
    ckpt.require_float(list(linear_weights), "a float checkpoint being quantized")
    if quantize_fn is None:
        quantize_fn = _rtn(format, config, group_size, symmetric)
    # Read in file order (shard, then offset): sequential reads of each shard.
    order = sorted(names, key=lambda n: (str(ckpt.info(n).file), ckpt.info(n).begin))
    report = StreamReport(output=Path(out_dir))
    t0 = time.perf_counter()
    bar = tqdm(
        total=ckpt.total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        desc="nybble: quantizing",
        disable=not progress,
        leave=False,
        dynamic_ncols=True,
    )
    with bar, ShardedWriter(out_dir, max_shard_bytes=max_shard_size, overwrite=overwrite) as out:
        for name in order:
            bar.set_postfix_str(name, refresh=False)
            array = ckpt.get(name)
            module = linear_weights.get(name)
            if module is None:
                out.add(name, array)
                report.bytes_written += array.nbytes
            else:
                _check_linear(name, array)
                qw = quantize_fn(np.asarray(to_nybble("kernel", array), np.float32), module)
                del array  # the float weight is no longer needed: keep the peak at one tensor
                for key, value in writer.write_linear(module, qw).items():
                    value = np.asarray(value)
                    out.add(key, value)
                    report.bytes_written += value.nbytes
                report.quantized.append(module)
            report.tensors += 1
            report.bytes_read += ckpt.nbytes(name)
            bar.update(ckpt.nbytes(name))
        ignore = sorted({n[: -len(".weight")] for n in names if n.endswith(".weight")} - set(linears))
        config["quantization_config"] = writer.quantization_config(ignore=_ignore_list(ignore))
        out.write_config(config)
        out.copy_files(ckpt.path)
    report.seconds = time.perf_counter() - t0
    report.files = out.files_written
    report.peak_rss_bytes = peak_rss_bytes()
    return report


def _ignore_list(modules: list[str]) -> list[str]:
    """The float modules a quantization_config names in ``ignore``: linear-like ones (lm_head, MoE
    routers)."""
    return [
        m
        for m in modules
        if m == "lm_head" or m.endswith("_proj") or m.endswith(".lm_head") or is_router_module(m)
    ]


def _check_linear(name: str, array: np.ndarray) -> None:
    if array.ndim != 2:
        raise CheckpointError(
            f"tensor {name!r}: a linear weight must be 2-D (out, in), got shape {list(array.shape)}"
        )


def _rtn(format: str, config: dict[str, Any], group_size: int | None, symmetric: bool) -> Callable[..., Any]:
    options: dict[str, Any] = {
        "group_size": group_size,
        "symmetric": symmetric,
        "scale_dtype": scale_dtype_for(format, config),
    }
    if not symmetric and format in ("compressed-tensors", "gptq"):
        options["zero_point"] = "integer"  # these formats store w = (q - z) s with an integer z

    def rtn(w: np.ndarray, module: str) -> Any:
        return quantize(w, **options)

    return rtn


__all__ = ["FORMATS", "StreamReport", "linear_modules", "peak_rss_bytes", "quantize_directory"]
