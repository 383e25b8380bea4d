"""One description of each NVIDIA GPU nybble targets, used by the heuristics' cost model, the X-ray's model
and the benchmark: SMs, HBM bandwidth, clock, tensor-core rate, SMEM, distributed-SMEM rate, launch cost.

Published figures (SXM boards; H100 and H200 are the same GH100 die: 132 SMs at 1.98 GHz boost, 989 TFLOP/s
dense bf16); H200 has 141 GB of HBM3e at 4.8 TB/s, H100 80 GB of HBM3 at 3.35 TB/s. Two are nybble's own
working figures, not datasheet ones: the distributed-SMEM rate (~32 bytes per cycle per SM, what the
split-K reduction in a cluster is charged) and the cost of one extra launch (~2 us). A kernel replayed inside
a CUDA graph is charged 0.875 us: CUDA.jl's documentation ("Graphs": an RK4 integration of 80 small
broadcast kernels takes 70 us as one graph, 260 us launched one by one; its GPU unnamed), each kernel's own
run included, so an upper figure for the gap alone. :func:`current_gpu` picks the spec of the local GPU (by
its device kind), else the H200's.

The other GPUs (the portable Triton kernel's targets, ``nybble.kernels.triton``), each from its vendor's
datasheet, with the per-SM limits (shared memory, threads, blocks) of its compute capability from the CUDA
C++ Programming Guide's table of technical specifications: A100 SXM4 80GB (NVIDIA A100 Tensor Core GPU
datasheet: 2,039 GB/s HBM2e, 312 TFLOP/s dense bf16; 108 SMs at 1.41 GHz boost, 40 MB L2, from the NVIDIA
A100 Tensor Core GPU Architecture whitepaper), L40S (NVIDIA L40S datasheet: 864 GB/s GDDR6, 362.05 TFLOP/s
dense bf16, 48 GB; 142 SMs at 2.52 GHz boost, 96 MB L2, from the NVIDIA Ada Lovelace architecture
whitepaper's AD102), RTX 5090 (NVIDIA RTX Blackwell GPU Architecture whitepaper: 170 SMs at 2.41 GHz boost,
1,792 GB/s GDDR7, 32 GB, 209.5 TFLOP/s dense FP16/bf16 with FP32 accumulate, 96 MB L2), B200 (NVIDIA
DGX/HGX B200 datasheet: 8 TB/s HBM3e, 180 GB, 2.25 PFLOP/s dense bf16 per GPU; 148 SMs, 126 MB L2, from
the NVIDIA Blackwell architecture technical brief; ~1.965 GHz boost). The Ada and sm_120 parts have 100 KB
of shared memory per SM (99 KB for one block) and 1,536 threads per SM; no NVLink (PCIe Gen4 x16:
32 GB/s each way; RTX 5090: PCIe Gen5 x16, 64 GB/s each way); A100 NVLink 3: 600 GB/s both ways; B200
NVLink 5: 1.8 TB/s both ways.

B200 (Blackwell, sm_100a), from NVIDIA's HGX/DGX B200 datasheets and the CUDA C++ Programming Guide's
compute capability 10.0 table: 148 SMs, ~1.965 GHz boost (the DGX B200's published GPU clock), 8 TB/s of
HBM3e (180 GB usable on HGX B200), 2.25 PFLOP/s dense bf16 (the 8-GPU board's 18 PFLOP/s dense over
8), 228 KiB SMEM per SM of which 227 KiB per CTA (as on Hopper), 126.5 MiB of L2, NVLink 5 at 1.8 TB/s
both directions; tensor memory (TMEM) 256 KiB per SM, 128 lanes x 512 columns of 32 bits (PTX ISA,
tcgen05 "Tensor Memory").
"""

from __future__ import annotations

import dataclasses

from nybble import device


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Facts of one GPU model: the inputs of nybble's cost models."""

    name: str
    description: str  # the CUDA device name
    sms: int
    clock_hz: float  # boost clock
    hbm_bytes_per_s: float  # peak HBM bandwidth
    bf16_flops: float  # dense bf16 tensor-core peak
    memory_bytes: int
    compute_capability: str = "9.0"  # CUDA compute capability, "major.minor"
    smem_per_sm: int = 233472  # bytes per SM (228 KiB)
    smem_per_block_optin: int = 232448  # the most one CTA may allocate
    dsmem_bytes_per_cycle_per_sm: float = 32.0  # distributed SMEM reads in a cluster (nybble's figure)
    launch_s: float = 2e-6  # one more kernel launch in a call (nybble's figure)
    # A kernel replayed inside a CUDA graph (an XLA command buffer): CUDA.jl's documentation, 80 broadcast
    # kernels in 70 us as one graph (0.875 us each, own run included), 260 us launched one by one.
    graph_launch_s: float = 0.875e-6
    registers_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    l2_bytes: int = 50 * 2**20
    issue_per_sm_cycle: int = 4  # warp-instructions: one per scheduler
    # NVLink 4 (H100/H200 SXM): 900 GB/s per GPU both directions together, 450 GB/s each way.
    nvlink_bytes_per_s: float = 450e9
    tmem_bytes_per_sm: int = 0  # tensor memory (Blackwell): 0 where there is none
    tmem_columns: int = 0  # TMEM columns per SM (128 lanes x 32-bit columns)

    @property
    def clock_ghz(self) -> float:
        return self.clock_hz / 1e9

    @property
    def cc_major_minor(self) -> tuple[int, int]:
        """The compute capability as (major, minor) ints: (9, 0) for "9.0"."""
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    @property
    def is_hopper(self) -> bool:
        """Compute capability 9.x: where the Mosaic GPU (WGMMA) kernels run."""
        return self.cc_major_minor[0] == 9


H200 = GpuSpec(
    name="h200",
    description="NVIDIA H200",
    sms=132,
    clock_hz=1.98e9,
    hbm_bytes_per_s=4.8e12,
    bf16_flops=989e12,
    memory_bytes=141 * 10**9,
)
H100_SXM = GpuSpec(
    name="h100",
    description="NVIDIA H100 80GB HBM3",
    sms=132,
    clock_hz=1.98e9,
    hbm_bytes_per_s=3.35e12,
    bf16_flops=989e12,
    memory_bytes=80 * 2**30,
)
A100 = GpuSpec(
    name="a100",
    description="NVIDIA A100-SXM4-80GB",
    sms=108,
    clock_hz=1.41e9,
    hbm_bytes_per_s=2.039e12,
    bf16_flops=312e12,
    memory_bytes=80 * 2**30,
    compute_capability="8.0",
    smem_per_sm=167936,  # 164 KiB
    smem_per_block_optin=166912,  # 163 KiB
    l2_bytes=40 * 2**20,
    nvlink_bytes_per_s=300e9,
)
L40S = GpuSpec(
    name="l40s",
    description="NVIDIA L40S",
    sms=142,
    clock_hz=2.52e9,
    hbm_bytes_per_s=864e9,
    bf16_flops=362.05e12,
    memory_bytes=48 * 2**30,
    compute_capability="8.9",
    smem_per_sm=102400,  # 100 KiB
    smem_per_block_optin=101376,  # 99 KiB
    max_threads_per_sm=1536,
    max_blocks_per_sm=24,
    l2_bytes=96 * 2**20,
    nvlink_bytes_per_s=32e9,  # no NVLink: PCIe Gen4 x16
)
RTX5090 = GpuSpec(
    name="rtx5090",
    description="NVIDIA GeForce RTX 5090",
    sms=170,
    clock_hz=2.41e9,
    hbm_bytes_per_s=1.792e12,
    bf16_flops=209.5e12,
    memory_bytes=32 * 2**30,
    compute_capability="12.0",
    smem_per_sm=102400,
    smem_per_block_optin=101376,
    max_threads_per_sm=1536,
    l2_bytes=96 * 2**20,
    nvlink_bytes_per_s=64e9,  # no NVLink: PCIe Gen5 x16
)
B200 = GpuSpec(
    name="b200",
    description="NVIDIA B200",
    sms=148,
    clock_hz=1.965e9,
    hbm_bytes_per_s=8e12,
    bf16_flops=2.25e15,
    memory_bytes=180 * 10**9,
    compute_capability="10.0",
    l2_bytes=132644864,  # 126.5 MiB
    nvlink_bytes_per_s=900e9,
    tmem_bytes_per_sm=256 * 1024,
    tmem_columns=512,
)
GPUS: dict[str, GpuSpec] = {s.name: s for s in (H200, H100_SXM, A100, L40S, B200, RTX5090)}


def get_gpu(name: str) -> GpuSpec:
    """The spec named ``name`` ("h200", "h100", "a100", "l40s", "b200", "rtx5090"); ValueError naming the
    known ones otherwise."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {sorted(GPUS)}") from None


def spec_for_device_kind(kind: str) -> GpuSpec | None:
    """The spec of a device kind as JAX names it ("NVIDIA H200", "NVIDIA H100 80GB HBM3"), else None."""
    kind = kind.lower()
    if "h200" in kind:
        return H200
    if "h100" in kind and "pcie" not in kind:
        return H100_SXM
    for spec in (A100, L40S, B200, RTX5090):
        if spec.description.lower() == kind or (
            spec.name != "a100" and spec.name.replace("rtx", "rtx ") in kind
        ):
            return spec
    if "a100" in kind and "80gb" in kind and "pcie" not in kind:
        return A100
    return None


def current_gpu() -> GpuSpec:
    """The spec of the local GPU (SM count from the device itself), else the H200's."""
    dev = device.gpu_device()
    if dev is None:
        return H200
    spec = spec_for_device_kind(str(getattr(dev, "device_kind", ""))) or H200
    sms = getattr(dev, "core_count", None)
    return dataclasses.replace(spec, sms=int(sms)) if sms else spec


__all__ = [
    "A100",
    "B200",
    "GPUS",
    "H100_SXM",
    "H200",
    "L40S",
    "RTX5090",
    "GpuSpec",
    "current_gpu",
    "get_gpu",
    "spec_for_device_kind",
]
