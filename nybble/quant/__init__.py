"""Float weights to ``QuantizedWeight``: round to nearest now; calibrated methods and imports beside it."""

from nybble.quant.qweight import QuantizedWeight, dequantize
from nybble.quant.rtn import quantize

__all__ = ["QuantizedWeight", "dequantize", "quantize"]
