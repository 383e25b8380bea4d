"""``python -m bench``: the throughput benchmark's command line.

Default: on a GPU the ``quick`` preset (``--full`` for every shape and M); without one, a banner, the XLA
paths on the CPU at small shapes, and the host-side packing and quantization. Writes ``bench.json``,
``bench.md`` and ``bench.png`` to ``--out``, else ``$OUT``, else ``bench/results/<device>-<date>/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

NO_GPU_BANNER = (
    "NO GPU: nybble's Mosaic GPU kernel and the torch/tokamax peers cannot run here. Timing the XLA "
    "paths on the CPU at small shapes, plus host-side packing and quantization; these numbers say "
    "nothing about GPU speed. On an H200 run `make gpu-check` (bash bench/gpu_check.sh)."
)
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Without a GPU, larger weights / points are skipped with a reason (a CPU would take minutes per point).
CPU_MAX_PARAMS = 40_000_000
CPU_MAX_FLOPS = 10e9
# Of --budget-s, what the MoE points keep (bench/gpu_check.sh: ~4 points at ~10 s each on an H200).
MOE_RESERVE_S = 45.0


def moe_presets() -> dict[str, Any]:
    from bench.moe import MOE_PRESETS

    return MOE_PRESETS


def build_parser() -> argparse.ArgumentParser:
    from bench.arg_specs import DEFAULT_GROUP_SIZE, PRESETS, SHAPES

    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="int4 weight-only GEMM throughput: nybble against XLA bf16, XLA int4, torch, "
        "tokamax, with the device's copy bandwidth and bf16 matmul rate measured in the same run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--full", action="store_true", help="every named shape at every M (preset 'full')")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="; ".join(f"{k}: {v.description}" for k, v in PRESETS.items())
        + " (default: quick on a GPU, cpu without one)",
    )
    p.add_argument("--shapes", nargs="+", metavar="NAME", help=f"shapes to run: {', '.join(SHAPES)}, or KxN")
    p.add_argument("--ms", nargs="+", type=int, metavar="M", help="values of M (rows of x)")
    p.add_argument(
        "--moe",
        metavar="PRESET",
        default=None,
        help="MoE points run after the dense ones: "
        + "; ".join(f"{k}: {v.description}" for k, v in moe_presets().items())
        + "; none: no MoE points (default: the preset's; none with --shapes)",
    )
    p.add_argument(
        "--moe-reserve-s",
        type=float,
        default=MOE_RESERVE_S,
        help="with --budget-s and MoE points: seconds of the budget kept for the MoE points (the dense "
        "points stop starting once budget - reserve is spent)",
    )
    p.add_argument(
        "--group-size",
        default=str(DEFAULT_GROUP_SIZE),
        help="scale group size along K: 32, 64, 128, 256, or -1 for one scale per column",
    )
    p.add_argument("--asymmetric", action="store_true", help="quantize with a zero point per group")
    p.add_argument(
        "--peers", nargs="+", metavar="NAME", help="run only these peers (names or prefixes, e.g. nybble)"
    )
    p.add_argument("--out", type=Path, default=None, help="output folder (default: $OUT or bench/results/)")
    p.add_argument(
        "--budget-s",
        "--max-seconds",
        dest="budget_s",
        type=float,
        default=None,
        help="stop starting new (shape, M) points after this many seconds; the rest is noted as skipped",
    )
    p.add_argument("--sample-ms", type=float, default=None, help="length of one timing sample in ms")
    p.add_argument(
        "--max-time-per-row", type=float, default=None, help="seconds of timing per row (at least 5 samples)"
    )
    p.add_argument(
        "--no-cpu-limits",
        action="store_true",
        help=f"without a GPU, also run weights over {CPU_MAX_PARAMS:.0e} parameters and points over "
        f"{CPU_MAX_FLOPS:.0e} FLOPs (slow: minutes per point)",
    )
    p.add_argument("--no-host", action="store_true", help="skip the host-side packing/quantize timings")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def output_dir(arg: Path | None, slug: str, now: datetime.datetime) -> Path:
    """--out, else $OUT, else bench/results/<device>-<date>/."""
    if arg is not None:
        return arg
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return RESULTS_DIR / f"{slug}-{now.strftime('%Y-%m-%d-%H%M%S')}"


def main(argv: list[str] | None = None) -> int:
    # Leave GPU memory for torch's peer in the same process (JAX takes 75% by default).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    args = build_parser().parse_args(argv)
    start = time.monotonic()
    now = datetime.datetime.now(datetime.UTC)

    from bench import device, host, report
    from bench.arg_specs import PRESETS, group_label, parse_group_size, select_shapes
    from bench.moe import moe_peers, run_moe_sweep
    from bench.peers import all_peers
    from bench.runner import Config, run_sweep

    try:
        group_size = parse_group_size(args.group_size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpu = device.has_gpu()
    preset = PRESETS["full" if args.full else args.preset or ("quick" if gpu else "cpu")]
    try:
        shapes = select_shapes(args.shapes or preset.shapes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ms = tuple(args.ms or preset.ms)
    moe_name = args.moe or ("none" if args.shapes else preset.moe or "none")
    if moe_name != "none" and moe_name not in moe_presets():
        known = ", ".join(sorted(moe_presets()))
        print(f"error: unknown MoE preset {moe_name!r}: use one of {known} or none", file=sys.stderr)
        return 2
    moe_points = moe_presets()[moe_name].points if moe_name != "none" else ()
    cfg = Config(
        shapes=shapes,
        ms=ms,
        group_size=group_size,
        symmetric=not args.asymmetric,
        sample_s=(args.sample_ms / 1e3) if args.sample_ms else (0.005 if gpu else 0.01),
        max_time_s=args.max_time_per_row or (0.5 if gpu else 0.3),
        rotate_bytes=device.ROTATE_BYTES["gpu" if gpu else "cpu"],
        # XLA:CPU runs the independent ops of one program concurrently and slows them down: few sets.
        max_sets=32 if gpu else 4,
        budget_s=args.budget_s,
        moe_reserve_s=args.moe_reserve_s if moe_points and args.budget_s is not None else 0.0,
        max_params=None if gpu or args.no_cpu_limits else CPU_MAX_PARAMS,
        max_flops=None if gpu or args.no_cpu_limits else CPU_MAX_FLOPS,
    )
    peers = all_peers(args.peers)
    grouped_peers = moe_peers(args.peers) if moe_points else []
    banner = None if gpu else NO_GPU_BANNER
    if banner:
        print("=" * 100 + "\n" + banner + "\n" + "=" * 100, flush=True)
    machine = device.machine_info()
    print(
        f"device: {machine['device']} ({machine['backend']}), jax {machine['jax']}; preset "
        f"{'custom' if args.shapes or args.ms else preset.name}: {len(shapes)} shape(s) x {len(ms)} M, "
        f"{group_label(group_size)}, peers: {', '.join(p.name for p in peers)}"
        + (
            f"; MoE preset {moe_name}: {len(moe_points)} point(s), peers: "
            f"{', '.join(p.name for p in grouped_peers)}"
            if moe_points
            else ""
        ),
        flush=True,
    )
    ceilings, raw = device.measure_ceilings()
    result: dict[str, Any] = {
        "schema": report.SCHEMA,
        "banner": banner,
        "machine": machine,
        "config": {
            **cfg.as_dict(),
            "preset": preset.name,
            "moe": {"preset": moe_name, "points": [dataclasses.asdict(p) for p in moe_points]},
            "argv": sys.argv[1:] if argv is None else argv,
        },
        "ceilings": {
            "copy_bytes_per_s": ceilings.copy_bytes_per_s,
            "bf16_flops_per_s": ceilings.bf16_flops_per_s,
            "ridge_flops_per_byte": ceilings.ridge_flops_per_byte,
            "raw": raw,
        },
        "peers": [{"name": p.name, "description": p.description, "reference": p.reference} for p in peers],
        "moe_peers": [
            {"name": p.name, "description": p.description, "reference": p.reference} for p in grouped_peers
        ],
        "rows": [],
        "host": {},
        "notes": [],
        "elapsed_s": 0.0,
    }
    print(report.ceilings_line(result), flush=True)

    bar = _progress(len(shapes) * len(ms) * len(peers) + len(moe_points) * len(grouped_peers), args.quiet)
    out = output_dir(args.out, device.device_slug(), now)
    out.mkdir(parents=True, exist_ok=True)
    done: list[dict[str, Any]] = []

    def on_row_of(per_point: int) -> Any:
        count = [0]

        def on_row(row: dict[str, Any]) -> None:
            done.append(row)
            count[0] += 1
            if bar is not None:
                label = f"{report.case_label(row)} M={row['m']} {row['peer']}: {row['status']}"
                bar.set_postfix_str(label, refresh=False)
                bar.update(1)
            if count[0] % per_point == 0:  # a point is complete: keep a partial record
                partial = {**result, "rows": done, "partial": True, "elapsed_s": time.monotonic() - start}
                report.write_json(partial, out / "bench.json")

        return on_row

    rows, notes = run_sweep(cfg, peers, ceilings, on_row=on_row_of(max(len(peers), 1)), start=start)
    if moe_points and grouped_peers:
        on_moe_row = on_row_of(max(len(grouped_peers), 1))
        moe_rows, moe_notes = run_moe_sweep(
            cfg, moe_points, grouped_peers, ceilings, on_row=on_moe_row, start=start
        )
        rows, notes = rows + moe_rows, notes + moe_notes
    if bar is not None:
        bar.close()
    sys.stderr.flush()
    result["rows"], result["notes"] = rows, notes
    if not args.no_host:
        big = gpu  # on a GPU quantize a Llama-3-8B gate/up sized weight; on the CPU a 4096^2 one
        result["host"] = {
            "packing": host.packing_throughput(),
            "quantize": host.quantize_throughput(
                *((4096, 14336) if big else (4096, 4096)), group_size=group_size
            ),
        }
    result["elapsed_s"] = time.monotonic() - start

    report.write_json(result, out / "bench.json")
    (out / "bench.md").write_text(report.markdown_report(result))
    png = None
    if not args.no_plot:
        png = _plot(report.dense_rows(rows), out / "bench.png", machine["device"], gpu)

    print()
    print(report.detail_table(rows))
    if result["host"]:
        print("\nhost-side work:\n" + report.host_tables(result["host"]))
    for peer, reasons in report.skipped_reasons(rows).items():
        print(f"not timed: {peer}: {'; '.join(reasons)}")
    for note in notes:
        print(f"note: {note}")
    written = [out / "bench.json", out / "bench.md", *([png] if png else [])]
    print(f"\nwrote {', '.join(str(p) for p in written)}")
    if banner:
        print("\n" + banner)
    print(f"\n{report.ceilings_line(result)}; elapsed {result['elapsed_s']:.0f} s")
    if report.dense_rows(rows):
        print(report.summary_table(rows))
    if moe_points:
        print("\nMoE (grouped matmul; %roof over the active experts' bytes):")
        print(report.moe_table(rows))
    failed = [r for r in rows if r["status"] in ("FAILED", "error") and r["peer"].startswith("nybble:")]
    return 1 if failed else 0


def _progress(total: int, quiet: bool) -> Any:
    if quiet:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, desc="bench", unit="row", file=sys.stderr, dynamic_ncols=True)


def _plot(rows: list[dict[str, Any]], path: Path, device: str, gpu: bool) -> Path | None:
    try:
        from bench.plot import plot_rows, plot_title
    except ImportError as e:  # pragma: no cover - matplotlib missing
        print(f"no plot: {e}", file=sys.stderr)
        return None
    return plot_rows(rows, path, plot_title(device, gpu))
