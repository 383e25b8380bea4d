"""Tuning configurations of the Mosaic GPU W4A16 kernel, their SMEM cost, and the heuristics choosing them.

Naming: the kernel computes y^T = W^T x^T, so the weight's N is WGMMA's M dimension (``tiles`` A tiles of
64 rows of dequantized weights per warpgroup, in registers) and the batch M is WGMMA's N dimension.

WGMMA's N is ``slices * tile_m``: with ``slices`` = S > 1 (decode, M <= 8) K is cut into S slices that
run side by side in WGMMA's N, so one warpgroup covers 64 * tiles / S output rows over all of K and a
decode GEMM needs no split-K (see dequant_registers.py). Two dequantization routes (``scales_on``):
  * "accumulators": each A element is 136 + q straight from one LOP3 (no per-weight arithmetic); every
    group's products go to a fresh f32 accumulator, which is scaled once per group: y += s * (acc - 136 *
    sum(x)) + o * sum(x), where sum(x) over the group comes from one more WGMMA with an all-ones A tile in
    SMEM (symmetric groups with one A tile: that WGMMA multiplies a -136 tile into acc itself, and
    y += s * acc). 7 instructions per 8 weights; each accumulator element costs ~1-2 FMAs per group, so it
    suits a narrow WGMMA N (decode) and groups of >= 64;
  * "weights": exact bf16 weights w = q * s (+ o), one multiply per weight pair, accumulated in one f32
    accumulator: for wide N (prefill) and groups of 16 or 32.
Families from :func:`heuristic_config`:
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
that many 8-row slabs of y, :func:`split_k_shares`; prefill's 128-row tiles down to 16-row slabs, e.g.
Llama-3-8B kv at M = 128: 8 output tiles, 64 CTAs; decode's 16-row tiles over 4 CTAs, 8 rows of one A
tile each) when the output tiles alone leave SMs idle: those CTAs form one thread-block cluster and sum
their f32 partials through distributed SMEM (split_k.py), so a split-K matmul is one launch like any
other. Decode takes a config up to 3% slower in the model where it issues >= 0.10 fewer instructions per
weight (the model cannot resolve a few percent). The model's tensor-core time counts the accumulator route's
constant-tile WGMMAs, (tiles + 1) / tiles the weights' own: one A tile at WGMMA N = 32 is tensor-bound.
The fitted coefficients are :class:`CostModel`'s; the dated X-ray figures behind each rule are in
docs/performance-log.md.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable
from typing import Literal, NamedTuple

from nybble.kernels.device import DEFAULT_NUM_SMS
from nybble.kernels.gpu import H200, GpuSpec
from nybble.packing.groups import MIN_GROUP_SIZE, group_rows

# Hopper's opt-in SMEM per CTA (cudaDevAttrMaxSharedMemoryPerBlockOptin), what Mosaic checks against.
SMEM_BUDGET_BYTES = 232448
SMEM_PER_SM_BYTES = 233472
# Barriers, alignment padding and the driver's reserve next to the buffers counted in `smem_bytes`.
_SMEM_SLACK_BYTES = 1024
TILE_M_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TILES_CHOICES = (1, 2, 4)
TILE_K_CHOICES = (64, 128, 256, 512)
# 512-deep steps halve a decode step's fixed cost per weight (barrier wait, slot bookkeeping, the end-of-step
# fence; X-ray, Llama-3-8B down at M = 32: 2.03 -> 1.90 instructions per weight) on the accumulator route
# of the one-warpgroup kernel, the only one they are compiled and interpreted for.
WIDE_STEP_K = 512
SLICES_CHOICES = (1, 2, 4, 8)
CHUNK_K = 64  # one dequantization chunk: 64 x 64 codes, 8 bands x 64 words
# K of one WGMMA call: two chunks are dequantized, then multiplied by one call, so Mosaic derives the x
# tile's SMEM descriptor once for 8 HGMMAs instead of once for 4 (X-ray, Llama-3-8B q/o at M = 16: 269 ->
# 253 instructions a step; gate-up at M = 8, four A tiles: 756 -> 736, 254 registers, no spill).
WGMMA_K = 128
MAX_SPLIT_K = 8  # the split_k CTAs of one output tile form a cluster: 8 is the portable maximum
# y rows one CTA of a warp-specialized split-K cluster sums (tile_m / split_k): 64 spill 32 bytes (X-ray).
MAX_WS_SLAB_ROWS = 32
ScalesOn = Literal["accumulators", "weights"]


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
    # call with offsets on the accumulator route, ~1.1 an HGMMA (fitted to the X-ray of 70 accumulator-route
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
    # folded, 14 with a producer: the X-ray of the 512-deep picks).
    acc_per_column: int = 2
    acc_fixed: int = 8
    folded_fixed: int = 8
    folded_fixed_producer: int = 14
    # Decode near-ties (:func:`_fewer_instructions_nearly_as_fast`): a config this much slower in the model
    # is still taken where it issues at least ``decode_ipw_gain`` fewer instructions per weight (Llama-3-8B
    # down and q/o at M = 16-32, the X-ray).
    decode_tie: float = 0.03
    decode_ipw_gain: float = 0.10
    # Modeled times within this fraction of the fastest candidate's count as equal (heuristic_config: the
    # fastest, then prefill's issue and tensor-core times in steps of it). 0.1%: the picks of the former
    # absolute 0.01 us at every named shape (tests/fixtures/golden_picks), where 0.3% moves 5 of 520.
    tie_relative: float = 0.001


COST_MODEL = CostModel()
# The names these coefficients had before CostModel (kept importable).
DECODE_TIE = COST_MODEL.decode_tie
DECODE_IPW_GAIN = COST_MODEL.decode_ipw_gain


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuningConfig:
    """One compiled variant of the W4A16 kernel. Validates itself on construction."""

    # 64-row A tiles (of W^T) per compute warpgroup and K step.
    tiles: int = 2
    # Rows of x per K slice; WGMMA's N is slices * tile_m (a multiple of 8).
    tile_m: int = 128
    # K per pipeline step and slice (one TMA of codes, x and scale rows).
    tile_k: int = 128
    # K slices folded into WGMMA's N (1: off).
    slices: int = 1
    # Pipeline depth: SMEM slots per operand (>= 2: slots are released one step late).
    max_concurrent_steps: int = 4
    # CTAs sharing one output tile along K: one thread-block cluster, f32 partials summed in SMEM
    # (split_k.py).
    split_k: int = 1
    # Launch order: M tiles per band of the planar snake over (M tiles, N tiles); see common.py.
    grid_tile_m: int = 8
    # 1: one warpgroup per CTA (w4a16.py). 2: warp-specialized, a TMA warpgroup feeding two compute
    # warpgroups that share the x tile (w4a16_ws.py).
    compute_wgs: int = 1
    # Where group scales (and offsets, and the 136 bias of the magic-number dequantization) are applied.
    scales_on: ScalesOn = "weights"
    # One-warpgroup kernel only: a second warpgroup issues the TMA copies (the producer, 40 registers)
    # while the compute warpgroup only waits on full slots, dequantizes and runs WGMMA (w4a16.py). The CTA
    # then takes the SM's whole register file (one CTA per SM).
    producer: bool = False
    # Warp-specialized kernel without split-K only. 0: one CTA per output tile. n > 0: min(n, tiles) CTAs,
    # each looping over output tiles cta, cta + CTAs, ... (a persistent grid, pipeline.OutputTiles): the TMA
    # warpgroup fetches the next tile's first K steps while the compute warpgroups store the last one, and
    # that store (a TMA from SMEM) runs under the next tile's WGMMAs.
    persistent_ctas: int = 0

    def __post_init__(self) -> None:
        for name, choices in (
            ("tiles", TILES_CHOICES),
            ("tile_m", TILE_M_CHOICES),
            ("tile_k", TILE_K_CHOICES),
            ("slices", SLICES_CHOICES),
            ("compute_wgs", (1, 2)),
            ("scales_on", ("accumulators", "weights")),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"TuningConfig: {name}={getattr(self, name)!r} must be one of {choices}")
        if self.wgmma_n % 8 or self.wgmma_n > 256:
            raise ValueError(
                f"TuningConfig: slices * tile_m = {self.wgmma_n} is WGMMA's N: a multiple of 8, at most 256"
            )
        if self.split_k > 1:
            split_k_shares(self.tile_m, self.split_k, self.tiles)  # raises, naming the rule
        if self.split_k > 1 and self.compute_wgs > 1 and self.tile_m // self.split_k > MAX_WS_SLAB_ROWS:
            raise ValueError(
                f"TuningConfig: the warp-specialized kernel splits K into slabs of at most "
                f"{MAX_WS_SLAB_ROWS} rows, got tile_m / split_k = {self.tile_m} / {self.split_k}: 64-row "
                "slabs spill registers (the X-ray of tile_m=128, split_k=2: 32 bytes)"
            )
        if self.slices > 1 and self.split_k > 1:
            raise ValueError("TuningConfig: K slices or split-K, not both (slices already span all of K)")
        if self.slices > 1 and self.compute_wgs > 1:
            raise ValueError("TuningConfig: K slices run in the one-warpgroup kernel only (compute_wgs=1)")
        if self.producer and self.compute_wgs > 1:
            raise ValueError(
                "TuningConfig: producer=True is the one-warpgroup kernel's (compute_wgs=1), got "
                f"compute_wgs={self.compute_wgs} (compute_wgs=2 has a producer already)"
            )
        if self.tile_k == WIDE_STEP_K and (self.scales_on != "accumulators" or self.compute_wgs > 1):
            raise ValueError(
                f"TuningConfig: tile_k={WIDE_STEP_K} runs on the accumulator route of the one-warpgroup "
                f"kernel (scales_on='accumulators', compute_wgs=1), got scales_on={self.scales_on!r}, "
                f"compute_wgs={self.compute_wgs}: use tile_k <= 256"
            )
        if self.persistent_ctas < 0:
            raise ValueError(f"TuningConfig: persistent_ctas={self.persistent_ctas} must be >= 0 (0: off)")
        if self.persistent_ctas and (self.compute_wgs == 1 or self.split_k > 1):
            raise ValueError(
                f"TuningConfig: persistent_ctas={self.persistent_ctas} needs the warp-specialized kernel "
                f"(compute_wgs=2) without split-K, got compute_wgs={self.compute_wgs}, split_k={self.split_k}"
            )
        if not 2 <= self.max_concurrent_steps <= 8:
            raise ValueError(
                f"TuningConfig: max_concurrent_steps={self.max_concurrent_steps} must be in [2, 8]"
            )
        if not 1 <= self.grid_tile_m <= 64:
            raise ValueError(f"TuningConfig: grid_tile_m={self.grid_tile_m} must be in [1, 64]")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"TuningConfig: split_k={self.split_k} must be in [1, {MAX_SPLIT_K}]")

    @property
    def tag(self) -> str:
        """One name for this config, every field in it: kernel names (what a profiler shows), X-ray rows and
        test ids. ``t2m16k256s1p4x2b8w1acc_tma``: A tiles, tile_m, tile_k, K slices, pipeline slots, split-K,
        grid band (grid_tile_m), compute warpgroups, scales on accumulators (acc) or weights (wt), then
        ``_tma`` with a producer warpgroup and ``_P132`` on a persistent grid of 132 CTAs. An identifier."""
        return (
            f"t{self.tiles}m{self.tile_m}k{self.tile_k}s{self.slices}p{self.max_concurrent_steps}"
            f"x{self.split_k}b{self.grid_tile_m}w{self.compute_wgs}"
            f"{'acc' if self.scales_on == 'accumulators' else 'wt'}"
            f"{'_tma' if self.producer else ''}{f'_P{self.persistent_ctas}' if self.persistent_ctas else ''}"
        )

    @property
    def wgmma_n(self) -> int:
        return self.slices * self.tile_m

    @property
    def rows_per_wg(self) -> int:
        """Output rows (of N) one compute warpgroup covers: 64 per A tile, over S slices."""
        return 64 * self.tiles // self.slices

    @property
    def cta_rows(self) -> int:
        return self.rows_per_wg * self.compute_wgs

    def k_span(self) -> int:
        """K one pipeline step covers: tile_k in each of the S slices."""
        return self.tile_k * self.slices

    def m_tiles(self, m: int) -> int:
        """M tiles of M rows of x: one where K slices fold M into WGMMA's N, else ceil(M / tile_m)."""
        return 1 if self.slices > 1 else -(-m // self.tile_m)

    def ctas(self, m: int, n_pad: int) -> int:
        """CTAs of one (M, K_pad) x (K_pad, N_pad) problem: output tiles times split-K."""
        return n_pad // self.cta_rows * self.m_tiles(m) * self.split_k

    def dequantized_weights(self, m: int, n_pad: int, k_pad: int) -> int:
        """Weights the launch dequantizes: every M tile all of W again, and a partial last K step its
        zero-filled rows too."""
        return self.m_tiles(m) * n_pad * self.k_steps(k_pad) * self.k_span() * self.split_k

    def k_steps(self, k_pad: int) -> int:
        """Pipeline steps of one CTA over K_pad: the last one partial where the step does not divide K_pad
        (:func:`runs_past_k`)."""
        return -(-k_pad // (self.k_span() * self.split_k))

    def runs_past_k(self, k_pad: int) -> bool:
        """Whether this config's last K step reaches past K_pad: its TMA copies then read the block's rows
        past K_pad as zeros (codes, x and scale rows alike: TMA zero-fills out-of-bounds boxes and reads no
        HBM for them), so those rows add 0 * finite weights to every accumulator and 0-scaled groups."""
        return k_pad % (self.k_span() * self.split_k) != 0

    def check_problem(self, m: int, n_pad: int, k_pad: int, group: int) -> None:
        """Raises ValueError naming the rule when this config cannot run (M, K_pad) x (K_pad, N_pad)."""
        if n_pad % self.cta_rows:
            raise ValueError(
                f"N_pad={n_pad} must be a multiple of the CTA's {self.cta_rows} output rows "
                f"(64 * tiles / slices * compute_wgs = 64 * {self.tiles} / {self.slices} * "
                f"{self.compute_wgs})"
            )
        if self.runs_past_k(k_pad) and not (
            self.slices == 1 and self.split_k == 1 and self.compute_wgs == 1 and k_pad % CHUNK_K == 0
        ):
            # A partial last step (TMA zero-fills its rows past K_pad) runs in the one-warpgroup kernel
            # without K slices (each slice would hold its own ragged end) or split-K (whose CTAs share
            # steps evenly); the warp-specialized kernel is not compiled or interpreted for it.
            raise ValueError(
                f"K_pad={k_pad} must be a multiple of tile_k * slices * split_k = {self.tile_k} * "
                f"{self.slices} * {self.split_k} (a partial last K step needs slices=1, split_k=1 and "
                f"compute_wgs=1, got compute_wgs={self.compute_wgs})"
            )
        if self.slices > 1 and m * self.slices > self.wgmma_n:
            raise ValueError(f"M={m} rows do not fit tile_m={self.tile_m} with slices={self.slices}")
        if self.slices > 1 and group % CHUNK_K:
            # Each lane gathers its rows' scales per group: with groups of 16 or 32 that is 2 to 4 gathers
            # per chunk, too many; those run without slices.
            raise ValueError(f"K slices need groups of a multiple of 64, got {group}")
        if group < MIN_GROUP_SIZE:
            raise ValueError(f"group size {group} must be >= {MIN_GROUP_SIZE}")
        if group < self.tile_k and self.tile_k % group:
            raise ValueError(f"group size {group} must divide tile_k={self.tile_k}")
        if group > self.tile_k and group % self.tile_k:
            raise ValueError(f"group size {group} must be a multiple of tile_k={self.tile_k}")
        slice_k = k_pad // self.slices
        if self.slices > 1 and group < k_pad and slice_k % group:
            raise ValueError(f"K slices of {slice_k} must hold whole groups of {group}")
        if self.scales_on == "accumulators" and group % CHUNK_K:
            raise ValueError(f"scales_on='accumulators' needs groups of a multiple of 64, got {group}")


def split_k_shares(tile_m: int, split_k: int, tiles: int) -> list[tuple[int, int, int, int]]:
    """How the ``split_k`` CTAs of a cluster share the reduction of one output tile (split_k.py): CTA q
    sums and stores (rows, row slab, first A tile, A tiles) ``shares[q]``, whole 8-row slabs of y.

    Each warpgroup's tile is ``tiles`` A tiles (64 y columns each) by tile_m y rows, cut into slabs of
    max(8, tile_m / split_k) rows: split_k of them per A tile, or tile_m / 8 where that is fewer. The
    (row slab, A tile) pieces, row slab by row slab, go to the CTAs in equal runs, so a CTA's share is a
    run of A tiles within one row slab (tile_m = 128, split_k = 4: CTA q stores rows 32q.. of every A
    tile; tile_m = 16, split_k = 4, tiles = 2: CTA q stores rows 8 (q // 2).. of A tile q % 2).
    """
    if split_k < 1 or split_k & (split_k - 1) or tile_m % 8:
        raise ValueError(
            f"split-K in a cluster needs split_k={split_k} to be a power of two and tile_m={tile_m} a "
            "multiple of 8 (each CTA of the cluster sums and stores whole 8-row slabs of the y tile)"
        )
    rows = max(8, tile_m // split_k)
    pieces = tile_m // rows * tiles
    if pieces % split_k:
        raise ValueError(
            f"split_k={split_k} needs tiles * tile_m / 8 = {tiles} * {tile_m} / 8 = {pieces} 8-row slabs "
            "of y to share out, at least one per CTA of the cluster: fewer CTAs, more A tiles or a wider "
            "tile_m"
        )
    share = pieces // split_k
    return [(rows, q * share // tiles, q * share % tiles, share) for q in range(split_k)]


def splits_k(tile_m: int, split_k: int, tiles: int) -> bool:
    """Whether :func:`split_k_shares` accepts these."""
    try:
        split_k_shares(tile_m, split_k, tiles)
    except ValueError:
        return False
    return True


def folds_bias(config: TuningConfig, has_offsets: bool) -> bool:
    """Whether the accumulator route takes 136 * sum(x) off each group's accumulator inside WGMMA, with a
    constant A tile of -136 (common.scaled_accumulators_step): symmetric groups (offsets need sum(x) on
    its own) and one A tile (with more, that tile's WGMMAs would repeat per A tile: more instructions,
    docs/performance-log.md). Such a symmetric
    kernel is not the asymmetric one minus the offsets: the suite interprets it, lowers it once per fold
    class (tests/test_kernel_lowering.py) and compiles its asymmetric twin, whose loop is longer (X-ray)."""
    return config.scales_on == "accumulators" and not has_offsets and config.tiles == 1


def scale_rows_per_step(config: TuningConfig, group: int) -> int:
    """Scale (and offset) rows one step reads per slice: several groups per K step, or one."""
    return max(1, config.tile_k // group)


def wgmma_k(config: TuningConfig, group: int) -> int:
    """K one WGMMA call covers: :data:`WGMMA_K`, or the step's K, or on the accumulator route a group's
    (each group has its own accumulator), where that is less. Calls stay one chunk wide where the wider
    A operand costs ptxas more than it saves: in the warp-specialized kernel (168 registers a thread), and
    for exact weights against a 128-wide accumulator (docs/performance-log.md)."""
    if config.compute_wgs > 1 or (config.scales_on == "weights" and config.wgmma_n > 64):
        return CHUNK_K
    span = config.tile_k if config.scales_on == "weights" else min(config.tile_k, group)
    return min(WGMMA_K, span)


def smem_bytes(
    config: TuningConfig, *, group: int, has_offsets: bool, act_bytes: int = 2, scale_bytes: int = 2
) -> int:
    """SMEM one CTA allocates: the pipeline's stage buffers, the constant tile (64 x :func:`wgmma_k`),
    the epilogue's staging."""
    rows = scale_rows_per_step(config, group)
    a_tiles = config.tiles * config.compute_wgs
    per_stage = (
        a_tiles * 64 * config.tile_k // 2  # int4 codes (8 slots of tile_k words per A tile)
        + config.wgmma_n * config.tile_k * act_bytes  # activations
        + config.slices * rows * config.cta_rows * scale_bytes * (2 if has_offsets else 1)
    )
    ones = 64 * wgmma_k(config, group) * act_bytes if config.scales_on == "accumulators" else 0
    if config.slices > 1:  # f32 accumulators staged for the slice sum, and the y tile
        epilogue = a_tiles * 64 * config.wgmma_n * 4 + config.tile_m * config.cta_rows * act_bytes
    elif config.split_k > 1:
        # The f32 partial in slabs for the cluster's reduction; its bf16 y staging slab is allocated after
        # the pipeline, in the stage buffers' SMEM (split_k.py).
        rows, _, _, share_tiles = split_k_shares(config.tile_m, config.split_k, config.tiles)[0]
        slab = rows * 64 * share_tiles * config.compute_wgs * act_bytes
        fixed = ones + config.tile_m * config.cta_rows * 4
        return fixed + max(per_stage * config.max_concurrent_steps, slab)
    else:
        epilogue = config.tile_m * config.cta_rows * act_bytes
    return per_stage * config.max_concurrent_steps + ones + epilogue


def fits_smem(config: TuningConfig, *, group: int, has_offsets: bool, scale_bytes: int = 2) -> bool:
    """Whether ``config`` fits Hopper's SMEM budget (with room for barriers)."""
    return _fits(smem_bytes(config, group=group, has_offsets=has_offsets, scale_bytes=scale_bytes))


def _fits(used: int) -> bool:
    """Whether ``used`` bytes of buffers fit one CTA's SMEM with room for barriers (:func:`fits_smem`)."""
    return used + _SMEM_SLACK_BYTES <= SMEM_BUDGET_BYTES


def _pow2_at_least(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


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
    return _combined(modeled_times_us(config, m, n_pad, k_pad, group, has_offsets, num_sms))


def _combined(times: dict[str, float]) -> float:
    return max(times["hbm"], times["issue"], times["tensor"]) + times["extra"]


def stores_any_rows(config: TuningConfig) -> bool:
    """Whether ``config``'s kernel stages y so that one TMA store reaches a y of any number of rows
    (``staging.y_staging``): one or two A tiles without K slices. With four, Mosaic's layout inference finds
    no layout for the 256-column tile's stores; K slices sum into their tile in layouts of their own. Those
    keep Mosaic's own staging, whose 8-row tiles need y rows that fill them (the wrapper's zero rows)."""
    return config.slices == 1 and config.tiles <= 2


def refills(config: TuningConfig, k_pad: int) -> bool:
    """Whether a CTA's pipeline refills slots (more K steps than slots), or issues every copy up front."""
    return config.k_steps(k_pad) > config.max_concurrent_steps


def x_rows(m: int, config: TuningConfig) -> int:
    """Rows of x the kernel reads: M, or M padded so that the x view (rows * slices, K / slices) suits a
    TMA into 8-row SMEM tiles (at most 8 rows, or a multiple of 8). Padding costs the wrapper a copy."""
    s = config.slices
    if m * s <= 8 or (m * s) % 8 == 0:
        return m
    step = 8 // math.gcd(s, 8)
    return -(-m // step) * step


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
) -> TuningConfig:
    """Chooses a config for an (M, K_pad) x (K_pad, N_pad) problem on a GPU with ``num_sms`` SMs.

    ``group_size`` None means one group over all of K_pad; K_pad and N_pad are multiples of 64.

    Decode (M <= 64): one compute warpgroup per CTA (with a producer warpgroup issuing the TMA, or
    without). Small M runs S K slices side by side in WGMMA's N (M = 1 puts 8 slices of K where padding
    would be), so a CTA covers 64 * tiles / S rows of N over all of K and needs no split-K: one launch.
    Every candidate (A tiles, tile_k, slices, split-K, scale route, producer where the pipeline refills
    its slots) that fits SMEM, at every pipeline depth, is ranked by :func:`modeled_time_us`; ties go to
    hidden latency (a producer running TMA ahead, every copy issued up front, or two CTAs per SM: a second
    warp per scheduler hides the other's stalls), fewer instructions per weight, more A tiles per step,
    then deeper pipelines; then a config within ``DECODE_TIE`` of that time that issues
    ``DECODE_IPW_GAIN`` fewer instructions per weight replaces it
    (:func:`_fewer_instructions_nearly_as_fast`). Prefill (M > 64): two compute warpgroups sharing 128-
    or 256-row x tiles, weights dequantized exactly; ties go to the least issue time, then the least
    tensor-core time.

    ``experts`` > 1: one launch runs that many such problems, each against its own weight (the grouped
    kernel, grouped.py): a config must fit one, the cost model counts the CTAs and weights of all. ``allow``:
    a predicate on the candidates (what that kernel runs).
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
            config = dataclasses.replace(probe, max_concurrent_steps=steps)
            used = smem_bytes(config, group=group, has_offsets=has_offsets, scale_bytes=scale_bytes)
            if not _fits(used):
                continue
            # A producer's CTA takes the whole register file (two warpgroups, up to 256 registers each).
            resident = 1 if config.producer else max(1, SMEM_PER_SM_BYTES // (used + _SMEM_SLACK_BYTES))
            ctas = config.ctas(m, experts * n_pad)
            times = modeled_times_us(config, m, experts * n_pad, k_pad, group, has_offsets, num_sms)
            t = _combined(times)
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
    so the tie allows 3% (the cases: docs/performance-log.md). Accumulator-route tiles stay within tiles *
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
            # 128 columns spill (X-ray, Llama-3-70B gate-up at M = 12, four A tiles at N = 32: 816-856
            # bytes), and 64 split 8 ways spill in the split-K epilogue (Llama-3-8B down at M = 32, two A
            # tiles: 16-48 bytes; q/o: 24 bytes, or 2.19 instructions per weight against 1.92 split 4 ways).
            continue
        if k_pad % (tile_k * slices * split_k) and (slices > 1 or split_k > 1 or k_pad % (2 * CHUNK_K) == 0):
            # Partial last K steps (TuningConfig.runs_past_k) only where K_pad is an odd number of 64-wide
            # chunks, so that no step deeper than 64 divides it (gpt-oss: K = 2880 = 45 x 64, whose 64-deep
            # steps issue 2.81-3.25 instructions per weight in the X-ray); elsewhere a dividing step exists.
            continue
        if tile_k == WIDE_STEP_K and (
            scales_on != "accumulators" or group < 2 * CHUNK_K or tiles > 2 or slices > 4
        ):
            # At most 4 groups a step. Four A tiles spill (X-ray: 24-72 bytes at M = 1 and 8), and with
            # 8 K slices a step of 512 issues more than two of 256 (Llama-3-8B q/o at M = 1: 1.61 -> 1.63).
            continue
        shape = dict(
            tiles=tiles, tile_m=t_m, tile_k=tile_k, slices=slices, split_k=split_k, scales_on=scales_on
        )
        yield shape
        yield dict(shape, producer=True)
