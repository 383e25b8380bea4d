"""The quantized-linear part of Hugging Face checkpoint directories: read and write, exactly.

A directory's ``config.json`` ``quantization_config`` names how its linear layers are stored.
:func:`scheme_from_config` turns it into an :class:`HFScheme` that says which modules are quantized, which
tensors each one has, and reads one into a :class:`~nybble.quant.qweight.QuantizedWeight` (logical
(K, N) = (in_features, out_features), nybble's default layout) straight from the packed integers: no float
round trip. :func:`writer_for` is the other direction. One module per format holds its reader and writer:
``compressed_tensors``, ``gptq_format``, ``awq_format``, ``autoround_format``, ``nybble_format``
(``hf_base``: what they share).

Formats read (``SUPPORTED``):

* compressed-tensors ``pack-quantized`` (llm-compressor W4A16, vLLM): 4-bit ``int`` weights, symmetric or
  asymmetric, ``group`` or ``channel`` strategy, ``ignore`` (exact names and ``re:`` regexes), ``targets``,
  ``actorder`` (``weight_g_idx``). Tensors per linear ``p`` (torch layout, N = out, K = in):
  ``p.weight_packed`` int32 (N, ceil(K / 8)) (8 codes along K, element i at bits 4i, stored q + 8),
  ``p.weight_scale`` (N, groups), ``p.weight_zero_point`` int32 (ceil(N / 8), groups) (asymmetric, packed
  along N, stored z + 8), ``p.weight_shape`` int64 [N, K], ``p.weight_g_idx`` int32 (K,) (actorder
  "group"). Weight ``(q - z) * s``.
* GPTQ (AutoGPTQ / optimum / GPTQModel): ``checkpoint_format`` "gptq" (v1: stored zero - 1) and
  "gptq_v2", ``desc_act`` (``g_idx``), ``sym``; see ``gptq_format``.
* AWQ ``version: gemm`` (interleaved nibble order); see ``awq_format``.
* AutoRound's own export (``quant_method: auto-round``, ``packing_format`` ``auto_round:auto_gptq`` /
  ``auto_round:gptq`` (GPTQ v1 tensors), ``auto_round`` / ``auto_round:gptqmodel`` (GPTQ tensors, zero
  stored as is) and ``auto_round:auto_awq`` (AWQ tensors)); its symmetric scales may be negative, which
  changes nothing here (no sign is assumed anywhere).
* nybble's own (``quant_method: nybble``): codes, scales and offsets exactly as a QuantizedWeight holds them.

Exactness. Every format stores unsigned codes u, an integer zero z and a scale s with weight
``(u - z) * s``; nybble stores signed codes ``q = u - 8`` and ``offset = (8 - z) * s``. Symmetric layers keep
their scale dtype. Asymmetric layers keep their scales' dtype and store the offsets in float32: for 16-bit
scales both ``q * s`` and ``(8 - z) * s`` are exact in float32, so ``nybble.dequantize(qw, float32)`` is
exactly the library's ``(q - z) * s`` (and the cast to the checkpoint dtype rounds that one exact value as
the library does). Every dequantization path (``nybble.dequantize``, the XLA matmul, the Mosaic kernel)
reads scales and offsets each in its own dtype, so the mixed pair needs no kernel rule (checked in GPU
interpret mode). Float32 scales: symmetric is exact too; asymmetric rounds twice (``q * s``, then
``+ offset``) where the library rounds once, within one float32 ulp.

Which tensors: :meth:`HFScheme.tensor_names` lists what a linear must have; tensors some exporters add
(a GPTQ ``g_idx``) are :meth:`HFScheme.optional_tensor_names`, included when ``available=`` (the
checkpoint's names) holds them.

Writers (:func:`writer_for`) refuse, naming the layer, what the format cannot hold exactly: float zero
points (quantize with ``zero_point="integer"``), scales the format's dtype cannot represent, GPTQ's zero 0
(v1 stores ``z - 1``), mixed group sizes or per-layer float exceptions a GPTQ config cannot state.
compressed-tensors output is byte-identical to its own compressor's for the same codes and scales.

Activation order (GPTQ ``desc_act``, compressed-tensors ``actorder: group``): row k of K uses group
``g_idx[k]``. Where runs of G' >= 16 consecutive rows share a group (G' a power of two), the weight is
regrouped exactly at group size G' in natural order (:func:`nybble.quant.formats._common.regroup_natural`).
Otherwise (the usual case: groups scattered row by row) the rows are sorted by group, which needs the
input permuted: :meth:`HFScheme.read_linear_with_perm` returns ``(weight, perm)`` with
``x @ W_checkpoint == x[..., perm] @ weight``, and :meth:`HFScheme.read_linear` refuses such a layer rather
than return a weight that needs a permutation its caller might not apply.
"""

from __future__ import annotations

from typing import Any

from nybble.quant.formats.autoround_format import AutoRoundScheme
from nybble.quant.formats.awq_format import AWQScheme
from nybble.quant.formats.compressed_tensors import CompressedTensorsScheme, CompressedTensorsWriter
from nybble.quant.formats.gptq_format import GPTQScheme, GPTQWriter
from nybble.quant.formats.hf_base import (
    SUPPORTED,
    WRITE_FORMATS,
    HFScheme,
    HFWriter,
    _unsupported,
    pack_int32,
)
from nybble.quant.formats.nybble_format import NybbleScheme, NybbleWriter

__all__ = [
    "SUPPORTED",
    "WRITE_FORMATS",
    "HFScheme",
    "HFWriter",
    "pack_int32",
    "scheme_from_config",
    "writer_for",
]


def scheme_from_config(quantization_config: dict) -> HFScheme:
    """The :class:`HFScheme` of a config.json ``quantization_config``; an error listing what nybble
    reads (``SUPPORTED``) for anything else (other bit widths, fp8, nvfp4, marlin-24, 2:4 sparse, float
    or dynamic quantization, activation quantization, an unknown ``quant_method``)."""
    if not isinstance(quantization_config, dict):
        raise ValueError(f"quantization_config must be a dict, got {type(quantization_config).__name__}")
    method = str(quantization_config.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return CompressedTensorsScheme(quantization_config)
    if method == "gptq":
        return GPTQScheme(quantization_config)
    if method == "awq":
        return AWQScheme(quantization_config)
    if method in ("auto-round", "autoround", "intel/auto-round", "auto_round"):
        return AutoRoundScheme(quantization_config)
    if method == "nybble":
        return NybbleScheme(quantization_config)
    raise _unsupported(f"quant_method={quantization_config.get('quant_method')!r}")


def writer_for(format: str, **options: Any) -> HFWriter:
    """A writer for ``format`` in ``WRITE_FORMATS``: "compressed-tensors" (options ``scale_dtype``: the
    model dtype, default each weight's own; ``version``), "gptq" (``scale_dtype``, default float16) or
    "nybble" (``layout``)."""
    writers = {"compressed-tensors": CompressedTensorsWriter, "gptq": GPTQWriter, "nybble": NybbleWriter}
    if format not in writers:
        raise ValueError(f"format={format!r}: nybble writes {WRITE_FORMATS}")
    return writers[format](**options)
