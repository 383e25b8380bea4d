"""The Hopper GPUs nybble compiles for without one: their published facts and JAX's deviceless topology."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Published facts of one GPU model (SXM boards), the inputs of the X-ray's static model."""

    name: str
    description: str  # the CUDA device name
    sms: int
    clock_ghz: float  # boost clock
    hbm_bytes_per_s: float  # peak HBM bandwidth
    bf16_flops: float  # dense bf16 tensor-core peak
    memory_bytes: int
    smem_per_sm: int = 233472  # bytes per SM (228 KiB)
    smem_per_block_optin: int = 232448  # the most one CTA may allocate
    registers_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    l2_bytes: int = 50 * 2**20
    issue_per_sm_cycle: int = 4  # warp-instructions: one per scheduler

    def target_config(self) -> str:
        """A ``GpuTargetConfigProto`` in text form, what ``get_topology_desc(target_config=...)`` takes."""
        return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.smem_per_sm}
  threads_per_core_limit: {self.max_threads_per_sm}
  core_count: {self.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.hbm_bytes_per_s)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.smem_per_block_optin}
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: {self.registers_per_sm}
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{self.description}"
"""


# H200 SXM: 141 GB HBM3e at 4.8 TB/s; H100 SXM: 80 GB HBM3 at 3.35 TB/s. Same GH100 die: 132 SMs at
# 1.98 GHz boost, 989 TFLOP/s dense bf16.
GPUS: dict[str, GpuSpec] = {
    s.name: s
    for s in (
        GpuSpec(
            name="h200",
            description="NVIDIA H200",
            sms=132,
            clock_ghz=1.98,
            hbm_bytes_per_s=4.8e12,
            bf16_flops=989.4e12,
            memory_bytes=141 * 10**9,
        ),
        GpuSpec(
            name="h100",
            description="NVIDIA H100 80GB HBM3",
            sms=132,
            clock_ghz=1.98,
            hbm_bytes_per_s=3.35e12,
            bf16_flops=989.4e12,
            memory_bytes=80 * 2**30,
        ),
    )
}


def get_gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {sorted(GPUS)}") from None


def deviceless_devices(gpu: str | GpuSpec = "h200", num_devices: int = 1) -> list[Any]:
    """``num_devices`` abstract devices of a deviceless ``gpu`` topology (one host): compile targets.

    Needs a process set up by :func:`nybble.kernels.xray.toolchain.child_environment`.
    """
    from jax.experimental import topologies

    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    topo = topologies.get_topology_desc(
        spec.name, "cuda", target_config=spec.target_config(), topology=f"1x{num_devices}x1"
    )
    return list(topo.devices)
