"""GPTQ and AutoRound over a checkpoint directory, one decoder block at a time.

``quantize_directory_calibrated(model_dir, out_dir, calibration=ids, method="gptq")`` never builds the
whole model. It embeds the calibration tokens (the embedding table is read, used and written through),
then for each decoder block ``i``: reads that block's float tensors from the files into a ``Block``,
quantizes its linear layers with nybble's GPTQ (``nybble.models.quantize(method="gptq")``) or AutoRound on
the activations that reach it (the outputs of the already quantized blocks before it, as the in-memory
methods do), runs the quantized block to get the next block's inputs, writes the block's tensors (the
linears in the output format, norms and biases byte for byte from the input), and drops it. In memory at
any time: one block's float weights, the calibration activations (windows x length x hidden) and the
method's own working set (a Hessian per layer, AutoRound's block state). The final norm and the LM head are
passed through. Shards are written as they fill, into a temporary directory renamed on success.

The one difference from the in-memory AutoRound: its target for block ``i`` is the float block on the
quantized inputs (``target="own"``), since the float model's hidden states are not carried along.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nybble.models.definitions.layers import QLinear
from nybble.models.definitions.llama import Block, RMSNorm
from nybble.models.io.hf.config import decoder_config_from_hf
from nybble.models.io.hf.files import CheckpointDir, CheckpointError, ShardedWriter
from nybble.models.io.hf.names import hf_module_for, hf_name_for, is_ignored, to_nybble
from nybble.models.io.hf.stream import (
    StreamReport,
    linear_modules,
    peak_rss_bytes,
    scale_dtype_for,
    writer_for_format,
)
from nybble.models.quantization.adapter import quantize
from nybble.models.quantization.calibrate import calibration_batches
from nybble.quant.autoround import AutoRoundConfig, resolve_config

CALIBRATED = ("gptq", "autoround")


class _Shell(nnx.Module):
    """One block in an ``nnx.List``, so the model-level quantizers see ``layers.0`` as a block."""

    def __init__(self, block: Block) -> None:
        self.layers = nnx.List([block])


def _load_block(ckpt: CheckpointDir, cfg: Any, index: int, dtype: Any) -> Block:
    """Decoder block ``index`` with its float weights read from ``ckpt`` (one tensor at a time)."""
    block = nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(block)
    for key_path, var in nnx.to_flat_state(state):
        module = ".".join(str(k) for k in key_path[:-1])
        param = str(key_path[-1])
        name = hf_name_for(f"layers.{index}.{module}", param)
        value = to_nybble(param, ckpt.get_float(name, "a float checkpoint being quantized"))
        var.set_value(jnp.asarray(value, dtype))
    return nnx.merge(graphdef, state)


def quantize_directory_calibrated(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    calibration: Any,
    method: str = "gptq",
    format: str = "compressed-tensors",
    group_size: int | None = 128,
    symmetric: bool = True,
    max_shard_size: int | str = "2GB",
    overwrite: bool = False,
    progress: bool = True,
    seq_len: int = 256,
    dtype: Any = jnp.float32,
    **method_options: Any,
) -> StreamReport:
    """GPTQ or AutoRound of a float HF checkpoint directory into ``out_dir``, decoder block by block.

    Args:
      model_dir: a float Llama-family checkpoint directory.
      out_dir: the directory to write (refused if it exists unless ``overwrite``).
      calibration: token ids, (batch, length) or a 1-D stream cut into ``seq_len`` windows.
      method: ``"gptq"`` or ``"autoround"`` (options as ``nybble.models.quantize``'s, e.g. ``config="fast"``
        for AutoRound, ``act_order`` for GPTQ; the end-to-end stage needs the whole model and is refused).
      format, group_size, symmetric, max_shard_size: as :func:`nybble.models.io.hf.stream.quantize_directory`.
      dtype: the compute dtype of the calibration passes (float32 by default).

    Returns a :class:`~nybble.models.io.hf.stream.StreamReport`.
    """
    from tqdm.auto import tqdm

    if method not in CALIBRATED:
        raise ValueError(f"quantize_directory_calibrated: method must be one of {CALIBRATED}, got {method!r}")
    if method_options.get("end_to_end_epochs"):
        raise ValueError(
            "end_to_end_epochs tunes scales through the whole model, which a block-by-block pass never "
            "holds: load the model (from_pretrained), quantize it, then save_pretrained"
        )
    ckpt = CheckpointDir(model_dir)
    config = dict(ckpt.config)
    if "quantization_config" in config:
        raise CheckpointError(f"{ckpt.path}: already quantized (config.json has a quantization_config)")
    cfg = decoder_config_from_hf(config)
    linear_modules(config, ckpt)  # every tensor's shape checked against config.json before any work
    ids = calibration_batches(calibration, seq_len)
    scale_dtype = scale_dtype_for(format, config)
    writer = writer_for_format(format, scale_dtype=scale_dtype)
    options: dict[str, Any] = dict(
        method=method, group_size=group_size, symmetric=symmetric, scale_dtype=scale_dtype, progress=False
    )
    if not symmetric and format in ("compressed-tensors", "gptq"):
        options["zero_point"] = "integer"  # these formats store w = (q - z) s with an integer z
    options.update(method_options)
    autoround_config = None
    if method == "autoround":
        fields = {f.name for f in dataclasses.fields(AutoRoundConfig)}
        overrides = {k: options.pop(k) for k in list(options) if k in fields}
        autoround_config = resolve_config(options.pop("config", "default"), **overrides)
        options.setdefault("target", "own")  # the float model's hidden states are not carried along
    report = StreamReport(output=Path(out_dir))
    t0 = time.perf_counter()
    written: set[str] = set()
    float_linears: list[str] = []
    bar = tqdm(
        total=cfg.num_layers, desc=f"nybble: {method}", unit="block", disable=not progress, leave=False
    )

    def passthrough(out: ShardedWriter, name: str) -> None:
        array = ckpt.get(name)
        out.add(name, array)
        written.add(name)
        report.tensors += 1
        report.bytes_read += array.nbytes
        report.bytes_written += array.nbytes

    with bar, ShardedWriter(out_dir, max_shard_bytes=max_shard_size, overwrite=overwrite) as out:
        embed_name = "model.embed_tokens.weight"
        table = jnp.asarray(ckpt.get_float(embed_name), dtype)
        x = table[ids]  # (windows, length, hidden): what the first block receives
        del table
        passthrough(out, embed_name)
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        for i in range(cfg.num_layers):
            bar.set_postfix_str(f"block {i}", refresh=False)
            block = _load_block(ckpt, cfg, i, dtype)
            shell = _Shell(block)

            def forward(m: _Shell, _ids: Any, x: Any = x) -> Any:
                return m.layers[0](x, positions)  # the block's inputs, not the token ids

            if autoround_config is not None:  # block i draws from seed + i, as in the whole-model pass
                options["config"] = dataclasses.replace(autoround_config, seed=autoround_config.seed + i)
            quantize(shell, calibration=ids, forward=forward, **options)
            block = shell.layers[0]
            x = jax.block_until_ready(block(x, positions))  # the quantized block's output
            for path, module in nnx.iter_modules(block):
                if not path or not isinstance(module, QLinear | nnx.Linear | RMSNorm):
                    continue  # the block itself and its containers (attn, mlp) hold no tensors
                hf_module = hf_module_for(f"layers.{i}.{'.'.join(str(p) for p in path)}")
                if isinstance(module, QLinear):
                    for key, value in writer.write_linear(hf_module, module.weight).items():
                        value = np.asarray(value)
                        out.add(key, value)
                        report.bytes_written += value.nbytes
                    report.quantized.append(hf_module)
                    report.tensors += 1
                    report.bytes_read += ckpt.nbytes(f"{hf_module}.weight")
                    written.add(f"{hf_module}.weight")
                    if f"{hf_module}.bias" in ckpt:
                        passthrough(out, f"{hf_module}.bias")
                    continue
                if isinstance(module, nnx.Linear):
                    float_linears.append(hf_module)
                for param in ("weight", "bias"):
                    name = f"{hf_module}.{param}"
                    if name in ckpt and name not in written:
                        passthrough(out, name)
            del block, shell, forward
            bar.update()
        for name in ckpt.names():  # the final norm, the LM head, anything else the decoder does not read
            if name not in written and not is_ignored(name) and not name.startswith("model.layers."):
                passthrough(out, name)
                if name == "lm_head.weight":
                    float_linears.append("lm_head")
        config["quantization_config"] = writer.quantization_config(ignore=sorted(float_linears))
        out.write_config(config)
        out.copy_files(ckpt.path)
    report.seconds = time.perf_counter() - t0
    report.files = out.files_written
    report.peak_rss_bytes = peak_rss_bytes()
    return report


__all__ = ["CALIBRATED", "quantize_directory_calibrated"]
