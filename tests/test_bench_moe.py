"""bench/moe.py on the CPU: group sizes and checked rows by hand, a tiny MoE sweep of the XLA peers against
the float64 reference, wrong answers that the check must catch, the MoE table, the X-ray match, the CLI."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from bench import metrics, moe, predicted, report, runner
from bench.peers import REF_BF16

CEILINGS = metrics.Ceilings(1e10, 1e11)
MINI = "qwen3-30b-a3b-mini"  # (hidden 256, intermediate 192, 8 experts, top-2)


def _cfg(**kw):
    return runner.Config(shapes=[], ms=[], group_size=128, sample_s=1e-4, max_time_s=0.01, max_sets=2, **kw)


# ------------------------------------------------------------------------------------ cases


def test_group_sizes_by_hand():
    assert moe.group_sizes_for(32, 8, moe.BALANCED).tolist() == [4] * 8
    # 8 rows over 128 experts: one row on each of 8 experts spaced over the stack, round(linspace(0, 127, 8)).
    sizes = moe.group_sizes_for(8, 128, moe.BALANCED)
    assert np.flatnonzero(sizes).tolist() == [0, 18, 36, 54, 73, 91, 109, 127] and sizes.sum() == 8
    # 2 + 1 rows over 2 experts: the first gets the extra row.
    assert moe.group_sizes_for(3, 2, moe.BALANCED).tolist() == [2, 1]
    # Skewed, 32 rows on 8 experts: 1 each, then 24 rows in proportion to 1/rank (/ H_8 = 2.7179): shares
    # 8.83 4.41 2.94 2.21 1.77 1.47 1.26 1.10 -> floors 8 4 2 2 1 1 1 1 (28 with the ones); the 4 rows
    # left go to the largest fractions (.94, .83, .77, .47: ranks 3, 1, 5, 6).
    assert moe.group_sizes_for(32, 8, moe.SKEWED).tolist() == [10, 5, 4, 3, 3, 3, 2, 2]
    point = moe.MoePoint("qwen3-30b-a3b", "down", 4)
    assert point.dims == (768, 2048, 128, 8) and point.rows == 32 and point.shape == "qwen3-30b-a3b-down"
    with pytest.raises(ValueError):
        moe.MoePoint("no-such-model", "gate", 1)


def test_presets():
    full = moe.MOE_PRESETS["moe"].points
    # 5 models x 5 T x 2 projections balanced, plus skewed at T 64, 512, 4096 (where it differs).
    assert sum(p.distribution == moe.BALANCED for p in full) == 50
    assert {p.tokens for p in full if p.distribution == moe.SKEWED} == {64, 512, 4096}
    for name in ("cpu", "tiny"):
        assert {p.model for p in moe.MOE_PRESETS[name].points} == {MINI}
    # The check preset starts with cases the committed X-ray has symmetric rows for.
    assert moe.MOE_PRESETS["check"].points[0] == moe.MoePoint("qwen3-30b-a3b", "down", 1)


def test_check_rows_and_owners_by_hand():
    sizes = np.array([10, 5, 4, 3, 3, 3, 2, 2])  # ends 10 15 19 22 25 28 30 32, 2 rows past them
    rows = moe.moe_check_rows(sizes, 34)
    # Experts 0, 2, 5, 7 (round(linspace(0, 7, 4))): first and last rows; then rows 32 and 33.
    assert rows.tolist() == [0, 9, 15, 18, 25, 27, 30, 31, 32, 33]
    assert moe.expert_of_rows(sizes, rows).tolist() == [0, 0, 2, 2, 5, 5, 7, 7, -1, -1]


def test_tokamax_operands_are_nybbles_weight():
    """The codes and scales handed to tokamax's QArray, multiplied out, are nybble's dequantized stack."""
    w = jax.random.normal(jax.random.key(3), (3, 192, 96), jnp.float32)  # K = 192: a partial last group
    qw = nybble.quantize(w, group_size=128)
    q, s = moe.tokamax_operands(qw)
    assert q.shape == (3, 192, 96) and q.dtype == jnp.int4 and s.shape == (3, 2, 96)
    ours = np.asarray(q, np.float32) * np.repeat(np.asarray(s, np.float32), 128, axis=1)[:, :192]
    np.testing.assert_array_equal(ours, np.asarray(nybble.dequantize(qw)))


# ------------------------------------------------------------------------------------ the sweep


def test_tiny_sweep_checks_xla_peers_and_says_why_others_cannot_run():
    points = [moe.MoePoint(MINI, "gate", 16, moe.SKEWED), moe.MoePoint(MINI, "down", 1, dropped=3)]
    rows, notes = moe.run_moe_sweep(_cfg(), points, moe.moe_peers(), CEILINGS)
    assert len(rows) == 2 * 5 and any("only the experts that hold rows" in n for n in notes)
    by = {(r["shape"], r["peer"]): r for r in rows}
    for shape in (f"{MINI}-gate", f"{MINI}-down"):
        for peer in ("nybble:xla", "xla:ragged_dot-bf16", "xla:ragged_dot-deq-int4"):
            r = by[(shape, peer)]
            assert r["status"] == "ok", r
            assert r["rel_err"] < runner.BF16_TOLERANCE and r["time"]["median_us"] > 0
        assert "Hopper" in by[(shape, "nybble:mosaic_gpu")]["reason"]
        assert by[(shape, "tokamax:int4")]["status"] == "skipped"
        assert "tokamax" in by[(shape, "tokamax:int4")]["reason"]
    gate = by[(f"{MINI}-gate", "nybble:xla")]
    assert gate["group_sizes"] == [10, 5, 4, 3, 3, 3, 2, 2] and gate["m"] == 32 and gate["k"] == 256
    assert gate["flops"] == 2 * 32 * 256 * 192
    # Only the active experts' bytes: 8 of 8 here, one expert as nybble.quantize stores it alone.
    one = nybble.quantize(np.zeros((256, 192), np.float32), group_size=128).nbytes
    assert gate["weight_bytes"] == 8 * one
    assert gate["bytes"] == 8 * one + (32 * 256 + 32 * 192) * 2
    # T = 1 over 8 experts at top-2: 2 experts hold rows, 3 dropped rows after them (zero in the output).
    down = by[(f"{MINI}-down", "xla:ragged_dot-bf16")]
    assert down["active_experts"] == 2 and down["m"] == 5 and down["weight_bytes"] == 2 * 192 * 256 * 2
    assert down["flops"] == 2 * 2 * 192 * 256
    nyb = by[(f"{MINI}-down", "nybble:xla")]
    assert nyb["speedup_vs_bf16"] == pytest.approx(down["time"]["median_us"] / nyb["time"]["median_us"])

    table = report.moe_table(rows)
    line = next(t for t in table.splitlines() if " gate " in t)
    assert MINI in line and "8/8" in line and "skewed" in line and " 32 " in line
    assert report.moe_table(rows, markdown=True).startswith("| model | proj | T | rows | experts | groups |")
    assert MINI not in report.summary_table(rows)  # the dense summary leaves MoE rows out


@dataclasses.dataclass
class _Tampered:
    """A real peer handed a tampered case (what a bug in a peer would do): its answer must fail the check."""

    base: object
    tamper: object
    name: str = "fake:tampered"
    description: str = "a peer with a bug on purpose"

    @property
    def reference(self):
        return self.base.reference

    def unavailable(self, case):
        return None

    def weight_bytes(self, case):
        return self.base.weight_bytes(case)

    def prepare(self, case, n_sets):
        return self.base.prepare(self.tamper(case), n_sets)


def _one_row_moved(case):
    sizes = case.group_sizes.copy()
    first, last = np.flatnonzero(sizes)[[0, -1]]
    sizes[first] -= 1  # the first expert's last row goes to the next active expert
    sizes[first + 1 + np.argmax(sizes[first + 1 :] > 0)] += 1
    assert sizes.sum() == case.group_sizes.sum() and last > first
    return dataclasses.replace(case, group_sizes=sizes)


def test_wrong_group_sizes_weights_and_tail_fail_the_check():
    point = moe.MoePoint(MINI, "gate", 16, moe.BALANCED, dropped=2)
    cfg = _cfg()
    case = moe.make_case(point, cfg, 0, n_sets=1)
    bf16 = moe.XlaRaggedBf16Peer()

    @dataclasses.dataclass
    class TailPeer(moe.XlaRaggedBf16Peer):
        """ragged_dot plus 1e-3 in the rows past the groups' sum (small: only the exact check sees it)."""

        name: str = "fake:tail"

        def prepare(self, case, n_sets):
            assigned = int(case.group_sizes.sum())

            def op(x, w, sizes):
                y = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
                tail = (jnp.arange(x.shape[0]) >= assigned)[:, None]
                return (y + 1e-3 * tail).astype(x.dtype)

            return moe._ragged_prepared(op, case, case.w_bf16, n_sets, 1)

    peers = [
        _Tampered(bf16, _one_row_moved),
        _Tampered(moe.NybbleRaggedPeer("xla"), _one_row_moved),
        _Tampered(bf16, lambda c: dataclasses.replace(c, w_bf16=c.w_bf16[::-1])),  # experts swapped
        TailPeer(),
        bf16,
    ]
    rows = moe.run_grouped_case(case, peers, cfg, CEILINGS)
    for r in rows[:3]:
        assert r["status"] == "FAILED" and "relative error" in r["reason"] and "time" not in r, r
    assert rows[3]["status"] == "FAILED" and rows[3]["reason"] == "rows past sum(group_sizes) are not zero"
    assert rows[3]["rel_err"] < runner.BF16_TOLERANCE  # the relative error alone would have let it pass
    assert rows[4]["status"] == "ok" and rows[4]["speedup"] == {}
    assert rows[4]["m"] == 34 and rows[4]["dropped_rows"] == 2


def test_reference_rows_by_hand():
    x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    weights = {0: np.eye(2), 1: 2 * np.eye(2)}
    out = moe.reference_rows(x, np.array([0, 1, -1]), weights.__getitem__, 2)
    assert out.tolist() == [[1.0, 2.0], [6.0, 8.0], [0.0, 0.0]]
    assert REF_BF16 == "bf16"


# ------------------------------------------------------------------------------------ X-ray, CLI


def test_moe_rows_beside_the_xray():
    xray = {
        "commit": "abc",
        "ceilings": {"copy_bytes_per_s": 4.8e12, "bf16_flops_per_s": 989e12, "source": "spec sheet"},
        "rows": [
            {"key": "moe/m-gate/T1/g128-sym/nybble:mosaic_gpu", "shape": "m-gate", "m": 8,
             "quant": "g128-sym", "peer": "nybble:mosaic_gpu", "bytes": 4.8e6, "t_tc_us": 0.1,
             "t_issue_us": 0.5, "t_model_us": 1.0, "bound": "hbm"},
        ],
    }  # fmt: skip
    base = {"kind": "moe", "shape": "m-gate", "m": 8, "tokens": 1, "peer": "nybble:mosaic_gpu",
            "status": "ok", "group_size": 128, "distribution": "balanced", "dropped_rows": 0, "bytes": 1e6,
            "time": {"median_us": 3.0}}  # fmt: skip
    bench = {
        "config": {"symmetric": True},
        "ceilings": {"copy_bytes_per_s": 4.0e12, "bf16_flops_per_s": 800e12},
        "rows": [
            base,
            {**base, "distribution": "skewed"},  # the X-ray models the balanced grouping only
            {**base, "kind": None},  # a dense row of the same name and M is another case
        ],
    }
    result = predicted.side_by_side(bench, [xray])
    (row,) = result["rows"]
    assert row["kind"] == "moe" and row["tokens"] == 1 and row["remodeled_us"] == pytest.approx(1.2)
    assert row["measured_over_remodeled"] == pytest.approx(2.5) and row["xray_bytes"] == 4.8e6
    assert [(r.get("distribution"), r["m"]) for r in result["not_in_xray"]] == [("skewed", 8), (None, 8)]
    assert "moe/m-gate/T1" in predicted.table(result)


def test_cli_moe_preset_on_cpu(tmp_path):
    """``--preset moe`` without a GPU: every real MoE point is skipped as too large, with the reason."""
    from bench.cli import main

    out = tmp_path / "res"
    assert main(["--preset", "moe", "--out", str(out), "--quiet", "--no-host", "--no-plot"]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert report.validate(result) == []
    assert len(result["rows"]) == len(moe.MOE_PRESETS["moe"].points) * 5
    cpu = jax.default_backend() == "cpu"
    assert all(r["kind"] == "moe" for r in result["rows"])
    if cpu:
        assert all(r["status"] == "skipped" and "too large" in r["reason"] for r in result["rows"])
    assert [p["name"] for p in result["moe_peers"]][:2] == ["nybble:mosaic_gpu", "nybble:xla"]
    md = (out / "bench.md").read_text()
    assert "## MoE (grouped matmul)" in md and "`xla:ragged_dot-deq-int4`" in md
