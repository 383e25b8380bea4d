"""Float weights to ``QuantizedWeight``: round to nearest, GPTQ, least-squares scale refits, and exact
imports of GPTQ/AWQ/qwix."""

from nybble.quant.formats import (
    from_awq,
    from_gptq,
    from_gptq_act_order,
    from_qwix,
    load_awq_checkpoint,
    load_gptq_checkpoint,
    to_torch_int4pack,
    to_torch_uint8_codes,
)
from nybble.quant.gptq import HessianAccumulator, gptq, hessian_from_inputs
from nybble.quant.qformat import QuantFormat
from nybble.quant.qweight import QuantizedWeight, dequantize, relayout
from nybble.quant.refit import refit_group_params
from nybble.quant.rtn import quantize

__all__ = [
    "HessianAccumulator",
    "QuantFormat",
    "QuantizedWeight",
    "dequantize",
    "from_awq",
    "from_gptq",
    "from_gptq_act_order",
    "from_qwix",
    "gptq",
    "hessian_from_inputs",
    "load_awq_checkpoint",
    "load_gptq_checkpoint",
    "quantize",
    "refit_group_params",
    "relayout",
    "to_torch_int4pack",
    "to_torch_uint8_codes",
]
