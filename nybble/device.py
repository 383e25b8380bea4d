"""The local GPU, as the library asks for it: which device (the dispatcher, once per call, never inside a
kernel or at trace time; the default layout ``nybble.quantize`` writes) and its SM count.
It imports only jax."""

from __future__ import annotations

from typing import Any

import jax

# Streaming multiprocessors of an H100 SXM / H200: used only when no GPU can be asked (lowering on a CPU).
DEFAULT_NUM_SMS = 132


def gpu_device() -> Any | None:
    """The first local GPU device, or None."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    return devices[0] if devices else None


def hopper_device() -> Any | None:
    """The first local GPU if it is a Hopper (compute capability 9.x), else None."""
    dev = gpu_device()
    if dev is None:
        return None
    return dev if str(getattr(dev, "compute_capability", "")).startswith("9") else None


def num_sms() -> int:
    """Streaming multiprocessors of the local Hopper GPU, or the H100/H200 count when none is local."""
    dev = hopper_device()
    return int(getattr(dev, "core_count", DEFAULT_NUM_SMS)) if dev is not None else DEFAULT_NUM_SMS


__all__ = ["DEFAULT_NUM_SMS", "gpu_device", "hopper_device", "num_sms"]
