"""The Triton backend as the dispatcher sees it: the six functions of nybble's backend seam.

``implementation="triton"`` runs the portable Pallas-on-Triton kernels (``dense`` and ``grouped``) on any
NVIDIA GPU of compute capability 8.0 or newer; ``implementation=None`` reaches them where the Mosaic GPU
kernels cannot run (Ampere, Ada, Blackwell until its own kernel, sm_120; Hopper with f32 activations).
On a CPU they run in Pallas' interpret mode inside :func:`interpret` (tests, debugging).

Not yet taken by ``implementation=None`` on a real GPU (:func:`unverified`): their first run on one (an
H200, 2026-12-04: bench/results/gpu-check-2026-12-04) returned wrong outputs, though interpret mode is
exact for the same configs. ``implementation="triton"`` still runs them.

They read the ``planes_nk_int4`` layout: quantize with ``layout="planes_nk_int4"`` (the default on those GPUs,
``nybble.packing.default_layout``) or convert once with ``nybble.quant.relayout(qw, "planes_nk_int4")``;
nothing is repacked per call.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from nybble import device
from nybble.kernels.gpu import GpuSpec, get_gpu, spec_for_device_kind
from nybble.kernels.triton.config import TuningConfig, block_kw_unsupported, choose_config
from nybble.packing.layouts import TRITON_LAYOUT
from nybble.quant.qweight import QuantizedWeight

LAYOUT = TRITON_LAYOUT
X_DTYPES = ("bfloat16", "float16", "float32")
MIN_COMPUTE_CAPABILITY = (8, 0)  # bf16 MMA (Ampere) and newer

# The GpuSpec an active interpret() simulates (its heuristics' target), or None outside interpret().
_INTERPRET: contextvars.ContextVar[GpuSpec | None] = contextvars.ContextVar(
    "nybble_triton_interpret", default=None
)


@contextlib.contextmanager
def interpret(gpu: str = "a100") -> Iterator[None]:
    """Runs the Triton kernels on the CPU in Pallas' interpret mode, with the configs picked for ``gpu``."""
    token = _INTERPRET.set(get_gpu(gpu))
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def is_interpret_active() -> bool:
    """Whether an :func:`interpret` context is active."""
    return _INTERPRET.get() is not None


def _gpu_device() -> Any | None:
    return device.gpu_device()


def _compute_capability(dev: Any) -> tuple[int, int] | None:
    try:
        major, minor = str(getattr(dev, "compute_capability", "")).split(".")
        return int(major), int(minor)
    except ValueError:
        return None


def target_gpu() -> GpuSpec:
    """The GPU the heuristics plan for: the interpreted one, else the local one (its SM count), else A100."""
    spec = _INTERPRET.get()
    if spec is not None:
        return spec
    import dataclasses

    dev = _gpu_device()
    if dev is None:
        return get_gpu("a100")
    spec = spec_for_device_kind(str(getattr(dev, "device_kind", ""))) or get_gpu("a100")
    sms = getattr(dev, "core_count", None)
    return dataclasses.replace(spec, sms=int(sms)) if sms else spec


def _layout_reason(qw: QuantizedWeight) -> str | None:
    if qw.layout != LAYOUT:
        return (
            f"the Triton kernel reads layout {LAYOUT!r} and this weight is stored as {qw.layout!r}: quantize "
            f"with layout={LAYOUT!r} or convert once with nybble.quant.relayout(qw, {LAYOUT!r})"
        )
    return block_kw_unsupported(qw.padded_shape[0], qw.group)


def _dtype_reason(x: Any) -> str | None:
    name = np.dtype(x.dtype).name
    if name not in X_DTYPES:
        return f"the Triton kernel multiplies x of dtype {X_DTYPES}, got {name}"
    return None


def unsupported(x: Any, qw: QuantizedWeight) -> str | None:
    """Why the dense Triton kernel cannot compute ``x @ qw`` (jax release, layout, K and group, dtype), or
    None."""
    from nybble.jax_range import outside_reason

    if (reason := outside_reason()) is not None:
        return reason
    if np.ndim(qw.codes) != 2:
        return f"the dense Triton kernel takes one weight, got codes of shape {tuple(qw.codes.shape)}"
    return _dtype_reason(x) or _layout_reason(qw)


def not_here() -> str | None:
    """Why the Triton kernels cannot run here now (no NVIDIA GPU of compute capability >= 8.0 and not
    interpreting), or None."""
    if is_interpret_active():
        return None
    dev = _gpu_device()
    if dev is None:
        return (
            f"it needs an NVIDIA GPU (compute capability >= 8.0) and the default backend is "
            f"{jax.default_backend()!r}; on a CPU run it inside "
            f"`with nybble.kernels.triton.backend.interpret():`"
        )
    cc = _compute_capability(dev)
    if cc is None or cc < MIN_COMPUTE_CAPABILITY:
        return (
            f"it needs compute capability >= 8.0 (bf16 tensor cores) and this GPU, "
            f"{getattr(dev, 'device_kind', 'unknown')}, has compute capability "
            f"{getattr(dev, 'compute_capability', 'unknown')}"
        )
    return None


# Why implementation=None passes the kernels over on a real GPU.
HARDWARE_REASON = (
    "the Triton kernels returned wrong outputs on their first real GPU (an H200, 2026-12-04: relative "
    "error 0.82 at M=1, K=N=4096, g128; interpret mode is exact for the same config), so implementation=None "
    "does not take them until a hardware check passes; implementation='triton' runs them anyway"
)


def unverified(x: Any, qw: QuantizedWeight) -> str | None:
    """Why ``implementation=None`` passes the dense kernel over on a real GPU (see HARDWARE_REASON); None
    inside :func:`interpret`."""
    del x, qw
    return None if is_interpret_active() or _gpu_device() is None else HARDWARE_REASON


def ragged_unverified(x: Any, qw: QuantizedWeight, group_sizes: Any) -> str | None:
    """:func:`unverified` for the grouped kernel."""
    del group_sizes
    return unverified(x, qw)


def plan(m: int, qw: QuantizedWeight, x_dtype: Any = "bfloat16", gpu: GpuSpec | None = None):
    """The TuningConfig the heuristics pick for M rows of x times ``qw`` on ``gpu`` (default: here)."""
    k_pad, n_pad = qw.padded_shape
    return choose_config(m, k_pad, n_pad, qw.group, np.dtype(x_dtype).itemsize, gpu or target_gpu())


def matmul(x2d: Any, qw: QuantizedWeight) -> jax.Array:
    """``x2d @ dequantize(qw)`` for x2d (M, K): the dense kernel with the heuristics' config."""
    from nybble.kernels.triton.dense import dense_matmul

    cfg = plan(x2d.shape[0], qw, x2d.dtype)
    return dense_matmul(x2d, qw, cfg, interpret=is_interpret_active())


def describe(m: int, qw: QuantizedWeight) -> str:
    """One line for ``nybble.kernels.explain``: the config picked for M rows of bf16/f16 x on the target
    GPU (f32 x may take fewer pipeline stages)."""
    gpu = target_gpu()
    cfg = plan(m, qw, "bfloat16", gpu)
    launches = "1 launch" if cfg.splits == 1 else f"2 launches (split-K over {cfg.splits}, then a reduction)"
    return f"Triton kernel config for M={m} on {gpu.name} ({gpu.sms} SMs): {cfg}, {launches}"


def grouped_config(rows: int, qw: QuantizedWeight, x_dtype: Any) -> TuningConfig:
    """The grouped kernel's config: the dense heuristics' tile for the mean rows per expert, no split."""
    import dataclasses

    experts = int(qw.codes.shape[0])
    mean = max(1, -(-rows // experts))
    cfg = plan(mean, qw, x_dtype)
    return dataclasses.replace(cfg, splits=1)


def ragged_unsupported(x: Any, qw: QuantizedWeight, group_sizes: Any) -> str | None:
    """Why the grouped Triton kernel cannot compute these arguments, or None."""
    from nybble.jax_range import outside_reason

    del group_sizes  # checked by nybble.ragged_matmul; clamped in the kernel when traced
    if (reason := outside_reason()) is not None:
        return reason
    if np.ndim(qw.codes) != 3:
        return f"the grouped Triton kernel takes a stacked weight, got codes of shape {tuple(qw.codes.shape)}"
    return _dtype_reason(x) or _layout_reason(qw)


def ragged_matmul(x: Any, qw: QuantizedWeight, group_sizes: Any) -> jax.Array:
    """The grouped product of a mixture of experts (``nybble.ragged_matmul``'s contract)."""
    from nybble.kernels.triton.grouped import grouped_matmul

    cfg = grouped_config(x.shape[0], qw, x.dtype)
    return grouped_matmul(x, qw, group_sizes, cfg, interpret=is_interpret_active())


__all__ = [
    "HARDWARE_REASON",
    "LAYOUT",
    "describe",
    "grouped_config",
    "interpret",
    "is_interpret_active",
    "matmul",
    "not_here",
    "plan",
    "ragged_matmul",
    "ragged_unsupported",
    "ragged_unverified",
    "target_gpu",
    "unsupported",
    "unverified",
]
