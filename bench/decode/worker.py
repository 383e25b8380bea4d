"""The compiling side of ``bench.decode``: a process set up for deviceless CUDA compiles (the X-ray's).

``python -m bench.decode.worker GPU`` reads one JSON :class:`~bench.decode.count.StepCase` a line on stdin
and writes one JSON record a line (``bench.xray.worker.serve``'s protocol): the step's launches as the
compiled HLO has them (``bench.kernel_xray.hlo``), each with its op family, flops and (nybble's kernels)
issue-bound time, plus XLA's thunk sequence summary (which launches command buffers capture).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# XLA writes its thunk sequence (and the command buffers it formed) only into a dump folder, set before
# jax starts: one folder per worker process.
_XLA_DUMP = tempfile.mkdtemp(prefix="nybble-decode-xla-")


def _start_dump() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={_XLA_DUMP}".strip()


def compile_step(program: Any, gpu: Any) -> tuple[Any, str, str, dict[str, Any]]:
    """(CompileReport, thunk sequence text, thunk metadata text, parsed SASS by kernel dump name) of a
    ``StepProgram`` compiled for one deviceless ``gpu``."""
    from bench.kernel_xray import compile as xc
    from bench.kernel_xray import layout_key
    from bench.kernel_xray.target import deviceless_devices

    layout_key.install()  # the same lowering, faster on jax 0.11.2 (bench.kernel_xray.layout_key)
    device = deviceless_devices(gpu, 1)[0]
    args = xc.abstract(program.args, device)
    with kernel_family(gpu):
        return _compile(program, args, device)


@contextlib.contextmanager
def kernel_family(gpu: Any) -> Iterator[None]:
    """The kernels a real ``gpu`` would run, on this CPU: for a B200, nybble's Blackwell (tcgen05) family
    lowered for sm_100a (``blackwell.target.target_arch``), chosen as ``mosaic_gpu.backend.family`` chooses
    it on a B200 (its grouped MoE kernel has no Blackwell version: the XLA path, as there); else Hopper."""
    if gpu.name != "b200":
        yield
        return
    from nybble.kernels.mosaic_gpu import backend
    from nybble.kernels.mosaic_gpu.blackwell.target import target_arch

    saved = backend.family
    backend.family = lambda: "blackwell"
    try:
        with target_arch(10, 0):
            yield
    finally:
        backend.family = saved


def _compile(program: Any, args: Any, device: Any) -> tuple[Any, str, str, dict[str, Any]]:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from bench.kernel_xray import compile as xc
    from bench.kernel_xray import hlo, sass
    from bench.kernel_xray.dumps import mosaic_dumps

    for old in Path(_XLA_DUMP).iterdir():
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="nybble-decode-") as tmp:
        # the mesh: Pallas' Triton lowering (the decode attention kernel) reads its target GPU there
        with mosaic_dumps(Path(tmp)), jax.set_mesh(Mesh(np.array([device]), ("x",))):
            jitted = jax.jit(program.fn, donate_argnums=program.donate_argnums)
            compiled = jitted.trace(*args).lower(lowering_platforms=("cuda",)).compile()
        kernels = xc.read_kernel_dumps(Path(tmp))
        # the Blackwell kernels' roles are read from their whole SASS (bench.xray.blackwell.kernel_loops)
        sass_by_kernel = {f.stem: sass.parse_sass(f.read_text()) for f in Path(tmp).glob("*.sass_ctrl")}
    text = compiled.as_text()
    report = xc.CompileReport(hlo.launches(text), kernels, [], text)
    # XLA writes the sequence after its thunk passes where they changed it (formed a command buffer), else
    # only the sequence before them, which is then the one that runs
    thunks = _last_dump("*thunk_sequence_after_thunk_passes.txt") or _last_dump("*thunk_sequence.txt")
    return report, thunks, _last_dump("*thunk_metadata.txt"), sass_by_kernel


def _last_dump(pattern: str) -> str:
    files = sorted(Path(_XLA_DUMP).glob(pattern))
    return files[-1].read_text() if files else ""


def main() -> int:
    _start_dump()
    from bench.decode.count import StepCase, step_record
    from bench.kernel_xray import get_gpu
    from bench.xray.worker import serve

    gpu = get_gpu(sys.argv[1] if len(sys.argv) > 1 else "h200")

    def compile_case(case: StepCase, out: dict) -> None:
        program = case.program()
        report, thunks, metadata, sass_by_kernel = compile_step(program, gpu)
        out.update(step_record(case, program, report, thunks, gpu, metadata, sass_by_kernel))

    return serve(lambda d: StepCase(**d), compile_case)


if __name__ == "__main__":
    sys.exit(main())
