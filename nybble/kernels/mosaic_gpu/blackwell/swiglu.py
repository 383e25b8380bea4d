"""The Blackwell kernel with the SwiGLU epilogue (the Hopper kernel's, ``mosaic_gpu/swiglu.py``): at decode
its K-sliced tiles sum their slices through SMEM with ``dequant_registers.sum_slices``, the same pass the
Hopper kernel's epilogue extends; the warpgroup that stores y stages the rows' sums of squares at its start
(``kernel.launch``). A CTA covers tile_n / S columns (32 at decode: two 16-column gate/up blocks)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from nybble.kernels.mosaic_gpu.blackwell.config import DEFAULT_NUM_SMS, BlackwellConfig
from nybble.kernels.mosaic_gpu.blackwell.kernel import (
    BlackwellProblem,
    DenseTiles,
    launch,
    operand_views,
    plan,
)
from nybble.kernels.mosaic_gpu.dense import kernel_x
from nybble.packing.gate_up import GATE_UP_BLOCK
from nybble.quant.qweight import QuantizedWeight


def swiglu_reason(config: BlackwellConfig) -> str | None:
    """Why ``config`` cannot run the SwiGLU epilogue, or None: K slices (the slices' sum is the epilogue),
    and whole 16-column gate/up blocks in a CTA's tile_n / S columns."""
    if config.slices == 1:
        return f"the SwiGLU epilogue runs with K slices (decode configs), not slices=1 ({config.tag})"
    if config.cta_cols % (2 * GATE_UP_BLOCK):
        blocks = 2 * GATE_UP_BLOCK
        return f"a CTA of {config.cta_cols} columns holds no whole {blocks}-column blocks ({config.tag})"
    return None


def swiglu_plan(
    m: int,
    qw: QuantizedWeight,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    config: BlackwellConfig | None = None,
    dtype: Any = jnp.bfloat16,
) -> BlackwellProblem:
    """The launch of M rows against the gate/up weight ``qw`` with the epilogue: the B200 heuristics' pick
    (or ``config``); ValueError naming the rule where it cannot run the epilogue."""
    p = plan(m, qw, num_sms=num_sms, config=config, dtype=dtype)
    if (why := swiglu_reason(p.config)) is not None:
        raise ValueError(f"swiglu_plan: {why}")
    return dataclasses.replace(p, n=qw.shape[1] // 2, swiglu=True)


def fits(m: int, qw: QuantizedWeight, num_sms: int = DEFAULT_NUM_SMS) -> bool:
    """Whether the B200 pick for M rows against ``qw`` runs the epilogue."""
    try:
        swiglu_plan(m, qw, num_sms=num_sms)
    except ValueError:
        return False
    return True


def forward(
    x2d: jax.Array,
    qw: QuantizedWeight,
    sum_of_squares: jax.Array,
    norm: tuple[float, float],
    config: BlackwellConfig | None,
    num_sms: int,
) -> jax.Array:
    """(M, N / 2) in x's dtype: the kernel with the epilogue (arguments checked by the caller)."""
    m = x2d.shape[0]
    p = dataclasses.replace(swiglu_plan(m, qw, num_sms=num_sms, config=config, dtype=x2d.dtype), norm=norm)
    x2d = kernel_x(x2d, p)  # the CUDA guard, and x's zero rows where M * S would not fill 8-row tiles
    rows = p.out_rows  # under K slices y takes x's rows (Mosaic's 8-row staging tiles), sliced after
    if rows != m:
        sum_of_squares = jnp.pad(sum_of_squares, (0, rows - m))
    views = operand_views(p, qw.codes, x2d, qw.scales, qw.offsets)
    y = launch(p, [*views, sum_of_squares], DenseTiles())
    return y if rows == m else y[:m]


__all__ = ["fits", "forward", "swiglu_plan", "swiglu_reason"]
