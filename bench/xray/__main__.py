"""``python -m bench.xray``: compile nybble's kernels for an H200 on this machine and report what they run.

Examples::

    python -m bench.xray                                   # named shapes x M 1..4096, g128 sym/asym
    python -m bench.xray --shapes llama3-8b-qo 4096x11008 --ms 1 16 --groups 128:sym 64:asym
    python -m bench.xray --peers --shapes llama3-8b-qo --ms 1 16   # Marlin, tokamax, JAX's int8 example too
    python -m bench.xray --check                           # exit 1 on a regression against the baseline
    python -m bench.xray --update-baseline                 # record today's numbers as the baseline
    python -m bench.xray --gpu a100                        # another GPU: bench.xray.gpus (the Triton kernel)
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.xray.cases import (
    ALL_PEERS,
    DEFAULT_GROUPS,
    DEFAULT_MS,
    EXTERNAL_PEERS,
    MARLIN,
    MOE_SHAPES,
    MOSAIC,
    PEERS,
    TOKAMAX,
)
from bench.xray.provenance import source_commit

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def parse_group(text: str) -> tuple[int | None, bool]:
    """``128:sym``, ``64:asym``, ``col:sym`` -> (group size or None, symmetric)."""
    from bench.arg_specs import parse_group_size

    group, _, kind = text.partition(":")
    kind = kind or "sym"
    if kind not in ("sym", "asym"):
        raise argparse.ArgumentTypeError(f"--groups {text!r}: write G:sym or G:asym (e.g. 128:asym)")
    try:
        return parse_group_size(group), kind == "sym"
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--groups {text!r}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    from bench.arg_specs import SHAPES

    p = argparse.ArgumentParser(
        prog="python -m bench.xray",
        description="Compile nybble's Mosaic GPU kernels (and XLA's bf16 dot and int4 path) for an H200 on "
        "a machine without a GPU; report registers, spills, SMEM, the main loop's SASS, launches and bytes "
        "per call, and a static model of the time. Needs the `xray` extra.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--shapes", nargs="+", metavar="NAME", help=f"named shapes ({', '.join(SHAPES)}) or KxN")
    p.add_argument("--ms", nargs="+", type=int, default=list(DEFAULT_MS), help="values of M")
    p.add_argument(
        "--groups",
        nargs="+",
        type=parse_group,
        default=list(DEFAULT_GROUPS),
        metavar="G:sym|asym",
        help="group settings (default 128:sym 128:asym; col for per column)",
    )
    p.add_argument(
        "--peers",
        nargs="*",
        choices=ALL_PEERS,
        default=None,
        help=f"what to compile (default {' '.join(PEERS)}); --peers alone: also {', '.join(EXTERNAL_PEERS)} "
        "(their toolchains install into nybble's cache on first use, see bench/xray/peer_tools.py)",
    )
    p.add_argument(
        "--moe",
        nargs="+",
        choices=(*MOE_SHAPES, "none"),
        default=list(MOE_SHAPES),
        help=f"MoE shapes compiled for {TOKAMAX} (grouped, fused gate-up) when it is among the peers",
    )
    p.add_argument(
        "--gpu",
        default="h200",
        choices=("h200", "h100", "a100", "l40s", "b200", "rtx5090"),
        help="the GPU compiled for; b200 runs bench/xray/blackwell.py (the Blackwell Mosaic GPU kernel on "
        "sm_100a); a100, l40s and rtx5090 run bench.xray.gpus (the portable Triton kernel, nybble:xla, "
        "xla:bf16 and XLA's int4, at the Llama-3 and MoE shapes)",
    )
    p.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: cores, <= 4)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: $OUT, else bench/results/xray-<date>/)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="compare with bench/xray_baseline.json; exit 1 on spills, > 3%% more instructions "
        "per weight, or more launches",
    )
    p.add_argument(
        "--update-baseline", action="store_true", help="write today's kernel numbers as the baseline"
    )
    p.add_argument(
        "--ceilings",
        type=Path,
        default=None,
        metavar="BENCH_JSON",
        help="the model's copy bandwidth and bf16 rate from this bench.json (a `python -m bench` run on the "
        "same GPU model); default: the spec sheet's",
    )
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.gpu == "b200":
        from bench.xray import blackwell

        ms = blackwell.DEFAULT_MS if args.ms == list(DEFAULT_MS) else args.ms
        out = args.out or RESULTS_DIR / "xray-b200"
        return blackwell.main(ms, args.groups, args.shapes, out, args.jobs)
    if args.gpu not in ("h200", "h100"):  # no Mosaic GPU kernel there: the X-ray of the portable kernel
        from bench.xray import gpus

        forwarded = ["--gpus", args.gpu, "--ms", *map(str, args.ms)]
        if args.shapes:
            forwarded += ["--shapes", *args.shapes]
        if args.out:
            forwarded += ["--out", str(args.out)]
        return gpus.main(forwarded)
    from bench.arg_specs import SHAPES, select_shapes
    from bench.kernel_xray import ToolchainMissing, get_gpu
    from bench.xray import model, report
    from bench.xray.cases import build_cases
    from bench.xray.runner import run_cases

    peers = list(PEERS) if args.peers is None else (args.peers or list(ALL_PEERS))
    try:
        shapes = select_shapes(args.shapes or list(SHAPES))
        cases = build_cases(shapes, args.ms, args.groups, peers)
        if TOKAMAX in peers and "none" not in args.moe:
            from bench.xray.cases import moe_cases

            cases += moe_cases(args.moe, args.ms)
    except ValueError as e:
        print(f"python -m bench.xray: {e}", file=sys.stderr)
        return 2
    gpu = get_gpu(args.gpu)
    started = time.time()
    print(
        f"X-ray: {len(cases)} compiles for an {gpu.description} (sm_90a) on this CPU; a static view, "
        "not a timing.",
        file=sys.stderr,
    )
    from bench.xray import peers as peer_runs

    toolchains, unavailable, extra_env = peer_runs.prepare(peers)
    jax_cases = [c for c in cases if c.peer != MARLIN and c.peer not in unavailable]
    try:
        records = run_cases(jax_cases, gpu=gpu.name, jobs=args.jobs, extra_env=extra_env) if jax_cases else {}
    except ToolchainMissing as e:
        print(f"python -m bench.xray: {e}", file=sys.stderr)
        return 2
    records.update(peer_runs.other_records(cases, unavailable, gpu))
    try:
        ceilings = model.ceilings_for(gpu, args.ceilings)
    except (OSError, ValueError) as e:
        print(f"python -m bench.xray: --ceilings: {e}", file=sys.stderr)
        return 2
    models = {k: model.model_case(r, gpu, ceilings) for k, r in records.items() if "error" not in r}
    rows = report.build_rows(records, models)
    import jax

    result: dict[str, Any] = {
        "schema": report.SCHEMA,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": source_commit(),
        "versions": {"jax": jax.__version__, "python": sys.version.split()[0], **toolchains},
        "gpu": {k: v for k, v in vars(gpu).items()},
        "ceilings": vars(ceilings),
        "model": model.__doc__,
        "rows": rows,
        "elapsed_s": round(time.time() - started, 1),
    }
    problems: list[str] = []
    if args.check:
        problems = report.check_against_baseline(rows, report.load_baseline())
        result["baseline_check"] = "\n".join(f"- {p}" for p in problems) or "no regression."
    out = args.out or (
        Path(os.environ["OUT"])
        if os.environ.get("OUT")
        else RESULTS_DIR / f"xray-{datetime.date.today().isoformat()}"
    )
    files = report.write_outputs(result, out)
    if not args.no_plot:
        png = __import__("bench.xray.plot", fromlist=["plot_rows"]).plot_rows(
            rows,
            out / "xray.png",
            f"nybble kernel X-ray, {gpu.description} (compiled on a CPU; model, not timing)",
        )
        files += [png] if png else []
    if any(r["peer"] in EXTERNAL_PEERS for r in rows):
        from bench.xray.peers import peer_tables

        print(peer_tables(rows))
    else:
        print(report.table(rows))
    print(f"\nwrote {', '.join(str(f) for f in files)} ({result['elapsed_s']} s)")
    if args.update_baseline:
        path = report.write_baseline(
            rows, {"gpu": gpu.name, "commit": result["commit"], "date": result["date"]}
        )
        print(f"baseline written: {path}")
    if args.check:
        print("\nbaseline check: " + ("no regression" if not problems else f"{len(problems)} problem(s)"))
        for p in problems:
            print(f"  {p}")
        return 1 if problems else 0
    errors = [r for r in rows if r["peer"] == MOSAIC and "error" in r]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
