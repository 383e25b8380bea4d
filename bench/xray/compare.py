"""``python -m bench.xray.compare A/xray.json B/xray.json``: two X-ray runs side by side, per kernel case.

For the jax range (``make xray`` on the pinned end, ``make xray-jax-latest`` on the newest release): each
Mosaic GPU case in both runs with its main loop's instructions per weight, registers, spill bytes and
launches in A and in B, and whether its SASS changed (any of those, the loop's length or its opcode mix).
Prints a markdown table (changed cases first) and a one-line summary; ``--out FILE`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.xray.cases import MOSAIC


def _figures(row: dict[str, Any]) -> dict[str, Any] | None:
    kernel = row.get("kernel")
    if row.get("peer") != MOSAIC or "error" in row or not kernel:
        return None
    loop = kernel.get("loop") or {}
    return {
        "ipw": loop.get("instructions_per_weight"),
        "registers": kernel["registers"],
        "spills": kernel["spill_bytes"],
        "launches": row["launches"],
        "loop": loop.get("instructions"),
        "mix": sorted(map(tuple, loop.get("opcode_mix", []))),
        "sass": kernel.get("sass_instructions"),
    }


# What a kernel's main loop and resources are; "sass" (the kernel's whole SASS length) the rest.
_LOOP = ("ipw", "registers", "spills", "launches", "loop", "mix")


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per Mosaic GPU case present in both runs: key, A's and B's figures, ``changed``: "loop"
    (the main loop's instructions or opcode mix, registers, spills or launches differ), "outside the loop"
    (only the kernel's SASS length elsewhere: prologue, epilogue), or "" (the same)."""
    rows_a = {r["key"]: f for r in a["rows"] if (f := _figures(r)) is not None}
    rows_b = {r["key"]: f for r in b["rows"] if (f := _figures(r)) is not None}
    out = []
    for key in sorted(rows_a.keys() & rows_b.keys()):
        fa, fb = rows_a[key], rows_b[key]
        if any(fa[f] != fb[f] for f in _LOOP):
            changed = "loop"
        else:
            changed = "outside the loop" if fa["sass"] != fb["sass"] else ""
        out.append({"key": key.removesuffix("/" + MOSAIC), "a": fa, "b": fb, "changed": changed})
    return out


def _cell(x: Any, fmt: str = "{}") -> str:
    return "-" if x is None else fmt.format(x)


def table(entries: list[dict[str, Any]], label_a: str, label_b: str) -> str:
    """Markdown: changed cases first, then the rest."""
    head = (
        f"| case | instr/w {label_a} | instr/w {label_b} | regs {label_a} | regs {label_b} | spills "
        f"{label_a} | spills {label_b} | launches {label_a} | launches {label_b} | loop instr {label_a} | "
        f"loop instr {label_b} | SASS {label_a} | SASS {label_b} | SASS changed |"
    )
    lines = [head, "|" + "---|" * 14]
    order = {"loop": 0, "outside the loop": 1, "": 2}
    for e in sorted(entries, key=lambda e: (order[e["changed"]], e["key"])):
        a, b = e["a"], e["b"]
        lines.append(
            f"| {e['key']} | {_cell(a['ipw'], '{:.3f}')} | {_cell(b['ipw'], '{:.3f}')} | {a['registers']} | "
            f"{b['registers']} | {a['spills']} | {b['spills']} | {a['launches']} | {b['launches']} | "
            f"{_cell(a['loop'])} | {_cell(b['loop'])} | {_cell(a['sass'])} | {_cell(b['sass'])} | "
            f"{e['changed'] or 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.xray.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="an xray.json (e.g. the pinned jax's)")
    p.add_argument("b", type=Path, help="another xray.json (e.g. the newest jax's)")
    p.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    args = p.parse_args(argv)
    a, b = (json.loads(path.read_text()) for path in (args.a, args.b))
    label_a, label_b = (f"jax {run['versions']['jax']}" for run in (a, b))
    entries = compare(a, b)
    loop = sum(e["changed"] == "loop" for e in entries)
    outside = sum(e["changed"] == "outside the loop" for e in entries)
    summary = (
        f"{len(entries)} Mosaic GPU cases in both runs: main loop or resources changed in {loop}, only the "
        f"SASS outside the main loop in {outside}, identical {len(entries) - loop - outside}."
    )
    text = f"{table(entries, label_a, label_b)}\n\n{summary}\n"
    print(text, end="")
    if args.out is not None:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(text)
        tmp.rename(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
