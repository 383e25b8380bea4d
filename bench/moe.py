"""The benchmark's grouped (mixture-of-experts) points: cases, peers, the correctness check and the sweep.

A point is one grouped matmul of a MoE layer: (model, projection gate|down, tokens T) -> rows = T x top-k
rows of x sorted by expert, E stacked (K, N) expert weights, and deterministic group sizes: ``balanced``
(the rows spread evenly over ``min(E, rows)`` experts spaced across the stack, the grouping the X-ray's
``planned_rows`` models) or ``skewed`` (the same experts, sizes in proportion to 1 / rank). Every peer
computes ``ragged_dot(x, W, group_sizes)`` and is checked against the float64 reference of the weight it
multiplies (bf16 stack or nybble's int4 stack), rows past ``sum(group_sizes)`` exactly zero.

Bytes for the roofline count only the experts that hold rows (an expert with no rows need not be read),
plus x read and y written; FLOPs are 2 x sum(group_sizes) x K x N.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import nybble
from bench.metrics import Ceilings, activation_bytes
from bench.peers import REF_BF16, REF_GROUPED, Prepared, _jax_prepared, tokamax_unavailable
from bench.runner import (
    STATUS_OK,
    STATUS_SKIPPED,
    Config,
    fill_speedups,
    n_sets_for,
    record_check,
    run_once,
    time_checked,
)
from bench.xray.moe_cases import MOE_SHAPES, TOKENS
from nybble.kernels import available_ragged_implementations, reference_dequantize, relative_error
from nybble.quant import QuantizedWeight

MOE_BF16_BASELINE = "xla:ragged_dot-bf16"
BALANCED, SKEWED = "balanced", "skewed"
# Shrunk MoE layers for a run without a GPU (each point well under a second on one CPU core): Qwen3-30B-A3B
# with hidden / 8, expert intermediate / 4, experts / 16, top-k / 4. K = 192 leaves a partial 128-group.
CPU_MOE_SHAPES: dict[str, tuple[int, int, int, int]] = {"qwen3-30b-a3b-mini": (256, 192, 8, 2)}
ALL_MOE_SHAPES = {**MOE_SHAPES, **CPU_MOE_SHAPES}
# The correctness check reads the first and last row of this many active experts (first, last, between),
# and the rows past the groups' sum: where a grouped product goes wrong, at a group's edges.
CHECK_EXPERTS = 4


@dataclasses.dataclass(frozen=True)
class MoePoint:
    """One grouped matmul of a MoE layer (``dropped``: rows left past the groups' sum, as dropped tokens)."""

    model: str
    proj: str  # "gate" (K = hidden, N = intermediate; up has the same shape) or "down"
    tokens: int
    distribution: str = BALANCED
    dropped: int = 0

    def __post_init__(self) -> None:
        if self.model not in ALL_MOE_SHAPES:
            raise ValueError(f"unknown MoE model {self.model!r}: use one of {sorted(ALL_MOE_SHAPES)}")
        if self.proj not in ("gate", "down") or self.distribution not in (BALANCED, SKEWED):
            raise ValueError(f"bad MoE point {self}")

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(K, N, experts, top-k)."""
        hidden, inter, experts, top_k = ALL_MOE_SHAPES[self.model]
        k, n = (hidden, inter) if self.proj == "gate" else (inter, hidden)
        return k, n, experts, top_k

    @property
    def shape(self) -> str:
        """The X-ray's shape name: ``<model>-<proj>``."""
        return f"{self.model}-{self.proj}"

    @property
    def rows(self) -> int:
        return self.tokens * self.dims[3] + self.dropped

    def group_sizes(self) -> np.ndarray:
        _, _, experts, top_k = self.dims
        return group_sizes_for(self.tokens * top_k, experts, self.distribution)


def active_expert_ids(assigned: int, experts: int) -> np.ndarray:
    """The ``min(experts, assigned)`` experts that hold rows, spaced evenly across the stack."""
    active = max(1, min(experts, assigned))
    return np.unique(np.linspace(0, experts - 1, active).round().astype(np.int64))


def group_sizes_for(assigned: int, experts: int, distribution: str) -> np.ndarray:
    """int32 (experts,) summing to ``assigned``: balanced (sizes differ by at most one) or skewed (in
    proportion to 1 / rank, at least one row each, by largest remainder); the same active experts."""
    ids = active_expert_ids(assigned, experts)
    a = len(ids)
    if distribution == BALANCED:
        sizes = np.full(a, assigned // a, np.int64)
        sizes[: assigned % a] += 1
    else:
        share = (1.0 / np.arange(1, a + 1)) * (assigned - a) / np.sum(1.0 / np.arange(1, a + 1))
        sizes = 1 + np.floor(share).astype(np.int64)
        order = np.argsort(-(share - np.floor(share)), kind="stable")
        sizes[order[: assigned - int(sizes.sum())]] += 1
    out = np.zeros(experts, np.int32)
    out[ids] = sizes
    return out


def points(
    models: Sequence[str],
    tokens: Sequence[int],
    projections: Sequence[str] = ("gate", "down"),
    skewed_from: int | None = None,
) -> tuple[MoePoint, ...]:
    """Every (model, projection, T), balanced; also skewed from ``skewed_from`` tokens on, where the
    skewed sizes differ from the balanced ones."""
    out = []
    for model, t, proj in itertools.product(models, tokens, projections):
        out.append(MoePoint(model, proj, t))
        skew = MoePoint(model, proj, t, SKEWED)
        if (
            skewed_from is not None
            and t >= skewed_from
            and not np.array_equal(skew.group_sizes(), out[-1].group_sizes())
        ):
            out.append(skew)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class MoePreset:
    name: str
    points: tuple[MoePoint, ...]
    description: str


MOE_PRESETS: dict[str, MoePreset] = {
    p.name: p
    for p in (
        MoePreset(
            "moe",
            points(tuple(MOE_SHAPES), TOKENS, skewed_from=64),
            f"every MoE shape of the X-ray ({', '.join(MOE_SHAPES)}), gate and down, T in {TOKENS}; "
            "balanced, and skewed from T = 64",
        ),
        MoePreset(
            "check",
            # Most important first (cut by the budget): the cases the committed X-ray has symmetric rows
            # for (modeled time beside the measured), then Mixtral's few large experts.
            (
                MoePoint("qwen3-30b-a3b", "down", 1),
                MoePoint("gpt-oss-120b", "gate", 1),
                MoePoint("gpt-oss-120b", "gate", 512),
                MoePoint("mixtral-8x7b", "gate", 8),
                MoePoint("qwen3-30b-a3b", "gate", 512, SKEWED),
            ),
            "bench/gpu_check.sh: decode and prefill MoE points at real shapes, behind the dense ones",
        ),
        MoePreset(
            "cpu",
            points(tuple(CPU_MOE_SHAPES), (1, 16, 64), skewed_from=16),
            "without a GPU: Qwen3-30B-A3B shrunk (K, N, experts, top-k / 8, 4, 16, 4), T 1, 16, 64",
        ),
        MoePreset(
            "tiny",
            (
                MoePoint("qwen3-30b-a3b-mini", "gate", 1),
                MoePoint("qwen3-30b-a3b-mini", "gate", 16),
                MoePoint("qwen3-30b-a3b-mini", "down", 16, SKEWED),
            ),
            "smoke tests: the shrunk Qwen3 layer at T 1 and 16 (one skewed)",
        ),
    )
}


# ---------------------------------------------------------------------------------------------- case


@dataclasses.dataclass
class GroupedCase:
    """One point on device: the (E, K, N) weight as bf16 and as nybble's int4 stack, S sets of x."""

    point: MoePoint
    group_size: int | None
    group_sizes: np.ndarray  # int32 (E,): what every peer is handed and the reference is built from
    w_bf16: jax.Array  # (E, K, N) bf16
    qw: QuantizedWeight  # stacked (E, ...) nybble.quantize(w_bf16)
    xs: list[jax.Array]  # rotated input sets, bf16 (rows, K)

    @property
    def k(self) -> int:
        return self.point.dims[0]

    @property
    def n(self) -> int:
        return self.point.dims[1]

    @property
    def experts(self) -> int:
        return self.point.dims[2]

    @property
    def m(self) -> int:
        return self.xs[0].shape[0]

    @property
    def active_experts(self) -> int:
        return int(np.count_nonzero(self.group_sizes))

    def int4_bytes(self) -> int:
        """Bytes of the active experts' int4 weights as nybble stores them (codes, scales, offsets)."""
        return self.qw.nbytes // self.experts * self.active_experts

    def bf16_bytes(self) -> int:
        return self.active_experts * self.k * self.n * 2

    def x_sets(self, count: int) -> list[jax.Array]:
        return self.xs[: max(1, min(count, len(self.xs)))]


def _ragged_prepared(
    op: Callable[[jax.Array, Any, jax.Array], jax.Array], case: GroupedCase, w: Any, n_sets: int, nbytes: int
) -> Prepared:
    """``_jax_prepared`` with the group sizes as an argument (rotated with the weight): traced, as a
    router's output is, so no peer specializes on the sizes."""
    sizes = jnp.asarray(case.group_sizes, jnp.int32)
    return _jax_prepared(lambda x, ws: op(x, ws[0], ws[1]), case.x_sets(n_sets), (w, sizes), nbytes)


@dataclasses.dataclass
class XlaRaggedBf16Peer:
    """The float baseline: ``jax.lax.ragged_dot`` on the bf16 expert stack."""

    name: str = MOE_BF16_BASELINE
    reference: str = REF_BF16
    description: str = "jax.lax.ragged_dot(x_bf16, w_bf16 (E, K, N), group_sizes, f32 accumulation) -> bf16"

    def unavailable(self, case: GroupedCase) -> str | None:
        return None

    def weight_bytes(self, case: GroupedCase) -> int:
        return case.bf16_bytes()

    def prepare(self, case: GroupedCase, n_sets: int) -> Prepared:
        def op(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
            return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32).astype(x.dtype)

        return _ragged_prepared(op, case, case.w_bf16, n_sets, self.weight_bytes(case))


@dataclasses.dataclass
class XlaDequantRaggedPeer:
    """The naive int4 path: the whole int4 stack dequantized to bf16 in the program, then ``ragged_dot``."""

    name: str = "xla:ragged_dot-deq-int4"
    reference: str = REF_GROUPED
    description: str = "jax.lax.ragged_dot(x, nybble.dequantize(qw stack, bf16), group_sizes)"

    def unavailable(self, case: GroupedCase) -> str | None:
        return None

    def weight_bytes(self, case: GroupedCase) -> int:
        return case.int4_bytes()

    def prepare(self, case: GroupedCase, n_sets: int) -> Prepared:
        def op(x: jax.Array, qw: QuantizedWeight, sizes: jax.Array) -> jax.Array:
            w = nybble.dequantize(qw, x.dtype)
            return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32).astype(x.dtype)

        return _ragged_prepared(op, case, case.qw, n_sets, self.weight_bytes(case))


@dataclasses.dataclass
class NybbleRaggedPeer:
    """``nybble.ragged_matmul(x, qw, group_sizes, implementation=...)``."""

    implementation: str
    reference: str = REF_GROUPED

    @property
    def name(self) -> str:
        return f"nybble:{self.implementation}"

    @property
    def description(self) -> str:
        return f"nybble.ragged_matmul(x, qw, group_sizes, implementation={self.implementation!r})"

    def unavailable(self, case: GroupedCase) -> str | None:
        avail = available_ragged_implementations(case.xs[0], case.qw, jnp.asarray(case.group_sizes))
        if self.implementation not in avail:
            return f"nybble has no grouped implementation {self.implementation!r}"
        return avail[self.implementation]

    def weight_bytes(self, case: GroupedCase) -> int:
        return case.int4_bytes()

    def prepare(self, case: GroupedCase, n_sets: int) -> Prepared:
        impl = self.implementation

        def op(x: jax.Array, qw: QuantizedWeight, sizes: jax.Array) -> jax.Array:
            return nybble.ragged_matmul(x, qw, sizes, implementation=impl)

        return _ragged_prepared(op, case, case.qw, n_sets, self.weight_bytes(case))


def tokamax_operands(qw: QuantizedWeight) -> tuple[jax.Array, jax.Array]:
    """(int4 codes (E, K, N), scales (E, ceil(K / G), N)): nybble's symmetric stack as tokamax's QArray
    holds it (no padding, no zero point); codes x scales is nybble's dequantized weight."""
    k, n = qw.shape
    codes = jax.vmap(lambda one: one.logical_codes())(qw)[:, :k, :n]  # int8 in [-8, 7]
    return codes.astype(jnp.int4), qw.scales[:, : -(-k // qw.group), :n]


@dataclasses.dataclass
class TokamaxRaggedPeer:
    """tokamax's ``ragged_dot`` with its int4 quantization: a qwix QArray of nybble's codes and scales."""

    name: str = "tokamax:int4"
    reference: str = REF_GROUPED
    description: str = "tokamax.ragged_dot(x, qwix QArray int4 (E, K, N), group_sizes)"

    def unavailable(self, case: GroupedCase) -> str | None:
        if not case.qw.symmetric:
            return "tokamax's int4 path has no zero point (symmetric weights only)"
        if case.group_size is None:
            return "tokamax int4 peer is wired for grouped scales only"
        return tokamax_unavailable()

    def weight_bytes(self, case: GroupedCase) -> int:
        return case.int4_bytes()

    def prepare(self, case: GroupedCase, n_sets: int) -> Prepared:  # pragma: no cover - needs tokamax + GPU
        import qwix
        import tokamax

        q, scale = tokamax_operands(case.qw)
        rhs = qwix.QArray(qvalue=q, scale=scale, zero_point=None, qtype=jnp.int4)

        def op(x: jax.Array, w: Any, sizes: jax.Array) -> jax.Array:
            return tokamax.ragged_dot(x, w, group_sizes=sizes).astype(x.dtype)

        return _ragged_prepared(op, case, rhs, n_sets, self.weight_bytes(case))


def moe_peers(include: Sequence[str] | None = None) -> list[Any]:
    """nybble's grouped implementations, then the peers; ``include`` keeps the names (or prefixes) given."""
    peers: list[Any] = [NybbleRaggedPeer("mosaic_gpu"), NybbleRaggedPeer("xla")]
    peers += [XlaRaggedBf16Peer(), XlaDequantRaggedPeer(), TokamaxRaggedPeer()]
    if include:
        peers = [p for p in peers if any(p.name == s or p.name.startswith(s) for s in include)]
    return peers


# ---------------------------------------------------------------------------------------------- check


def moe_check_rows(group_sizes: np.ndarray, rows: int, experts_checked: int = CHECK_EXPERTS) -> np.ndarray:
    """Rows compared with the reference: the first and last row of up to ``experts_checked`` active
    experts (spread from the first to the last), and the first and last row past the groups' sum."""
    ends = np.cumsum(group_sizes)
    starts = ends - group_sizes
    active = np.flatnonzero(group_sizes)
    spread = np.linspace(0, len(active) - 1, min(len(active), experts_checked)).round().astype(np.int64)
    picked = active[np.unique(spread)]
    out = [starts[picked], ends[picked] - 1]
    assigned = int(ends[-1])
    if assigned < rows:
        out.append(np.array([assigned, rows - 1]))
    return np.unique(np.concatenate(out).astype(np.int64))


def expert_of_rows(group_sizes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The expert whose group holds each row; -1 for rows past the groups' sum."""
    ends = np.cumsum(group_sizes)
    e = np.searchsorted(ends, rows, side="right")
    return np.where(rows < ends[-1], e, -1)


def reference_rows(
    x_rows: np.ndarray, experts: np.ndarray, expert_weight: Callable[[int], np.ndarray], n: int
) -> np.ndarray:
    """float64 ``x[r] @ W[expert(r)]`` for each checked row, zero for rows past the groups' sum."""
    out = np.zeros((len(x_rows), n))
    for e in np.unique(experts[experts >= 0]):
        mine = experts == e
        out[mine] = x_rows[mine] @ expert_weight(int(e))
    return out


def reference_expert(case: GroupedCase, kind: str, e: int) -> np.ndarray:
    """The float64 (K, N) weight of expert ``e`` as peers of ``kind`` multiply it."""
    if kind == REF_BF16:
        return np.asarray(case.w_bf16[e], dtype=np.float64)
    return reference_dequantize(jax.tree.map(lambda a: a[e], case.qw))


# ---------------------------------------------------------------------------------------------- sweep


def _row(case_point: MoePoint, cfg: Config, peer: Any) -> dict[str, Any]:
    k, n, experts, top_k = case_point.dims
    sizes = case_point.group_sizes()
    return {
        "kind": "moe",
        "shape": case_point.shape,
        "model": case_point.model,
        "proj": case_point.proj,
        "tokens": case_point.tokens,
        "top_k": top_k,
        "k": k,
        "n": n,
        "m": case_point.rows,
        "experts": experts,
        "active_experts": int(np.count_nonzero(sizes)),
        "distribution": case_point.distribution,
        "dropped_rows": case_point.dropped,
        "group_sizes": [int(s) for s in sizes],
        "group_size": cfg.group_size,
        "peer": peer.name,
        "status": STATUS_SKIPPED,
        "reason": None,
        "flops": 2 * int(sizes.sum()) * k * n,
    }


def run_grouped_case(case: GroupedCase, peers: Sequence[Any], cfg: Config, ceilings: Ceilings) -> list[dict]:
    """Checks and times every peer on one grouped case; one row per peer, speedups filled in."""
    rows_idx = moe_check_rows(case.group_sizes, case.m)
    x0 = np.asarray(case.xs[0][jnp.asarray(rows_idx)], dtype=np.float64)
    owners = expert_of_rows(case.group_sizes, rows_idx)
    tail = owners < 0
    refs: dict[str, np.ndarray] = {}
    out: list[dict[str, Any]] = []
    act = activation_bytes(case.m, case.k, case.n)
    for peer in peers:
        row = _row(case.point, cfg, peer)
        out.append(row)
        reason = peer.unavailable(case)
        if reason is not None:
            row["reason"] = reason
            continue
        n_sets = n_sets_for(peer.weight_bytes(case) + act, cfg.rotate_bytes, cfg.max_sets)
        ran = run_once(peer, case, n_sets, rows_idx, row)
        if ran is None:
            continue
        prep, got, finite = ran
        if peer.reference not in refs:
            kind = peer.reference
            weight = functools.partial(reference_expert, case, kind)
            refs[kind] = reference_rows(x0, owners, weight, case.n)
        err = relative_error(got, refs[peer.reference])
        tail_written = "rows past sum(group_sizes) are not zero" if np.any(got[tail] != 0) else None
        nbytes = record_check(row, prep, err, act, finite, tail_written)
        if nbytes is None:
            continue
        time_checked(prep, rows_idx, refs[peer.reference], row, cfg, nbytes, ceilings)
        del prep
    fill_speedups(out, MOE_BF16_BASELINE)
    return out


def make_case(point: MoePoint, cfg: Config, index: int, n_sets: int | None = None) -> GroupedCase:
    """The point's weights (bf16 N(0, 0.02^2), quantized as the config says) and x sets, on device."""
    k, n, experts, _ = point.dims
    key = jax.random.fold_in(jax.random.key(cfg.seed), 10_000 + index)
    kw, kx = jax.random.split(key)
    w = (0.02 * jax.random.normal(kw, (experts, k, n), jnp.bfloat16)).astype(jnp.bfloat16)
    qw = nybble.quantize(w, group_size=cfg.group_size, symmetric=cfg.symmetric)
    sizes = point.group_sizes()
    if n_sets is None:
        active_bytes = qw.nbytes // experts * int(np.count_nonzero(sizes))
        n_sets = n_sets_for(active_bytes + activation_bytes(point.rows, k, n), cfg.rotate_bytes, cfg.max_sets)
    xs = [jax.random.normal(jax.random.fold_in(kx, i), (point.rows, k), jnp.bfloat16) for i in range(n_sets)]
    return GroupedCase(point, cfg.group_size, sizes, w, qw, xs)


def run_moe_sweep(
    cfg: Config,
    points_: Sequence[MoePoint],
    peers: Sequence[Any],
    ceilings: Ceilings,
    *,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    start: float | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every MoE point; stops starting points once ``cfg.budget_s`` (the whole run's) is spent."""
    start = time.monotonic() if start is None else start
    rows: list[dict[str, Any]] = []
    cut = too_big = 0

    def skip(point: MoePoint, reason: str) -> int:
        for peer in peers:
            row = _row(point, cfg, peer)
            row["reason"] = reason
            rows.append(row)
            if on_row is not None:
                on_row(row)
        return len(peers)

    for i, point in enumerate(points_):
        k, n, experts, _ = point.dims
        if cfg.budget_s is not None and time.monotonic() - start > cfg.budget_s:
            cut += skip(point, f"time budget ({cfg.budget_s} s) spent")
            continue
        if cfg.max_params is not None and experts * k * n > cfg.max_params:
            too_big += skip(point, f"too large for a run without a GPU (E*K*N > {cfg.max_params:.3g})")
            continue
        if cfg.max_flops is not None and 2 * point.rows * k * n > cfg.max_flops:
            too_big += skip(point, f"too large for a run without a GPU (2*rows*K*N > {cfg.max_flops:.3g})")
            continue
        case = make_case(point, cfg, i)
        for row in run_grouped_case(case, peers, cfg, ceilings):
            rows.append(row)
            if on_row is not None:
                on_row(row)
        del case
    notes = []
    if any(r["status"] == STATUS_OK for r in rows):
        notes.append(
            "MoE rows: weight bytes (and so the roofline) count only the experts that hold rows "
            "(an expert with no rows is not read), plus x read and y written"
        )
    if too_big:
        notes.append(f"{too_big} MoE row(s) too large for a run without a GPU were not run (status skipped)")
    if cut:
        notes.append(f"time budget of {cfg.budget_s:g} s spent: {cut} MoE row(s) not run (status skipped)")
    return rows, notes
