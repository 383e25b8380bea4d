"""``python -m bench.summarize bench.json``: the short table of a finished (or partial) run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import report


def summarize(path: Path) -> str:
    result = json.loads(path.read_text())
    lines = []
    if result.get("banner"):
        lines.append(result["banner"])
    m = result["machine"]
    lines.append(
        f"{m['device']} ({m['backend']}), driver {m['driver']}, jax {m['jax']}, torch {m['torch']}; "
        f"{result['config']['group']}; elapsed {result.get('elapsed_s', 0):.0f} s"
        + ("; PARTIAL (run did not finish)" if result.get("partial") else "")
    )
    lines.append(report.ceilings_line(result))
    for peer, reasons in report.skipped_reasons(result["rows"]).items():
        lines.append(f"not timed: {peer}: {'; '.join(reasons)}"[:400])
    lines += [f"note: {n}" for n in result.get("notes", [])]
    lines.append(report.summary_table(result["rows"]))
    if any(report.is_moe(r) for r in result["rows"]):
        lines += [
            "MoE (grouped matmul; %roof over the active experts' bytes):",
            report.moe_table(result["rows"]),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.summarize RESULT.json", file=sys.stderr)
        return 2
    print(summarize(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
