"""Exact importers of existing int4 checkpoints (GPTQ, AWQ, qwix) and the torch tinygemm exporter.

The implementations live in ``nybble.quant.formats`` (one module per format, each documenting its bit
layout); this module is the public entry point.
"""

from nybble.quant.formats import (
    TorchCodes,
    TorchInt4Pack,
    from_awq,
    from_gptq,
    from_gptq_act_order,
    from_qwix,
    load_awq_checkpoint,
    load_gptq_checkpoint,
    to_torch_int4pack,
    to_torch_uint8_codes,
)

__all__ = [
    "TorchCodes",
    "TorchInt4Pack",
    "from_awq",
    "from_gptq",
    "from_gptq_act_order",
    "from_qwix",
    "load_awq_checkpoint",
    "load_gptq_checkpoint",
    "to_torch_int4pack",
    "to_torch_uint8_codes",
]
