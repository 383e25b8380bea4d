"""Two ``bench.decode`` runs side by side: launches and predicted tokens/s before and after, per row.

    python -m bench.decode.compare BEFORE/decode.json AFTER/decode.json --out DIR

Writes ``DIR/compare.md``: per (model, batch, weights) the launches per step, the predicted tokens/s and
the share of the HBM limit of each run, and the int4/bf16 ratios beside the ideal. Predictions both, from
the same static model; nothing is measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.decode.report import ratio_rows, write_atomic
from bench.report import format_table


def _overheads(meta: dict[str, Any]) -> str:
    """A run's launch overheads as its meta records them (runs before ``graph_launch_overhead_s`` existed
    charged every launch the one constant)."""
    launch = f"{meta['launch_overhead_s'] * 1e6:g} us a launch"
    if "graph_launch_overhead_s" not in meta:
        return launch
    return f"{launch} the host submits, {meta['graph_launch_overhead_s'] * 1e6:g} us one replayed in a graph"


def compare_markdown(before: dict[str, Any], after: dict[str, Any], title: str) -> str:
    """The side-by-side tables of two decode.json documents (rows matched by model, batch, weights)."""
    key = lambda r: (r["model"], r["batch"], r["weights"])
    old = {key(r): r for r in before["rows"]}
    rows = []
    for r in after["rows"]:
        b = old.get(key(r))
        if b is None:
            continue
        rows.append(
            [
                r["model"],
                str(r["batch"]),
                r["weights"],
                f"{b['launches_per_step']:.0f} -> {r['launches_per_step']:.0f}",
                f"{b['predicted_tokens_per_s']:,.0f} -> {r['predicted_tokens_per_s']:,.0f}",
                f"{100 * b['pct_of_hbm_limit']:.0f}% -> {100 * r['pct_of_hbm_limit']:.0f}%",
            ]
        )
    ratio_old = {(x["model"], x["batch"]): x for x in ratio_rows(before["rows"])}
    ratios = [
        [
            x["model"],
            str(x["batch"]),
            f"{ratio_old[(x['model'], x['batch'])]['predicted']:.2f}x -> {x['predicted']:.2f}x"
            if (x["model"], x["batch"]) in ratio_old
            else f"{x['predicted']:.2f}x",
            f"{x['ideal']:.2f}x",
            f"{100 * x['of_ideal']:.0f}%",
        ]
        for x in ratio_rows(after["rows"])
    ]
    meta = after["meta"]
    return "\n".join(
        [
            f"# {title}",
            "",
            f"Predicted, not measured: both runs are `bench.decode`'s static model ({meta['gpu']}, "
            f"context {meta['context']}), each as its own `decode.md` states: {_overheads(before['meta'])} "
            f"before, {_overheads(meta)} after.",
            "",
            format_table(
                ["model", "batch", "weights", "launches", "predicted tok/s", "% of HBM limit"], rows, True
            ),
            "",
            "## int4 / bf16 predicted ratio (after: of the ideal, bf16 / int4 bytes a step must read)",
            "",
            format_table(["model", "batch", "predicted int4/bf16", "ideal", "of ideal"], ratios, True),
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode.compare", description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="Decode step before -> after")
    args = ap.parse_args(argv)
    before, after = (json.loads(p.read_text()) for p in (args.before, args.after))
    text = compare_markdown(before, after, args.title)
    write_atomic(args.out / "compare.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
