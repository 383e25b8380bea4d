"""Blackwell (sm_100a) Mosaic GPU kernels: the W4A16 GEMM on tcgen05 with its accumulator in TMEM.

:func:`blackwell_matmul` is what the dispatcher runs on compute capability 10.x (and inside
``nybble.kernels.interpret(gpu="b200")``); :func:`plan` the launch it makes; :class:`BlackwellConfig` and
:func:`heuristic_config` its tilings and the B200 rules that choose one.
:func:`blackwell_grouped_matmul` is the grouped (mixture-of-experts) kernel on the same body, what
``nybble.ragged_matmul`` runs there.
"""

from nybble.kernels.mosaic_gpu.blackwell.api import blackwell_matmul, is_supported, plan
from nybble.kernels.mosaic_gpu.blackwell.config import BlackwellConfig, heuristic_config
from nybble.kernels.mosaic_gpu.blackwell.grouped import blackwell_grouped_matmul
from nybble.kernels.mosaic_gpu.blackwell.kernel import BlackwellProblem, w4a16_blackwell

__all__ = [
    "BlackwellConfig",
    "BlackwellProblem",
    "blackwell_grouped_matmul",
    "blackwell_matmul",
    "heuristic_config",
    "is_supported",
    "plan",
    "w4a16_blackwell",
]
