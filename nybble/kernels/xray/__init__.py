"""Kernel X-ray: compile for a Hopper GPU (sm_90a) on a machine without one and read what it would run.

The pieces: :mod:`~nybble.kernels.xray.toolchain` (the ``xray`` extra: JAX's CUDA plugin, ptxas, nvdisasm,
and the process environment they need), :mod:`~nybble.kernels.xray.target` (H100/H200 facts, deviceless
topologies), :mod:`~nybble.kernels.xray.compile` (compile with Mosaic GPU's dumps and parse them),
:mod:`~nybble.kernels.xray.sass` (SASS main loop, ptxas resources) and :mod:`~nybble.kernels.xray.hlo`
(the launches of a compiled call). ``python -m bench.xray`` sweeps nybble's kernels with them.
"""

from nybble.kernels.xray.compile import CompileReport, KernelReport, LoopReport, abstract, xray_compile
from nybble.kernels.xray.target import GPUS, GpuSpec, deviceless_devices, get_gpu
from nybble.kernels.xray.toolchain import (
    Toolchain,
    ToolchainMissing,
    child_environment,
    find_toolchain,
    in_compile_process,
)

__all__ = [
    "GPUS",
    "CompileReport",
    "GpuSpec",
    "KernelReport",
    "LoopReport",
    "Toolchain",
    "ToolchainMissing",
    "abstract",
    "child_environment",
    "deviceless_devices",
    "find_toolchain",
    "get_gpu",
    "in_compile_process",
    "xray_compile",
]
