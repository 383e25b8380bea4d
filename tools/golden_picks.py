"""Regenerate tests/fixtures/golden_picks/picks.json: the TuningConfig the heuristics pick per problem.

    .venv/bin/python tools/golden_picks.py          # rewrite the file from today's heuristics
    .venv/bin/python tools/golden_picks.py --check  # exit 1 and list the problems whose pick changed

The picks are the heuristics' output over the benchmark's named shapes (bench/arg_specs.py), its M sweep
and four group settings on a 132-SM H100/H200. tests/test_golden_picks.py compares today's picks with the
file, so a change of the cost model shows up as a diff of this file, reviewed and committed on purpose
(with the X-ray of the cases that moved), rather than as edits to tuples scattered over the tests. The
heuristics' structural rules (a producer only where the pipeline refills, persistent grids only where the
tiles outnumber the SMs, ...) stay tests of their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.arg_specs import M_SWEEP, SHAPES  # noqa: E402
from nybble.kernels.mosaic_gpu.config import TuningConfig  # noqa: E402
from nybble.kernels.mosaic_gpu.heuristics import heuristic_config  # noqa: E402
from nybble.packing import padded_weight_dims  # noqa: E402

PATH = ROOT / "tests" / "fixtures" / "golden_picks" / "picks.json"
GROUPS = ((128, True), (128, False), (32, True), (None, True))
NUM_SMS = 132
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TuningConfig)}


def problems() -> list[dict]:
    """Every problem of the file: K, N (logical), M, group size, symmetric."""
    shapes = sorted({(s.k, s.n) for s in SHAPES.values()})
    return [
        dict(k=k, n=n, m=m, group_size=g, symmetric=sym)
        for k, n in shapes
        for m in M_SWEEP
        for g, sym in GROUPS
    ]


def pick(problem: dict) -> dict:
    """The heuristics' config for ``problem``, as the fields that differ from TuningConfig's defaults."""
    k_pad, n_pad = padded_weight_dims(problem["k"], problem["n"], problem["group_size"])
    config = heuristic_config(
        problem["m"], n_pad, k_pad, problem["group_size"], NUM_SMS, has_offsets=not problem["symmetric"]
    )
    return {f: v for f, v in dataclasses.asdict(config).items() if v != _DEFAULTS[f]}


def generate() -> dict:
    """The file's content: the sweep's parameters and every problem with its pick."""
    return {
        "num_sms": NUM_SMS,
        "regenerate": "python tools/golden_picks.py",
        "picks": [dict(p, config=pick(p)) for p in problems()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = parser.parse_args(argv)
    today = generate()
    if args.check:
        saved = json.loads(PATH.read_text())["picks"]
        changed = [(a, b) for a, b in zip(saved, today["picks"], strict=True) if a != b]
        for a, b in changed:
            print(
                f"K={a['k']} N={a['n']} M={a['m']} g{a['group_size']} sym={a['symmetric']}: "
                f"{a['config']} -> {b['config']}"
            )
        print(f"{len(changed)} of {len(saved)} picks changed")
        return 1 if changed else 0
    # One pick a line, so that a change of the heuristics reads as a diff of the lines that moved.
    lines = ",\n".join(json.dumps(p, sort_keys=True) for p in today["picks"])
    head = {k: v for k, v in today.items() if k != "picks"}
    tmp = PATH.with_suffix(".tmp")
    tmp.write_text(json.dumps(head, sort_keys=True)[:-1] + ', "picks": [\n' + lines + "\n]}\n")
    tmp.replace(PATH)
    print(f"wrote {PATH.relative_to(ROOT)} ({len(today['picks'])} picks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
