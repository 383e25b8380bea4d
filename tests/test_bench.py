"""``bench/`` on the CPU: counting, roofline math, peers, JSON schema, and a CLI smoke run."""

from __future__ import annotations

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from bench import arg_specs, metrics, report, runner
from bench.peers import (
    BF16_BASELINE,
    REF_GROUPED,
    Case,
    NybblePeer,
    Prepared,
    TokamaxPeer,
    TorchInt4Peer,
    XlaBf16Peer,
    XlaInt4GroupPeer,
    XlaInt4Peer,
    torch_inner_k_tiles,
    torch_shape_unavailable,
    xla_int4_matmul,
)
from bench.timing import measure
from nybble.device import hopper_device

# ------------------------------------------------------------------------------------ counting


def test_flops_and_bytes_exact():
    assert metrics.matmul_flops(16, 4096, 14336) == 2 * 16 * 4096 * 14336
    assert metrics.activation_bytes(16, 4096, 1024) == (16 * 4096 + 16 * 1024) * 2
    assert metrics.dense_weight_bytes(8192, 8192) == 134_217_728  # 134 MB (ANCHORS)
    # One 8192^2 layer at g128 with bf16 scales: 34.6 MB (ANCHORS).
    assert metrics.int4_weight_bytes(8192, 8192, 64) == 8192 * 8192 // 2 + 64 * 8192 * 2 == 34_603_008
    assert metrics.int4_weight_bytes(8192, 8192, 64, has_offsets=True) == 34_603_008 + 64 * 8192 * 2


@pytest.mark.parametrize(("k", "n", "g", "sym"), [(576, 1536, 128, True), (256, 128, 64, False)])
def test_int4_bytes_match_quantized_weight(k, n, g, sym):
    qw = nybble.quantize(np.ones((k, n), np.float32), group_size=g, symmetric=sym)
    k_pad, n_pad = qw.padded_shape
    assert metrics.int4_weight_bytes(k_pad, n_pad, qw.num_groups, has_offsets=not sym) == qw.nbytes


def test_ideal_speedup():
    assert metrics.ideal_speedup_over_bf16(4.125) == pytest.approx(3.878, abs=1e-3)
    assert metrics.ideal_speedup_over_bf16(5.0) == pytest.approx(3.2)


# ------------------------------------------------------------------------------------ roofline


def test_roofline_memory_and_compute_bound():
    c = metrics.Ceilings(copy_bytes_per_s=4e12, bf16_flops_per_s=800e12)
    assert c.ridge_flops_per_byte == pytest.approx(200)
    # Memory-bound: 8192^2 int4 at M=1; floor = bytes / bandwidth.
    nbytes = 34_603_008 + metrics.activation_bytes(1, 8192, 8192)
    assert c.roofline_s(metrics.matmul_flops(1, 8192, 8192), nbytes) == pytest.approx(nbytes / 4e12)
    # Compute-bound: 8192^3; floor = flops / rate.
    flops = metrics.matmul_flops(8192, 8192, 8192)
    assert c.roofline_s(flops, 3 * 8192 * 8192 * 2) == pytest.approx(flops / 800e12)


def test_rates():
    c = metrics.Ceilings(copy_bytes_per_s=1e12, bf16_flops_per_s=100e12)
    r = metrics.rates(2e-6, flops=100e6, nbytes=1e6, ceilings=c)
    assert r.tflops == pytest.approx(50.0)
    assert r.gbps == pytest.approx(500.0)
    assert r.pct_copy_bw == pytest.approx(50.0)
    assert r.pct_bf16 == pytest.approx(50.0)
    assert r.roofline_us == pytest.approx(1.0)
    assert r.pct_roofline == pytest.approx(50.0)
    with pytest.raises(ValueError):
        metrics.rates(0.0, 1, 1, c)


def test_speedups():
    times = {"nybble:xla": 10.0, BF16_BASELINE: 30.0, "torch:int4pack": 20.0, "x": None}
    s = metrics.speedups(times, "nybble:xla")
    assert s == {BF16_BASELINE: pytest.approx(3.0), "torch:int4pack": pytest.approx(2.0)}
    assert metrics.speedups(times, "x") == {}
    assert metrics.speedups(times, "missing") == {}


# ------------------------------------------------------------------------------------ specs


def test_arg_specs():
    assert arg_specs.SHAPES["llama3-8b-down"].k == 14336
    assert arg_specs.SHAPES["llama3-70b-gate-up"].n == 28672
    assert arg_specs.M_SWEEP[0] == 1 and arg_specs.M_SWEEP[-1] == 4096 and len(arg_specs.M_SWEEP) == 13
    for preset in arg_specs.PRESETS.values():
        assert all(name in arg_specs.SHAPES for name in preset.shapes)
    assert arg_specs.parse_group_size("-1") is None
    assert arg_specs.parse_group_size("64") == 64
    with pytest.raises(ValueError):
        arg_specs.parse_group_size("48")
    assert arg_specs.select_shapes(["4096x11008"])[0].n == 11008
    with pytest.raises(ValueError):
        arg_specs.select_shapes(["nonsense"])


def test_n_sets_and_check_rows():
    assert runner.n_sets_for(100 * 2**20, 256 * 2**20) == 3
    assert runner.n_sets_for(2**30, 256 * 2**20) == 2
    assert runner.n_sets_for(1000, 256 * 2**20, max_sets=4) == 4
    assert list(runner.check_rows(3)) == [0, 1, 2]
    rows = runner.check_rows(4096)
    assert rows[0] == 0 and rows[-1] == 4095 and len(rows) == runner.CHECK_ROWS


# ------------------------------------------------------------------------------------ peers


def _case(k=128, n=64, m=4, g=64, sets=2, symmetric=True):
    w = 0.02 * jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    weights = runner.make_weights(w, g, symmetric)
    xs = [jax.random.normal(jax.random.key(10 + i), (m, k), jnp.bfloat16) for i in range(sets)]
    return Case("t", k, n, m, g, w, weights, xs)


def test_torch_skipped_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    assert TorchInt4Peer().unavailable(_case()) == "torch is not installed"


def test_tokamax_skipped_without_tokamax(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)
    reason = TokamaxPeer().unavailable(_case())
    assert reason is not None and "tokamax" in reason


def test_torch_shape_limits():
    assert torch_shape_unavailable(4096, 4096, 128) is None
    assert "per-column" in torch_shape_unavailable(4096, 4096, None)
    assert "K % group_size" in torch_shape_unavailable(576, 576, 128)
    assert torch_shape_unavailable(576, 576, 64) is None
    assert torch_shape_unavailable(200, 100, 128) is None  # padded to (256, 128)
    assert (
        torch_inner_k_tiles(4096) == 8 and torch_inner_k_tiles(576) == 4 and torch_inner_k_tiles(40) is None
    )


@pytest.mark.parametrize("symmetric", [True, False])
def test_torch_peer_operands_dequantize_like_nybble(symmetric):
    """tinygemm's (u - 8) * scale + zero, from the operands the torch peer hands it, is nybble's weight.

    The peer takes them from ``nybble.quant.to_torch_uint8_codes``: padded (K_pad, N_pad) with every scale
    row, the partial last N tile included (N = 100 -> 128).
    """
    k, n, g = 256, 100, 64
    w = np.random.default_rng(0).normal(size=(k, n)).astype(np.float32)
    qw = nybble.quantize(w, group_size=g, symmetric=symmetric)
    ops = nybble.quant.to_torch_uint8_codes(qw)
    assert ops.codes.shape == (128, k // 2) and ops.codes.dtype == np.uint8 and ops.group_size == g
    assert ops.scale_and_zero.shape == (k // g, 128, 2)
    u = np.empty((128, k), np.int32)
    u[:, 0::2] = ops.codes >> 4  # even k in the HIGH nibble (torch's convention)
    u[:, 1::2] = ops.codes & 0xF
    saz = ops.scale_and_zero.astype(np.float32)
    s = np.repeat(saz[..., 0], g, axis=0)  # (K, N_pad)
    z = np.repeat(saz[..., 1], g, axis=0)
    tinygemm = ((u.T - 8) * s + z)[:, :n]
    assert np.abs(tinygemm).max() > 0
    np.testing.assert_array_equal(tinygemm.astype(np.float32), np.asarray(nybble.dequantize(qw)))


@pytest.mark.parametrize(("k", "g", "symmetric"), [(192, 64, False), (200, 128, True)])
def test_xla_int4_group_matches_reference(k, g, symmetric):
    """XLA's int4 with group scales: whole groups (a reshape) and a partial last one (K = 200 at g128: the
    scales repeated along K), symmetric and with offsets, against nybble's float64 reference."""
    case = _case(k=k, n=64, m=8, g=g, symmetric=symmetric)
    qw = case.weights[REF_GROUPED]
    assert (qw.offsets is None) == symmetric
    out = XlaInt4GroupPeer().prepare(case, 1)
    y = out.call()[0]
    ref = nybble.kernels.reference_matmul(case.xs[0], qw)
    assert y.shape == (8, 64) and nybble.kernels.relative_error(y, ref) < runner.BF16_TOLERANCE
    terms = 1 if symmetric else 2  # scales (and offsets), bf16, one row a group
    assert XlaInt4GroupPeer().weight_bytes(case) == k * 64 // 2 + terms * -(-k // g) * 64 * 2


def test_xla_int4_matches_reference():
    case = _case(k=192, n=128, m=8)
    qw = case.weights["per-column"]
    from nybble.packing import nk_int4_as_int4
    from nybble.quant import relayout

    y = xla_int4_matmul(case.xs[0], nk_int4_as_int4(relayout(qw, "nk_int4").codes), qw.scales[0], case.n)
    ref = nybble.kernels.reference_matmul(case.xs[0], qw)
    assert nybble.kernels.relative_error(y, ref) < runner.BF16_TOLERANCE


def test_nybble_mosaic_available_only_on_hopper():
    reason = NybblePeer("mosaic_gpu").unavailable(_case())
    if hopper_device() is None:
        assert "Hopper" in reason
    else:
        assert reason is None


@pytest.mark.parametrize("peer", [NybblePeer("xla"), XlaBf16Peer(), XlaInt4Peer(), XlaInt4GroupPeer()])
def test_run_case_times_correct_peers(peer):
    case = _case()
    ceil = metrics.Ceilings(1e10, 1e11)
    cfg = runner.Config(shapes=[], ms=[case.m], group_size=64, sample_s=1e-4, max_time_s=0.01)
    refs = {}

    def ref_weights(kind):
        return refs.setdefault(kind, runner.reference_weight(case.weights[kind]))

    shape = arg_specs.Shape("t", case.k, case.n)
    (row,) = runner.run_case(case, shape, [peer], cfg, ceil, ref_weights, case.xs)
    assert row["status"] == "ok", row
    assert row["rel_err"] < runner.BF16_TOLERANCE
    assert row["time"]["median_us"] > 0 and row["n_sets"] == 2


def test_run_case_repeats_ops_when_launch_bound(monkeypatch):
    """When launching costs the host most of the call, the ops run repeated inside one program."""
    monkeypatch.setattr(runner, "DISPATCH_FRACTION", 0.0)
    case = _case()
    cfg = runner.Config(shapes=[], ms=[case.m], group_size=64, sample_s=1e-4, max_time_s=0.01)
    shape = arg_specs.Shape("t", case.k, case.n)
    rows = runner.run_case(
        case,
        shape,
        [NybblePeer("xla"), XlaInt4Peer()],
        cfg,
        metrics.Ceilings(1e10, 1e11),
        lambda kind: runner.reference_weight(case.weights[kind]),
        case.xs,
    )
    for row in rows:
        assert row["status"] == "ok" and "repeat_error" not in row, row
        assert row["reps"] >= 4 and row["time"]["ops_per_sample"] % (row["n_sets"] * row["reps"]) == 0


def test_dispatch_cost(monkeypatch):
    """Launching takes what the call takes, completing adds what the sync takes (medians over n). A fake
    clock that only the call and the sync advance: exact, and independent of the machine's load."""
    now = [100.0]
    monkeypatch.setattr(runner.time, "perf_counter", lambda: now[0])
    calls, syncs = iter([0.01, 0.05, 0.02]), iter([0.03, 0.30, 0.04])

    def call():
        now[0] += next(calls)

    def sync(_):
        now[0] += next(syncs)

    launch, full = runner.dispatch_cost(call, sync, n=3)
    assert launch == pytest.approx(0.02)  # median of 0.01, 0.05, 0.02
    assert full == pytest.approx(0.06)  # median of 0.04, 0.35, 0.06


class _WrongPeer:
    """Returns a wrong answer (x @ 0) or raises: must be FAILED / error, and never timed."""

    name = "fake:wrong"
    reference = REF_GROUPED
    description = "wrong on purpose"

    def __init__(self, raise_error=False):
        self.raise_error = raise_error
        self.calls = 0

    def unavailable(self, case):
        return None

    def weight_bytes(self, case):
        return 1

    def prepare(self, case, n_sets):
        if self.raise_error:
            raise RuntimeError("boom")

        def call():
            self.calls += 1
            return jnp.zeros((case.m, case.n), jnp.bfloat16) + 1.0

        return Prepared(
            call=call,
            sync=jax.block_until_ready,
            output_rows=lambda out, rows: np.asarray(out, np.float64)[rows],
            n_sets=1,
            weight_bytes=1,
        )


def test_wrong_answers_fail_and_are_not_timed():
    case = _case()
    cfg = runner.Config(shapes=[], ms=[case.m], group_size=64)
    shape = arg_specs.Shape("t", case.k, case.n)
    wrong, raising = _WrongPeer(), _WrongPeer(raise_error=True)
    rows = runner.run_case(
        case,
        shape,
        [wrong, raising, XlaBf16Peer()],
        cfg,
        metrics.Ceilings(1e10, 1e11),
        lambda kind: runner.reference_weight(case.weights[kind]),
        case.xs,
    )
    assert rows[0]["status"] == "FAILED" and "relative error" in rows[0]["reason"]
    assert "time" not in rows[0] and "speedup" not in rows[0]
    assert wrong.calls == 1  # checked once, never timed
    assert rows[1]["status"] == "error" and "boom" in rows[1]["reason"]
    assert rows[2]["status"] == "ok" and rows[2]["speedup"] == {}


def test_measure_counts_ops():
    t = measure(lambda: None, lambda _: None, ops_per_call=4, sample_s=1e-4, max_time_s=0.01)
    assert t.samples >= 5 and t.median_s > 0 and t.min_s <= t.median_s <= t.max_s


# ------------------------------------------------------------------------------------ reports


def _fake_rows():
    def ok(peer, us, m=1):
        return {
            "shape": "s", "k": 8, "n": 8, "m": m, "group_size": 128, "peer": peer, "status": "ok",
            "reason": None, "flops": 128, "time": {"median_us": us}, "tflops": 1.0, "gbps": 1.0,
            "pct_copy_bw": 10.0, "pct_bf16": 1.0, "roofline_us": 1.0, "pct_roofline": 100 / us,
            "rel_err": 1e-3, "bytes": 10, "weight_bytes": 5, "n_sets": 2,
        }  # fmt: skip

    rows = [ok("nybble:xla", 2.0), ok(BF16_BASELINE, 6.0), ok("xla:int4-col", 3.0)]
    rows.append({**rows[0], "peer": "torch:int4pack", "status": "skipped", "reason": "no torch"})
    times = {r["peer"]: r["time"]["median_us"] for r in rows if r["status"] == "ok"}
    for r in rows[:3]:
        r["speedup"] = metrics.speedups(times, r["peer"])
        r["speedup_vs_bf16"] = r["speedup"].get(BF16_BASELINE)
    return rows


def test_tables():
    rows = _fake_rows()
    text = report.summary_table(rows)
    assert "3.00" in text and "xla:int4-col (1.50x)" in text and "torch" not in text
    assert ">1x = nybble faster" in text  # the peer took 3.0 us, nybble 2.0 us: 1.50x, nybble faster
    md = report.summary_table(rows, markdown=True)
    assert md.startswith("| shape | M |")
    assert "nybble:xla" in report.detail_table(rows)
    assert report.skipped_reasons(rows) == {"torch:int4pack (skipped)": ["no torch"]}
    assert "cache" not in text and "cache" not in report.detail_table(rows)


def test_tables_mark_cache_resident_cases():
    """Above 100% of the DRAM roofline the operands stayed cached: the tables say "cache", not a number."""
    rows = _fake_rows()
    rows[0]["pct_roofline"] = 1945.0  # nybble's row, as seen for small weights on a CPU
    assert "1945" not in report.summary_table(rows) and "cache" in report.summary_table(rows)
    detail = report.detail_table(rows).splitlines()
    assert any("nybble:xla" in line and "cache" in line for line in detail)
    assert not any("xla:int4-col" in line and "cache" in line for line in detail)  # 33%: a number


def test_validate_schema():
    assert "missing top-level key 'rows'" in report.validate({"schema": report.SCHEMA})
    bad = {k: [] for k in report.TOP_KEYS} | {
        "schema": report.SCHEMA,
        "ceilings": {"copy_bytes_per_s": 1.0, "bf16_flops_per_s": 1.0},
        "rows": [{"status": "skipped"}],
    }
    problems = report.validate(bad)
    assert any("lacks 'peer'" in p for p in problems) and any("without a reason" in p for p in problems)


def test_json_is_clean(tmp_path):
    path = tmp_path / "r.json"
    report.write_json({"a": float("nan"), "b": np.float32(1.5), "c": [np.int64(3)]}, path)
    assert json.loads(path.read_text()) == {"a": None, "b": 1.5, "c": [3]}


def test_host_throughput_small():
    from bench import host

    pack = host.packing_throughput(k=256, n=128, repeats=2)
    assert [r["op"] for r in pack] == ["np.copy (int8 codes)", "pack_int4", "unpack_int4"]
    # The rates are the counts over the measured times (bytes: the int8 codes and their packed half).
    assert [r["bytes_moved"] for r in pack] == [2 * 256 * 128, 256 * 128 * 3 // 2, 256 * 128 * 3 // 2]
    for r in pack:
        assert r["values_per_s"] == pytest.approx(r["values"] / (r["median_ms"] / 1e3))
        assert r["x_copy_time"] == pytest.approx(r["median_ms"] / pack[0]["median_ms"])
    quant = host.quantize_throughput(k=256, n=128, repeats=1)
    assert [r["op"].split()[:2] for r in quant] == [["quantize", "sym"], ["quantize", "asym"]]
    assert all(r["params_per_s"] == pytest.approx(256 * 128 / (r["median_ms"] / 1e3)) for r in quant)


# ------------------------------------------------------------------------------------ CLI smoke


def test_cli_smoke(tmp_path, capsys):
    from bench.cli import main

    out = tmp_path / "res"
    rc = main(
        ["--shapes", "smollm2-135m-qo", "--ms", "1", "8", "--out", str(out), "--quiet", "--no-host",
         "--max-time-per-row", "0.05", "--sample-ms", "1"]
    )  # fmt: skip
    assert rc == 0
    for name in ("bench.json", "bench.md", "bench.png"):
        assert (out / name).stat().st_size > 0, name
    result = json.loads((out / "bench.json").read_text())
    assert report.validate(result) == []
    by = {(r["peer"], r["m"]): r for r in result["rows"]}
    assert by[("nybble:xla", 8)]["status"] == "ok"
    assert by[("xla:bf16", 8)]["status"] == "ok"
    assert by[("torch:int4pack", 1)]["status"] == "skipped" and by[("torch:int4pack", 1)]["reason"]
    assert math.isclose(
        by[("nybble:xla", 8)]["speedup_vs_bf16"],
        by[("xla:bf16", 8)]["time"]["median_us"] / by[("nybble:xla", 8)]["time"]["median_us"],
    )
    assert result["machine"]["jax"] == jax.__version__
    printed = capsys.readouterr().out
    assert "nybble x bf16" in printed.splitlines()[-4]  # the summary table comes last
    assert ("NO GPU" in printed) == (jax.default_backend() != "gpu")


def test_cli_budget_skips_rest(tmp_path):
    from bench.cli import main

    out = tmp_path / "res"
    rc = main(
        ["--shapes", "smollm2-135m-qo", "--ms", "1", "2", "--out", str(out), "--quiet", "--no-host",
         "--no-plot", "--budget-s", "0", "--peers", "xla:bf16"]
    )  # fmt: skip
    assert rc == 0
    result = json.loads((out / "bench.json").read_text())
    assert all(r["status"] == "skipped" and "budget" in r["reason"] for r in result["rows"])
    assert any("budget" in n for n in result["notes"])


# ------------------------------------------------------------------------------------ torch plumbing


class _FakeTensor:
    """Just enough of torch.Tensor (numpy inside) for the torch peer's plumbing to run on the CPU."""

    device = "cuda"

    def __init__(self, a):
        self.a = np.asarray(a)

    def to(self, target):
        if target == "bf16":
            import ml_dtypes

            return _FakeTensor(self.a.astype(np.float32).astype(ml_dtypes.bfloat16))
        return self  # a device

    def view(self, dtype):
        import ml_dtypes

        assert dtype == "bf16" and self.a.dtype == np.int16
        return _FakeTensor(self.a.view(ml_dtypes.bfloat16))

    def contiguous(self):
        return self

    def clone(self):
        return _FakeTensor(self.a.copy())

    def numel(self):
        return self.a.size

    def element_size(self):
        return self.a.itemsize

    def __getitem__(self, idx):
        return _FakeTensor(self.a[idx.a if isinstance(idx, _FakeTensor) else idx])

    def float(self):
        return _FakeTensor(self.a.astype(np.float32))

    def cpu(self):
        return self

    def numpy(self):
        return self.a


def _fake_torch():
    import contextlib
    import types

    import ml_dtypes

    def int4pack_mm(x, w, g, saz):  # tinygemm's math on the uint8 operand (fake "packing" = identity)
        u = np.empty((w.a.shape[0], 2 * w.a.shape[1]), np.float32)
        u[:, 0::2], u[:, 1::2] = w.a >> 4, w.a & 0xF
        s = np.repeat(saz.a[..., 0].astype(np.float32), g, axis=0)
        z = np.repeat(saz.a[..., 1].astype(np.float32), g, axis=0)
        y = x.a.astype(np.float32) @ ((u.T - 8) * s + z)
        return _FakeTensor(y.astype(ml_dtypes.bfloat16))

    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        Stream=lambda: types.SimpleNamespace(wait_stream=lambda s: None),
        current_stream=lambda: types.SimpleNamespace(wait_stream=lambda s: None),
        stream=lambda s: contextlib.nullcontext(),
        CUDAGraph=lambda: None,
        graph=lambda g: (_ for _ in ()).throw(RuntimeError("no graphs in the fake")),
        synchronize=lambda: None,
    )
    aten = types.SimpleNamespace(
        _convert_weight_to_int4pack=lambda w, tiles: w, _weight_int4pack_mm=int4pack_mm
    )
    return types.SimpleNamespace(
        __version__="fake",
        cuda=cuda,
        ops=types.SimpleNamespace(aten=aten),
        device=lambda name: name,
        bfloat16="bf16",
        from_numpy=_FakeTensor,
        as_tensor=lambda a, device=None: _FakeTensor(a),
        equal=lambda a, b: np.array_equal(a.a, b.a),
    )


@pytest.mark.parametrize(("k", "n"), [(256, 64), (200, 100)])
def test_torch_peer_plumbing_with_a_fake_torch(monkeypatch, k, n):
    """The torch peer's conversions (codes, scales, bf16 x through int16) give the right answer, for a
    padded weight too ((200, 100) -> (256, 128): x padded along K, the output cut to N)."""
    monkeypatch.setitem(sys.modules, "torch", _fake_torch())
    case = _case(k=k, n=n, m=8, g=64)
    peer = TorchInt4Peer()
    assert peer.unavailable(case) is None
    shape = arg_specs.Shape("t", case.k, case.n)
    cfg = runner.Config(shapes=[], ms=[case.m], group_size=64, sample_s=1e-4, max_time_s=0.01)
    (row,) = runner.run_case(
        case,
        shape,
        [peer],
        cfg,
        metrics.Ceilings(1e10, 1e11),
        lambda kind: runner.reference_weight(case.weights[kind]),
        case.xs,
    )
    assert row["status"] == "ok", row
    assert row["rel_err"] < runner.BF16_TOLERANCE
    # The fake "packs" as the identity, so the cross-check of nybble's own converter must notice.
    assert row["torch_int4pack_converter"].startswith("DIFFERS")


def test_plot_caps_cache_resident_roofline_points_and_says_no_gpu(tmp_path):
    """A CPU run's plot: points over 100% of the roofline (operands cached) drawn at the cap, and a title
    that says the run had no GPU."""
    from bench.plot import ROOFLINE_CAP_PCT, capped_roofline, plot_rows, plot_title

    assert ROOFLINE_CAP_PCT == 100.0
    shown, over = capped_roofline([12.0, 99.5, 100.0, 1867.0])
    assert shown == [12.0, 99.5, 100.0, 100.0] and over == [False, False, False, True]
    cpu_title, gpu_title = plot_title("cpu", has_gpu=False), plot_title("NVIDIA H200", has_gpu=True)
    assert "CPU (no GPU)" in cpu_title and "no GPU" not in gpu_title and "H200" in gpu_title
    rows = [
        {"status": "ok", "shape": "s", "k": 576, "n": 1536, "m": m, "peer": peer, "pct_roofline": pct,
         "speedup_vs_bf16": None if peer == "xla:bf16" else 0.5}
        for m, peer, pct in [(1, "xla:bf16", 1867.0), (16, "xla:bf16", 40.0), (1, "nybble:xla", 30.0)]
    ]  # fmt: skip
    png = plot_rows(rows, tmp_path / "bench.png", cpu_title)
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
