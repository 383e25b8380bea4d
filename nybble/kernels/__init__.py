"""int4 matmul implementations: the ops (``ops/``), their backends (``mosaic_gpu/``, XLA) and the registry
that chooses between them (``backends.py``)."""

from typing import Any

from nybble.device import num_sms
from nybble.kernels.backends import IMPLEMENTATIONS, Availability
from nybble.kernels.ops.matmul.api import available_implementations, explain, matmul
from nybble.kernels.ops.matmul.reference import reference_dequantize, reference_matmul, relative_error
from nybble.kernels.ops.matmul.xla import xla_matmul
from nybble.kernels.ops.ragged_matmul.api import available_ragged_implementations, ragged_matmul
from nybble.kernels.ops.ragged_matmul.reference import reference_ragged_matmul
from nybble.kernels.ops.ragged_matmul.xla import xla_ragged_matmul
from nybble.kernels.ops.ragged_swiglu_matmul import ragged_swiglu_matmul
from nybble.kernels.ops.residual_matmul import residual_matmul
from nybble.kernels.ops.swiglu_matmul import swiglu_matmul


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
    "ragged_swiglu_matmul",
    "reference_dequantize",
    "reference_matmul",
    "reference_ragged_matmul",
    "relative_error",
    "residual_matmul",
    "swiglu_matmul",
    "xla_matmul",
    "xla_ragged_matmul",
]
