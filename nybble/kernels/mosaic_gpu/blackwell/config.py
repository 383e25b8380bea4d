"""Tilings of the Blackwell W4A16 kernel (kernel.py) and the frozen heuristics that pick one for a B200.

One CTA owns ``tile_n`` columns of y (tcgen05's M: the rows of W^T) and ``tile_m`` rows of x (tcgen05's N),
over all of K in steps of ``tile_k``. TMEM holds one f32 accumulator of ``tile_n`` lanes x ``tile_m``
columns (allocated in powers of two >= 32 columns of the SM's 512).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

from nybble.kernels.mosaic_gpu.config import CHUNK_K

# The most SMEM one CTA may allocate on a B200 (227 KiB, as on Hopper), and Mosaic's slack beside it.
SMEM_BUDGET_BYTES = 232448
_SMEM_SLACK_BYTES = 1024
TMEM_COLUMNS = 512  # per SM: 128 lanes x 512 columns of 32 bits (256 KiB)
# tcgen05 M of one CTA (cta_group::1). 64 (the M = 64 MMA) fails Mosaic's layout inference for its TMEM
# load in jax 0.11.2; an N_pad that is an odd multiple of 64 runs a last CTA whose TMA reads zeros past N_pad.
TILE_N_CHOICES = (128,)
TILE_M_CHOICES = (16, 32, 64, 128, 192, 256)  # tcgen05 N: a multiple of 16 for M = 128, at most 256
TILE_K_CHOICES = (64, 128, 256)
DEFAULT_NUM_SMS = 148  # a B200
# K a decode CTA keeps in flight (6 steps of 128): the HBM latency it hides; deeper K steps keep as much.
DECODE_K_IN_FLIGHT = 768


@dataclasses.dataclass(frozen=True)
class BlackwellConfig:
    """One compiled variant of the Blackwell W4A16 kernel. Validates itself on construction."""

    tile_n: int = 128
    tile_m: int = 16
    tile_k: int = 128
    # SMEM slots of codes, x and scales (>= 2: slots are released one step late, after the MMA read them).
    max_concurrent_steps: int = 4
    # K slices folded into tcgen05's N (the Hopper kernel's trick, dequant_registers.py): x viewed as
    # (M * S, K / S), each 64-row A tile 8 slots of (band, slice); a CTA covers 128 / S columns of y over all
    # of K, so decode fills S times more SMs without split-K. tile_m / S rows of x per CTA, one M tile.
    slices: int = 1

    def __post_init__(self) -> None:
        for name, value, choices in (
            ("tile_n", self.tile_n, TILE_N_CHOICES),
            ("tile_m", self.tile_m, TILE_M_CHOICES),
            ("tile_k", self.tile_k, TILE_K_CHOICES),
        ):
            if value not in choices:
                raise ValueError(f"BlackwellConfig: {name}={value} must be one of {choices}")
        if self.slices not in (1, 2, 4, 8) or self.slices > self.tile_m:
            raise ValueError(f"BlackwellConfig: slices={self.slices} must be 1, 2, 4 or 8 and <= tile_m")
        if self.max_concurrent_steps < 2:
            raise ValueError(
                f"BlackwellConfig: max_concurrent_steps={self.max_concurrent_steps} must be >= 2 (a slot is "
                f"released one step after its MMA was issued)"
            )

    @property
    def tiles(self) -> int:
        """64-row dequantization tiles per step (the Hopper helpers' unit)."""
        return self.tile_n // 64

    @property
    def tag(self) -> str:
        sliced = f"_x{self.slices}" if self.slices > 1 else ""
        return f"bw_n{self.tile_n}_m{self.tile_m}_k{self.tile_k}_s{self.max_concurrent_steps}{sliced}"

    @property
    def x_rows_per_tile(self) -> int:
        """Rows of x (and y) one CTA multiplies: tcgen05's N over the K slices."""
        return self.tile_m // self.slices

    @property
    def cta_cols(self) -> int:
        """Columns of y one CTA computes: tile_n / S (the A rows hold S slices of each)."""
        return self.tile_n // self.slices

    def m_tiles(self, m: int) -> int:
        return -(-m // self.x_rows_per_tile)

    def ctas(self, m: int, n_pad: int) -> int:
        return self.m_tiles(m) * -(-n_pad // self.cta_cols)

    def check_problem(self, m: int, n_pad: int, k_pad: int, group: int, *, a_in_smem: bool = True) -> None:
        """Raises ValueError naming the rule when this config cannot run (M, K_pad) x (K_pad, N_pad);
        ``a_in_smem`` False: the kernel's A operand goes through TMEM (``kernel.a_in_tmem``), not SMEM."""
        if n_pad % 64:
            raise ValueError(f"N_pad={n_pad} must be a multiple of 64 (QuantizedWeight pads N so)")
        s = self.slices
        if k_pad % (s * self.tile_k):
            raise ValueError(f"K_pad={k_pad} must be a multiple of slices x tile_k = {s} x {self.tile_k}")
        if group < k_pad and group < self.tile_k and self.tile_k % group:
            raise ValueError(f"group={group} must divide tile_k={self.tile_k}")
        if s > 1 and group < k_pad and (k_pad // s) % group:
            raise ValueError(f"group={group} must divide a K slice (K_pad / slices = {k_pad // s})")
        if s > 1 and m > self.x_rows_per_tile:
            raise ValueError(
                f"M={m} rows need {self.m_tiles(m)} M tiles; K slices (slices={s}) take one: at most "
                f"tile_m / slices = {self.x_rows_per_tile} rows"
            )
        kw = dict(group=group, has_offsets=True, scale_bytes=4, a_in_smem=a_in_smem)
        if not fits_smem(self, **kw):
            raise ValueError(
                f"config {self.tag} needs {smem_bytes(self, **kw)} bytes of SMEM, more than a B200 CTA's "
                f"{SMEM_BUDGET_BYTES - _SMEM_SLACK_BYTES}"
            )


def scale_rows_per_step(config: BlackwellConfig, group: int) -> int:
    """Scale rows one K step reads: tile_k / G when groups are shorter than a step, else one."""
    return config.tile_k // group if group < config.tile_k else 1


def smem_bytes(
    config: BlackwellConfig, *, group: int, has_offsets: bool, scale_bytes: int = 2, a_in_smem: bool = True
) -> int:
    """SMEM the kernel allocates: pipeline slots (codes, x, scale rows), two dequantized A-operand buffers
    of bf16 weights (not where A goes through TMEM: ``a_in_smem`` False), the y staging tile."""
    c = config
    codes = c.tile_n * c.tile_k // 2
    x = c.tile_m * c.tile_k * 2
    scales = scale_rows_per_step(c, group) * c.tile_n * scale_bytes * (2 if has_offsets else 1)
    weights = 2 * c.tile_n * c.tile_k * 2 if a_in_smem else 0
    y = c.x_rows_per_tile * c.cta_cols * 2
    sliced = c.tile_n * c.tile_m * 4 if c.slices > 1 else 0  # the f32 partials the slices are summed from
    return c.max_concurrent_steps * (codes + x + scales) + weights + y + sliced


def fits_smem(config: BlackwellConfig, **kw) -> bool:
    return smem_bytes(config, **kw) + _SMEM_SLACK_BYTES <= SMEM_BUDGET_BYTES


def power_of_two_depth(config: BlackwellConfig, group: int) -> BlackwellConfig:
    """``config`` with a pipeline of a power of two slots, for a kernel whose A operand goes through TMEM
    (its SMEM holds no A buffer, so deeper pipelines fit than the heuristics, which count one, allow): the
    next power of two up from the heuristics' depth where it fits SMEM, else the one below. Every warp of
    the kernel indexes its slot and barrier phase by the K step modulo the depth: a power of two is a mask
    and a shift, where 3 or 5 slots cost a multiply-high sequence a step (X-ray, sm_100a, Llama-3-8B down
    at M = 1: 1.51 -> 1.45 instructions a weight with 4 slots instead of 3; at M = 16, 2.04 -> 1.94 with 4
    instead of 5)."""
    depth = config.max_concurrent_steps
    up = 1 << (depth - 1).bit_length()
    for candidate in (up, up // 2):
        piped = dataclasses.replace(config, max_concurrent_steps=candidate)
        if candidate >= 2 and fits_smem(piped, group=group, has_offsets=True, scale_bytes=4, a_in_smem=False):
            return piped
    return config


def x_rows(m: int, config: BlackwellConfig) -> int:
    """Rows of x the kernel reads: M when its view (M * S, K / S) suits a TMA into 8-row SMEM tiles (at
    most 8 rows, or a multiple of 8), else M padded so (a copy in the wrapper), as the Hopper kernel does."""
    s = config.slices
    if m * s <= 8 or (m * s) % 8 == 0:
        return m
    step = 8 // math.gcd(s, 8)
    return -(-m // step) * step


def _sm_time(m: int, n_pad: int, k_pad: int, c: BlackwellConfig, num_sms: int) -> float:
    """Relative decode time: waves of CTAs x the K each CTA walks (every CTA dequantizes 128 x K / S)."""
    return -(-c.ctas(m, n_pad) // num_sms) * (k_pad // c.slices)


@functools.lru_cache(maxsize=4096)
def heuristic_config(
    m: int,
    n_pad: int,
    k_pad: int,
    group: int,
    num_sms: int = DEFAULT_NUM_SMS,
    *,
    has_offsets: bool = True,
    sliced: bool = True,
) -> BlackwellConfig:
    """The B200 config for an (M, K_pad) x (K_pad, N_pad) problem (frozen rules, no search).

    tcgen05's M is 128 weight columns, its N M x S rounded up to 16..256. At decode (M <= 32) K slices
    S = 4, up to M = 64 S = 2, where they shorten the slowest SM's K walk (waves of CTAs x K / S: a 64-row
    M tile alone leaves Llama's 4096 columns 32 CTAs for 148 SMs); K steps of 256 at
    decode where 3 of them fit SMEM (the step's fixed cost over more weights, as much K in flight as 6
    steps of 128), else 128; past 128 rows M tiles of 256, 192 or 128 rows (:func:`prefill_config`); the
    deepest pipeline that fits SMEM. ``sliced`` False: no K slices.
    """
    del has_offsets
    if m > PREFILL_TILE_M:
        config = prefill_config(m, n_pad, k_pad, group, lambda c: c.ctas(m, n_pad), num_sms)
    else:
        config = _decode_config(m, n_pad, k_pad, group, num_sms, sliced)
    if config is None:
        raise ValueError(f"no Blackwell config fits M={m}, N_pad={n_pad}, K_pad={k_pad}, group={group}")
    return config


def _decode_config(
    m: int, n_pad: int, k_pad: int, group: int, num_sms: int, sliced: bool
) -> BlackwellConfig | None:
    """The tiling of M <= 128 rows in one M tile: of the K slice counts weighed, the one whose slowest SM
    walks least K (:func:`_sm_time`; ties to fewer slices), or None where none fits; then
    :func:`with_deeper_steps`."""
    best = None
    # Slices 4 or none at M <= 32, 2 or none up to 64 (slice_choices): other counts gain little over them
    # in the model (waves x K / S at the Llama and MoE shapes) and each is more code for the suite to
    # interpret.
    for slices in slice_choices(m) if sliced else (1,):
        config = sliced_config(m, n_pad, k_pad, group, slices)
        if config is None:
            continue
        t = _sm_time(m, n_pad, k_pad, config, num_sms)
        if best is None or t < best[0]:
            best = (t, config)
    if best is None:
        return None
    return with_deeper_steps(best[1], m, n_pad, k_pad, group, lambda c: _sm_time(m, n_pad, k_pad, c, num_sms))


# A decode K step's instructions per weight relative to a 256-deep step's (B200 X-ray, 2026-12-07,
# Qwen3-235B-A22B's expert down projection, K = 1536, at one token: 4 K slices of 128-deep steps 1.70, 2
# slices of 256-deep steps 1.48); a 64-deep step is charged at least as much as a 128-deep one.
STEP_COST = {256: 1.0, 128: 1.15, 64: 1.15}


def with_deeper_steps(
    config: BlackwellConfig,
    m: int,
    n_pad: int,
    k_pad: int,
    group: int,
    sm_time: Callable[[BlackwellConfig], float],
) -> BlackwellConfig:
    """``config``, or, where it takes 4 K slices too short for 256-deep steps (K_pad not a multiple of 4 x
    256), the 2-slice tiling of 256-deep steps in the same M tile (the case measured) when its slowest SM's
    K (``sm_time``) times the step's cost (:data:`STEP_COST`) is no more than the 4 slices': half the
    CTAs, each walking twice the K in steps of fewer instructions a weight."""
    if config.slices != 4 or config.tile_k >= 256:
        return config
    two = sliced_config(m, n_pad, k_pad, group, 2)
    if two is None or two.tile_k < 256 or two.tile_m != config.tile_m:
        return config
    if sm_time(two) * STEP_COST[two.tile_k] <= sm_time(config) * STEP_COST[config.tile_k]:
        return two
    return config


# Past this many rows the M tile is one of PREFILL_TILE_MS (:func:`prefill_config`), widest first.
PREFILL_TILE_M = 128
PREFILL_TILE_MS = (256, 192, PREFILL_TILE_M)


def prefill_config(
    m: int, n_pad: int, k_pad: int, group: int, ctas: Callable[[BlackwellConfig], int], num_sms: int
) -> BlackwellConfig | None:
    """The tiling of M > 128 rows (``ctas(config)``: the launch's CTAs under a config): M tiles of 256,
    192 or 128 rows, whichever leaves the busiest SM the fewest MMA rows (waves x tile_m; ties to the wider
    tile, which dequantizes each weight for more rows). All three are tensor-bound in the B200 X-ray's
    model, where an SM's time is its waves x tile_m x K: Llama-3-8B's k/v projection (N = 1024) at M = 2048
    is 64 CTAs of 256 rows for 148 SMs, and 128 CTAs of 128 rows in half the time; a 1536-column one
    (Qwen3-30B-A3B's expert gate-up) 96 of 256 or 192 of 128 rows (2 waves), and 132 of 192 in one."""
    best = None
    for tile_m in PREFILL_TILE_MS:
        config = sliced_config(m, n_pad, k_pad, group, 1, tile_m=tile_m)
        if config is None:
            continue
        t = -(-ctas(config) // num_sms) * tile_m
        if best is None or t < best[0]:
            best = (t, config)
    return None if best is None else best[1]


def sliced_config(
    m: int, n_pad: int, k_pad: int, group: int, slices: int, *, tile_m: int | None = None
) -> BlackwellConfig | None:
    """The tiling of ``slices`` K slices for M rows in one M tile (or, without slices, M tiles of
    ``tile_m`` rows, by default the least of TILE_M_CHOICES holding M, at most 256), or None where none
    fits: tile_m the least of TILE_M_CHOICES holding M x S; the deepest K step that divides K_pad and fits
    SMEM: 256 at decode, where a step's fixed cost (descriptors, barriers, the MMA issue) is shared by more
    weights, but only with as much K in flight as 6 steps of 128 (the HBM latency a decode CTA hides); 128
    in 128-row M tiles (3 steps fit SMEM); 64 in wider ones (the x slots grow with M); the deepest
    pipeline that fits SMEM."""
    if tile_m is None:
        tile_m = next((t for t in TILE_M_CHOICES if t >= m * slices), None if slices > 1 else 256)
    if tile_m is None or (slices > 1 and tile_m > 128):  # x slots past 128 rows outgrow SMEM
        return None
    config = None
    tile_k = 256 if tile_m <= 64 or slices > 1 else 128 if tile_m == 128 else 64
    while config is None and tile_k >= CHUNK_K:
        if k_pad % (slices * tile_k) == 0 or tile_k == CHUNK_K:
            min_steps = DECODE_K_IN_FLIGHT // tile_k if tile_k > 128 else 2
            config = _fitting(128, tile_m, tile_k, slices, group, min_steps)
        tile_k //= 2
    if config is None:
        return None
    try:
        config.check_problem(m, n_pad, k_pad, group)
    except ValueError:
        return None
    return config


def slice_choices(m: int) -> tuple[int, ...]:
    """K slices worth weighing at M: 4 at decode (M <= 32), 2 up to M = 64 (x rows M x S stay within a
    128-row tile), none beyond."""
    return (1, 4) if m <= 32 else (1, 2) if m <= 64 else (1,)


def _fitting(
    tile_n: int, tile_m: int, tile_k: int, slices: int, group: int, min_steps: int = 2
) -> BlackwellConfig | None:
    """The deepest pipeline of this tiling that fits SMEM, of at least ``min_steps`` steps."""
    for steps in range(6, min_steps - 1, -1):
        config = BlackwellConfig(tile_n, tile_m, tile_k, steps, slices)
        if fits_smem(config, group=group, has_offsets=True, scale_bytes=4):
            return config
    return None
