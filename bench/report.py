"""Writing results: the JSON record, the markdown report, and the plain-text tables for the terminal."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.plot import ROOFLINE_CAP_PCT

SCHEMA = "nybble-bench/1"
# Keys every result row has; ok rows have the timing keys too.
ROW_KEYS = ("shape", "k", "n", "m", "group_size", "peer", "status", "reason", "flops")
OK_ROW_KEYS = (
    "time",
    "tflops",
    "gbps",
    "pct_copy_bw",
    "pct_bf16",
    "roofline_us",
    "pct_roofline",
    "rel_err",
    "bytes",
    "weight_bytes",
    "n_sets",
    "speedup",
    "speedup_vs_bf16",
)
TOP_KEYS = ("schema", "machine", "config", "ceilings", "peers", "rows", "host", "notes", "elapsed_s")


def validate(result: dict[str, Any]) -> list[str]:
    """Problems with a result dict against the schema (empty when it is fine)."""
    problems = [f"missing top-level key {k!r}" for k in TOP_KEYS if k not in result]
    if result.get("schema") != SCHEMA:
        problems.append(f"schema is {result.get('schema')!r}, expected {SCHEMA!r}")
    for key in ("copy_bytes_per_s", "bf16_flops_per_s"):
        if not isinstance(result.get("ceilings", {}).get(key), int | float):
            problems.append(f"ceilings.{key} missing")
    for i, row in enumerate(result.get("rows", [])):
        problems += [f"rows[{i}] lacks {k!r}" for k in ROW_KEYS if k not in row]
        if row.get("status") == "ok":
            problems += [f"rows[{i}] (ok) lacks {k!r}" for k in OK_ROW_KEYS if k not in row]
        elif not row.get("reason"):
            problems.append(f"rows[{i}] is {row.get('status')} without a reason")
    return problems


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN and inf become None, numpy scalars become Python numbers."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, str):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(_clean(result), indent=1) + "\n")


# ---------------------------------------------------------------------------------------------- tables


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    """An aligned plain-text table, or a markdown pipe table."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _roof(pct: float | None) -> str:
    """% of roofline, or "cache" above 100%: the operands stayed in cache between calls (small weights on a
    CPU), so the DRAM roofline does not bound it (the plot draws those points hollow)."""
    if pct is not None and pct > ROOFLINE_CAP_PCT:
        return "cache"
    return _num(pct, ".0f")


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


def _status_cell(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        return _num(row["time"]["median_us"], ".1f" if row["time"]["median_us"] < 1000 else ".0f")
    return {"FAILED": "FAILED", "error": "error", "skipped": "skip"}.get(row["status"], row["status"])


def peers_that_ran(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Peers with at least one row that was not skipped, in first-seen order."""
    seen: list[str] = []
    for r in rows:
        if r["status"] != "skipped" and r["peer"] not in seen:
            seen.append(r["peer"])
    return seen


def best_nybble(case_rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in case_rows if r["status"] == "ok" and r["peer"].startswith("nybble:")]
    return min(ok, key=lambda r: r["time"]["median_us"]) if ok else None


def is_moe(row: dict[str, Any]) -> bool:
    """A grouped (mixture-of-experts) row of bench.moe, reported in its own table."""
    return row.get("kind") == "moe"


def dense_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if not is_moe(r)]


def case_label(row: dict[str, Any]) -> str:
    """The shape, and for a MoE row its tokens and grouping: ``qwen3-30b-a3b-gate T64 skewed``."""
    return f"{row['shape']} T{row['tokens']} {row['distribution']}" if is_moe(row) else row["shape"]


def group_cases(rows: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rows grouped by (shape, M), in order."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["m"]), []).append(r)
    return list(groups.values())


BEST_PEER = "best peer (its time / nybble's: >1x = nybble faster)"


def summary_table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """One line per (shape, M): each peer's median time in us, then nybble's best against the rest.

    "best peer" names the fastest peer with its median time over nybble's best: above 1x nybble is faster.
    """
    rows = dense_rows(rows)
    peers = peers_that_ran(rows)
    header = ["shape", "M", *[f"{p} us" for p in peers], "nybble x bf16", "nybble %roof", BEST_PEER]
    body = []
    for case in group_cases(rows):
        by_peer = {r["peer"]: r for r in case}
        if all(r["status"] == "skipped" for r in case):
            if "budget" in (case[0].get("reason") or ""):
                body.append([case[0]["shape"], str(case[0]["m"]), *["budget" for _ in peers], "", "", ""])
            continue
        cells = [_status_cell(by_peer[p]) if p in by_peer else "" for p in peers]
        best = best_nybble(case)
        vs_peer = best_peer_cell(case, best)
        body.append(
            [
                case[0]["shape"],
                str(case[0]["m"]),
                *cells,
                _num(best and best.get("speedup_vs_bf16"), ".2f"),
                _roof(best and best.get("pct_roofline")),
                vs_peer,
            ]
        )
    return format_table(header, body, markdown)


def best_peer_cell(case: Sequence[dict[str, Any]], best: dict[str, Any] | None) -> str:
    """The fastest non-nybble peer of a case and its median over nybble's best, e.g. ``xla:bf16 (1.50x)``."""
    others = [r for r in case if r["status"] == "ok" and not r["peer"].startswith("nybble:")]
    fastest_peer = min(others, key=lambda r: r["time"]["median_us"]) if others else None
    if best is None or fastest_peer is None:
        return ""
    return f"{fastest_peer['peer']} ({fastest_peer['time']['median_us'] / best['time']['median_us']:.2f}x)"


def moe_table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """One line per MoE point: model, projection, tokens, rows, experts with rows / experts, grouping,
    each peer's median in us, nybble's best over the bf16 ragged_dot, its % of the roofline (active
    experts' bytes), and the best peer's time over nybble's."""
    rows = [r for r in rows if is_moe(r)]
    peers = peers_that_ran(rows)
    header = ["model", "proj", "T", "rows", "experts", "groups", *[f"{p} us" for p in peers],
              "nybble x bf16", "nybble %roof", BEST_PEER]  # fmt: skip
    cases: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        cases.setdefault((r["shape"], r["tokens"], r["distribution"], r["dropped_rows"]), []).append(r)
    body = []
    for case in cases.values():
        if all(r["status"] == "skipped" for r in case) and "budget" not in (case[0].get("reason") or ""):
            continue
        by_peer = {r["peer"]: r for r in case}
        best = best_nybble(case)
        first = case[0]
        body.append(
            [first["model"], first["proj"], str(first["tokens"]), str(first["m"]),
             f"{first['active_experts']}/{first['experts']}", first["distribution"],
             *[_status_cell(by_peer[p]) if p in by_peer else "" for p in peers],
             _num(best and best.get("speedup_vs_bf16"), ".2f"), _roof(best and best.get("pct_roofline")),
             best_peer_cell(case, best)]
        )  # fmt: skip
    return format_table(header, body, markdown)


MOE_NOTE = (
    "MoE rows: `ragged_dot(x, W (E, K, N), group_sizes)` with rows = T x top-k sorted by expert; "
    "x bf16 = time of xla:ragged_dot-bf16 / nybble's; the weight bytes behind %roof count only the experts "
    "that hold rows (an expert with no rows is not read), plus x read and y written."
)


def detail_table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """Every row that ran: time, rates, fractions of the ceilings, speedup over bf16, error."""
    header = [
        "shape", "M", "peer", "status", "us", "TFLOP/s", "GB/s", "%copyBW", "%bf16", "%roof", "x bf16",
        "rel err", "sets",
    ]  # fmt: skip
    body = []
    for r in rows:
        if r["status"] == "skipped":
            continue
        ok = r["status"] == "ok"
        body.append(
            [
                case_label(r),
                str(r["m"]),
                r["peer"],
                r["status"],
                _num(r["time"]["median_us"], ".2f") if ok else "-",
                _num(r.get("tflops"), ".2f") if ok else "-",
                _num(r.get("gbps"), ".0f") if ok else "-",
                _num(r.get("pct_copy_bw"), ".0f") if ok else "-",
                _num(r.get("pct_bf16"), ".1f") if ok else "-",
                _roof(r.get("pct_roofline")) if ok else "-",
                _num(r.get("speedup_vs_bf16"), ".2f") if ok else "-",
                _num(r.get("rel_err"), ".1e"),
                str(r.get("n_sets", "-")),
            ]
        )
    return format_table(header, body, markdown)


def skipped_reasons(rows: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
    """Each peer's distinct reasons for not running or not passing."""
    out: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] != "ok" and r.get("reason"):
            reasons = out.setdefault(f"{r['peer']} ({r['status']})", [])
            if r["reason"] not in reasons:
                reasons.append(r["reason"])
    return out


def host_tables(host: dict[str, Any], markdown: bool = False) -> str:
    parts = []
    if host.get("packing"):
        header = ["op", "shape", "ms", "Mvalues/s", "GB/s", "x np.copy time"]
        body = [
            [
                r["op"],
                "x".join(map(str, r["shape"])),
                _num(r["median_ms"], ".2f"),
                _num(r["values_per_s"] / 1e6, ".0f"),
                _num(r["gbps"], ".2f"),
                _num(r["x_copy_time"], ".1f"),
            ]
            for r in host["packing"]
        ]
        parts.append(format_table(header, body, markdown))
    if host.get("quantize"):
        header = ["op", "shape", "device", "ms", "Mparams/s"]
        body = [
            [
                r["op"],
                "x".join(map(str, r["shape"])),
                r["device"],
                _num(r["median_ms"], ".1f"),
                _num(r["params_per_s"] / 1e6, ".1f"),
            ]
            for r in host["quantize"]
        ]
        parts.append(format_table(header, body, markdown))
    return "\n\n".join(parts)


def ceilings_line(result: dict[str, Any]) -> str:
    c = result["ceilings"]
    return (
        f"ceilings measured in this run: copy {c['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + written), "
        f"bf16 matmul {c['bf16_flops_per_s'] / 1e12:.2f} TFLOP/s "
        f"({c['raw']['bf16_matmul']['size']}^3), ridge {c['ridge_flops_per_byte']:.0f} FLOP/B"
    )


def markdown_report(result: dict[str, Any]) -> str:
    m = result["machine"]
    cfg = result["config"]
    lines = [
        "# nybble benchmark",
        "",
        f"- date: {m['date']}; device: {m['device']} ({m['backend']}); CPU: {m['cpu']} x{m['cpu_count']}",
        f"- jax {m['jax']}, jaxlib {m['jaxlib']}, numpy {m['numpy']}, torch {m['torch']}, "
        f"driver {m['driver']}",
        f"- weights {cfg['group']} {'symmetric' if cfg['symmetric'] else 'asymmetric'}, bf16 x; "
        f"tolerance {cfg['tolerance']:g} (relative, vs float64 reference); "
        f"elapsed {result['elapsed_s']:.0f} s",
        f"- {ceilings_line(result)}",
    ]
    if result.get("banner"):
        lines += ["", f"> {result['banner']}"]
    for note in result["notes"]:
        lines.append(f"- note: {note}")
    lines += ["", "Times are medians in microseconds per matmul (us); x bf16 = time of xla:bf16 / time.", ""]
    lines += ["## Summary", "", summary_table(result["rows"], markdown=True), ""]
    if any(is_moe(r) for r in result["rows"]):
        lines += ["## MoE (grouped matmul)", "", MOE_NOTE, "", moe_table(result["rows"], markdown=True), ""]
    lines += ["## All rows", "", detail_table(result["rows"], markdown=True), ""]
    reasons = skipped_reasons(result["rows"])
    if reasons:
        lines += ["## Not timed", ""]
        lines += [f"- {peer}: {'; '.join(rs)}" for peer, rs in reasons.items()]
        lines.append("")
    lines += ["## Peers", ""]
    lines += [
        f"- {kind}`{p['name']}`: {p['description']} (checked against: {p['reference']})"
        for kind, group in (("", result["peers"]), ("MoE ", result.get("moe_peers", [])))
        for p in group
    ]
    if result.get("host"):
        lines += ["", "## Host-side work", "", host_tables(result["host"], markdown=True)]
    peers_xray = xray_peers_section(result["rows"])
    if peers_xray:
        lines += ["", *peers_xray]
    return "\n".join(lines) + "\n"


# The committed X-ray of nybble beside its peers (`make xray-peers`), quoted in the benchmark's report.
XRAY_PEERS_JSON = Path(__file__).resolve().parent / "results" / "xray-peers" / "xray.json"


def xray_peers_section(rows: Sequence[dict[str, Any]], path: Path = XRAY_PEERS_JSON) -> list[str]:
    """Markdown lines: the peers' X-ray (registers, spills, loop instructions, instructions per weight,
    launches) for the (shape, M) cases this run timed, from the committed ``make xray-peers`` result;
    none when that file is absent or shares no case with the run."""
    try:
        xray = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    timed = {(r["shape"], r["m"]) for r in dense_rows(rows)}
    cases = [r for r in xray.get("rows", []) if (r["shape"], r["m"]) in timed]
    if not cases:
        return []
    header = ["shape", "M", "peer", "quant", "regs", "spill", "loop instr", "instr/w", "launches"]
    body = []
    for r in sorted(cases, key=lambda r: (r["shape"], r["m"], r["peer"])):
        k = r.get("kernel") or {}
        loop = k.get("loop") or {}
        ipw = loop.get("instructions_per_weight")
        body.append(
            [r["shape"], str(r["m"]), r["peer"], r["quant"], str(k.get("registers", "-")),
             str(k.get("spill_bytes", "-")), str(loop.get("instructions", "-")),
             "-" if ipw is None else f"{ipw:.2f}", "-" if "error" in r else str(r.get("launches", "-"))]
        )  # fmt: skip
    return [
        "## The same cases compiled side by side (X-ray: sm_90a SASS compiled on a CPU, not timed)",
        "",
        f"From {path.parent.parent.name}/{path.parent.name}/{path.name} (commit {xray.get('commit')}); "
        "`make xray-peers` rebuilds it.",
        "",
        format_table(header, body, True),
    ]
