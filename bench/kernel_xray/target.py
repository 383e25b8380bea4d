"""The GPUs (Hopper, Blackwell) nybble compiles for without one: JAX's deviceless topology of a ``GpuSpec``.

The GPUs' facts live in :mod:`nybble.kernels.gpu` (one spec for the heuristics, the X-ray and bench).
"""

from __future__ import annotations

from typing import Any

from nybble.kernels.gpu import GPUS, GpuSpec, get_gpu

__all__ = ["GPUS", "GpuSpec", "deviceless_devices", "get_gpu", "target_config"]


def target_config(spec: GpuSpec) -> str:
    """A ``GpuTargetConfigProto`` in text form, what ``get_topology_desc(target_config=...)`` takes."""
    cc_major, cc_minor = (int(v) for v in getattr(spec, "compute_capability", "9.0").split("."))
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {spec.smem_per_sm}
  threads_per_core_limit: {spec.max_threads_per_sm}
  core_count: {spec.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(spec.hbm_bytes_per_s)}
  l2_cache_size: {spec.l2_bytes}
  clock_rate_ghz: {spec.clock_ghz}
  device_memory_size: {spec.memory_bytes}
  shared_memory_per_block_optin: {spec.smem_per_block_optin}
  cuda_compute_capability {{ major: {cc_major} minor: {cc_minor} }}
  registers_per_core_limit: {spec.registers_per_sm}
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{spec.description}"
"""


def deviceless_devices(
    gpu: str | GpuSpec = "h200", num_devices: int = 1, *, hosts: int | None = None
) -> list[Any]:
    """``num_devices`` abstract devices of a deviceless ``gpu`` topology: compile targets.

    ``hosts`` None spreads them one per host (topology ``1xNx1``); ``hosts=1`` puts them all in one host
    (``1x1xN``, an 8-GPU NVLink node), any divisor of ``num_devices`` in between. Needs a process set up by
    :func:`bench.kernel_xray.toolchain.child_environment`.
    """
    from jax.experimental import topologies

    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    hosts = num_devices if hosts is None else hosts
    if hosts < 1 or num_devices % hosts:
        raise ValueError(f"deviceless_devices: hosts={hosts} must divide num_devices={num_devices}")
    topo = topologies.get_topology_desc(
        spec.name,
        "cuda",
        target_config=target_config(spec),
        topology=f"1x{hosts}x{num_devices // hosts}",
    )
    return list(topo.devices)
