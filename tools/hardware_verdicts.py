"""What a GPU check's log says about each kernel structure: clean passes and clean failures on hardware.

    python tools/hardware_verdicts.py bench/results/gpu-check-2026-12-04/tests.log.gz

Reads the pytest log of ``make gpu-check`` (``-v``, pytest-xdist: a line per test, ``[gwN] PASSED ...``) and
the parametrization of tests/test_kernel_gpu.py's ``test_every_heuristic_config_exact`` as a GPU runs it
(every case), and counts per kernel structure (:func:`nybble.kernels.mosaic_gpu.hardware.structure`):

* a clean pass: the test passed;
* a clean failure: the test failed in a worker process where no test had crashed before it. A crash
  ("unspecified launch failure") leaves the process's CUDA context unusable, so the failures after it in
  the same worker say nothing about their own kernel; a wrong output (an AssertionError) leaves it usable.

Prints the structures that passed cleanly and never failed cleanly, with split-K left out: what
``nybble.kernels.mosaic_gpu.hardware.HOPPER_VERIFIED`` must hold (tests/test_hardware_gate.py checks it).
"""

from __future__ import annotations

import gzip
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

_LINE = re.compile(r"\[(gw\d+)\] \[\s*\d+%\] (PASSED|FAILED) tests/(\S+?)::(\S+)")
_SECTION = re.compile(r"\n_{3,} (test_\S+) _{3,}\n")
HEURISTIC_TEST = "test_every_heuristic_config_exact"


def read_log(path: str | Path) -> str:
    """The log's text (``.gz`` or plain)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def _failure_kinds(log: str) -> dict[str, str]:
    """Test id -> "crash" | "wrong" | "other", from the FAILURES sections."""
    start = log.find("= FAILURES =")
    if start < 0:
        return {}
    parts = _SECTION.split(log[start:])
    kinds = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if "unspecified launch failure" in body or "CUDA_ERROR" in body:
            kinds[name] = "crash"
        elif "AssertionError" in body:
            kinds[name] = "wrong"
        else:
            kinds[name] = "other"
    return kinds


def clean_outcomes(log: str) -> dict[str, str]:
    """Test id -> "pass" | "fail" for every test whose outcome speaks for its own kernel."""
    kinds = _failure_kinds(log)
    poisoned: set[str] = set()
    outcomes: dict[str, str] = {}
    for worker, status, _, test in _LINE.findall(log):
        if status == "PASSED":
            outcomes[test] = "pass"
        elif worker not in poisoned:
            outcomes[test] = "fail"
        if status == "FAILED" and kinds.get(test, "crash") != "wrong":
            poisoned.add(worker)  # an unknown failure counts as a crash: nothing after it is trusted
    return outcomes


def heuristic_rows() -> list[tuple[str, Any]]:
    """(test id, TuningConfig) of test_every_heuristic_config_exact as a GPU runs it (every case)."""
    from tests import test_kernel_gpu

    every_case = test_kernel_gpu.ALL_CASES
    test_kernel_gpu.ALL_CASES = True  # as on a GPU, also where the module was imported for interpret mode
    try:
        rows = test_kernel_gpu._heuristic_rows()
    finally:
        test_kernel_gpu.ALL_CASES = every_case
    return [(f"{HEURISTIC_TEST}[{row[1]}]", row[2]) for row in rows]


def structure_verdicts(log: str) -> dict[tuple, dict[str, int]]:
    """Kernel structure -> {"pass": clean passes, "fail": clean failures}."""
    from nybble.kernels.mosaic_gpu.hardware import structure

    outcomes = clean_outcomes(log)
    verdicts: dict[tuple, dict[str, int]] = defaultdict(lambda: {"pass": 0, "fail": 0})
    for test, config in heuristic_rows():
        if test in outcomes:
            verdicts[structure(config)][outcomes[test]] += 1
    return dict(verdicts)


def verified_structures(log: str) -> frozenset[tuple]:
    """The structures with a clean pass, no clean failure and no split-K."""
    return frozenset(
        s for s, v in structure_verdicts(log).items() if v["pass"] and not v["fail"] and s[4] == 1
    )


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    log = read_log(argv[0])
    verdicts = structure_verdicts(log)
    for s, v in sorted(verdicts.items(), key=str):
        print(f"{v['pass']:2d} pass {v['fail']:2d} fail  {s}")
    print("verified (no split-K):")
    for s in sorted(verified_structures(log), key=str):
        print(f"    {s},")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
