"""The cost model the heuristics rank Mosaic GPU W4A16 configs by (heuristics.py): an estimate of the main
loop's instructions per weight, and modeled HBM, issue and tensor-core times on a GPU of given SMs.

The fitted coefficients are :class:`CostModel`'s; the dated X-ray figures each was fitted on are in
docs/performance-log.md.
"""

from __future__ import annotations

import dataclasses
import math

from nybble.kernels.gpu import H200, GpuSpec
from nybble.kernels.mosaic_gpu.config import (
    TuningConfig,
    folds_bias,
    refills,
    stores_any_rows,
    wgmma_k,
    x_rows,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """The heuristics' fitted coefficients, in one place, each with what it was fitted on (the X-ray of this
    kernel, ``python -m bench.xray``; docs/performance-log.md has the dated figures). Change one here and
    rerun ``tools/heuristic_picks.py`` before and after to see which picks move.

    Instruction estimate (:func:`estimated_instructions_per_weight`), per weight per thread unless said:
    """

    # 3 SHF + 4 LOP3 per 8 weights (the magic-number dequantization) and one HGMMA per 8.
    dequant: float = 0.875
    hgmma: float = 0.125
    # A pipeline step of the one-warpgroup kernel that refills slots itself: ~100 instructions of barriers,
    # descriptors and TMA, ~2 per HGMMA.
    step: int = 100
    step_per_hgmma: int = 2
    # With a producer warpgroup, or nothing to refill: ~40 a step, ~8 a WGMMA call (its descriptor), ~17 a
    # call with offsets on the accumulator route, ~1.1 an HGMMA (fitted to the X-ray of the accumulator-route
    # decode picks, M <= 64, two WGMMA calls a step).
    lean_step: int = 40
    lean_per_call: int = 8
    lean_per_call_offsets: int = 17
    lean_per_hgmma: float = 1.1
    # The warp-specialized kernel (constant slots, pipeline.py): ~15 a step, ~2.5 an HGMMA.
    ws_step: int = 15
    ws_per_hgmma: float = 2.5
    # Exact weights: a bf16x2 subtract and multiply per pair; an offset rides in an HFMA2 (+0.03).
    exact: float = 1.0
    exact_offsets: float = 0.03
    # Accumulator route, per group and accumulator column: ~2 FFMA and 8 more (~1 and 8 where the bias is
    # folded, 14 with a producer: fitted to the X-ray of the 512-deep picks).
    acc_per_column: int = 2
    acc_fixed: int = 8
    folded_fixed: int = 8
    folded_fixed_producer: int = 14
    # Decode near-ties (``heuristics._fewer_instructions_nearly_as_fast``): a config this much slower in the
    # model is still taken where it issues at least ``decode_ipw_gain`` fewer instructions per weight (the
    # model cannot resolve the few percent a split-K reduction costs).
    decode_tie: float = 0.03
    decode_ipw_gain: float = 0.10
    # Modeled times within this fraction of the fastest candidate's count as equal (heuristic_config: the
    # fastest, then prefill's issue and tensor-core times in steps of it). 0.1%: the picks of the former
    # absolute 0.01 us at every named shape (tests/fixtures/golden_picks); wider moves some.
    tie_relative: float = 0.001


COST_MODEL = CostModel()
# The names these coefficients had before CostModel (kept importable).
DECODE_TIE = COST_MODEL.decode_tie
DECODE_IPW_GAIN = COST_MODEL.decode_ipw_gain


def estimated_instructions_per_weight(
    config: TuningConfig,
    group: int,
    has_offsets: bool,
    *,
    refills: bool = True,
    model: CostModel = COST_MODEL,
) -> float:
    """A rough count of the main loop's SASS instructions per weight per thread, for ranking configs.

    Calibrated on the X-ray of this kernel (bench/xray): 3 SHF + 4 LOP3 per 8 weights, one HGMMA per 8;
    exact weights add a bf16x2 subtract and multiply per pair (with offsets a fused multiply-add); the
    accumulator
    route adds the constant tile's WGMMA of each 64-wide chunk and ~2 FFMA per accumulator element and group
    (~1 where :func:`folds_bias`);
    each step costs ~100 instructions of barriers, descriptors and TMA, and ~2 per HGMMA; with a producer
    warpgroup issuing the TMA, or when nothing ``refills`` a slot (every step has its own and all copies go
    out before the first), ~56 and ~1.1 per HGMMA, ~18 more with offsets on the accumulator route, for WGMMA
    calls two chunks wide (:func:`wgmma_k`; ~8 more per call of one chunk); in the warp-specialized
    kernel, whose pipeline has constant slots (pipeline.py), ~15 and ~2.5 per HGMMA. The coefficients are
    ``model``'s (:class:`CostModel`); the fit's error against the X-ray is in docs/performance-log.md.
    """
    c, cm = config, model
    per_thread_step = c.tiles * c.tile_k / 2  # weights a thread dequantizes per step
    hgmmas = c.tiles * c.tile_k // 16 + (c.tile_k // 16 if c.scales_on == "accumulators" else 0)
    if c.compute_wgs > 1:
        per_step = cm.ws_step + cm.ws_per_hgmma * hgmmas
    elif c.producer or not refills:
        calls = c.tile_k // wgmma_k(c, group)
        per_call = (
            cm.lean_per_call_offsets if has_offsets and c.scales_on == "accumulators" else cm.lean_per_call
        )
        per_step = cm.lean_step + per_call * calls + cm.lean_per_hgmma * hgmmas
    else:
        per_step = cm.step + cm.step_per_hgmma * hgmmas
    ipw = cm.dequant + cm.hgmma + per_step / per_thread_step
    if c.scales_on == "weights":  # a subtract and a multiply per pair; an offset rides in an HFMA2
        ipw += cm.exact + (cm.exact_offsets if has_offsets else 0.0)
    elif folds_bias(c, has_offsets):  # one FFMA per accumulator element and group
        ipw += (c.wgmma_n + (cm.folded_fixed_producer if c.producer else cm.folded_fixed)) / min(
            group, c.tile_k
        )
    else:
        ipw += (cm.acc_per_column * c.wgmma_n + cm.acc_fixed) / min(group, c.tile_k)
    return ipw


def modeled_times_us(
    config: TuningConfig,
    m: int,
    n_pad: int,
    k_pad: int,
    group: int,
    has_offsets: bool,
    num_sms: int,
    gpu: GpuSpec = H200,
) -> dict[str, float]:
    """The heuristics' cost model (``gpu``'s figures, the H200's by default; ``num_sms`` is the SM count
    asked for), its parts in microseconds: ``hbm``, ``issue``, ``tensor`` and ``extra`` (split-K's
    reduction, a launch); :func:`modeled_time_us` combines them.

    HBM time counts the bytes over the bandwidth the busy SMs can pull (an idle SM is lost bandwidth);
    issue time the instructions of :func:`estimated_instructions_per_weight` on the busiest SM; split-K
    adds its reduction in the cluster (each CTA reads 1 / S of the f32 tile from each of S CTAs through
    distributed SMEM at ``gpu.dsmem_bytes_per_cycle_per_sm``); an x copy by the wrapper a second launch
    (``gpu.launch_s``).
    """
    ctas = config.ctas(m, n_pad)
    weights = config.dequantized_weights(m, n_pad, k_pad)  # HBM bytes count K_pad's rows only
    nbytes = n_pad * k_pad / 2 + 2 * (m * k_pad + m * n_pad) + 2 * n_pad * -(-k_pad // group)
    t_reduce = 0.0
    if config.split_k > 1:
        t_reduce = config.tile_m * config.cta_rows * 4 / gpu.dsmem_bytes_per_cycle_per_sm / gpu.clock_hz
    t_hbm = nbytes / (gpu.hbm_bytes_per_s * min(1.0, ctas / num_sms))
    ipw = estimated_instructions_per_weight(config, group, has_offsets, refills=refills(config, k_pad))
    busiest = weights / 32 * ipw / ctas * math.ceil(ctas / num_sms)  # warp-instructions on one SM
    t_issue = busiest / (gpu.issue_per_sm_cycle * gpu.clock_hz)
    # The accumulator route runs one more WGMMA a chunk, the constant A tile's, shared by the A tiles.
    hgmma_share = (config.tiles + 1) / config.tiles if config.scales_on == "accumulators" else 1.0
    t_tensor = 2.0 * config.wgmma_n * weights * hgmma_share / gpu.bf16_flops
    # The wrapper's zero rows of x are a launch; where the kernel cannot store y's M rows itself, the slice
    # of y is another (:func:`stores_any_rows`).
    launch = gpu.launch_s * (x_rows(m, config) != m) * (1 if stores_any_rows(config) else 2)
    extra = t_reduce + launch
    return {"hbm": t_hbm * 1e6, "issue": t_issue * 1e6, "tensor": t_tensor * 1e6, "extra": extra * 1e6}


def modeled_time_us(
    config: TuningConfig, m: int, n_pad: int, k_pad: int, group: int, has_offsets: bool, num_sms: int
) -> float:
    """The heuristics' modeled time: the largest of HBM, issue and tensor-core time (they overlap), plus
    the split-K reduction and a launch (:func:`modeled_times_us`)."""
    return combined_time_us(modeled_times_us(config, m, n_pad, k_pad, group, has_offsets, num_sms))


def combined_time_us(times: dict[str, float]) -> float:
    return max(times["hbm"], times["issue"], times["tensor"]) + times["extra"]
