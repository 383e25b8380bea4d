"""Tuning configurations of the Mosaic GPU W4A16 kernel: what each field means, the rules a config obeys,
and its SMEM cost. The cost model ranking them is cost_model.py, the heuristics choosing one heuristics.py.

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
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Literal

from nybble.packing.gate_up import GATE_UP_BLOCK
from nybble.packing.groups import MIN_GROUP_SIZE

# Hopper's opt-in SMEM per CTA (cudaDevAttrMaxSharedMemoryPerBlockOptin), what Mosaic checks against.
SMEM_BUDGET_BYTES = 232448
SMEM_PER_SM_BYTES = 233472
# Barriers, alignment padding and the driver's reserve next to the buffers counted in `smem_bytes`.
SMEM_SLACK_BYTES = 1024
TILE_M_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TILES_CHOICES = (1, 2, 4)
TILE_K_CHOICES = (64, 128, 256, 512)
# 512-deep steps halve a decode step's fixed cost per weight (barrier wait, slot bookkeeping, the end-of-step
# fence) on the accumulator route of the one-warpgroup kernel, the only one they are compiled and
# interpreted for.
WIDE_STEP_K = 512
SLICES_CHOICES = (1, 2, 4, 8)
CHUNK_K = 64  # one dequantization chunk: 64 x 64 codes, 8 bands x 64 words
# K of one WGMMA call: two chunks are dequantized, then multiplied by one call, so Mosaic derives the x
# tile's SMEM descriptor once for 8 HGMMAs instead of once for 4 (fewer instructions a step, no spill).
WGMMA_K = 128
MAX_SPLIT_K = 8  # the split_k CTAs of one output tile form a cluster: 8 is the portable maximum
# y rows one CTA of a warp-specialized split-K cluster sums (tile_m / split_k): 64 spill.
MAX_WS_SLAB_ROWS = 32
ScalesOn = Literal["accumulators", "weights"]


def _check_steps(steps: int) -> None:
    """The pipeline depth's rule: at least 2 slots (released one step late), at most 8."""
    if not 2 <= steps <= 8:
        raise ValueError(f"TuningConfig: max_concurrent_steps={steps} must be in [2, 8]")


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
                "slabs spill registers"
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
        _check_steps(self.max_concurrent_steps)
        if not 1 <= self.grid_tile_m <= 64:
            raise ValueError(f"TuningConfig: grid_tile_m={self.grid_tile_m} must be in [1, 64]")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"TuningConfig: split_k={self.split_k} must be in [1, {MAX_SPLIT_K}]")

    def with_steps(self, steps: int) -> TuningConfig:
        """This config at pipeline depth ``steps``: ``dataclasses.replace(self, max_concurrent_steps=steps)``
        without re-running the other fields' checks (no rule ties the depth to them), as the heuristics
        try every depth of every candidate (a third of their time went to ``replace``)."""
        _check_steps(steps)
        config = copy.copy(self)
        object.__setattr__(config, "max_concurrent_steps", steps)
        return config

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


def swiglu_reason(config: TuningConfig) -> str | None:
    """Why ``config`` cannot run the SwiGLU epilogue (gate/up interleaved, ``nybble.packing.gate_up``), or
    None. It runs in the K slices' epilogue (``dequant_registers.sum_slices``: decode, M <= 8), whose
    warpgroup holds whole 16-column gate/up blocks when its 64 * tiles / S output columns are a multiple
    of 16."""
    if config.slices == 1:
        return f"the SwiGLU epilogue runs with K slices (decode configs), not slices=1 ({config.tag})"
    if config.rows_per_wg % (2 * GATE_UP_BLOCK):
        return (
            f"a CTA of {config.rows_per_wg} output columns (64 * tiles / slices) holds no whole "
            f"{2 * GATE_UP_BLOCK}-column gate/up blocks ({config.tag})"
        )
    return None


def residual_reason(config: TuningConfig) -> str | None:
    """Why ``config`` cannot run the residual epilogue (x = residual + y, h = x * w: residual.py), or None.
    It runs in the K slices' epilogue (``dequant_registers.sum_slices``: decode, M <= 8, one launch per
    output tile), whose CTA copies its residual rows in at its start: one output tile per CTA."""
    if config.slices == 1:
        return f"the residual epilogue runs with K slices (decode configs), not slices=1 ({config.tag})"
    if config.persistent_ctas:
        return f"the residual epilogue copies one tile's rows per CTA: no persistent CTAs ({config.tag})"
    return None


def residual_smem_bytes(config: TuningConfig) -> int:
    """SMEM the residual epilogue adds to :func:`smem_bytes`: h's staging tile, the residual rows and the norm
    weight's row (f32 at most), each allocation rounded up to Mosaic's 1 KiB alignment (X-ray: +3,072 bytes
    at Llama-3-8B's down projection, M = 1 and 8)."""
    tile = config.tile_m * config.cta_rows * 2
    return sum(-(-size // 1024) * 1024 for size in (tile, tile, config.cta_rows * 4))


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
    docs/logs/performance-log.md). Such a symmetric
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
    for exact weights against a 128-wide accumulator (docs/logs/performance-log.md)."""
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
    return smem_fits(smem_bytes(config, group=group, has_offsets=has_offsets, scale_bytes=scale_bytes))


def smem_fits(used: int) -> bool:
    """Whether ``used`` bytes of buffers fit one CTA's SMEM with room for barriers (:func:`fits_smem`)."""
    return used + SMEM_SLACK_BYTES <= SMEM_BUDGET_BYTES


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
