"""The grouped (mixture-of-experts) kernels with the SwiGLU epilogue: ``silu(x @ W_gate[e]) * (x @ W_up[e])``
for each row's expert e, one launch, on Hopper (``grouped.py``) and Blackwell (``blackwell/grouped.py``).

A MoE layer's experts read their rows' x through gate and up, then down reads the SiLU product. With each
expert's gate and up fused into one stacked weight whose columns interleave them 8 by 8
(``nybble.packing.gate_up``, per expert; ``nybble.models``' fused experts hold theirs so), the grouped
kernel's K-sliced decode CTAs hold both halves of every product they compute, and the dense kernel's
SwiGLU epilogue (``swiglu.py``: the slices' sum, then the SiLU product in f32, rounded once) stores
(rows, N / 2): the elementwise launch XLA would spend between the gate/up and down grouped kernels is gone
(one a MoE layer of a decode step). The grouping is the plain grouped kernel's: the same CTAs, row windows
and zero rows past the groups (silu(0) * 0).

No row scale: a MoE block's norm scale multiplies its rows before they are sorted by expert (the gather
that sorts them applies it), so the epilogue's r is 1 and the kernel reads no sums of squares
(``Problem.norm`` None). Forward only, as the plain grouped kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nybble.device import DEFAULT_NUM_SMS
from nybble.kernels.mosaic_gpu.common import Problem
from nybble.kernels.mosaic_gpu.config import TuningConfig, swiglu_reason
from nybble.kernels.mosaic_gpu.dense import kernel_x
from nybble.kernels.mosaic_gpu.grouped import (
    GroupedWork,
    _check_values,
    _views,
    grouped_is_supported,
    grouped_plan,
)
from nybble.kernels.mosaic_gpu.swiglu import width_reason
from nybble.kernels.mosaic_gpu.w4a16 import w4a16_single_wg
from nybble.kernels.ops.ragged_matmul.reference import reference_ragged_matmul
from nybble.packing.gate_up import concatenated_order
from nybble.quant.qweight import QuantizedWeight

FAMILIES = ("hopper", "blackwell")


def unsupported(x: Any, qw: Any, group_sizes: Any) -> str | None:
    """Why the grouped kernels cannot run the SwiGLU epilogue on these arguments, or None: what the plain
    grouped kernel refuses, or a per-expert N that is not 2 x a multiple of 64 (gate and up, each stored
    straight into y: ``swiglu.OUT_COLUMNS``)."""
    return grouped_is_supported(x, qw, group_sizes) or width_reason(qw.shape[1])


def _allows(config: TuningConfig) -> bool:
    """The Hopper configs that run the epilogue: K-sliced, whole gate/up blocks, one compute warpgroup."""
    return swiglu_reason(config) is None and config.compute_wgs == 1


def grouped_swiglu_plan(
    rows: int,
    qw: QuantizedWeight,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    config: Any = None,
    family: str = "hopper",
) -> tuple[Any, GroupedWork]:
    """The launch of ``rows`` rows against the stacked gate/up weight ``qw`` with the epilogue: the
    problem (``n`` = pairs, ``swiglu`` set) and its CTAs. Hopper: the grouped heuristics' pick among the
    configs that run it; Blackwell: the grouped pick, or ValueError naming the rule where it cannot run it
    (as for an explicit ``config`` that cannot)."""
    if family == "blackwell":
        from nybble.kernels.mosaic_gpu.blackwell import grouped as blackwell
        from nybble.kernels.mosaic_gpu.blackwell.swiglu import swiglu_reason as blackwell_reason

        p, work = blackwell.grouped_plan(rows, qw, num_sms=num_sms, config=config)
        if (why := blackwell_reason(p.config)) is not None:
            raise ValueError(f"grouped_swiglu_plan: {why}")
    else:
        if config is not None and not _allows(config):
            why = swiglu_reason(config) or f"one compute warpgroup, not {config.compute_wgs} ({config.tag})"
            raise ValueError(f"grouped_swiglu_plan: {why}")
        p, work = grouped_plan(rows, qw, num_sms=num_sms, config=config, allow=_allows)
    # No row scale (module docstring): norm None, so no sums of squares to read.
    return dataclasses.replace(p, n=qw.shape[1] // 2, swiglu=True, norm=None), work


def fits(rows: int, qw: QuantizedWeight, num_sms: int = DEFAULT_NUM_SMS, family: str = "hopper") -> bool:
    """Whether a config with the epilogue runs ``rows`` rows against ``qw`` on ``family``'s kernel."""
    try:
        grouped_swiglu_plan(rows, qw, num_sms=num_sms, family=family)
    except ValueError:
        return False
    return True


def reference(x: Any, qw: QuantizedWeight, group_sizes: Any) -> np.ndarray:
    """The same function in float64 on the host, sharing no code with the kernels: each row's expert
    product (``reference_ragged_matmul``), its columns put back as gate then up
    (``gate_up.concatenated_order``), then silu(gate) * up; (rows, N / 2), rows past the groups zero."""
    y = reference_ragged_matmul(x, qw, group_sizes)
    n = qw.shape[1] // 2
    concatenated = y[:, concatenated_order(n)]
    gate, up = concatenated[:, :n], concatenated[:, n:]
    return gate / (1.0 + np.exp(-gate)) * up


def mosaic_gpu_grouped_swiglu(
    x: jax.Array,
    qw: QuantizedWeight,
    group_sizes: jax.Array,
    *,
    config: Any = None,
    num_sms: int = DEFAULT_NUM_SMS,
    family: str = "hopper",
) -> jax.Array:
    """``silu(x @ W_gate[e]) * (x @ W_up[e])`` for x's rows sorted by expert, with the grouped kernel's
    SwiGLU epilogue: (rows, K) bf16/f16 -> (rows, N / 2) in x's dtype, rows past the groups zero.

    Args:
      x: (rows, K), sorted by expert (``group_sizes[0]`` rows of expert 0 first, ...).
      qw: a stacked ``wgmma_int4`` gate/up weight, each expert's columns gate and up interleaved
        (``nybble.packing.gate_up``), N = 2 x a multiple of 64.
      group_sizes: (experts,) int32, summing to at most rows (checked where concrete).
      config: a TuningConfig (Hopper) or BlackwellConfig that runs the epilogue; None: the heuristics'.
      num_sms: SMs of the target GPU.
      family: "hopper" or "blackwell".

    Raises NotImplementedError when the kernel cannot read the arguments (:func:`unsupported`), ValueError
    naming the rule when no config with the epilogue fits. Forward only.
    """
    if family not in FAMILIES:
        raise ValueError(f"mosaic_gpu_grouped_swiglu: family={family!r} must be one of {FAMILIES}")
    if (why := unsupported(x, qw, group_sizes)) is not None:
        raise NotImplementedError(f"mosaic_gpu_grouped_swiglu cannot run these arguments: {why}")
    rows = x.shape[0]
    _check_values(group_sizes, rows)
    if rows == 0:
        return jnp.zeros((0, qw.shape[1] // 2), x.dtype)
    p, work = grouped_swiglu_plan(rows, qw, num_sms=num_sms, config=config, family=family)
    if family == "blackwell":
        from nybble.kernels.mosaic_gpu.blackwell import grouped as blackwell

        return blackwell.launch_grouped(x, qw, group_sizes, p, work)
    return _hopper(x, qw, group_sizes, dataclasses.replace(p, dtype=x.dtype), work)


def _hopper(
    x: jax.Array, qw: QuantizedWeight, group_sizes: jax.Array, p: Problem, work: GroupedWork
) -> jax.Array:
    x = kernel_x(x, p)
    return w4a16_single_wg(p, [group_sizes, *_views(p, work.experts, x, qw)], work)


__all__ = ["fits", "grouped_swiglu_plan", "mosaic_gpu_grouped_swiglu", "reference", "unsupported"]
