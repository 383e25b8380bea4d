"""The sweep: for each shape and M, check every peer against the float64 reference, then time it."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import nybble
from bench.arg_specs import Shape, group_label
from bench.metrics import Ceilings, activation_bytes, matmul_flops, rates, speedups
from bench.peers import (
    BF16_BASELINE,
    REF_BF16,
    REF_GROUPED,
    REF_PER_COLUMN,
    Case,
    Peer,
    Prepared,
)
from bench.timing import measure
from nybble.kernels import reference_dequantize, relative_error
from nybble.quant import QuantizedWeight

# ||out - ref|| / ||ref|| allowed for a bf16 output of a bf16 x int4/bf16 product accumulated in f32.
BF16_TOLERANCE = 1e-2
# Rows of the output compared with the float64 reference (rows are independent; a spread-out subset
# keeps the host reference cheap at M = 4096 and large K, N).
CHECK_ROWS = 32
MAX_SETS = 32
# Repeat the ops inside one program when launching it takes more than this fraction of its run time.
DISPATCH_FRACTION = 0.3
MAX_REPS = 64

STATUS_OK = "ok"
STATUS_FAILED = "FAILED"  # ran, but the answer was wrong: never timed
STATUS_SKIPPED = "skipped"  # cannot run here (reason given), or the time budget ran out
STATUS_ERROR = "error"  # raised while preparing or running


@dataclasses.dataclass
class Config:
    shapes: Sequence[Shape]
    ms: Sequence[int]
    group_size: int | None = 128
    symmetric: bool = True
    sample_s: float = 0.005
    max_time_s: float = 1.0
    min_samples: int = 5
    rotate_bytes: int = 256 * 2**20
    max_sets: int = MAX_SETS
    budget_s: float | None = None
    # Seconds of budget_s kept for the MoE points that follow the dense ones (bench.moe): the dense points
    # stop starting after budget_s - moe_reserve_s.
    moe_reserve_s: float = 0.0
    # Limits for runs without a GPU: larger weights (K*N) or points (2MKN) are skipped with a reason.
    max_params: int | None = None
    max_flops: float | None = None
    seed: int = 0

    @property
    def dense_budget_s(self) -> float | None:
        """When the dense points stop starting: the budget less what the MoE points keep."""
        return None if self.budget_s is None else max(0.0, self.budget_s - self.moe_reserve_s)

    def as_dict(self) -> dict[str, Any]:
        return {
            "shapes": [dataclasses.asdict(s) for s in self.shapes],
            "ms": list(self.ms),
            "group_size": self.group_size,
            "group": group_label(self.group_size),
            "symmetric": self.symmetric,
            "sample_s": self.sample_s,
            "max_time_s": self.max_time_s,
            "min_samples": self.min_samples,
            "rotate_bytes": self.rotate_bytes,
            "max_sets": self.max_sets,
            "budget_s": self.budget_s,
            "moe_reserve_s": self.moe_reserve_s,
            "max_params": self.max_params,
            "max_flops": self.max_flops,
            "tolerance": BF16_TOLERANCE,
            "seed": self.seed,
        }


def n_sets_for(bytes_per_set: int, rotate_bytes: int, max_sets: int = MAX_SETS) -> int:
    """Input sets to rotate so that together they exceed ``rotate_bytes`` (at least 2, at most max)."""
    return int(min(max_sets, max(2, math.ceil(rotate_bytes / max(bytes_per_set, 1)))))


def check_rows(m: int, count: int = CHECK_ROWS) -> np.ndarray:
    """Indices of the output rows checked: all of them up to ``count``, else spread from first to last."""
    return np.unique(np.linspace(0, m - 1, min(m, count)).round().astype(np.int64))


def make_weights(w: jax.Array, group_size: int | None, symmetric: bool) -> dict[str, Any]:
    """The weight in every variant a peer multiplies with."""
    return {
        REF_GROUPED: nybble.quantize(w, group_size=group_size, symmetric=symmetric),
        REF_PER_COLUMN: nybble.quantize(w, group_size=None, symmetric=True),
        REF_BF16: w.astype(jnp.bfloat16),
    }


def reference_weight(weight: Any) -> np.ndarray:
    """The float64 (K, N) matrix a variant stands for: nybble's one reference dequantization
    (``nybble.kernels.ops.matmul.reference``, computed from the stored arrays with numpy alone) for an
    int4 weight, the values themselves for the bf16 one."""
    if isinstance(weight, QuantizedWeight):
        return reference_dequantize(weight)
    return np.asarray(weight, dtype=np.float64)


def _row(shape: Shape, m: int, cfg: Config, peer: Peer) -> dict[str, Any]:
    return {
        "shape": shape.name,
        "k": shape.k,
        "n": shape.n,
        "m": m,
        "group_size": cfg.group_size,
        "peer": peer.name,
        "status": STATUS_SKIPPED,
        "reason": None,
        "flops": matmul_flops(m, shape.k, shape.n),
    }


def _fmt_exc(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text[:300]


def run_case(
    case: Case,
    shape: Shape,
    peers: Sequence[Peer],
    cfg: Config,
    ceilings: Ceilings,
    ref_weights: Callable[[str], np.ndarray],
    x_all: Sequence[jax.Array],
) -> list[dict[str, Any]]:
    """Checks and times every peer on one case; returns one row per peer, speedups filled in."""
    rows_idx = check_rows(case.m)
    x0 = np.asarray(x_all[0][jnp.asarray(rows_idx)], dtype=np.float64)
    refs: dict[str, np.ndarray] = {}
    out: list[dict[str, Any]] = []
    for peer in peers:
        row = _row(shape, case.m, cfg, peer)
        out.append(row)
        reason = peer.unavailable(case)
        if reason is not None:
            row["reason"] = reason
            continue
        wbytes = peer.weight_bytes(case)
        act = activation_bytes(case.m, case.k, case.n)
        n_sets = n_sets_for(wbytes + act, cfg.rotate_bytes, cfg.max_sets)
        ran = run_once(peer, case, n_sets, rows_idx, row)
        if ran is None:
            continue
        prep, got, finite = ran
        if peer.reference not in refs:
            refs[peer.reference] = x0 @ ref_weights(peer.reference)
        nbytes = record_check(row, prep, relative_error(got, refs[peer.reference]), act, finite)
        if nbytes is None:
            continue
        time_checked(prep, rows_idx, refs[peer.reference], row, cfg, nbytes, ceilings)
        del prep
    fill_speedups(out, BF16_BASELINE)
    return out


def record_check(
    row: dict[str, Any], prep: Prepared, err: float, act: int, finite: bool, failure: str | None = None
) -> int | None:
    """Records a peer's check in ``row`` (its error, bytes and input sets) and its verdict: failed on the
    relative error, then on ``failure`` (a check of the caller's own), then on a NaN or Inf anywhere in the
    output. Returns the bytes one call moves, or None where it failed (``prep`` is then cleaned up)."""
    nbytes = prep.weight_bytes + act
    row.update(prep.extra)
    row.update(
        rel_err=err,
        weight_bytes=prep.weight_bytes,
        bytes=nbytes,
        n_sets=prep.n_sets,
        rotated_bytes=prep.n_sets * nbytes,
    )
    if not err <= BF16_TOLERANCE:
        failure = f"relative error {err:.3g} > {BF16_TOLERANCE:g} against the float64 reference"
    elif failure is None and not finite:
        failure = "NaN or Inf in the output (outside the rows compared)"
    if failure is None:
        return nbytes
    row.update(status=STATUS_FAILED, reason=failure)
    prep.cleanup()
    return None


def run_once(
    peer: Any, case: Any, n_sets: int, rows_idx: np.ndarray, row: dict[str, Any]
) -> tuple[Prepared, np.ndarray, bool] | None:
    """Prepares ``peer`` for ``case`` and runs it once: (prepared, set 0's checked rows as float64, whether
    every output is finite), or None with the error in ``row``."""
    try:
        prep = peer.prepare(case, n_sets)
        result = prep.call()
        prep.sync(result)
        got = prep.output_rows(result, rows_idx)
        finite = prep.all_finite(result) if prep.all_finite is not None else True
        del result
    except Exception as e:
        row.update(status=STATUS_ERROR, reason=_fmt_exc(e))
        return None
    return prep, got, finite


def time_checked(
    prep: Prepared,
    rows_idx: np.ndarray,
    ref: np.ndarray,
    row: dict[str, Any],
    cfg: Config,
    nbytes: int,
    ceilings: Ceilings,
) -> None:
    """Times a peer whose output passed the check into ``row`` (status, time, rates), one launch running
    the S sets ``reps`` times where the peer has such a mode; ``prep`` is cleaned up either way."""
    call, reps = prep.call, 1
    try:
        call, reps = _amortize_dispatch(prep, rows_idx, ref, row)
    except Exception as e:  # the looped program is an optimization: fall back to plain launches
        row["repeat_error"] = _fmt_exc(e)
    row["reps"] = reps
    try:
        t = measure(
            call,
            prep.sync,
            ops_per_call=prep.n_sets * reps,
            sample_s=cfg.sample_s,
            min_samples=cfg.min_samples,
            max_time_s=cfg.max_time_s,
        )
    except Exception as e:
        row.update(status=STATUS_ERROR, reason=_fmt_exc(e))
        return
    finally:
        prep.cleanup()
    r = rates(t.median_s, row["flops"], nbytes, ceilings)
    row.update(status=STATUS_OK, time=t.as_dict(), **dataclasses.asdict(r))


def fill_speedups(out: list[dict[str, Any]], baseline: str) -> None:
    """Each timed row's speedups over the other timed rows of its case, and over ``baseline``."""
    times = {r["peer"]: r["time"]["median_us"] for r in out if r["status"] == STATUS_OK}
    for r in out:
        if r["status"] == STATUS_OK:
            r["speedup"] = speedups(times, r["peer"])
            r["speedup_vs_bf16"] = r["speedup"].get(baseline)


def dispatch_cost(call: Callable[[], Any], sync: Callable[[Any], None], n: int = 5) -> tuple[float, float]:
    """(host seconds to launch one call, seconds for one call to complete), medians over ``n``."""
    launch, full = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        out = call()
        t1 = time.perf_counter()
        sync(out)
        t2 = time.perf_counter()
        launch.append(t1 - t0)
        full.append(t2 - t0)
    return float(np.median(launch)), float(np.median(full))


def _amortize_dispatch(
    prep: Any, rows_idx: np.ndarray, ref_rows: np.ndarray, row: dict[str, Any]
) -> tuple[Callable[[], Any], int]:
    """The call to time and how many times it repeats the S ops.

    When launching a program costs the host a large part of what the program takes to run, back-to-back
    launches would time the host, not the device: then the S ops are repeated inside one program
    (``prep.repeat``), and the repeated program is checked against the reference again.
    """
    launch_s, full_s = dispatch_cost(prep.call, prep.sync)
    row["launch_us"], row["call_us"] = launch_s * 1e6, full_s * 1e6
    if prep.repeat is None or launch_s < DISPATCH_FRACTION * full_s:
        return prep.call, 1
    reps = int(min(MAX_REPS, max(4, math.ceil(16 * launch_s / full_s))))
    call = prep.repeat(reps)
    result = call()
    prep.sync(result)
    err = relative_error(prep.output_rows(result, rows_idx), ref_rows)
    if not err <= BF16_TOLERANCE:
        raise AssertionError(f"the repeated program's answer is off (relative error {err:.3g})")
    return call, reps


def run_sweep(
    cfg: Config,
    peers: Sequence[Peer],
    ceilings: Ceilings,
    *,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    start: float | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every (shape, M) of the config; returns the rows and notes (such as rows cut by the budget)."""
    start = time.monotonic() if start is None else start
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    budget_cut = 0
    key = jax.random.key(cfg.seed)
    budget = cfg.dense_budget_s
    budget_reason = f"time budget ({budget} s) spent"
    too_big = 0
    for si, shape in enumerate(cfg.shapes):
        if budget is not None and time.monotonic() - start > budget:
            budget_cut += _skip_rest(rows, shape, cfg.ms, cfg, peers, on_row, budget_reason)
            continue
        if cfg.max_params is not None and shape.k * shape.n > cfg.max_params:
            reason = f"too large for a run without a GPU (K*N > {cfg.max_params:.3g}); use a GPU"
            too_big += _skip_rest(rows, shape, cfg.ms, cfg, peers, on_row, reason)
            continue
        kw, kx = jax.random.split(jax.random.fold_in(key, si))
        w = 0.02 * jax.random.normal(kw, (shape.k, shape.n), jnp.float32)
        weights = make_weights(w, cfg.group_size, cfg.symmetric)
        ref_cache: dict[str, np.ndarray] = {}

        def ref_weights(kind: str, weights: dict[str, Any] = weights, cache=ref_cache) -> np.ndarray:
            if kind not in cache:
                cache[kind] = reference_weight(weights[kind])
            return cache[kind]

        for mi, m in enumerate(cfg.ms):
            if budget is not None and time.monotonic() - start > budget:
                budget_cut += _skip_rest(rows, shape, cfg.ms[mi:], cfg, peers, on_row, budget_reason)
                continue
            if cfg.max_flops is not None and matmul_flops(m, shape.k, shape.n) > cfg.max_flops:
                reason = f"too large for a run without a GPU (2MKN > {cfg.max_flops:.3g}); use a GPU"
                too_big += _skip_rest(rows, shape, [m], cfg, peers, on_row, reason)
                continue
            int4_bytes = weights[REF_GROUPED].nbytes + activation_bytes(m, shape.k, shape.n)
            n_x = n_sets_for(int4_bytes, cfg.rotate_bytes, cfg.max_sets)
            xs = [
                jax.random.normal(jax.random.fold_in(kx, 1000 * m + i), (m, shape.k), jnp.bfloat16)
                for i in range(n_x)
            ]
            case = Case(shape.name, shape.k, shape.n, m, cfg.group_size, w, weights, xs)
            for row in run_case(case, shape, peers, cfg, ceilings, ref_weights, xs):
                rows.append(row)
                if on_row is not None:
                    on_row(row)
            del case, xs
        del w, weights, ref_cache
    small = [r for r in rows if r["status"] == STATUS_OK and r["rotated_bytes"] < cfg.rotate_bytes]
    if small:
        notes.append(
            f"{len(small)} timed row(s) rotate fewer input bytes than {cfg.rotate_bytes / 2**20:g} MiB "
            f"(capped at {cfg.max_sets} sets): caches may flatter them (see rotated_bytes in the JSON)"
        )
    differs = sorted({f"{r['peer']}: {k}" for r in rows for k, v in r.items() if "DIFFERS" in str(v)})
    if differs:
        notes.append(f"cross-check failed ({', '.join(differs)}): see the rows in the JSON")
    if too_big:
        notes.append(f"{too_big} row(s) too large for a run without a GPU were not run (status skipped)")
    if budget_cut:
        notes.append(f"time budget of {budget:g} s spent: {budget_cut} row(s) not run (status skipped)")
    return rows, notes


def _skip_rest(
    rows: list[dict[str, Any]],
    shape: Shape,
    ms: Sequence[int],
    cfg: Config,
    peers: Sequence[Peer],
    on_row: Callable[[dict[str, Any]], None] | None,
    reason: str,
) -> int:
    count = 0
    for m in ms:
        for peer in peers:
            row = _row(shape, m, cfg, peer)
            row["reason"] = reason
            rows.append(row)
            count += 1
            if on_row is not None:
                on_row(row)
    return count
