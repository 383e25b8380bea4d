"""The Triton kernel's tuning configuration and the heuristics that pick it from the problem and the GPU.

A config is a tile of the output (``block_m`` x ``block_n``), the words of K read per step and plane
(``block_kw``: each step multiplies 8 planes of ``block_kw`` K rows, so 8 * block_kw rows of K), the
split of K over programs (``splits`` > 1: f32 partial sums, then one reduction), and Triton's launch
parameters. :func:`candidate_configs` is the whole set the heuristics can return, so that the tests can
run each one.
"""

from __future__ import annotations

import dataclasses

from nybble.kernels.gpu import GpuSpec
from nybble.packing.planes import PLANES

# tl.dot needs every dimension >= 16.
MIN_DOT = 16
DECODE_M = 16  # at most this many rows: the GEMV-like decode tiles (one 16-row MMA tile, split-K)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuningConfig:
    """One launch of the Triton kernel: tile sizes, the K split and Triton's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_kw: int  # words (K rows per plane) per step: 8 * block_kw rows of K per step
    splits: int = 1  # programs along K; > 1 writes f32 partials reduced by a second launch
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_kw"):
            v = getattr(self, name)
            if v < MIN_DOT or v & (v - 1):
                raise ValueError(f"TuningConfig: {name} must be a power of two >= {MIN_DOT}, got {v}")
        if self.splits < 1:
            raise ValueError(f"TuningConfig: splits must be >= 1, got {self.splits}")

    @property
    def route(self) -> str:
        """How the scales are applied (``nybble.kernels.triton.dequant.step``): "accumulators" for the
        16-row decode tiles, "weights" for the prefill tiles."""
        return "accumulators" if self.block_m <= MIN_DOT else "weights"

    def smem_bytes(self, x_itemsize: int) -> int:
        """Shared memory of the software pipeline: per stage one word tile and 8 x tiles."""
        words = self.block_kw * self.block_n * 4
        x = PLANES * self.block_m * self.block_kw * x_itemsize
        return self.num_stages * (words + x)


def plane_rows(k_pad: int) -> int:
    """P = K_pad / 8: the K rows of one plane (``nybble.packing.planes``)."""
    return k_pad // PLANES


def largest_block_kw(k_pad: int, group: int, want: int) -> int:
    """The largest power of two <= ``want`` dividing both P and the group: a plane tile in one group."""
    p = plane_rows(k_pad)
    kw = want
    while kw > 1 and (p % kw or group % kw):
        kw //= 2
    return kw


def block_kw_unsupported(k_pad: int, group: int) -> str | None:
    """Why no plane tile of >= 16 rows fits these K and group, or None."""
    if largest_block_kw(k_pad, group, MIN_DOT) < MIN_DOT:
        return (
            f"the Triton kernel needs K_pad / 8 = {plane_rows(k_pad)} and the group ({group}) to be "
            f"multiples of {MIN_DOT} (K a multiple of {PLANES * MIN_DOT}, group >= {MIN_DOT})"
        )
    return None


def _splits(k_steps: int, tiles: int, sms: int, m: int, k_pad: int) -> int:
    """Programs along K so that about two waves of programs cover the SMs; a divisor of the K steps. At
    most K / (160 m): each split writes and reads back m x N f32 partials (8 m N bytes), kept within 5%
    of the weight's K N / 2 bytes."""
    want = max(1, min(-(-2 * sms // max(tiles, 1)), k_pad // (160 * m)))
    best = 1
    for s in range(1, min(want, k_steps) + 1):
        if k_steps % s == 0:
            best = s
    return best


# Per branch of M (the largest M it takes): block_m, block_n, the largest step (words per plane), warps,
# stages. block_n shrinks to a divisor of N_pad (a multiple of 64; a tile past it would write past y).
# The decode branch's block_n and warps are the widest of DECODE_TILES that fills the SMs (``_decode_tile``).
BRANCHES = ((DECODE_M, MIN_DOT, 64, 128, 4, 3), (64, 64, 128, 32, 4, 3), (None, 128, 128, 16, 8, 3))
# Prefill rows per tile on datacenter Blackwell (sm_100): its MMA accumulates outside the registers, so a
# tile of twice the rows halves the dequantization per weight (each weight is dequantized once per M tile).
BLACKWELL_PREFILL_M = 256
# Decode (block_n, warps): one warp per 16 output columns (a warp's MMA tile: 16 rows x 2 x 8 columns).
DECODE_TILES = ((64, 4), (32, 2), (16, 1))


def _fit_stages(cfg: TuningConfig, x_itemsize: int, gpu: GpuSpec) -> TuningConfig:
    """Fewer pipeline stages (down to 2), then shorter steps, until the pipeline fits the GPU's shared
    memory for one block."""
    stages = cfg.num_stages
    while cfg.num_stages > 2 and cfg.smem_bytes(x_itemsize) > gpu.smem_per_block_optin:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.smem_bytes(x_itemsize) > gpu.smem_per_block_optin and cfg.block_kw > MIN_DOT:
        return _fit_stages(
            dataclasses.replace(cfg, block_kw=cfg.block_kw // 2, num_stages=stages), x_itemsize, gpu
        )
    return cfg


def _decode_tile(n_pad: int, sms: int) -> tuple[int, int] | None:
    """(block_n, warps) of the widest decode tile whose N tiles alone fill the SMs (one launch, no split),
    the narrowest if its tiles reach a quarter of the SMs (a second launch costs more than idle SMs at
    these sizes); None: too few columns, split K instead."""
    for bn, warps in DECODE_TILES:
        if -(-n_pad // bn) >= sms:
            return bn, warps
    bn, warps = DECODE_TILES[-1]
    return (bn, warps) if 4 * -(-n_pad // bn) >= sms else None


def choose_config(m: int, k_pad: int, n_pad: int, group: int, x_itemsize: int, gpu: GpuSpec) -> TuningConfig:
    """The config for an (m, K_pad) x (K_pad, N_pad) product on ``gpu``.

    Decode (m <= 16): one 16-row tile, 128-word steps (1024 K rows), the widest of 64/32/16-column tiles
    (4/2/1 warps) whose tiles fill the SMs: one launch, no partial sums; where even 16-column tiles leave
    more than three quarters of the SMs idle, 64-column tiles and split-K to fill two waves of SMs (the
    partials, splits x m x N floats, are small). Up to 64 rows: 64 x 128 tiles, 32-word steps, no split.
    Prefill: 128 x 128 tiles (256 x 128 on sm_100 past 128 rows), 16-word steps (128 K rows), 8 warps.
    Steps shrink to what the group and P allow (a plane tile in one group); stages, then steps, drop to
    what the GPU's shared memory holds (Ada's and sm_120's 99 KB per block take fewer).
    """
    _, bm, bn, kw_max, warps, stages = next(b for b in BRANCHES if b[0] is None or m <= b[0])
    kw = largest_block_kw(k_pad, group, kw_max)
    splits = 1
    if bm == MIN_DOT:
        tile = _decode_tile(n_pad, gpu.sms)
        if tile is None:
            splits = _splits(plane_rows(k_pad) // kw, -(-n_pad // bn), gpu.sms, max(m, 1), k_pad)
        else:
            bn, warps = tile
    while n_pad % bn:  # no N tile past N_pad (a multiple of 64): the compiled kernel masks rows only
        bn //= 2
        warps = max(1, warps // 2) if bm == MIN_DOT else warps
    if bm == BRANCHES[-1][1] and gpu.compute_capability.startswith("10.") and m > bm:
        bm = BLACKWELL_PREFILL_M
    cfg = TuningConfig(block_m=bm, block_n=bn, block_kw=kw, splits=splits, num_warps=warps, num_stages=stages)
    cfg = _fit_stages(cfg, x_itemsize, gpu)
    if cfg.splits > 1 and (plane_rows(k_pad) // cfg.block_kw) % cfg.splits:  # shorter steps: a divisor again
        cfg = dataclasses.replace(
            cfg, splits=_splits(plane_rows(k_pad) // cfg.block_kw, -(-n_pad // bn), gpu.sms, max(m, 1), k_pad)
        )
    return cfg


def code_path(cfg: TuningConfig) -> TuningConfig:
    """``cfg`` with ``splits`` cut to 2: what its code does (one split or partials) without the count,
    which follows from K and the SM count."""
    return dataclasses.replace(cfg, splits=min(cfg.splits, 2))


def candidate_configs(gpus: tuple[GpuSpec, ...]) -> set[TuningConfig]:
    """Every config :func:`choose_config` can return on these GPUs, as :func:`code_path` s, by
    construction: each branch of M (each decode tile), every step size from 16 to the branch's largest,
    one split or several (decode), the stage counts and steps each GPU's shared memory leaves for 2- and
    4-byte x."""
    out = set()
    for _, bm, bn, kw_max, warps, stages in BRANCHES:
        tiles = DECODE_TILES if bm == MIN_DOT else ((bn, warps), (bn // 2, warps))  # N_pad % 128 = 64
        for tile_n, tile_warps in tiles:
            kw = MIN_DOT
            while kw <= kw_max:
                for splits in (1, 2) if bm == MIN_DOT and tile_n == bn else (1,):
                    base = TuningConfig(
                        block_m=bm,
                        block_n=tile_n,
                        block_kw=kw,
                        splits=splits,
                        num_warps=tile_warps,
                        num_stages=stages,
                    )
                    out.update(_fit_stages(base, size, gpu) for gpu in gpus for size in (2, 4))
                    if bm == BRANCHES[-1][1]:
                        wide = dataclasses.replace(base, block_m=BLACKWELL_PREFILL_M)
                        out.update(
                            _fit_stages(wide, size, gpu)
                            for gpu in gpus
                            if gpu.compute_capability.startswith("10.")
                            for size in (2, 4)
                        )
                kw *= 2
    return out


__all__ = [
    "BRANCHES",
    "DECODE_M",
    "DECODE_TILES",
    "MIN_DOT",
    "TuningConfig",
    "block_kw_unsupported",
    "candidate_configs",
    "choose_config",
    "code_path",
    "largest_block_kw",
]
