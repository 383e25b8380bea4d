"""Tuning configurations of the Mosaic GPU W4A16 kernel, their SMEM cost, and the heuristics choosing them.

Naming: the kernel computes y^T = W^T x^T, so the weight's N is WGMMA's M dimension (``tile_n`` rows of
dequantized weights per warpgroup, in registers) and the batch M is WGMMA's N dimension (``tile_m``).

Two families come out of :func:`heuristic_config`:
  * decode (M <= 64): one warpgroup per CTA (w4a16.py), ``tile_m`` just covers M, and split-K multiplies
    the CTA count so that all SMs stream weights (a decode GEMM is a weight-bandwidth problem: every byte
    of W is read exactly once);
  * prefill (M > 64): warp-specialized (w4a16_ws.py), two compute warpgroups of ``tile_n`` rows sharing
    each x tile, ``tile_m`` = 128 (a 128x128 f32 accumulator is 128 registers per thread, the most a
    warpgroup can hold next to a dequantized chunk), split-K only when the tile grid underfills the GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable

from nybble.kernels.device import DEFAULT_NUM_SMS
from nybble.packing.groups import MIN_GROUP_SIZE, group_rows

# Hopper's opt-in SMEM per CTA (cudaDevAttrMaxSharedMemoryPerBlockOptin), what Mosaic checks against.
SMEM_BUDGET_BYTES = 232448
# Barriers and alignment padding next to the buffers counted in `smem_bytes`.
_SMEM_SLACK_BYTES = 1024
# WGMMA's N (our tile_m) runs 8..256 in steps of 8; powers of two keep the store path simple.
TILE_M_CHOICES = (8, 16, 32, 64, 128)
TILE_N_CHOICES = (64, 128)
TILE_K_CHOICES = (64, 128)
# Dequantization works on K chunks of this width: an int4 chunk of 64 is a 32-byte swizzled SMEM tile, the
# narrowest swizzle WGMMA_UPCAST_4X loads accept, and a 128x64 f32 chunk (64 registers) fits beside the
# accumulator.
DEQUANT_CHUNK_K = 64
MAX_SPLIT_K = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuningConfig:
    """One compiled variant of the W4A16 kernel. Validates itself on construction."""

    # Rows of W^T (columns of the output) per compute warpgroup: WGMMA's M.
    tile_n: int = 128
    # Rows of the activations per CTA: WGMMA's N. M is padded to a multiple of it.
    tile_m: int = 128
    # K per pipeline step (one TMA of codes, activations, scale rows).
    tile_k: int = 128
    # Pipeline depth: SMEM slots per operand. >= 2: the activation slot is released one step late
    # because one WGMMA stays in flight across steps.
    max_concurrent_steps: int = 4
    # CTAs sharing one output tile along K; partials are f32 and summed outside the kernel.
    split_k: int = 1
    # Launch order: M tiles per band of the planar snake over (M tiles, N tiles); see common.py.
    grid_tile_m: int = 8
    # 1: one warpgroup per CTA, software pipeline (w4a16.py). 2: warp-specialized, a TMA warpgroup
    # feeding two compute warpgroups that share the x tile, a CTA covers 2 * tile_n (w4a16_ws.py).
    compute_wgs: int = 1
    # How the codes reach registers. "int4": TMA'd as jnp.int4 and unpacked by Mosaic's WGMMA_UPCAST_4X
    # path (uint8 codes then need an XLA bitcast that copies them: fine for prefill). "uint8": TMA'd as
    # the stored bytes, nibbles split with i32 shifts, x's K de-interleaved per 64-chunk by the wrapper
    # (zero-copy weights: for decode, where weight bytes are the whole cost).
    codes_as: str = "int4"

    def __post_init__(self) -> None:
        if self.tile_n not in TILE_N_CHOICES:
            raise ValueError(f"TuningConfig: tile_n={self.tile_n} must be one of {TILE_N_CHOICES}")
        if self.tile_m not in TILE_M_CHOICES:
            raise ValueError(f"TuningConfig: tile_m={self.tile_m} must be one of {TILE_M_CHOICES}")
        if self.tile_k not in TILE_K_CHOICES:
            raise ValueError(f"TuningConfig: tile_k={self.tile_k} must be one of {TILE_K_CHOICES}")
        if not 2 <= self.max_concurrent_steps <= 8:
            raise ValueError(
                f"TuningConfig: max_concurrent_steps={self.max_concurrent_steps} must be in [2, 8]"
            )
        if self.codes_as not in ("int4", "uint8"):
            raise ValueError(f"TuningConfig: codes_as={self.codes_as!r} must be 'int4' or 'uint8'")
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"TuningConfig: compute_wgs={self.compute_wgs} must be 1 or 2")
        if not 1 <= self.grid_tile_m <= 64:
            raise ValueError(f"TuningConfig: grid_tile_m={self.grid_tile_m} must be in [1, 64]")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"TuningConfig: split_k={self.split_k} must be in [1, {MAX_SPLIT_K}]")

    def check_problem(self, m_pad: int, n_pad: int, k_pad: int, group: int) -> None:
        """Raises ValueError naming the rule when this config cannot run a padded problem."""
        if m_pad % self.tile_m:
            raise ValueError(f"padded M={m_pad} must be a multiple of tile_m={self.tile_m}")
        cta_n = self.tile_n * self.compute_wgs
        if n_pad % cta_n:
            raise ValueError(
                f"N_pad={n_pad} must be a multiple of tile_n * compute_wgs = {self.tile_n} * "
                f"{self.compute_wgs}"
            )
        if k_pad % (self.tile_k * self.split_k):
            raise ValueError(
                f"K_pad={k_pad} must be a multiple of tile_k * split_k = {self.tile_k} * "
                f"{self.split_k}; choose a split_k dividing K_pad / tile_k = {k_pad // self.tile_k}"
            )
        if group < MIN_GROUP_SIZE:
            raise ValueError(f"group size {group} must be >= {MIN_GROUP_SIZE}")
        if group < self.tile_k and self.tile_k % group:
            raise ValueError(f"group size {group} must divide tile_k={self.tile_k}")
        if group > self.tile_k and group % self.tile_k:
            raise ValueError(f"group size {group} must be a multiple of tile_k={self.tile_k}")


def scale_rows_per_step(config: TuningConfig, group: int) -> int:
    """Scale (and offset) rows one pipeline step reads: several groups per K step, or one."""
    return max(1, config.tile_k // group)


def smem_bytes(
    config: TuningConfig, *, group: int, has_offsets: bool, act_bytes: int = 2, scale_bytes: int = 2
) -> int:
    """SMEM one CTA allocates: the pipeline's stage buffers plus the output staging tile."""
    rows = scale_rows_per_step(config, group)
    cta_n = config.tile_n * config.compute_wgs
    per_stage = (
        cta_n * config.tile_k // 2  # int4 codes
        + config.tile_m * config.tile_k * act_bytes  # activations
        + rows * cta_n * scale_bytes * (2 if has_offsets else 1)
    )
    out_bytes = 4 if config.split_k > 1 else act_bytes
    return per_stage * config.max_concurrent_steps + config.tile_m * cta_n * out_bytes


def fits_smem(config: TuningConfig, *, group: int, has_offsets: bool, scale_bytes: int = 2) -> bool:
    """Whether ``config`` fits Hopper's SMEM budget (with room for barriers)."""
    used = smem_bytes(config, group=group, has_offsets=has_offsets, scale_bytes=scale_bytes)
    return used + _SMEM_SLACK_BYTES <= SMEM_BUDGET_BYTES


def _tile_m_for(m: int) -> int:
    for t in TILE_M_CHOICES:
        if m <= t:
            return t
    return TILE_M_CHOICES[-1]


def _wave_efficiency(ctas: int, num_sms: int) -> float:
    """Fraction of SM-slots doing work over the waves a launch of ``ctas`` CTAs needs."""
    return ctas / (math.ceil(ctas / num_sms) * num_sms)


def heuristic_config(
    m: int,
    n_pad: int,
    k_pad: int,
    group_size: int | None,
    num_sms: int = DEFAULT_NUM_SMS,
    *,
    has_offsets: bool = True,
    scale_bytes: int = 2,
    warp_specialized: bool = True,
    codes_dtype: str = "uint8",
) -> TuningConfig:
    """Chooses a config for an (M, K_pad) x (K_pad, N_pad) problem on a GPU with ``num_sms`` SMs.

    ``group_size`` None means one group over all of K_pad; K_pad and N_pad are multiples of 64.
    Decode (M <= 64) runs one warpgroup per CTA; prefill runs the warp-specialized kernel (two compute
    warpgroups sharing each x tile) unless ``warp_specialized=False`` or N_pad is not a multiple of 128.
    Among tile_n / split_k choices it takes the launch that fills the SMs' waves best (fewer splits and
    wider tiles win ties: less f32 partial traffic), then the deepest pipeline that fits SMEM.
    ``codes_dtype`` is how the weight stores its codes ("uint8" or "int4"): uint8 codes are read as bytes
    (``codes_as="uint8"``) while x is small next to them (4 M < N: de-interleaving x costs less than
    XLA's copy of the codes into int4), and through the int4 view otherwise.
    """
    if m < 1 or n_pad < 1 or k_pad < 1:
        raise ValueError(f"heuristic_config: bad problem M={m}, N_pad={n_pad}, K_pad={k_pad}")
    group = group_rows(k_pad, group_size)
    tile_m = _tile_m_for(m)
    m_tiles = -(-m // tile_m)
    decode = m <= 64
    # 128-wide K steps halve the pipeline's per-step overhead; 64 when K_pad or the groups need it.
    tile_k = 128 if k_pad % 128 == 0 and (group % 128 == 0 or 128 % group == 0) else 64
    k_steps = k_pad // tile_k
    wgs_choices = (1,) if decode or not warp_specialized else (2, 1)
    codes_as = "uint8" if codes_dtype == "uint8" and 4 * m_tiles * tile_m < n_pad else "int4"
    best: tuple[float, TuningConfig] | None = None
    for compute_wgs, tile_n in itertools.product(wgs_choices, TILE_N_CHOICES[::-1]):
        if n_pad % (tile_n * compute_wgs):
            continue
        tiles = n_pad // (tile_n * compute_wgs) * m_tiles
        for split_k in range(1, MAX_SPLIT_K + 1):
            # Split K only while the tile grid alone underfills the SMs (each split adds an f32 partial
            # write + read of the output), and keep >= 4 K steps per split to amortise the prologue.
            if split_k > 1 and (tiles * (split_k - 1) >= num_sms or k_steps // split_k < 4):
                continue
            if k_steps % split_k:
                continue
            # Wave efficiency, discounted 5% per extra split (partials traffic, reduction), 3% for
            # 64-row tiles (half the WGMMA work per loaded x tile) and 10% for a prefill CTA without
            # warp specialization.
            score = _wave_efficiency(tiles * split_k, num_sms) / (1 + 0.05 * (split_k - 1))
            score *= 0.97 if tile_n == 64 else 1.0
            score *= 0.9 if len(wgs_choices) == 2 and compute_wgs == 1 else 1.0
            if best is None or score > best[0] + 1e-9:
                shape = dict(tile_n=tile_n, tile_m=tile_m, tile_k=tile_k, split_k=split_k)
                shape.update(compute_wgs=compute_wgs, codes_as=codes_as)
                # Decode streams weights: a deep pipeline keeps ~8 K steps of codes in flight per SM.
                max_steps = min(8 if decode else 4, k_steps // split_k)
                config = _deepest_fitting(shape, max_steps, group, has_offsets, scale_bytes)
                if config is not None:
                    best = (score, config)
    if best is None:
        raise ValueError(
            f"heuristic_config: no config fits M={m}, N_pad={n_pad}, K_pad={k_pad}, group={group}"
        )
    return best[1]


def _deepest_fitting(
    shape: dict[str, int], max_steps: int, group: int, has_offsets: bool, scale_bytes: int
) -> TuningConfig | None:
    """The config of this tile shape with the most pipeline slots (2..max_steps) that fits SMEM."""
    for steps in range(max(2, max_steps), 1, -1):
        config = TuningConfig(max_concurrent_steps=steps, **shape)
        if fits_smem(config, group=group, has_offsets=has_offsets, scale_bytes=scale_bytes):
            return config
    return None


def heuristic_cases(
    weight_shapes: Iterable[tuple[int, int]],
    batches: Iterable[int],
    group_sizes: Iterable[int | None],
    num_sms: int = DEFAULT_NUM_SMS,
    codes_dtypes: Iterable[str] = ("uint8", "int4"),
) -> dict[tuple[TuningConfig, object, bool], tuple[int, int, int, int | None, bool, str]]:
    """Every kernel :func:`heuristic_config` can build for these problems, each with one problem using it.

    Keys are (config, how groups meet the 64-wide dequant chunks, symmetric): what changes the kernel's
    code; values are (M, K, N, group_size, symmetric, codes_dtype). Tests lower every entry for CUDA, so
    every kernel the heuristics can return at those shapes is known to compile. (K, N) are logical.
    """
    from nybble.packing import padded_weight_dims

    cases: dict[tuple[TuningConfig, object, bool], tuple[int, int, int, int | None, bool, str]] = {}
    for (k, n), m, group_size, symmetric, codes_dtype in itertools.product(
        weight_shapes, list(batches), list(group_sizes), (True, False), list(codes_dtypes)
    ):
        k_pad, n_pad = padded_weight_dims(k, n, group_size)
        config = heuristic_config(
            m, n_pad, k_pad, group_size, num_sms, has_offsets=not symmetric, codes_dtype=codes_dtype
        )
        group = group_rows(k_pad, group_size)
        structure = group if group < config.tile_k else "group >= tile_k"
        cases.setdefault((config, structure, symmetric), (m, k, n, group_size, symmetric, codes_dtype))
    return cases
