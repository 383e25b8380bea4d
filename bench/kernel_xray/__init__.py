"""Kernel X-ray: compile for a Hopper GPU (sm_90a) on a machine without one and read what it would run.

A development tool of the nybble checkout (not part of the installed ``nybble`` package).

The pieces: :mod:`~bench.kernel_xray.toolchain` (the ``xray`` extra: JAX's CUDA plugin, ptxas, nvdisasm,
and the process environment they need), :mod:`~bench.kernel_xray.target` (deviceless topologies of
``nybble.kernels.gpu``'s specs), :mod:`~bench.kernel_xray.compile` (compile with Mosaic GPU's dumps and
parse them), :mod:`~bench.kernel_xray.dumps` (those dumps as files, without the IR log),
:mod:`~bench.kernel_xray.sass` (SASS main loop, ptxas resources) and :mod:`~bench.kernel_xray.hlo` (the
launches of a compiled call). ``python -m bench.xray`` sweeps nybble's
kernels with them.
"""

from bench.kernel_xray.compile import CompileReport, KernelReport, LoopReport, abstract, xray_compile
from bench.kernel_xray.target import GPUS, GpuSpec, deviceless_devices, get_gpu
from bench.kernel_xray.toolchain import (
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
