"""tools/mutate.py's bookkeeping: the prefix-extending sample, the equivalent list and the weighted rate."""

import json
import math

import pytest

from tools import mutate

KERNEL_MODULE = "nybble/kernels/mosaic_gpu/split_k.py"


def test_a_larger_sample_extends_a_smaller_one():
    small = mutate.sampled(KERNEL_MODULE, 5, seed=3)
    large = mutate.sampled(KERNEL_MODULE, 20, seed=3)
    assert len(small) == 5 and len(large) == 20
    assert {m.index for m in small} <= {m.index for m in large}
    assert [m.index for m in large] == sorted(m.index for m in large)
    assert {m.index for m in mutate.sampled(KERNEL_MODULE, 20, seed=4)} != {m.index for m in large}
    everything = mutate.sampled(KERNEL_MODULE, 10_000, seed=3)
    assert [m.index for m in everything] == list(range(len(mutate.mutants(KERNEL_MODULE))))


def _row(module: str, status: str, line: str = "x = 1", what: str = "1 -> 2") -> dict:
    return {"module": module, "line": 1, "status": status, "source_line": line, "what": what}


def test_equivalent_survivors_leave_the_rate(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(mutate, "EQUIVALENT", [("a.py", "y = 2", "2 -> 3", "reason")])
    rows = [
        *[_row("a.py", "killed") for _ in range(6)],
        _row("a.py", "timeout"),
        _row("a.py", "survived"),
        _row("a.py", "survived", "y = 2", "2 -> 3"),  # equivalent
        _row("a.py", "survived", "y = 2", "* -> /"),  # same line, another mutation: a survivor
    ]
    (t,) = mutate.tally(rows, {"a.py": 10, "b.py": 4})  # b.py has no rows: left out
    assert (t.run, t.killed, t.timeouts, t.survived, t.equivalent) == (10, 6, 1, 2, 1)
    assert t.rate == 7 / 9
    estimate, low, high = mutate.overall_rate([t])
    assert estimate == low == high == 7 / 9  # every mutant ran: no sampling error


def test_a_sampled_module_is_weighted_by_its_mutant_count_and_widens_the_interval():
    full = mutate.ModuleTally("a.py", mutants=10, run=10, killed=9, survived=1)
    sampled = mutate.ModuleTally("b.py", mutants=100, run=10, killed=10)
    estimate, low, high = mutate.overall_rate([full, sampled])
    assert estimate == pytest.approx((10 * 0.9 + 100 * 1.0) / 110, rel=1e-12)
    p = 12 / 14  # Agresti-Coull, 10 of 10 killed
    half = 1.96 * 100 * math.sqrt(p * (1 - p) / 14 * 90 / 99) / 110
    assert low == pytest.approx(estimate - half, rel=1e-12)
    assert high == 1.0  # clipped
    assert low < estimate


def test_gpu_only_marks_the_lines_of_the_gpu_functions():
    module = "nybble/kernels/mosaic_gpu/dequant_registers.py"
    lines = (mutate.ROOT / module).read_text().splitlines()
    gpu = next(i for i, s in enumerate(lines, 1) if s.startswith("def _gpu_dequantize("))
    twin = next(i for i, s in enumerate(lines, 1) if s.startswith("def _twin_dequantize("))
    assert mutate.is_gpu_only({"module": module, "line": gpu + 1})
    assert not mutate.is_gpu_only({"module": module, "line": twin + 1})
    assert not mutate.is_gpu_only({"module": "nybble/packing/nibbles.py", "line": gpu + 1})


def test_summary_merges_files_and_keeps_only_the_sample(tmp_path, capsys):
    """Later files win for the same mutant; with a sample, other mutants of the sampled module drop out."""
    row = {"module": KERNEL_MODULE, "line": 1, "what": "1 -> 2", "source_line": "x", "seconds": 1.0}
    first, retry = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps({**row, "index": i, "status": "survived"}) + "\n" for i in (0, 1, 2)))
    retry.write_text(json.dumps({**row, "index": 1, "status": "killed"}) + "\n")
    mutate.summarize([first, retry])
    assert "   3      1    2 " in capsys.readouterr().out  # run 3: 1 killed, 2 survived
    mutate.summarize([first, retry], {(KERNEL_MODULE, 1), (KERNEL_MODULE, 2)}, {KERNEL_MODULE})
    assert "   2      1    1 " in capsys.readouterr().out


def test_retry_reruns_only_the_selected_modules_unsettled_mutants():
    rows = [
        {"module": "a.py", "index": 0, "status": "killed"},
        {"module": "a.py", "index": 1, "status": "survived"},
        {"module": "a.py", "index": 2, "status": "timeout"},
        {"module": "b.py", "index": 0, "status": "survived"},  # another module: kept for its summary
    ]
    kept = mutate.rows_kept_for_retry(rows, {("a.py", 0), ("a.py", 1), ("a.py", 2)})
    assert kept == [rows[0], rows[3]]
