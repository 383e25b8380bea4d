"""Compile a jitted function for a Hopper GPU on a machine without one, and X-ray what came out.

``xray_compile(fn, *args)`` lowers ``fn`` for CUDA against a deviceless topology, compiles it (XLA's GPU
compiler; each Mosaic GPU kernel through ptxas during XLA's compile) with Mosaic GPU's dumps switched on
in a fresh folder, and returns the launches of the compiled call and, for every Mosaic GPU kernel in it,
ptxas' registers and spills, the SMEM it allocates, and its main loop's SASS. A static view of the code
the GPU would run, never a timing.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.kernel_xray import hlo, layout_key, sass
from bench.kernel_xray.dumps import mosaic_dumps
from bench.kernel_xray.target import deviceless_devices
from bench.kernel_xray.toolchain import EXTRA_HINT, in_compile_process


@dataclasses.dataclass(frozen=True)
class LoopReport:
    start_offset: int  # byte offset of the loop's first instruction
    end_offset: int  # byte offset of its closing branch (16 bytes per sm_90 instruction)
    instructions: int
    hgmmas: int
    weight_hgmmas: int  # HGMMAs with A (the dequantized weights) in registers
    hgmma_shape: str
    weights_per_thread: float
    instructions_per_weight: float
    stall_cycles: int
    opcode_mix: list[tuple[str, int]]
    straight_line: bool = False  # every K step unrolled: the stretch of steps, not a loop (sass.py)


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """One Mosaic GPU kernel as ptxas compiled it for sm_90a."""

    name: str
    registers: int
    spill_bytes: int
    stack_bytes: int
    threads: int
    smem_bytes: int  # Mosaic's scratch allocation (ptxas reports only static SMEM)
    loop: LoopReport | None
    sass_instructions: int

    @property
    def registers_per_block(self) -> int:
        return self.registers * self.threads


@dataclasses.dataclass(frozen=True)
class CompileReport:
    launches: list[hlo.Launch]
    kernels: list[KernelReport]
    collectives: list[hlo.Collective] = dataclasses.field(default_factory=list)
    hlo_text: str | None = None  # the optimized HLO, when asked for (keep_hlo=True)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompileReport:
        kernels = []
        for k in d["kernels"]:
            loop = k["loop"]
            if loop is not None:
                loop = LoopReport(**{**loop, "opcode_mix": [tuple(p) for p in loop["opcode_mix"]]})
            kernels.append(KernelReport(**{**k, "loop": loop}))
        return cls(
            [hlo.Launch(**launch) for launch in d["launches"]],
            kernels,
            [hlo.Collective(**c) for c in d.get("collectives", [])],
            d.get("hlo_text"),
        )


def abstract(tree: Any, device: Any) -> Any:
    """Arrays or ShapeDtypeStructs -> ShapeDtypeStructs placed on one (deviceless) device."""
    import jax
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def abstract_on(tree: Any, devices: Sequence[Any]) -> Any:
    """ShapeDtypeStructs for a multi-device compile: a leaf's own sharding is kept (it must use only
    ``devices``), other leaves are replicated over ``devices``."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    replicated = NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec())
    allowed = set(devices)

    def place(a: Any) -> Any:
        sharding = getattr(a, "sharding", None)
        if sharding is None:
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated)
        if not set(sharding.device_set) <= allowed:
            raise ValueError(f"an argument of shape {a.shape} is placed on devices outside the compile's")
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return jax.tree.map(place, tree)


def read_kernel_dumps(folder: Path) -> list[KernelReport]:
    """Parses every kernel Mosaic GPU dumped into ``folder`` (``<name>.ptxas``, ``.ptx``, ``.sass_ctrl``)."""
    reports = []
    for ptxas_file in sorted(folder.glob("*.ptxas")):
        base = ptxas_file.with_suffix("")
        ptx = Path(f"{base}.ptx").read_text()
        sass_file = Path(f"{base}.sass_ctrl")
        if not sass_file.exists():
            raise RuntimeError(
                f"Mosaic GPU dumped no SASS for {base.name} (nvdisasm missing from CUDA_ROOT?): {EXTRA_HINT}"
            )
        code = sass.parse_sass(sass_file.read_text())
        loop = sass.main_loop(code)
        loop_report = None
        if loop is not None:
            loop_report = LoopReport(
                start_offset=loop.instructions[0].offset,
                end_offset=loop.instructions[-1].offset,
                instructions=loop.size,
                hgmmas=len(loop.hgmmas),
                weight_hgmmas=len(loop.weight_hgmmas),
                hgmma_shape=loop.hgmmas[0].opcode,
                weights_per_thread=loop.weights_per_thread,
                instructions_per_weight=loop.instructions_per_weight,
                stall_cycles=loop.stall_cycles,
                opcode_mix=loop.opcode_mix(12),
                straight_line=loop.straight_line,
            )
        info = sass.parse_ptxas(ptxas_file.read_text())
        resources = Path(f"{base}.resources.txt")
        reports.append(
            KernelReport(
                name=base.name,
                registers=info.registers,
                spill_bytes=info.spill_bytes,
                stack_bytes=info.stack_bytes,
                threads=sass.threads_per_block(ptx),
                smem_bytes=sass.smem_scratch_bytes(resources.read_text()) if resources.exists() else 0,
                loop=loop_report,
                sass_instructions=len(code.instructions),
            )
        )
    return reports


def xray_compile(
    fn: Any,
    *args: Any,
    gpu: str = "h200",
    keep_dumps: Path | None = None,
    devices: Sequence[Any] | None = None,
    keep_hlo: bool = False,
) -> CompileReport:
    """Compiles ``jax.jit(fn)`` for one deviceless ``gpu`` (or several) and X-rays the result.

    Args:
      fn: a function of ``args``; it is jitted here.
      args: arrays or ShapeDtypeStructs (pytrees of them); only shapes and dtypes matter.
      gpu: "h200" or "h100" (see ``bench.kernel_xray.target.GPUS``).
      keep_dumps: a folder to keep Mosaic GPU's dumps in (default: a temporary folder, deleted).
      devices: None compiles for one device. Else deviceless devices (``deviceless_devices(gpu, n)``) of
        an SPMD compile: ShapeDtypeStructs whose ``sharding`` is on them keep it (a ``NamedSharding`` over a
        mesh of these devices), other leaves are replicated. The report is then the per-device program:
        its launches include the collectives (``hlo.collectives`` reads them).
      keep_hlo: keep the optimized HLO text in the report.

    Must run in a process started with ``toolchain.child_environment()`` (``python -m bench.xray`` does).
    """
    import jax

    if not in_compile_process():
        raise RuntimeError(
            "xray_compile must run in a process set up for deviceless CUDA compiles (see "
            "bench.kernel_xray.toolchain.child_environment; `python -m bench.xray` starts one). " + EXTRA_HINT
        )
    layout_key.install()  # jax 0.11.2's layout inference, without its per-key verification (same output)
    if devices is None:
        abstract_args = abstract(args, deviceless_devices(gpu, 1)[0])
    else:
        abstract_args = abstract_on(args, devices)
    with tempfile.TemporaryDirectory(prefix="nybble-xray-") as tmp:
        folder = Path(keep_dumps) if keep_dumps is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        with mosaic_dumps(folder):
            lowered = jax.jit(fn).trace(*abstract_args).lower(lowering_platforms=("cuda",))
            compiled = lowered.compile()
        kernels = read_kernel_dumps(folder)
    text = compiled.as_text()
    return CompileReport(hlo.launches(text), kernels, hlo.collectives(text), text if keep_hlo else None)
