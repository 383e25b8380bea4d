"""The compiling side of the X-ray: a process set up by the toolchain, reading cases, writing reports.

``python -m bench.xray.worker GPU`` reads one JSON case a line on stdin and writes one JSON line per case
to stdout: ``{"key", "case", "report", "plan"}`` or ``{"key", "case", "error"}``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any


def serve(read_case: Callable[[dict], Any], compile_case: Callable[[Any, dict], None]) -> int:
    """The worker loop: one JSON case a line on stdin, one JSON line out per case.

    ``read_case`` builds a case from its JSON; ``compile_case(case, out)`` fills ``out`` (which already
    holds ``key`` and ``case``). An exception is reported in the case's line (the parent decides what fails).
    """
    for line in sys.stdin:
        if not line.strip():
            continue
        case = read_case(json.loads(line))
        out: dict = {"key": case.key, "case": dataclasses.asdict(case)}
        try:
            compile_case(case, out)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
            out["traceback"] = traceback.format_exc(limit=8)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


def main() -> int:
    import os

    from bench.kernel_xray import get_gpu, xray_compile
    from bench.xray.cases import MOSAIC, TOKAMAX, Case, kernel_plan, program, tokamax_deviceless

    gpu = get_gpu(sys.argv[1] if len(sys.argv) > 1 else "h200")
    # The peers' packages (bench.xray.peer_tools), after the venv's own: jax and numpy stay the venv's.
    sys.path.extend(p for p in os.environ.get("NYBBLE_XRAY_PEER_SITES", "").split(os.pathsep) if p)
    patched: list[bool] = []

    def compile_case(case: Case, out: dict) -> None:
        if case.peer == TOKAMAX and not patched:
            tokamax_deviceless(gpu.sms)
            patched.append(True)
        fn, args = program(case)
        out["report"] = xray_compile(fn, *args, gpu=gpu.name).to_dict()
        if case.peer == MOSAIC:
            out["plan"] = kernel_plan(case, gpu.sms)

    return serve(lambda d: Case(**d), compile_case)


if __name__ == "__main__":
    sys.exit(main())
