"""decode.json and decode.md: one row per (model, batch, weights), the int4/bf16 ratios beside the ideal."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from math import nan
from pathlib import Path
from typing import Any

from bench.decode.count import FAMILIES
from bench.decode.predict import OVERHEAD
from bench.report import format_table


def write_atomic(path: Path, text: str) -> None:
    """Writes ``text`` to a temporary file beside ``path``, then renames it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def ratio_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, batch): predicted int4/bf16 tokens/s ratio, the ideal (bf16 / int4 needed bytes)."""
    by_key = {(r["model"], r["batch"], r["weights"]): r for r in rows}
    out = []
    for (model, batch, weights), r in by_key.items():
        if weights != "int4" or (model, batch, "bf16") not in by_key:
            continue
        b = by_key[(model, batch, "bf16")]
        predicted = r["predicted_tokens_per_s"] / b["predicted_tokens_per_s"]
        # records written before the graphs-free bound existed have none: nan, printed as such
        free = r.get("tokens_per_s_captured_free", nan) / b.get("tokens_per_s_captured_free", nan)
        ideal = b["needed_bytes"]["total"] / r["needed_bytes"]["total"]
        out.append(
            {
                "model": model,
                "batch": batch,
                "predicted": predicted,
                "ideal": ideal,
                "of_ideal": predicted / ideal,
                "captured_free": free,
                "captured_free_of_ideal": free / ideal,
            }
        )
    return out


RATIO_HEAD = ["model", "batch", "predicted int4/bf16", "ideal", "of ideal"]
RATIO_HEAD += ["graphs free: int4/bf16", "of ideal"]


def markdown(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """decode.md: what was compiled, the rows, the ratios, the breakdown (microseconds per family)."""
    head = [
        "model",
        "batch",
        "weights",
        "launches",
        "in graphs",
        "graphs",
        "MB/step",
        "predicted tok/s",
        "HBM limit tok/s",
        "% of limit",
        "graphs free: tok/s",
        "% of limit",
    ]
    body = [
        [
            r["model"],
            str(r["batch"]),
            r["weights"],
            f"{r['launches_per_step']:.0f}",
            f"{r['launches_in_command_buffers']:.0f}",
            f"{r.get('command_buffer_launches', nan):.0f}",
            f"{r['bytes_per_step'] / 1e6:,.1f}",
            f"{r['predicted_tokens_per_s']:,.0f}",
            f"{r['hbm_limit_tokens_per_s']:,.0f}",
            f"{100 * r['pct_of_hbm_limit']:.0f}%",
            f"{r['tokens_per_s_captured_free']:,.0f}",
            f"{100 * r['tokens_per_s_captured_free'] / r['hbm_limit_tokens_per_s']:.0f}%",
        ]
        for r in rows
    ]
    ratios = [
        [
            x["model"],
            str(x["batch"]),
            f"{x['predicted']:.2f}x",
            f"{x['ideal']:.2f}x",
            f"{100 * x['of_ideal']:.0f}%",
            f"{x['captured_free']:.2f}x",
            f"{100 * x['captured_free_of_ideal']:.0f}%",
        ]
        for x in ratio_rows(rows)
    ]
    fams = [*FAMILIES, OVERHEAD]
    breakdown = [
        [r["model"], str(r["batch"]), r["weights"]]
        + [f"{r['breakdown'][f]['launches']:.0f} / {1e6 * r['breakdown'][f]['seconds']:,.0f}" for f in fams]
        for r in rows
    ]
    parts = [
        f"# Decode step, predicted ({meta['gpu']}, context {meta['context']}, variant {meta['variant']}"
        + (f", jax {meta['jax']})" if "jax" in meta else ")"),
        "",
        "A static model of one compiled decode step, never a timing: see the notes at the end. "
        f"`predicted` charges a launch the host submits {1e6 * meta['launch_overhead_s']:g} us (each "
        "command buffer's own launch, `graphs`, too) and one replayed inside a command buffer "
        f"(`in graphs`) {1e6 * meta.get('graph_launch_overhead_s', meta['launch_overhead_s']):g} us; "
        "`graphs free` charges the launches inside command buffers nothing: an upper bound.",
        "",
        format_table(head, body, True),
        "",
        "## int4 / bf16: predicted tokens/s ratio beside the ideal "
        "(bf16 bytes / int4 bytes a step must read)",
        "",
        format_table(RATIO_HEAD, ratios, True),
        "",
        "## Breakdown: launches / microseconds per step",
        "",
        format_table(["model", "batch", "weights", *fams], breakdown, True),
        "",
    ]
    parts += meta.get("notes", [])
    return "\n".join(parts) + "\n"


def write(out: Path, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> tuple[Path, Path]:
    """Writes ``out/decode.json`` ({"meta", "rows"}) and ``out/decode.md``."""
    js, md = out / "decode.json", out / "decode.md"
    write_atomic(js, json.dumps({"meta": meta, "rows": list(rows)}, indent=1) + "\n")
    write_atomic(md, markdown(rows, meta))
    return js, md
