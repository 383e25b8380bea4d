"""The GPU plan without a GPU: ``make gpu-check`` dry-run end to end (every step but the timing), and the
predicted-vs-measured table it writes checked by hand on a made-up run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import predicted

REPO = Path(__file__).resolve().parents[1]


def _xray(rows, copy=4.8e12, flops=989e12):
    return {"commit": "abc1234", "ceilings": {"copy_bytes_per_s": copy, "bf16_flops_per_s": flops,
                                              "source": "spec sheet"}, "rows": rows}  # fmt: skip


def _xray_row(shape, m, quant, peer, *, nbytes, t_tc, t_issue):
    t_hbm = nbytes / 4.8e12 * 1e6
    bound, t = max((("hbm", t_hbm), ("tensor", t_tc), ("issue", t_issue or 0.0)), key=lambda p: p[1])
    return {"shape": shape, "m": m, "quant": quant, "peer": peer, "bytes": nbytes, "t_tc_us": t_tc,
            "t_issue_us": t_issue, "t_hbm_us": t_hbm, "t_model_us": t, "bound": bound,
            "kernel": {"loop": {"instructions_per_weight": 1.5}}}  # fmt: skip


def _bench_row(shape, m, peer, us, group_size=128):
    return {"shape": shape, "m": m, "peer": peer, "group_size": group_size, "status": "ok",
            "time": {"median_us": us}}  # fmt: skip


def test_side_by_side_by_hand():
    xray = _xray(
        [
            _xray_row(
                "s", 1, "g128-sym", "nybble:mosaic_gpu", nbytes=9.6e6, t_tc=0.1, t_issue=1.0
            ),  # hbm 2 us
            _xray_row("s", 1, "-", "xla:bf16", nbytes=48e6, t_tc=0.1, t_issue=None),  # hbm 10 us
            _xray_row("s", 1, "g128-sym", "tokamax:ragged_dot", nbytes=9.6e6, t_tc=0.1, t_issue=3.0),
        ]
    )
    bench = {
        "machine": {"device": "NVIDIA H200"},
        "config": {"symmetric": True},
        "ceilings": {"copy_bytes_per_s": 4.0e12, "bf16_flops_per_s": 800e12},
        "rows": [
            _bench_row("s", 1, "nybble:mosaic_gpu", 4.8),
            _bench_row("s", 1, "xla:bf16", 13.0),
            _bench_row("s", 1, "tokamax:int4", 6.0),  # bench's name for the X-ray's tokamax:ragged_dot
            _bench_row("s", 16, "xla:bf16", 13.0),  # no X-ray row: listed apart
            {**_bench_row("s", 1, "torch:int4pack", 1.0), "status": "skipped"},
        ],
    }
    result = predicted.side_by_side(bench, [xray])
    by_peer = {r["peer"]: r for r in result["rows"]}
    assert set(by_peer) == {"nybble:mosaic_gpu", "xla:bf16", "tokamax:int4"}
    nyb = by_peer["nybble:mosaic_gpu"]
    # Spec sheet: 9.6 MB / 4.8 TB/s = 2 us; measured ceilings: 9.6 MB / 4.0 TB/s = 2.4 us (> issue 1 us).
    assert nyb["predicted_us"] == pytest.approx(2.0) and nyb["remodeled_us"] == pytest.approx(2.4)
    assert nyb["remodeled_bound"] == "hbm" and nyb["measured_over_remodeled"] == pytest.approx(2.0)
    assert by_peer["xla:bf16"]["remodeled_us"] == pytest.approx(12.0)
    assert by_peer["tokamax:int4"]["remodeled_bound"] == "issue"  # 3 us of issue beat 2.4 us of HBM
    assert result["not_in_xray"] == [{"shape": "s", "m": 16, "peer": "xla:bf16", "measured_us": 13.0}]
    assert "refitted" in result["note"]


def test_gpu_check_dry_run_end_to_end(tmp_path):
    """bash bench/gpu_check.sh with DRY_RUN=1: the GPU tests collected (not run), the benchmark's tiny CPU
    preset (its dense shape, then its three shrunk MoE points), the X-ray side by side written; exit 0 and
    the files of a real run but the model benchmark's."""
    out = tmp_path / "check"
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "OUT": str(out),
        "PYTHON": sys.executable,
        "DRY_RUN_BENCH_ARGS": (
            "--preset tiny --ms 1 --peers xla:bf16 xla:ragged_dot nybble tokamax --max-time-per-row 0.01 "
            "--no-host --no-plot"
        ),
    }
    env.pop("JAX_PLATFORMS", None)
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith("VERDICT: DRY RUN:") and "GPU tests collected, none run" in first
    assert int(first.split("DRY RUN: ")[1].split()[0]) > 0
    assert {"system.txt", "tests.log", "bench.json", "bench.md", "predicted.json", "predicted.md"} <= {
        p.name for p in out.iterdir()
    }
    bench = json.loads((out / "bench.json").read_text())
    assert bench["ceilings"]["copy_bytes_per_s"] > 0 and bench["ceilings"]["bf16_flops_per_s"] > 0
    dense = [r for r in bench["rows"] if r.get("kind") != "moe"]
    assert [r["peer"] for r in dense if r["status"] == "ok"] == ["nybble:xla", "xla:bf16"]
    # The MoE points ran after the dense ones, every XLA peer checked against float64 and timed on the CPU;
    # the kernel and tokamax say why they cannot run here.
    moe_rows = [r for r in bench["rows"] if r.get("kind") == "moe"]
    from bench.moe import MOE_PRESETS

    assert [(r["shape"], r["tokens"], r["distribution"]) for r in moe_rows[::5]] == [
        (p.shape, p.tokens, p.distribution) for p in MOE_PRESETS["tiny"].points
    ]
    for r in moe_rows:
        if r["peer"] in ("nybble:xla", "xla:ragged_dot-bf16", "xla:ragged_dot-deq-int4"):
            assert r["status"] == "ok" and r["rel_err"] < 1e-2 and r["time"]["median_us"] > 0, r
            assert 0 < r["weight_bytes"] and r["flops"] == 2 * sum(r["group_sizes"]) * r["k"] * r["n"]
        else:
            assert r["peer"] in ("nybble:mosaic_gpu", "tokamax:int4") and r["status"] == "skipped", r
            assert r["reason"]
    assert "## MoE (grouped matmul)" in (out / "bench.md").read_text()
    side = json.loads((out / "predicted.json").read_text())
    assert side["schema"] == predicted.SCHEMA and side["ceilings_measured"] == {
        k: bench["ceilings"][k] for k in ("copy_bytes_per_s", "bf16_flops_per_s")
    }
    # The CPU's smollm2 case and shrunk MoE layer have no X-ray row (the X-ray compiles real shapes for
    # Hopper): listed, not invented.
    assert side["rows"] == [] and [r["peer"] for r in side["not_in_xray"][:2]] == ["nybble:xla", "xla:bf16"]
    assert len(side["not_in_xray"]) == 2 + 3 * 3 and all("tokens" in r for r in side["not_in_xray"][2:])
