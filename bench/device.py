"""The machine the benchmark runs on: names and versions, and the two measured ceilings."""

from __future__ import annotations

import dataclasses
import datetime
import platform
import re
import shutil
import subprocess
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.metrics import Ceilings, matmul_flops
from bench.timing import measure

# Rotated input sets should together exceed the last-level cache several times over (H200: 60 MB L2).
ROTATE_BYTES = {"gpu": 256 * 2**20, "cpu": 64 * 2**20}


def backend() -> str:
    """``gpu`` or ``cpu`` (anything else is reported as is)."""
    return jax.default_backend()


def has_gpu() -> bool:
    return backend() == "gpu"


def device_name() -> str:
    """``NVIDIA H200``, or the CPU model when there is no GPU."""
    if has_gpu():
        return str(jax.devices()[0].device_kind)
    return cpu_name()


def device_slug() -> str:
    """A folder-friendly device name: ``nvidia-h200``, ``cpu``."""
    if not has_gpu():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device_name().lower()).strip("-") or "gpu"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_smi(query: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def machine_info() -> dict[str, Any]:
    """Everything needed to read the numbers later: machine, devices, driver, versions, date."""
    dev = jax.devices()[0]
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "machine": platform.machine(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "cpu_count": _cpu_count(),
        "backend": backend(),
        "device": device_name(),
        "device_count": jax.device_count(),
        "device_platform": dev.platform,
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "triton": _version("triton"),
        "tokamax": _version("tokamax"),
        "driver": None,
        "gpu_memory": None,
    }
    if has_gpu():
        info["compute_capability"] = str(getattr(dev, "compute_capability", ""))
        info["sm_count"] = getattr(dev, "core_count", None)
        info["driver"] = _nvidia_smi("driver_version")
        info["gpu_memory"] = _nvidia_smi("memory.total")
        info["gpu_clocks"] = _nvidia_smi("clocks.sm,clocks.mem,clocks.max.sm")
        # The spec sheet the models use for this device (nybble.kernels.gpu): predictions beside timings.
        from nybble.kernels.gpu import current_gpu

        info["gpu_spec"] = dataclasses.asdict(current_gpu())
    return info


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def measure_copy_bandwidth(nbytes: int | None = None) -> dict[str, float]:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written (one streaming pass)."""
    if nbytes is None:
        nbytes = 2 * 2**30 if has_gpu() else 64 * 2**20
    n = nbytes // 4
    a = jnp.arange(n, dtype=jnp.float32)  # not zeros; cheap to make
    copy = jax.jit(lambda v: v * 1.5 + 1.0)  # reads n floats, writes n floats; trivial arithmetic
    t = measure(lambda: copy(a), jax.block_until_ready, sample_s=0.02, min_samples=5, max_time_s=_budget(2.0))
    moved = 2 * n * 4
    return {"bytes": moved, "median_us": t.median_s * 1e6, "bytes_per_s": moved / t.median_s}


def measure_bf16_rate(size: int | None = None) -> dict[str, float]:
    """bf16 matmul rate in FLOP/s: a large square product of random bf16 with f32 accumulation."""
    if size is None:
        size = 8192 if has_gpu() else 1024
    k1, k2 = jax.random.split(jax.random.key(11))
    a = jax.random.normal(k1, (size, size), jnp.bfloat16)
    b = jax.random.normal(k2, (size, size), jnp.bfloat16)
    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    t = measure(
        lambda: dot(a, b), jax.block_until_ready, sample_s=0.02, min_samples=5, max_time_s=_budget(3.0)
    )
    flops = matmul_flops(size, size, size)
    return {"size": size, "median_us": t.median_s * 1e6, "flops_per_s": flops / t.median_s}


def _budget(gpu_seconds: float) -> float:
    """Seconds to spend on one ceiling: the full amount on a GPU, a third on the CPU."""
    return gpu_seconds if has_gpu() else gpu_seconds / 3


def measure_ceilings() -> tuple[Ceilings, dict[str, Any]]:
    """Both ceilings, measured now on this device, and the raw measurements for the JSON."""
    copy = measure_copy_bandwidth()
    mm = measure_bf16_rate()
    return Ceilings(copy["bytes_per_s"], mm["flops_per_s"]), {"copy": copy, "bf16_matmul": mm}
