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

No K slices (``BlackwellConfig.slices`` 1): the dense kernel's slices fill the SMs of one decode matmul,
and a decode MoE launch already has one CTA per N tile of every active expert (Qwen3-30B-A3B down at one
token: 8 experts x 16 N tiles = 128 CTAs; DeepSeek-V3 down: 8 x 56), while a sliced tile's window of
tile_m / S rows would make the expert scan's alignment and the partial-sum epilogue ragged. An explicit
sliced config is refused by name.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from nybble.kernels.mosaic_gpu import dense as hopper_api
from nybble.kernels.mosaic_gpu.blackwell.config import DEFAULT_NUM_SMS, BlackwellConfig, heuristic_config
from nybble.kernels.mosaic_gpu.blackwell.kernel import BlackwellProblem, launch, operand_views, plan
from nybble.kernels.mosaic_gpu.grouped import GroupedWork, _check_values, grouped_is_supported, x_alignment
from nybble.kernels.mosaic_gpu.grouped_config import max_m_tiles, planned_rows
from nybble.kernels.mosaic_gpu.interpret import active_params
from nybble.quant.qweight import QuantizedWeight

__all__ = ["blackwell_grouped_matmul", "grouped_heuristic_config", "grouped_plan"]


def grouped_heuristic_config(
    rows: int, experts: int, n_pad: int, k_pad: int, group: int, num_sms: int = DEFAULT_NUM_SMS
) -> BlackwellConfig:
    """The B200 config of a grouped matmul of ``rows`` rows over ``experts`` (K_pad, N_pad) weights: the
    dense heuristic's pick, without K slices, for the balanced case (``grouped_config.planned_rows``: every
    expert that can hold rows holding ``ceil(rows / active)``)."""
    if rows < 1 or experts < 1:
        raise ValueError(f"grouped_heuristic_config: bad problem rows={rows}, experts={experts}")
    return heuristic_config(planned_rows(rows, experts), n_pad, k_pad, group, num_sms, sliced=False)


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
    if config is None:
        config = grouped_heuristic_config(rows, experts, n_pad, k_pad, qw.group, num_sms)
    if config.slices != 1:
        raise ValueError(
            f"blackwell_grouped_matmul: the grouped Blackwell kernel runs without K slices (slices=1), "
            f"got slices={config.slices}: {config}"
        )
    p = plan(rows, qw, num_sms=num_sms, config=config, dtype=dtype)  # the dense kernel's padding
    bound = max_m_tiles(rows, experts, config.tile_m, x_alignment(p))
    return p, GroupedWork(experts, rows, bound)


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
      config: a BlackwellConfig without K slices; None: :func:`grouped_heuristic_config`'s.
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
    rows, k = x.shape
    _check_values(group_sizes, rows)
    if rows == 0:
        return jnp.zeros((0, qw.shape[1]), x.dtype)
    p, work = grouped_plan(rows, qw, num_sms=int(num_sms), config=config, dtype=x.dtype)
    if active_params() is None:
        x = hopper_api._requires_gpu_p.bind(x)
    if k != p.k_pad or p.x_rows != rows:  # the dense kernel's padding (K to 64, rows to whole 8-row tiles)
        x = jnp.pad(x, ((0, p.x_rows - rows), (0, p.k_pad - k)))
    operands = [group_sizes, *operand_views(p, qw.codes, x, qw.scales, qw.offsets)]
    y = launch(p, operands, work)
    return y if p.n == qw.shape[1] else y[:, : qw.shape[1]]
