"""The grouped (mixture-of-experts) W4A16 kernel on Blackwell: ``ragged_dot(x, dequantize(qw), group_sizes)``
on tcgen05, one launch.

The same contract as the Hopper grouped kernel (``mosaic_gpu/grouped.py``: x sorted by expert, a stacked
``wgmma_int4`` weight, rows past the sum of the group sizes zero, sizes traced or concrete) built the same
way: the dense kernel's body (``kernel.launch``: TMA, dequantization into the SMEM A operand, tcgen05 MMAs
into TMEM, epilogue) over the Hopper grouped kernel's CTAs (``grouped.GroupedWork``). Each CTA scans the
group sizes on the device, finds the expert owning its M tile, reads that expert's codes and scales
(``codes.at[e]``: an expert without rows is never read) and x through a window of ``tile_m`` rows, and
stores only its rows of y (``common.store_rows``: one TMA per set bit of the row count); a tile of rows
past the sum stores zeros, a CTA past the last tile does nothing.

K slices at decode, as in the dense kernel (an M tile then holds tile_m / S rows of x, its expert's, and
their S slices): the picks weigh them by the CTAs of the launch, one per N tile of every active expert
(Qwen3-30B-A3B gate at one token: 8 experts x 6 N tiles = 48 CTAs on 148 SMs without slices; with 4, 192,
each a quarter of K). The slices' partial sums are added into the staged rows, which the CTA stores as
its expert's rows (``common.store_rows``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from nybble.kernels.mosaic_gpu import dense as hopper_api
from nybble.kernels.mosaic_gpu.blackwell.config import (
    DEFAULT_NUM_SMS,
    PREFILL_TILE_M,
    BlackwellConfig,
    heuristic_config,
    prefill_config,
    slice_choices,
    sliced_config,
    with_deeper_steps,
)
from nybble.kernels.mosaic_gpu.blackwell.kernel import BlackwellProblem, launch, operand_views, plan
from nybble.kernels.mosaic_gpu.grouped import GroupedWork, _check_values, grouped_is_supported, x_alignment
from nybble.kernels.mosaic_gpu.grouped_config import active_experts, max_m_tiles, planned_rows
from nybble.kernels.mosaic_gpu.interpret import active_params
from nybble.quant.qweight import QuantizedWeight

__all__ = ["blackwell_grouped_matmul", "grouped_heuristic_config", "grouped_plan", "launch_grouped"]


# The widest M tile (x rows times K slices) the grouped picks slice: 4 rows an expert (decode). Wider, the
# B200 X-ray's sliced tiles lose (Mixtral at 64 tokens: 95 -> 75% of HBM, Qwen3-235B at 512: 83 -> 63%):
# the fold's FMAs grow with the tile's columns, the tensor core multiplies the other slices' columns too
# (S times the MMA work), and without slices the experts' N tiles already fill the SMs.
MAX_SLICED_TILE_M = 16


def grouped_heuristic_config(
    rows: int, experts: int, n_pad: int, k_pad: int, group: int, num_sms: int = DEFAULT_NUM_SMS
) -> BlackwellConfig:
    """The B200 config of a grouped matmul of ``rows`` rows over ``experts`` (K_pad, N_pad) weights, for
    the balanced case (``grouped_config.planned_rows``: every expert that can hold rows holding
    ``ceil(rows / active)``): the dense heuristic's tiling of each K slice count it weighs
    (``config.sliced_config``; slices only in M tiles of at most ``MAX_SLICED_TILE_M``), the one whose
    slowest SM walks least K (waves of the launch's CTAs, every active expert's M and N tiles, times K / S;
    ties to fewer slices; then ``config.with_deeper_steps``); past 128 rows an expert, the dense
    heuristic's M tiles of 256, 192 or 128 rows over all the active experts' CTAs
    (``config.prefill_config``)."""
    if rows < 1 or experts < 1:
        raise ValueError(f"grouped_heuristic_config: bad problem rows={rows}, experts={experts}")
    planned, active = planned_rows(rows, experts), active_experts(rows, experts)
    if planned > PREFILL_TILE_M:
        ctas = lambda c: active * c.ctas(planned, n_pad)
        config = prefill_config(planned, n_pad, k_pad, group, ctas, num_sms)
        return config or heuristic_config(planned, n_pad, k_pad, group, num_sms, sliced=False)  # raises

    def sm_time(c: BlackwellConfig) -> int:  # waves of the launch's CTAs x the K each walks
        return -(-active * c.ctas(planned, n_pad) // num_sms) * (k_pad // c.slices)

    best = None
    for slices in slice_choices(planned):
        config = sliced_config(planned, n_pad, k_pad, group, slices)
        if config is None or (slices > 1 and config.tile_m > MAX_SLICED_TILE_M):
            continue
        t = sm_time(config)
        if best is None or t < best[0]:
            best = (t, config)
    if best is None:
        return heuristic_config(planned, n_pad, k_pad, group, num_sms, sliced=False)  # raises, by name
    return with_deeper_steps(best[1], planned, n_pad, k_pad, group, sm_time)


def grouped_plan(
    rows: int,
    qw: QuantizedWeight,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    config: BlackwellConfig | None = None,
    dtype: Any = jnp.bfloat16,
) -> tuple[BlackwellProblem, GroupedWork]:
    """The launch of one grouped matmul of ``rows`` rows against the stacked ``qw`` on a Blackwell GPU:
    the problem (config, padding) and its CTAs (``GroupedWork``: the bound on M tiles times N tiles)."""
    experts = qw.codes.shape[0]
    k_pad, n_pad = qw.padded_shape
    picked = config is None
    if picked:
        config = grouped_heuristic_config(rows, experts, n_pad, k_pad, qw.group, num_sms)
    # the dense kernel's padding and pipeline sizing; each M tile holds x_rows_per_tile rows of one expert
    p = plan(rows, qw, num_sms=num_sms, config=config, dtype=dtype, grouped=True, picked=picked)
    tile_rows = p.config.x_rows_per_tile
    bound = max_m_tiles(rows, experts, tile_rows, x_alignment(p, tile_rows))
    return p, GroupedWork(experts, rows, bound, tile_rows=tile_rows)


def blackwell_grouped_matmul(
    x: jax.Array,
    qw: QuantizedWeight,
    group_sizes: jax.Array,
    *,
    config: BlackwellConfig | None = None,
    num_sms: int = DEFAULT_NUM_SMS,
) -> jax.Array:
    """``jax.lax.ragged_dot(x, dequantize(qw), group_sizes)`` with the Blackwell (tcgen05) grouped kernel.

    Args:
      x: (rows, K) bf16/f16, sorted by expert.
      qw: a stacked ``wgmma_int4`` QuantizedWeight: codes (experts, N_pad / 8, K_pad), scales (and
        offsets) (experts, groups, N_pad), ``shape`` (K, N) per expert.
      group_sizes: (experts,) int32, rows of x per expert, summing to at most rows.
      config: a BlackwellConfig; None: :func:`grouped_heuristic_config`'s.
      num_sms: SMs of the target GPU (148 on a B200).

    Returns:
      (rows, N) in x's dtype; rows past the sum of group_sizes are zero. Forward only (no gradient).

    Refuses what the Hopper grouped kernel refuses, with the same messages. group_sizes' values are checked
    where concrete (none negative, sum at most rows); under jit a negative size counts as zero and a sum
    past the rows computes the rows there are.
    """
    if (reason := grouped_is_supported(x, qw, group_sizes)) is not None:
        raise NotImplementedError(f"grouped_matmul cannot run these arguments: {reason}")
    if config is not None and not isinstance(config, BlackwellConfig):
        raise TypeError(
            f"blackwell_grouped_matmul: config must be a BlackwellConfig, got {type(config).__name__}"
        )
    if num_sms < 1:
        raise ValueError(f"blackwell_grouped_matmul: num_sms={num_sms} must be positive")
    rows = x.shape[0]
    _check_values(group_sizes, rows)
    if rows == 0:
        return jnp.zeros((0, qw.shape[1]), x.dtype)
    p, work = grouped_plan(rows, qw, num_sms=int(num_sms), config=config, dtype=x.dtype)
    return launch_grouped(x, qw, group_sizes, p, work)


def launch_grouped(
    x: jax.Array, qw: QuantizedWeight, group_sizes: jax.Array, p: BlackwellProblem, work: GroupedWork
) -> jax.Array:
    """The grouped launch of a plan (arguments checked by the caller): (rows, N) in x's dtype, or (rows,
    N / 2) with ``p.swiglu`` (``grouped_swiglu.py``: no row scale, ``p.norm`` None)."""
    rows, k = x.shape
    p = dataclasses.replace(p, dtype=x.dtype)
    if active_params() is None:
        x = hopper_api._requires_gpu_p.bind(x)
    if k != p.k_pad or p.x_rows != rows:  # the dense kernel's padding (K to 64, rows to whole 8-row tiles)
        x = jnp.pad(x, ((0, p.x_rows - rows), (0, p.k_pad - k)))
    operands = [group_sizes, *operand_views(p, qw.codes, x, qw.scales, qw.offsets)]
    y = launch(p, operands, work)  # (out_rows, n): under K slices x's padded rows, zeros past the groups
    n = p.n if p.swiglu else qw.shape[1]  # (p.n may be N_pad: whole 64-column TMA stores)
    return y if y.shape == (rows, n) else y[:rows, :n]
