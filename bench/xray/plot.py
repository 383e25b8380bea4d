"""The X-ray's PNG: per shape, instructions per weight against M, and the model's three bounds against M."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.xray.cases import MOSAIC

BUDGET_PERFECT_ISSUE = 3.5  # instructions per weight at which a perfect-issue kernel just streams HBM
BUDGET_WITH_STALLS = 2.0


def plot_rows(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Writes the plot; None (nothing written) when no nybble kernel row compiled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["peer"] == MOSAIC and "error" not in r and r.get("kernel")]
    if not mine:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in mine))
    quants = list(dict.fromkeys(r["quant"] for r in mine))
    fig, axes = plt.subplots(
        len(shapes), 2, figsize=(11, 2.7 * len(shapes) + 0.8), squeeze=False, constrained_layout=True
    )
    for i, shape in enumerate(shapes):
        ax_i, ax_t = axes[i]
        for quant in quants:
            pts = sorted((r["m"], r) for r in mine if r["shape"] == shape and r["quant"] == quant)
            pts = [(m, r) for m, r in pts if r["kernel"].get("loop")]
            if not pts:
                continue
            ms = [m for m, _ in pts]
            ax_i.plot(
                ms, [r["kernel"]["loop"]["instructions_per_weight"] for _, r in pts], "o-", ms=3, label=quant
            )
            if quant == quants[0]:
                for key, style, label in (
                    ("t_issue_us", "o-", "issue"),
                    ("t_hbm_us", "s--", "HBM"),
                    ("t_tc_us", "^:", "tensor core"),
                ):
                    ax_t.plot(ms, [r[key] for _, r in pts], style, ms=3, label=f"{label} ({quant})")
        ax_i.axhline(
            BUDGET_PERFECT_ISSUE, color="red", lw=0.8, ls="--", label="HBM-rate budget, perfect issue"
        )
        ax_i.axhline(BUDGET_WITH_STALLS, color="green", lw=0.8, ls="--", label="budget with room for stalls")
        k, n = pts[0][1]["k"], pts[0][1]["n"]
        ax_i.set_title(f"{shape} ({k}x{n}): main-loop SASS instructions per weight per thread", fontsize=9)
        ax_t.set_title(f"{shape}: model bounds, us (a model, not a measurement)", fontsize=9)
        ax_t.set_yscale("log")
        ax_i.set_ylim(bottom=0)
        for ax in (ax_i, ax_t):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("M (rows of x)", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
