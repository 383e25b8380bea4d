"""The X-ray's outputs: the terminal table, ``xray.json``, ``xray.md``, and the baseline check."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.report import format_table, write_json
from bench.xray.cases import EXTERNAL_PEERS, MOSAIC, Case

SCHEMA = "nybble-xray/1"
BASELINE_SCHEMA = "nybble-xray-baseline/1"
BASELINE_PATH = Path(__file__).resolve().parents[1] / "xray_baseline.json"
# A case fails the baseline check when its instructions per weight exceed the baseline's by more than this.
IPW_TOLERANCE = 0.03

COLUMN_HELP = {
    "config": (
        "TuningConfig.tag: A tiles, tile_m, tile_k, K slices, slots, split-K, grid band, warpgroups, "
        "scales on acc/wt, _tma: a producer warpgroup, _P: a persistent grid of that many CTAs"
    ),
    "regs": "registers per thread (ptxas)",
    "spill": "spill bytes, stores + loads (ptxas)",
    "smem": "SMEM per CTA, KiB (Mosaic's scratch allocation)",
    "loop": "SASS instructions in the main loop (the conditional backward branch around the HGMMAs)",
    "hgmma": "HGMMAs in the main loop: with A (weights) in registers / all (others read an SMEM tile)",
    "instr/w": "main-loop SASS instructions per weight per thread: loop / (register-A HGMMAs x 8)",
    "stall/w": "the loop's summed stall counts per weight per thread (one warp alone)",
    "launches": "device launches of one call (fusions, custom calls, copies in the compiled HLO)",
    "MB": "bytes one call moves: every launch's operands and results, MB",
    "inflight": "code bytes requested ahead per SM (pipeline slots x CTAs resident), KiB",
    "issue us": "model: issue-bound time (main loop only, 4 warp-instructions per SM-cycle)",
    "hbm us": "model: bytes over the copy bandwidth",
    "tc us": "model: 2MNK FLOPs over the bf16 tensor-core rate",
    "bound": "which of the three is largest",
    "%hbm": "model: HBM-bound time over the model's time, the share of bandwidth the bounds allow",
}


def short_config(config: dict[str, Any] | None) -> str:
    """The config's ``TuningConfig.tag`` (the kernel's name without ``nybble_w4a16_``), or "-"."""
    if not config:
        return "-"
    from nybble.kernels.mosaic_gpu import TuningConfig

    return TuningConfig(**config).tag


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(rows: Sequence[dict[str, Any]], *, markdown: bool = False, peers: bool = True) -> str:
    """Rows of ``build_rows`` as a table (nybble's kernel first, then the XLA peers)."""
    header = [
        "shape",
        "M",
        "quant",
        "peer",
        "config",
        "regs",
        "spill",
        "smem",
        "loop",
        "hgmma",
        "instr/w",
        "stall/w",
        "launches",
        "MB",
        "inflight",
        "issue us",
        "hbm us",
        "tc us",
        "bound",
        "%hbm",
    ]
    body = []
    for r in rows:
        if not peers and r["peer"] != MOSAIC:
            continue
        if "error" in r:
            body.append(
                [r["shape"], str(r["m"]), r["quant"], r["peer"], "ERROR: " + r["error"][:60]]
                + [""] * (len(header) - 5)
            )
            continue
        k = r.get("kernel") or {}
        loop = k.get("loop") or {}
        body.append(
            [
                r["shape"],
                str(r["m"]),
                r["quant"],
                r["peer"],
                short_config(r.get("config")),
                _f(k.get("registers"), "{}"),
                _f(k.get("spill_bytes"), "{}"),
                _f(k["smem_bytes"] / 1024 if k else None, "{:.0f}"),
                _f(loop.get("instructions"), "{}"),
                f"{loop['weight_hgmmas']}/{loop['hgmmas']}" if loop else "-",
                _f(loop.get("instructions_per_weight")),
                _f(loop["stall_cycles"] / loop["weights_per_thread"] if loop else None),
                str(r["launches"]),
                _f(r["bytes"] / 1e6, "{:.1f}"),
                _f(
                    r.get("weight_bytes_in_flight_per_sm", None)
                    and r["weight_bytes_in_flight_per_sm"] / 1024,
                    "{:.0f}",
                ),
                _f(r["t_issue_us"]),
                _f(r["t_hbm_us"]),
                _f(r["t_tc_us"]),
                r["bound"],
                _f(r["model_pct_hbm"], "{:.0f}"),
            ]
        )
    return format_table(header, body, markdown)


def build_rows(records: dict[str, dict[str, Any]], models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per case, ordered by shape, M, quantization, peer."""
    rows = []
    for key, rec in records.items():
        case = rec["case"]
        # A grouped case of bench/xray/moe_cases.py also carries its tokens per step; the label needs none.
        quant = Case(**{f.name: case[f.name] for f in dataclasses.fields(Case) if f.name in case}).quant_label
        row: dict[str, Any] = {
            "key": key,
            "shape": case["shape"],
            "k": case["k"],
            "n": case["n"],
            "m": case["m"],
            "quant": quant,
            "peer": case["peer"],
            "experts": case.get("experts", 0),
            "top_k": case.get("top_k", 0),
        }
        if "error" in rec:
            row["error"] = rec["error"]
        else:
            kernels = rec["report"]["kernels"]
            row["kernel"] = kernels[0] if kernels else None
            row["kernels"] = kernels
            row["config"] = (rec.get("plan") or {}).get("config")
            row["plan"] = rec.get("plan")
            row["launch_detail"] = rec["report"]["launches"]
            row.update(models[key])
        rows.append(row)
    order = {"nybble:mosaic_gpu": 0, "nybble:xla": 1, "xla:bf16": 2}
    rows.sort(
        key=lambda r: (r["shape"], r["m"], r["quant"] if r["quant"] != "-" else "~", order.get(r["peer"], 9))
    )
    return rows


def write_outputs(result: dict[str, Any], out: Path) -> list[Path]:
    """xray.json and xray.md in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(result, out / "xray.json")
    md = [
        f"# Kernel X-ray: {result['gpu']['description']} (sm_90a), compiled on a CPU without a GPU",
        "",
        f"{result['date']}, jax {result['versions'].get('jax')}, commit {result['commit']}. A static "
        "view of the code ptxas produced and a **model** of its time: no timing was measured. Ceilings: "
        f"{result['ceilings']['source']} ({result['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"{result['ceilings']['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s bf16).",
        "",
        table(result["rows"], markdown=True),
        "",
        "## Columns",
        "",
        *[f"- **{k}**: {v}" for k, v in COLUMN_HELP.items()],
        "",
        "## Launches and main-loop instruction mix",
        "",
    ]
    if any(r["peer"] in EXTERNAL_PEERS for r in result["rows"]):
        from bench.xray.peers import PEER_COLUMNS, peer_tables

        versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        md[md.index("## Columns") : md.index("## Columns")] = [
            "## Peers side by side (one table per shape and M)",
            "",
            f"Toolchains: {versions}.",
            "",
            *[f"- **{k}**: {v}" for k, v in PEER_COLUMNS.items()],
            "",
            peer_tables(result["rows"], markdown=True),
            "",
        ]
    for r in result["rows"]:
        if "error" in r:
            continue
        mix = ""
        if r.get("kernel") and r["kernel"].get("loop"):
            mix = " mix: " + ", ".join(f"{op} {n}" for op, n in r["kernel"]["loop"]["opcode_mix"][:8])
        md.append(f"- `{r['key']}`: {', '.join(r['launch_names'])}.{mix}")
    if result.get("baseline_check"):
        md += ["", "## Against the baseline", "", result["baseline_check"]]
    (out / "xray.md").write_text("\n".join(md) + "\n")
    return [out / "xray.json", out / "xray.md"]


def baseline_entries(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What the baseline records of each nybble kernel case."""
    out = {}
    for r in rows:
        if r["peer"] != MOSAIC or "error" in r or not r.get("kernel") or not r["kernel"].get("loop"):
            continue
        out[r["key"]] = {
            "config": short_config(r.get("config")),
            "registers": r["kernel"]["registers"],
            "spill_bytes": r["kernel"]["spill_bytes"],
            "instructions_per_weight": round(r["kernel"]["loop"]["instructions_per_weight"], 4),
            "launches": r["launches"],
        }
    return out


def write_baseline(rows: Sequence[dict[str, Any]], meta: dict[str, Any], path: Path = BASELINE_PATH) -> Path:
    data = {"schema": BASELINE_SCHEMA, **meta, "cases": dict(sorted(baseline_entries(rows).items()))}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def load_baseline(path: Path = BASELINE_PATH) -> dict[str, dict[str, Any]]:
    data = json.loads(path.read_text())
    if data.get("schema") != BASELINE_SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {BASELINE_SCHEMA!r}")
    return data["cases"]


def loop_read_whole(loop: dict[str, Any]) -> bool:
    """Whether a main loop's byte span (16 bytes per sm_90 instruction) holds exactly the instructions the
    SASS parser read: False means a line of the span was missed."""
    return (loop["end_offset"] - loop["start_offset"]) // 16 + 1 == loop["instructions"]


def check_against_baseline(rows: Sequence[dict[str, Any]], baseline: dict[str, dict[str, Any]]) -> list[str]:
    """Regressions: spills, instructions per weight above baseline + 3%, more launches, missing cases."""
    problems = []
    for key, now in baseline_entries(rows).items():
        if now["spill_bytes"]:
            problems.append(f"{key}: {now['spill_bytes']} spill bytes")
        base = baseline.get(key)
        if base is None:
            problems.append(f"{key}: not in the baseline (refresh it with --update-baseline)")
            continue
        limit = base["instructions_per_weight"] * (1 + IPW_TOLERANCE)
        if now["instructions_per_weight"] > limit:
            problems.append(
                f"{key}: {now['instructions_per_weight']:.3f} instructions per weight, baseline "
                f"{base['instructions_per_weight']:.3f} (+{IPW_TOLERANCE:.0%} allowed)"
            )
        if now["launches"] > base["launches"]:
            problems.append(f"{key}: {now['launches']} launches per call, baseline {base['launches']}")
    for r in rows:
        if r["peer"] == MOSAIC and "error" in r:
            problems.append(f"{r['key']}: compile failed: {r['error']}")
        loop = (r.get("kernel") or {}).get("loop")
        if r["peer"] == MOSAIC and loop and not loop_read_whole(loop):
            problems.append(f"{r['key']}: the main loop's byte span and its parsed instructions disagree")
    return problems
