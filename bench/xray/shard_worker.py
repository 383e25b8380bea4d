"""The compiling side of ``python -m bench.xray.shard``: SPMD compiles on deviceless GPUs, one JSON line each.

``python -m bench.xray.shard_worker GPU`` reads one :class:`~bench.xray.shard_cases.ShardCase` a line (JSON)
on stdin and writes ``{"key", "case", "report", "plans", "hlo_lines"}`` or ``{"key", "case", "error"}`` a
line on stdout. ``hlo_lines`` are the compiled per-device program's kernel and collective instructions.
"""

from __future__ import annotations

import dataclasses
import re
import sys

# The instructions worth quoting: Mosaic GPU kernels, cuBLAS/Triton GEMMs, collectives.
_QUOTED_KINDS = frozenset({"mosaic_gpu", "cublas", "cublasLt", "triton_gemm"})


def quoted_lines(hlo_text: str) -> list[str]:
    """The entry computation's kernel and collective lines, cut before their (long) backend_config."""
    from bench.kernel_xray import hlo

    collective = {c.name for c in hlo.collectives(hlo_text)}
    out = []
    for v in hlo.entry_values(hlo_text).values():
        if v.name not in collective and hlo.launch_kind(v)[0] not in _QUOTED_KINDS:
            continue
        out.append(re.split(r",\s*(backend_config|metadata)=", v.line)[0])
    return out


def main() -> int:
    from bench.kernel_xray import deviceless_devices, get_gpu, xray_compile
    from bench.xray.shard_cases import MOSAIC, ShardCase, kernel_plans, program
    from bench.xray.worker import serve

    gpu = get_gpu(sys.argv[1] if len(sys.argv) > 1 else "h100")

    def compile_case(case: ShardCase, out: dict) -> None:
        devices = deviceless_devices(gpu, case.tp, hosts=case.hosts)
        fn, args = program(case, devices)
        report = xray_compile(fn, *args, gpu=gpu.name, devices=devices, keep_hlo=True)
        out["hlo_lines"] = quoted_lines(report.hlo_text or "")
        out["report"] = dataclasses.replace(report, hlo_text=None).to_dict()
        if case.peer == MOSAIC:
            out["plans"] = kernel_plans(case, gpu.sms)

    return serve(lambda d: ShardCase(**d), compile_case)


if __name__ == "__main__":
    sys.exit(main())
