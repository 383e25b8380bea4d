"""The X-ray's prediction beside the measured time, per case (``python -m bench.predicted BENCH XRAY...``).

For every timed row of a ``python -m bench`` result, the X-ray row of the same case (shape, M, group
setting, peer; a MoE row of bench.moe matches the X-ray's ``moe/<model>-<proj>/T<tokens>/...`` row, for
the balanced grouping the X-ray models) from committed X-ray results (``python -m bench.xray``: nybble's
sweep and the peers'; ``python -m bench.xray.moe_cases``: the grouped kernel's): its modeled time with
the spec sheet's ceilings it was made with, the same model re-evaluated with the ceilings measured in that
bench run (bytes over the measured copy bandwidth, FLOPs over the measured bf16 rate, the issue bound
unchanged), and measured / predicted. It refits nothing: the comparison is for a person to read
(``make gpu-check`` writes it as predicted.md / predicted.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.report import format_table, is_moe, write_json

SCHEMA = "nybble-predicted/1"
# bench's peer names -> the X-ray's, where they differ.
PEER_NAMES = {"tokamax:int4": "tokamax:ragged_dot"}


def _quant(group_size: int | None, symmetric: bool, peer: str) -> str:
    if peer == "xla:bf16":
        return "-"
    if peer == "xla:int4-col":
        return "col-sym"
    return f"{'col' if group_size is None else f'g{group_size}'}-{'sym' if symmetric else 'asym'}"


MOE_NOTE = (
    "MoE rows match the X-ray's moe/<model>-<proj>/T<tokens> rows for the balanced grouping only (the one "
    "the X-ray models; skewed ones are listed as not in the X-ray). Both count the weight bytes of the "
    "experts that hold rows only (bench/xray/model.read_bytes)."
)


def _kind(xray_row: dict[str, Any]) -> str:
    return "moe" if str(xray_row.get("key", "")).startswith("moe/") else "dense"


def xray_index(
    xray_results: Iterable[dict[str, Any]],
) -> dict[tuple[str, str, int, str, str], dict[str, Any]]:
    """X-ray rows by (kind: dense or moe, shape, M, quant, peer); a later file's row wins (pass the newest
    last)."""
    out: dict[tuple[str, str, int, str, str], dict[str, Any]] = {}
    for result in xray_results:
        for r in result["rows"]:
            if "error" not in r and r.get("t_model_us") is not None:
                out[(_kind(r), r["shape"], r["m"], r["quant"], r["peer"])] = {
                    **r,
                    "_ceilings": result["ceilings"],
                    "_commit": result.get("commit"),
                }
    return out


def remodel(row: dict[str, Any], copy_bytes_per_s: float, bf16_flops_per_s: float) -> dict[str, float | str]:
    """The X-ray model of ``row`` with other ceilings: HBM and tensor-core times rescaled, issue kept."""
    made = row["_ceilings"]
    t_hbm = row["bytes"] / copy_bytes_per_s * 1e6
    t_tc = row["t_tc_us"] * made["bf16_flops_per_s"] / bf16_flops_per_s
    bounds = {"hbm": t_hbm, "tensor": t_tc, "issue": row.get("t_issue_us")}
    bound, t = max(((b, v) for b, v in bounds.items() if v is not None), key=lambda p: p[1])
    return {"t_us": t, "bound": bound}


def side_by_side(bench: dict[str, Any], xrays: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """predicted.json: one row per timed bench row that the X-ray has, and the bench rows it lacks."""
    index = xray_index(xrays)
    symmetric = bool(bench.get("config", {}).get("symmetric", True))
    ceilings = bench["ceilings"]
    rows, missing = [], []
    for r in bench["rows"]:
        if r.get("status") != "ok":
            continue
        peer = PEER_NAMES.get(r["peer"], r["peer"])
        moe = is_moe(r)
        quant = _quant(r.get("group_size"), symmetric, r["peer"])
        key = ("moe" if moe else "dense", r["shape"], r["m"], quant, peer)
        # The X-ray models a MoE launch for the balanced grouping of all rows: other groupings do not match.
        modeled = not moe or (r.get("distribution") == "balanced" and not r.get("dropped_rows"))
        x = index.get(key) if modeled else None
        measured = r["time"]["median_us"]
        if x is None:
            missing.append(
                {"shape": r["shape"], "m": r["m"], "peer": r["peer"], "measured_us": measured}
                | ({"tokens": r["tokens"], "distribution": r["distribution"]} if moe else {})
            )
            continue
        now = remodel(x, ceilings["copy_bytes_per_s"], ceilings["bf16_flops_per_s"])
        rows.append(
            {
                "kind": key[0],
                "shape": r["shape"],
                "m": r["m"],
                "tokens": r.get("tokens"),
                "quant": quant,
                "peer": r["peer"],
                "measured_us": measured,
                "predicted_us": x["t_model_us"],
                "predicted_bound": x["bound"],
                "predicted_ceilings": x["_ceilings"].get("source"),
                "remodeled_us": now["t_us"],
                "remodeled_bound": now["bound"],
                "measured_over_remodeled": measured / now["t_us"],
                "xray_bytes": x["bytes"],
                "bench_bytes": r.get("bytes"),
                "xray_commit": x["_commit"],
                "instructions_per_weight": ((x.get("kernel") or {}).get("loop") or {}).get(
                    "instructions_per_weight"
                ),
            }
        )
    return {
        "schema": SCHEMA,
        "machine": bench.get("machine", {}).get("device"),
        "ceilings_measured": {k: ceilings.get(k) for k in ("copy_bytes_per_s", "bf16_flops_per_s")},
        "rows": rows,
        "not_in_xray": missing,
        "note": "a model beside a measurement; nothing is refitted",
    }


def table(result: dict[str, Any], *, markdown: bool = False) -> str:
    header = ["shape", "M", "quant", "peer", "measured us", "X-ray us (spec)", "X-ray us (measured ceilings)",
              "bound", "measured / X-ray"]  # fmt: skip
    body = [
        [
            f"moe/{r['shape']}/T{r['tokens']}" if r.get("kind") == "moe" else r["shape"],
            str(r["m"]),
            r["quant"],
            r["peer"],
            f"{r['measured_us']:.1f}",
            f"{r['predicted_us']:.1f}",
            f"{r['remodeled_us']:.1f}",
            r["remodeled_bound"],
            f"{r['measured_over_remodeled']:.2f}",
        ]
        for r in result["rows"]
    ]
    return format_table(header, body, markdown)


def write(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_json(result, out / "predicted.json")
    md = [
        "# Measured beside the X-ray's prediction",
        "",
        f"Device: {result['machine']}; measured ceilings: {result['ceilings_measured']}. The X-ray's time "
        "is a static model (max of issue, HBM and tensor-core bounds), not a timing; nothing is refitted.",
        "",
        table(result, markdown=True),
        "",
        f"Timed cases the X-ray results do not have: {len(result['not_in_xray'])}.",
    ]
    moe_rows = [r for r in result["rows"] if r.get("kind") == "moe"]
    if moe_rows or any("tokens" in r for r in result["not_in_xray"]):
        md += ["", MOE_NOTE]
    (out / "predicted.md").write_text("\n".join(md) + "\n")
    return [out / "predicted.json", out / "predicted.md"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.predicted", description=__doc__.splitlines()[0])
    p.add_argument("bench_json", type=Path)
    p.add_argument("xray_json", type=Path, nargs="+", help="X-ray results (xray.json), the newest last")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        bench = json.loads(args.bench_json.read_text())
        xrays = [json.loads(x.read_text()) for x in args.xray_json if x.exists()]
    except (OSError, ValueError) as e:
        print(f"python -m bench.predicted: {e}", file=sys.stderr)
        return 2
    result = side_by_side(bench, xrays)
    files = write(result, args.out)
    print(table(result))
    n_rows, n_missing = len(result["rows"]), len(result["not_in_xray"])
    wrote = ", ".join(map(str, files))
    print(f"{n_rows} cases side by side, {n_missing} timed cases not in the X-ray; wrote {wrote}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
