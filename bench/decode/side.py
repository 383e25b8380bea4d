"""Measured decode tokens/s (``bench.model_bench``'s model_bench.json) beside ``bench.decode``'s prediction.

    python -m bench.decode.side DEST/model_bench.json bench/results/decode-<date>/smollm2/decode.json \\
        --out DEST

Writes ``decode_side.json`` and ``decode_side.md``: per batch and weights (float -> "bf16", int4), the
measured tokens/s, the predicted tokens/s of the committed prediction at that batch (and its context) and
measured / predicted. Nothing is refitted; a batch without a prediction is listed with none.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.decode.report import write_atomic
from bench.report import format_table


def side_rows(measured: dict[str, Any], predicted: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (batch, weights) of the measurement, with the prediction at that batch if any."""
    by_key = {(r["batch"], r["weights"]): r for r in predicted["rows"]}
    out = []
    for row in measured.get("rows", []):
        for kind, weights in (("float", "bf16"), ("int4", "int4")):
            m = row[kind]["tokens_per_s"]
            p = by_key.get((row["batch"], weights))
            out.append(
                {
                    "batch": row["batch"],
                    "weights": weights,
                    "measured_tokens_per_s": m,
                    "predicted_tokens_per_s": p["predicted_tokens_per_s"] if p else None,
                    "measured_over_predicted": m / p["predicted_tokens_per_s"] if p else None,
                    "predicted_model": p["model"] if p else None,
                    "predicted_gpu": p["gpu"] if p else None,
                }
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode.side", description=__doc__.splitlines()[0])
    ap.add_argument("model_bench", type=Path)
    ap.add_argument("decode", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    measured = json.loads(args.model_bench.read_text())
    predicted = json.loads(args.decode.read_text())
    rows = side_rows(measured, predicted)
    meta = {
        "measured_model": measured.get("config", {}).get("model"),
        "measured_device": measured.get("machine", {}).get("device"),
        "measured_dtype": measured.get("config", {}).get("dtype"),
        "prediction": str(args.decode),
        "predicted_context": predicted["meta"]["context"],
    }
    write_atomic(args.out / "decode_side.json", json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    fmt = lambda v, f: "-" if v is None else f.format(v)
    table = format_table(
        ["batch", "weights", "measured tok/s", "predicted tok/s", "measured / predicted"],
        [
            [
                str(r["batch"]),
                r["weights"],
                f"{r['measured_tokens_per_s']:,.1f}",
                fmt(r["predicted_tokens_per_s"], "{:,.0f}"),
                fmt(r["measured_over_predicted"], "{:.2f}"),
            ]
            for r in rows
        ],
        True,
    )
    text = (
        f"# Decode tokens/s: measured ({meta['measured_model']}, {meta['measured_device']}) "
        "beside predicted\n\n"
        f"Prediction: {args.decode.name} ({predicted['meta']['gpu']}, context {meta['predicted_context']}); "
        "nothing refitted.\n\n" + table + "\n"
    )
    write_atomic(args.out / "decode_side.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
