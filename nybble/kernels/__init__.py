"""int4 matmul implementations: the Hopper Mosaic GPU kernel, the XLA path, and the dispatch between them."""

from typing import Any

from nybble.kernels.api import (
    IMPLEMENTATIONS,
    Availability,
    available_implementations,
    explain,
    matmul,
    num_sms,
)
from nybble.kernels.ragged import available_ragged_implementations, ragged_matmul
from nybble.kernels.reference import reference_dequantize, reference_matmul, relative_error
from nybble.kernels.xla import xla_matmul
from nybble.kernels.xla_ragged import xla_ragged_matmul


def __getattr__(name: str) -> Any:
    # `interpret` lives with the Mosaic GPU kernels; imported on first use to keep `import nybble` light.
    if name == "interpret":
        from nybble.kernels.mosaic_gpu.interpret import interpret

        return interpret
    raise AttributeError(f"module 'nybble.kernels' has no attribute {name!r}")


__all__ = [
    "IMPLEMENTATIONS",
    "Availability",
    "available_implementations",
    "available_ragged_implementations",
    "explain",
    "interpret",
    "matmul",
    "num_sms",
    "ragged_matmul",
    "reference_dequantize",
    "reference_matmul",
    "relative_error",
    "xla_matmul",
    "xla_ragged_matmul",
]
