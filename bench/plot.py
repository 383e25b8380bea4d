"""The PNG: per shape, speedup over the bf16 dot and % of the roofline against M, one line per peer.

The roofline uses the copy bandwidth measured on buffers larger than any cache; an op whose operands stay
in cache between calls (small weights on a CPU) can beat it many times over (1867% was seen for XLA's bf16
dot on the 2-core CPU). Such points are drawn at the cap, ``ROOFLINE_CAP_PCT``, as hollow triangles and
named in a note, so the real ones stay readable.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.peers import BF16_BASELINE

# % of roofline above which a point is cache-resident, not a measurement against the DRAM roofline.
ROOFLINE_CAP_PCT = 100.0


def capped_roofline(pcts: Sequence[float], cap: float = ROOFLINE_CAP_PCT) -> tuple[list[float], list[bool]]:
    """The values to draw (at most ``cap``) and which points were above it (cache-resident)."""
    return [min(p, cap) for p in pcts], [p > cap for p in pcts]


def plot_title(device: str, has_gpu: bool) -> str:
    """The figure title; a run without a GPU says so."""
    if has_gpu:
        return f"nybble vs peers on {device}"
    return f"nybble vs peers on {device}: CPU (no GPU), XLA paths only, says nothing about GPU speed"


def plot_rows(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """Writes the plot; returns None (and writes nothing) when no row was timed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in ok))
    peers = list(dict.fromkeys(r["peer"] for r in ok))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {p: cycle[i % len(cycle)] for i, p in enumerate(peers)}
    fig, axes = plt.subplots(
        len(shapes), 2, figsize=(11, 2.8 * len(shapes) + 0.6), squeeze=False, constrained_layout=True
    )
    capped_any = False
    for i, shape in enumerate(shapes):
        mine = [r for r in ok if r["shape"] == shape]
        ax_s, ax_r = axes[i]
        for peer in peers:
            pts = sorted((r["m"], r) for r in mine if r["peer"] == peer)
            if not pts:
                continue
            ms = [m for m, _ in pts]
            style = {
                "marker": "o",
                "ms": 3,
                "color": colors[peer],
                "lw": 1.8 if peer.startswith("nybble:") else 1.0,
            }
            sp = [r.get("speedup_vs_bf16") for _, r in pts]
            if peer != BF16_BASELINE and any(s is not None for s in sp):
                ax_s.plot(ms, [s if s is not None else float("nan") for s in sp], label=peer, **style)
            shown, over = capped_roofline([r["pct_roofline"] for _, r in pts])
            ax_r.plot(ms, shown, label=peer, **style)
            if any(over):
                capped_any = True
                hi = [m for m, o in zip(ms, over, strict=True) if o]
                ax_r.plot(hi, [ROOFLINE_CAP_PCT] * len(hi), ls="none", marker="^", ms=7, mfc="none",
                          color=colors[peer])  # fmt: skip
        k, n = mine[0]["k"], mine[0]["n"]
        ax_s.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax_s.set_title(f"{shape} ({k}x{n}): speedup over {BF16_BASELINE}", fontsize=9)
        ax_r.set_title(f"{shape}: % of roofline (measured ceilings)", fontsize=9)
        for ax in (ax_s, ax_r):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("M (rows of x)", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        ax_r.set_ylim(0, ROOFLINE_CAP_PCT * 1.1)
        ax_s.legend(fontsize=7)
        ax_r.legend(fontsize=7)
    if capped_any:
        note = f"hollow triangles: above {ROOFLINE_CAP_PCT:.0f}% of roofline, operands cached between calls"
        title = f"{title}\n{note}" if title else note
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
