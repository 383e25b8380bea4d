"""Checkpoint formats nybble reads and writes: GPTQ, AWQ, qwix, Hugging Face directories' quantized linears
(compressed-tensors, GPTQ, AWQ, AutoRound, nybble: one module each, ``hf_scheme`` picks one) in; torch
tinygemm, compressed-tensors, GPTQ out. All exact."""

from nybble.quant.formats.awq_format import from_awq
from nybble.quant.formats.foreign_checkpoint import load_awq_checkpoint, load_gptq_checkpoint
from nybble.quant.formats.gptq_format import from_gptq, from_gptq_act_order
from nybble.quant.formats.hf_scheme import HFScheme, HFWriter, scheme_from_config, writer_for
from nybble.quant.formats.qwix import from_qwix
from nybble.quant.formats.torch_int4pack import (
    TorchCodes,
    TorchInt4Pack,
    to_torch_int4pack,
    to_torch_uint8_codes,
)

__all__ = [
    "HFScheme",
    "HFWriter",
    "TorchCodes",
    "TorchInt4Pack",
    "from_awq",
    "from_gptq",
    "from_gptq_act_order",
    "from_qwix",
    "load_awq_checkpoint",
    "load_gptq_checkpoint",
    "scheme_from_config",
    "to_torch_int4pack",
    "to_torch_uint8_codes",
    "writer_for",
]
