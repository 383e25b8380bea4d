"""The heuristics choosing a Mosaic GPU W4A16 config for a problem (:func:`heuristic_config`): every
candidate that fits SMEM, ranked by the cost model (cost_model.py).

Families:
  * decode (M <= 64): one compute warpgroup per CTA, K slices for M <= 8. Where the pipeline refills its
    slots (more K steps than slots), a producer warpgroup issues the TMA (``producer``): the compute loop
    loses the copies' ~60 instructions a step and TMA runs the whole pipeline ahead; the CTA then holds the
    SM's register file, one per SM. Where every step has a slot, all copies go out up front and no
    producer is needed; small CTAs may then run two per SM. On the accumulator route with groups of >= 128
    a step may be 512 deep (``WIDE_STEP_K``), which halves the step's fixed cost per weight;
  * prefill (M > 64): warp-specialized, a TMA warpgroup feeding two compute warpgroups that share each x
    tile, 128- or 256-wide WGMMA N. Where the model's times tie (the tensor cores bound every candidate),
    the one issuing least wins: from M ~ 1024 (and at M = 256 of the widest N) that is
    a 256-wide M tile with one A tile per warpgroup, which dequantizes each weight once per 256 rows of x
    (about half the instructions per FLOP of two A tiles at 128-wide M).
Decode's last K step may run past K_pad (:meth:`TuningConfig.runs_past_k`) where K_pad is an odd number
of 64-wide chunks, so that no step deeper than 64 divides it (gpt-oss-120b: K = 2880 = 45 x 64): TMA
zero-fills the step's rows past K_pad (no HBM read), and the candidates are ranked on instructions per
weight of W, those rows included.
Prefill launches with more output tiles than SMs run on a persistent grid of one CTA per SM
(``persistent_ctas``). Either family may split K over ``split_k`` CTAs (2, 4 or 8 where the tile has
that many 8-row slabs of y, ``config.split_k_shares``; prefill's 128-row tiles down to 16-row slabs, e.g.
Llama-3-8B kv at M = 128: 8 output tiles, 64 CTAs; decode's 16-row tiles over 4 CTAs, 8 rows of one A
tile each) when the output tiles alone leave SMs idle: those CTAs form one thread-block cluster and sum
their f32 partials through distributed SMEM (split_k.py), so a split-K matmul is one launch like any
other. Decode takes a config up to 3% slower in the model where it issues >= 0.10 fewer instructions per
weight (the model cannot resolve a few percent). The model's tensor-core time counts the accumulator route's
constant-tile WGMMAs, (tiles + 1) / tiles the weights' own: one A tile at WGMMA N = 32 is tensor-bound.
The fitted coefficients are ``cost_model.CostModel``'s; the dated X-ray figures behind each rule are in
docs/logs/performance-log.md.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable
from typing import NamedTuple

from nybble.device import DEFAULT_NUM_SMS
from nybble.kernels.mosaic_gpu.config import (
    CHUNK_K,
    MAX_SPLIT_K,
    MAX_WS_SLAB_ROWS,
    SLICES_CHOICES,
    SMEM_PER_SM_BYTES,
    SMEM_SLACK_BYTES,
    TILE_K_CHOICES,
    TILES_CHOICES,
    WIDE_STEP_K,
    TuningConfig,
    smem_bytes,
    smem_fits,
    splits_k,
)
from nybble.kernels.mosaic_gpu.cost_model import (
    COST_MODEL,
    CostModel,
    combined_time_us,
    estimated_instructions_per_weight,
    modeled_times_us,
)
from nybble.packing.groups import group_rows


class Rank(NamedTuple):
    """How :func:`heuristic_config` orders candidates of equal modeled time: field by field, larger wins."""

    issue: float  # prefill: minus the issue time in steps of CostModel.tie_relative; decode 0
    tensor: float  # prefill: minus the tensor-core time in those steps; decode 0
    hidden: bool  # decode: latency hidden (a producer, every copy up front, or two CTAs per SM)
    ipw_tenths: float  # minus the estimated instructions per weight, to 0.1
    tiles: int
    tile_k: int
    steps: int  # pipeline depth
    neg_ipw: float  # minus the estimate, unrounded


def _pow2_at_least(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


@functools.lru_cache(maxsize=8192)  # frozen results; the suite and dispatch ask again and again
def heuristic_config(
    m: int,
    n_pad: int,
    k_pad: int,
    group_size: int | None,
    num_sms: int = DEFAULT_NUM_SMS,
    *,
    has_offsets: bool = True,
    scale_bytes: int = 2,
    experts: int = 1,
    allow: Callable[[TuningConfig], bool] | None = None,
    extra_smem: Callable[[TuningConfig], int] | None = None,
) -> TuningConfig:
    """Chooses a config for an (M, K_pad) x (K_pad, N_pad) problem on a GPU with ``num_sms`` SMs.

    ``group_size`` None means one group over all of K_pad; K_pad and N_pad are multiples of 64.

    Decode (M <= 64): one compute warpgroup per CTA (with a producer warpgroup issuing the TMA, or
    without). Small M runs S K slices side by side in WGMMA's N (M = 1 puts 8 slices of K where padding
    would be), so a CTA covers 64 * tiles / S rows of N over all of K and needs no split-K: one launch.
    Every candidate (A tiles, tile_k, slices, split-K, scale route, producer where the pipeline refills
    its slots) that fits SMEM, at every pipeline depth, is ranked by the modeled time (cost_model.py);
    ties go to hidden latency (a producer running TMA ahead, every copy issued up front, or two CTAs per
    SM: a second warp per scheduler hides the other's stalls), fewer instructions per weight, more A tiles
    per step, then deeper pipelines; then a config within ``DECODE_TIE`` of that time that issues
    ``DECODE_IPW_GAIN`` fewer instructions per weight replaces it
    (:func:`_fewer_instructions_nearly_as_fast`). Prefill (M > 64): two compute warpgroups sharing 128-
    or 256-row x tiles, weights dequantized exactly; ties go to the least issue time, then the least
    tensor-core time.

    ``experts`` > 1: one launch runs that many such problems, each against its own weight (the grouped
    kernel, grouped.py): a config must fit one, the cost model counts the CTAs and weights of all. ``allow``:
    a predicate on the candidates (what that kernel runs); ``extra_smem``: SMEM bytes an epilogue adds to a
    config's (``config.residual_smem_bytes``).
    """
    if m < 1 or n_pad < 1 or k_pad < 1:
        raise ValueError(f"heuristic_config: bad problem M={m}, N_pad={n_pad}, K_pad={k_pad}")
    group = group_rows(k_pad, group_size)
    decode = m <= 64
    candidates: list[tuple[float, dict[str, float], Rank, TuningConfig]] = []
    for shape in _candidate_shapes(m, n_pad, k_pad, group, decode):
        probe = TuningConfig(**shape)
        if allow is not None and not allow(probe):
            continue
        try:
            probe.check_problem(m, n_pad, k_pad, group)
        except ValueError:
            continue
        k_steps = probe.k_steps(k_pad)
        for steps in range(min(8 if decode else 4, max(2, k_steps)), 1, -1):
            if probe.producer and k_steps <= steps:
                continue  # every step has a slot: all copies go out up front, a producer saves nothing
            config = probe.with_steps(steps)
            used = smem_bytes(config, group=group, has_offsets=has_offsets, scale_bytes=scale_bytes)
            used += 0 if extra_smem is None else extra_smem(config)
            if not smem_fits(used):
                continue
            # A producer's CTA takes the whole register file (two warpgroups, up to 256 registers each).
            resident = 1 if config.producer else max(1, SMEM_PER_SM_BYTES // (used + SMEM_SLACK_BYTES))
            ctas = config.ctas(m, experts * n_pad)
            times = modeled_times_us(config, m, experts * n_pad, k_pad, group, has_offsets, num_sms)
            t = combined_time_us(times)
            # Per weight of W: a partial last K step's zero-filled rows cost instructions too.
            ipw = estimated_instructions_per_weight(config, group, has_offsets, refills=k_steps > steps)
            ipw *= k_steps * config.k_span() * config.split_k / k_pad
            # Latency hidden: a producer running TMA ahead, every step's copy issued up front, or a second
            # CTA's warp on each scheduler.
            up_front = k_steps <= steps
            hidden = decode and (config.producer or up_front or min(resident, -(-ctas // num_sms)) >= 2)
            rank = Rank(0.0, 0.0, hidden, -round(ipw, 1), config.tiles, config.tile_k, steps, -ipw)
            candidates.append((t, times, rank, config))
    if not candidates:
        raise ValueError(
            f"heuristic_config: no config fits M={m}, N_pad={n_pad}, K_pad={k_pad}, group={group}"
        )
    fastest = min(t for t, _, _, _ in candidates)
    # Times count as equal in steps of CostModel.tie_relative of the fastest. Prefill ties go to less issue
    # time (the dequantization hides better behind WGMMA: a 256-wide M tile halves it per FLOP), then to
    # less tensor-core time (no WGMMA columns wasted on padding).
    quantum = fastest * COST_MODEL.tie_relative
    scored: list[tuple[float, Rank, TuningConfig]] = []
    for t, times, rank, config in candidates:
        if not decode:
            issue, tensor = _steps_of(times["issue"], quantum), _steps_of(times["tensor"], quantum)
            rank = rank._replace(issue=-issue, tensor=-tensor)
        scored.append((t, rank, config))
    best: tuple[Rank, TuningConfig] | None = None
    for t, rank, config in scored:  # the fastest (within the tie), then the best rank
        if t <= fastest + quantum and (best is None or rank > best[0]):  # the first of equal ranks
            best = (rank, config)
    assert best is not None
    if decode:
        best = _fewer_instructions_nearly_as_fast(scored, best, fastest)
    return _persistent_where_it_pays(best[1], m, n_pad, num_sms)


def _steps_of(value: float, quantum: float) -> float:
    """``value`` in whole steps of ``quantum`` (values in one step tie)."""
    return float(round(value / quantum)) if quantum > 0 else value


def _fewer_instructions_nearly_as_fast(
    scored: list[tuple[float, Rank, TuningConfig]],
    best: tuple[Rank, TuningConfig],
    fastest: float,
    model: CostModel = COST_MODEL,
) -> tuple[Rank, TuningConfig]:
    """A decode config within ``model.decode_tie`` of the fastest modeled time, hiding latency as well, that
    issues at least ``model.decode_ipw_gain`` fewer instructions per weight (estimated) than ``best``, if
    there is one.

    The model does not resolve a few percent: a split-K cluster's reduction, a percent of the streaming
    time, can be all that separates a config issuing fewer instructions per weight from one issuing more,
    so the tie allows 3% (docs/logs/performance-log.md). Accumulator-route tiles stay within tiles *
    WGMMA N <= 64 (64 accumulator columns split 8 ways spill, and the candidates leave them out:
    :func:`_candidate_shapes`)."""
    # The gain is measured on the unrounded estimates (Rank.neg_ipw).
    best_rank = best[0]
    found = best
    for t, rank, config in scored:
        fits = config.scales_on == "accumulators"  # (within tiles * WGMMA N <= 64: _candidate_shapes)
        if (
            fits
            and t <= fastest * (1 + model.decode_tie)
            and rank.hidden >= best_rank.hidden
            and rank.neg_ipw >= best_rank.neg_ipw + model.decode_ipw_gain
            and rank > found[0]
        ):
            found = (rank, config)
    return found


def _persistent_where_it_pays(config: TuningConfig, m: int, n_pad: int, num_sms: int) -> TuningConfig:
    """The warp-specialized ``config`` on a persistent grid of ``num_sms`` CTAs when its output tiles
    outnumber the SMs: every CTA but the last wave's then runs several tiles, and each tile's epilogue
    overlaps the next one's loads (not in the cost model, which counts the same waves either way)."""
    if config.compute_wgs == 1 or config.split_k > 1:
        return config
    tiles = config.m_tiles(m) * (n_pad // config.cta_rows)
    return dataclasses.replace(config, persistent_ctas=num_sms) if tiles > num_sms else config


def _candidate_shapes(
    m: int, n_pad: int, k_pad: int, group: int, decode: bool
) -> Iterable[dict[str, object]]:
    if not decode:
        wgs = 2 if n_pad % 128 == 0 else 1
        for tiles, tile_k, split_k in itertools.product((2, 1), (128, 64), (1, 2, 4, 8)):
            if split_k > 1 and wgs > 1 and 128 // split_k > MAX_WS_SLAB_ROWS:
                continue
            if k_pad % (tile_k * split_k):
                continue  # partial last K steps are decode's (TuningConfig.runs_past_k)
            yield dict(
                tiles=tiles, tile_m=128, tile_k=tile_k, compute_wgs=wgs, split_k=split_k, scales_on="weights"
            )
        if wgs > 1:
            # 256-wide M tiles: each compute warpgroup one A tile against 256 rows of x (a 64 x 256 f32
            # accumulator, 128 registers), so every weight is dequantized once per 256 rows of x, not 128.
            # tile_k=64 only: a 128-deep step is 72 KB, two slots, and with slots released a step late
            # (pipeline.py) two slots leave no copy in flight.
            yield dict(tiles=1, tile_m=256, tile_k=64, compute_wgs=wgs, split_k=1, scales_on="weights")
        return
    tile_m = _pow2_at_least(m)
    # (slices, tile_m): K slices filling a WGMMA N of 8..32, or none (N = max(8, M)).
    layouts = [(s, tile_m) for s in SLICES_CHOICES if s > 1 and 8 <= s * tile_m <= 64]
    layouts.append((1, max(8, tile_m)))
    for (slices, t_m), tiles, tile_k, split_k in itertools.product(
        layouts, TILES_CHOICES, TILE_K_CHOICES, range(1, 9)
    ):
        if split_k > 1 and (slices > 1 or not splits_k(t_m, split_k, tiles)):
            continue
        wgmma_n = slices * t_m
        scales_on = "accumulators" if group % CHUNK_K == 0 and wgmma_n <= 32 else "weights"
        if scales_on == "accumulators" and (
            tiles * wgmma_n > 64 or (split_k == MAX_SPLIT_K and tiles * wgmma_n == 64)
        ):
            # The route keeps two f32 accumulators of tiles * WGMMA N columns (a group's and the total):
            # 128 columns spill, and 64 split 8 ways spill in the split-K epilogue (and issue more than
            # split 4 ways).
            continue
        if k_pad % (tile_k * slices * split_k) and (slices > 1 or split_k > 1 or k_pad % (2 * CHUNK_K) == 0):
            # Partial last K steps (TuningConfig.runs_past_k) only where K_pad is an odd number of 64-wide
            # chunks, so that no step deeper than 64 divides it (gpt-oss: K = 2880 = 45 x 64, whose 64-deep
            # steps issue far more per weight); elsewhere a dividing step exists.
            continue
        if tile_k == WIDE_STEP_K and (
            scales_on != "accumulators" or group < 2 * CHUNK_K or tiles > 2 or slices > 4
        ):
            # At most 4 groups a step. Four A tiles spill, and with 8 K slices a step of 512 issues more
            # than two of 256.
            continue
        shape = dict(
            tiles=tiles, tile_m=t_m, tile_k=tile_k, slices=slices, split_k=split_k, scales_on=scales_on
        )
        yield shape
        yield dict(shape, producer=True)
