"""Hopper (sm90) Mosaic GPU kernels: int4-weight x bf16/f16-activation GEMM, and running them on a CPU.

Public surface: :func:`mosaic_gpu_matmul` and :func:`is_supported` (dense.py), :class:`TuningConfig` and
:func:`heuristic_config`; the grouped (mixture-of-experts) kernel
:func:`grouped_matmul` / :func:`grouped_is_supported` (grouped.py);
``backend.py`` plugs both into ``nybble.matmul`` / ``nybble.ragged_matmul`` (``nybble.kernels.backends``);
the ``interpret`` submodule's ``interpret()`` context (re-exported as ``nybble.kernels.interpret``) runs
them on a CPU in GPU interpret mode, and :func:`races_found` / :func:`reset_state` read and reset its race
detector.
"""

from nybble.kernels.mosaic_gpu.config import TuningConfig
from nybble.kernels.mosaic_gpu.dense import (
    is_interpret_active,
    is_supported,
    mosaic_gpu_matmul,
    plan,
)
from nybble.kernels.mosaic_gpu.grouped import grouped_is_supported, grouped_matmul
from nybble.kernels.mosaic_gpu.heuristics import heuristic_config
from nybble.kernels.mosaic_gpu.interpret import races_found, reset_state
from nybble.kernels.mosaic_gpu.kernel import w4a16

__all__ = [
    "TuningConfig",
    "grouped_is_supported",
    "grouped_matmul",
    "heuristic_config",
    "is_interpret_active",
    "is_supported",
    "mosaic_gpu_matmul",
    "plan",
    "races_found",
    "reset_state",
    "w4a16",
]
