"""nybble: int4 weight-only GEMM for JAX on NVIDIA Hopper.

    qw = nybble.quantize(w, group_size=128)      # (K, N) float -> QuantizedWeight
    y = nybble.matmul(x, qw)                     # Mosaic GPU kernel on Hopper, XLA elsewhere
"""

from nybble.checkpoint import load, save
from nybble.jax_range import warn_if_outside as _warn_if_outside
from nybble.ops import matmul, ragged_matmul
from nybble.packing import pack_int4, unpack_int4
from nybble.quant import QuantFormat, QuantizedWeight, dequantize, quantize

# Once per process, naming the tested range, when the installed jax is outside it (nybble/jax_range.py).
_warn_if_outside()

__version__ = "0.1.0"

__all__ = [
    "QuantFormat",
    "QuantizedWeight",
    "__version__",
    "dequantize",
    "load",
    "matmul",
    "pack_int4",
    "quantize",
    "ragged_matmul",
    "save",
    "unpack_int4",
]
