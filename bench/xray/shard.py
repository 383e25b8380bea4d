"""``python -m bench.xray.shard``: tensor-parallel int4 layers compiled for tp GPUs on this CPU, per shard.

Compiles Llama-3-70B's MLP weights (8192x28672 column-parallel, 28672x8192 row-parallel, and the whole
SwiGLU block) for tp = 2, 4, 8 deviceless H100s of one NVLink node, with nybble's kernel once per shard
(``nybble.sharding``), and reads the per-device program XLA produced: the kernels (ptxas' registers, the
main loop's SASS), every launch and its bytes, and each collective with the bytes it moves. Then a
**model**, not a timing: the shard's HBM time (its bytes over the copy bandwidth), its kernel's issue time,
and the collective's ring traffic over NVLink's 450 GB/s per direction (latency not modelled).

Examples::

    python -m bench.xray.shard                                 # 70B MLP, tp 2 4 8, M 1 16 2048
    python -m bench.xray.shard --tp 8 --ms 16 --programs mlp --hlo   # and the compiled HLO's lines
    python -m bench.xray.shard --peers nybble:xla xla:bf16 --layout nk_int4   # the XLA path's layout
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.xray.shard_cases import MOSAIC, PEERS, PROGRAMS, XLA_BF16, ShardCase

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
SCHEMA = "nybble-xray-shard/1"
COLUMN_HELP = {
    "tp": "tensor-parallel size: devices holding one shard each",
    "program": "column (N split), row (K split, all-reduce), mlp (gate, up column; down row)",
    "kernels": "nybble kernel launches in one device's program (one per matmul = one per shard)",
    "config": "the per-shard kernel's TuningConfig (bench.xray.report.short_config: A tiles, tile_m, tile_k, "
    "K slices, slots, split-K, warpgroups, scales on acc/wt)",
    "regs": "registers per thread of the per-shard kernel(s), ptxas",
    "spill": "spill bytes of the per-shard kernels, ptxas",
    "instr/w": "main-loop SASS instructions per weight per thread (worst kernel)",
    "launches": "device launches per device, collectives included",
    "MB/dev": "bytes the non-collective launches of one device move, MB",
    "hbm us": "model: MB/dev over the copy bandwidth",
    "issue us": "model: the kernel's main-loop issue time (single-kernel programs)",
    "tc us": "model: 2 M K N / tp FLOPs of the shard's matmuls over the bf16 tensor-core rate",
    "collective": "collectives of one device: op, buffer, group size",
    "ring KB": "bytes each device sends in a ring algorithm (all-reduce: 2 (tp - 1) / tp x buffer), KB",
    "link us": "model: ring bytes over NVLink's per-direction bandwidth (no latency)",
}


def parse_group(text: str) -> tuple[int | None, bool]:
    from bench.xray.__main__ import parse_group as parse

    return parse(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.xray.shard",
        description="Compile tensor-parallel int4 layers for tp deviceless Hopper GPUs on this CPU and "
        "report each shard's kernel, launches and bytes, and the collectives (a static view and a model, "
        "no timing). Needs the `xray` extra.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--programs", nargs="+", choices=PROGRAMS, default=list(PROGRAMS))
    p.add_argument("--shape", default="8192x28672", help="KxN of the column weight (the row one is NxK)")
    p.add_argument("--tp", nargs="+", type=int, default=[2, 4, 8], help="tensor-parallel sizes")
    p.add_argument("--ms", nargs="+", type=int, default=[1, 16, 2048], help="values of M")
    p.add_argument("--groups", nargs="+", type=parse_group, default=[(128, True)], metavar="G:sym|asym")
    p.add_argument(
        "--layout",
        default="wgmma_int4",
        help="the codes' layout (nybble.packing.LAYOUTS); nybble:mosaic_gpu reads wgmma_int4 only",
    )
    p.add_argument("--peers", nargs="+", choices=PEERS, default=[MOSAIC, XLA_BF16])
    p.add_argument("--gpu", default="h100", choices=("h100", "h200"))
    p.add_argument("--hosts", type=int, default=1, help="hosts the tp devices span (1: one NVLink node)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: cores, <= 4)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: bench/results/...)")
    p.add_argument("--hlo", action="store_true", help="print each case's kernel and collective HLO lines")
    return p


def _kernel_issue_us(kernel: dict[str, Any], plan: dict[str, Any], gpu: Any) -> float | None:
    from bench.xray import model

    if kernel.get("loop") is None:
        return None
    record = {
        "case": {"peer": MOSAIC, "k": 0, "n": 0, "m": 1},
        "plan": plan,
        "report": {"launches": [], "kernels": [kernel]},
    }
    ceilings = model.Ceilings(gpu.hbm_bytes_per_s, gpu.bf16_flops, "spec sheet")
    return model.model_case(record, gpu, ceilings)["t_issue_us"]


def summarize(record: dict[str, Any], gpu: Any, copy_bytes_per_s: float) -> dict[str, Any]:
    """One row of the table: the per-device program's kernels, launches, bytes and collectives, modelled."""
    from bench.xray.report import short_config

    case = record["case"]
    row: dict[str, Any] = {"key": record["key"], **case}
    if "error" in record:
        row["error"] = record["error"]
        return row
    report = record["report"]
    collectives = report["collectives"]
    coll_names = {c["name"] for c in collectives}
    work = [la for la in report["launches"] if la["name"] not in coll_names]
    mb = sum(sum(la["operand_bytes"].values()) + la["result_bytes"] for la in work)
    kernels = [la for la in work if la["kind"] == "mosaic_gpu"]
    plans = record.get("plans") or []
    row.update(
        kernels=len(kernels),
        launches=len(report["launches"]),
        bytes_per_device=mb,
        t_hbm_us=mb / copy_bytes_per_s * 1e6,
        configs=sorted({short_config(p["config"]) for p in plans}),
        registers=max((k["registers"] for k in report["kernels"]), default=None),
        spill_bytes=sum(k["spill_bytes"] for k in report["kernels"]) if report["kernels"] else None,
        instructions_per_weight=max(
            (k["loop"]["instructions_per_weight"] for k in report["kernels"] if k["loop"]), default=None
        ),
        t_issue_us=(
            _kernel_issue_us(report["kernels"][0], plans[0], gpu)
            if len(plans) == 1 and len(report["kernels"]) == 1
            else None
        ),
        collectives=[
            {
                "op": c["op"],
                "buffer_bytes": c["buffer_bytes"],
                "group_size": c["group_size"],
                "ring_bytes_per_device": c["buffer_bytes"] * _ring_factor(c["op"], c["group_size"]),
            }
            for c in collectives
        ],
        hlo_lines=record.get("hlo_lines", []),
    )
    m_pad = plans[0]["m_pad"] if plans else case["m"]
    flops = sum(2.0 * m_pad * k * n / case["tp"] for _, k, n in ShardCase(**case).splits())
    row["t_tc_us"] = flops / gpu.bf16_flops * 1e6
    row["ring_bytes_per_device"] = sum(c["ring_bytes_per_device"] for c in row["collectives"])
    row["t_link_us"] = row["ring_bytes_per_device"] / gpu.nvlink_bytes_per_s * 1e6
    return row


def _ring_factor(op: str, g: int) -> float:
    from bench.kernel_xray.hlo import Collective

    return Collective("", op, 1, g, "").ring_bytes_per_device


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(rows: list[dict[str, Any]], *, markdown: bool = False) -> str:
    from bench.report import format_table

    header = ["tp", "program", "shape", "M", "peer", *list(COLUMN_HELP)[2:]]
    body = []
    for r in rows:
        lead = [str(r["tp"]), r["program"], f"{r['k']}x{r['n']}", str(r["m"]), r["peer"]]
        if "error" in r:
            body.append(lead + ["ERROR: " + r["error"][:60]] + [""] * (len(header) - 6))
            continue
        coll = ", ".join(
            f"{c['op']} {c['buffer_bytes'] / 1024:.0f} KiB x{c['group_size']}" for c in r["collectives"]
        )
        body.append(
            [
                *lead,
                str(r["kernels"]),
                "; ".join(r["configs"]) or "-",
                _f(r["registers"], "{}"),
                _f(r["spill_bytes"], "{}"),
                _f(r["instructions_per_weight"]),
                str(r["launches"]),
                _f(r["bytes_per_device"] / 1e6, "{:.1f}"),
                _f(r["t_hbm_us"]),
                _f(r["t_issue_us"]),
                _f(r["t_tc_us"]),
                coll or "-",
                _f(r["ring_bytes_per_device"] / 1e3, "{:.0f}"),
                _f(r["t_link_us"]),
            ]
        )
    return format_table(header, body, markdown)


def write_outputs(result: dict[str, Any], out: Path) -> list[Path]:
    from bench.report import write_json

    out.mkdir(parents=True, exist_ok=True)
    write_json(result, out / "xray-shard.json")
    md = [
        f"# Tensor-parallel X-ray: {result['gpu']['description']} x tp, compiled on a CPU without a GPU",
        "",
        f"{result['date']}, jax {result['versions']['jax']}, commit {result['commit']}. Per-device programs "
        f"of SPMD compiles; times are a **model** ({result['gpu']['hbm_bytes_per_s'] / 1e12:.2f} TB/s HBM, "
        f"{result['gpu']['nvlink_bytes_per_s'] / 1e9:.0f} GB/s NVLink per direction), no timing.",
        "",
        table(result["rows"], markdown=True),
        "",
        "## Columns",
        "",
        *[f"- **{k}**: {v}" for k, v in COLUMN_HELP.items()],
        "",
        "## Kernel and collective lines of each compiled program",
        "",
    ]
    for r in result["rows"]:
        if r.get("hlo_lines"):
            md += [f"`{r['key']}`:", "", "```", *r["hlo_lines"], "```", ""]
    (out / "xray-shard.md").write_text("\n".join(md) + "\n")
    return [out / "xray-shard.json", out / "xray-shard.md"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bench.kernel_xray import ToolchainMissing, get_gpu
    from bench.xray.provenance import source_commit
    from bench.xray.runner import run_cases
    from bench.xray.shard_cases import build_cases

    try:
        k, n = (int(v) for v in args.shape.lower().split("x"))
        cases = build_cases(
            args.programs, (k, n), args.ms, args.tp, args.peers, args.groups, args.layout, args.hosts
        )
    except ValueError as e:
        print(f"python -m bench.xray.shard: {e}", file=sys.stderr)
        return 2
    gpu = get_gpu(args.gpu)
    started = time.time()
    print(f"X-ray (tensor parallel): {len(cases)} SPMD compiles for {gpu.description} x tp", file=sys.stderr)
    try:
        records = run_cases(cases, gpu=gpu.name, jobs=args.jobs, worker="bench.xray.shard_worker")
    except ToolchainMissing as e:
        print(f"python -m bench.xray.shard: {e}", file=sys.stderr)
        return 2
    order = {p: i for i, p in enumerate(PROGRAMS)}
    rows = sorted(
        (summarize(records[c.key], gpu, gpu.hbm_bytes_per_s) for c in cases),
        key=lambda r: (order[r["program"]], r["m"], r["tp"], r["peer"] != MOSAIC, r["peer"]),
    )
    import jax

    result = {
        "schema": SCHEMA,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": source_commit(),
        "versions": {"jax": jax.__version__, "python": sys.version.split()[0]},
        "gpu": dict(vars(gpu)),
        "rows": rows,
        "elapsed_s": round(time.time() - started, 1),
    }
    out = args.out or (
        Path(os.environ["OUT"])
        if os.environ.get("OUT")
        else RESULTS_DIR / f"xray-shard-{datetime.date.today().isoformat()}"
    )
    files = write_outputs(result, out)
    print(table(rows))
    if args.hlo:
        for r in rows:
            if r.get("hlo_lines"):
                print(f"\n{r['key']}:")
                for line in r["hlo_lines"]:
                    print(f"  {line}")
    print(f"\nwrote {', '.join(str(f) for f in files)} ({result['elapsed_s']} s)")
    return 1 if any("error" in r for r in rows if r["peer"] == MOSAIC) else 0


if __name__ == "__main__":
    sys.exit(main())
