"""The Mosaic GPU backend: nybble's Hopper kernels as the backend functions of ``nybble.kernels.backends``.

The dense kernel is ``dense.py``'s, the grouped (mixture-of-experts) one ``grouped.py``'s. They run on a
Hopper GPU (compute capability 9.x), or on any machine inside ``nybble.kernels.interpret()``. The SM count
their heuristics plan for is asked of the device once per call (``nybble.kernels.device.num_sms``), never
at trace time inside a kernel.
"""

from __future__ import annotations

from typing import Any

import jax

from nybble.kernels import device
from nybble.kernels.mosaic_gpu import dense, grouped
from nybble.kernels.mosaic_gpu.dense import is_interpret_active
from nybble.kernels.ops.ragged_matmul.xla import group_bounds
from nybble.quant.qweight import QuantizedWeight


def unsupported(x: Any, qw: QuantizedWeight) -> str | None:
    """Why the dense kernel cannot compute ``x @ dequantize(qw)`` at all (dtype, layout), or None."""
    return dense.is_supported(x, qw)


def not_here() -> str | None:
    """Why the kernels cannot run on this machine now (no Hopper GPU, not interpreting), or None."""
    if is_interpret_active() or device.hopper_device() is not None:
        return None
    gpu = device.gpu_device()
    if gpu is not None:  # Ampere, Ada, Blackwell: no sm_90a WGMMA
        cc = getattr(gpu, "compute_capability", "unknown")
        return (
            f"it needs a Hopper GPU (compute capability 9.x, WGMMA) and this GPU, {gpu.device_kind}, has "
            f"compute capability {cc}"
        )
    return (
        f"it needs a Hopper GPU (compute capability 9.x) and the default backend is "
        f"{jax.default_backend()!r}; on a CPU run it inside `with nybble.kernels.interpret():`"
    )


def matmul(x2d: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """The dense kernel with its heuristic config, for arguments :func:`unsupported` accepted."""
    return dense.matmul_supported(x2d, qw, num_sms=device.num_sms())


def describe(m: int, qw: QuantizedWeight) -> str:
    """The config the dense kernel's heuristics pick for M rows on this GPU's SM count."""
    sms = device.num_sms()
    return f"kernel config for M={m} on {sms} SMs: {dense.plan(m, qw, num_sms=sms).config}"


def ragged_unsupported(x: Any, qw: Any, group_sizes: Any) -> str | None:
    """Why the grouped kernel cannot compute these arguments (shapes, dtypes, layout), or None."""
    return grouped.grouped_is_supported(x, qw, group_sizes)


def ragged_matmul(x: jax.Array, qw: QuantizedWeight, group_sizes: jax.Array) -> jax.Array:
    """The grouped kernel, its group sizes clamped as the XLA path clamps them (a no-op on checked values;
    traced ones are not checked)."""
    _, sizes = group_bounds(group_sizes, x.shape[0])
    return grouped.grouped_matmul(x, qw, sizes, num_sms=device.num_sms())


__all__ = ["describe", "matmul", "not_here", "ragged_matmul", "ragged_unsupported", "unsupported"]
