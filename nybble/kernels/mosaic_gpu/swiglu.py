"""The Hopper kernel with the SwiGLU epilogue: ``silu(r (x @ W_gate)) * (r (x @ W_up))`` in one launch (and
the op's custom gradient for the Blackwell kernel's, ``blackwell/swiglu.py``: ``family="blackwell"``).

A SwiGLU MLP's gate and up projections read one x; fused into one weight with their columns interleaved
(``nybble.packing.gate_up``: 8 gate columns, then the 8 up columns they multiply), every CTA of a decode
config with K slices holds both halves of each product it computes. Its epilogue, where the S slices'
partial sums are added (``dequant_registers.sum_slices``), then scales both by the row's r (the
post-attention norm's deferred row scale, computed here from its sum of squares: XLA would spend a launch
on the rsqrt of a reduction's result), takes the SiLU product in f32 and stores
it: y is (M, N / 2), and the elementwise launch XLA would spend between the gate/up GEMM and the down
projection is gone. The main loop is the plain kernel's.

Configs: the decode ones with K slices whose CTA covers whole 16-column blocks
(``config.swiglu_reason``); the heuristics choose among those. Forward on the kernel; the gradient with
respect to x goes through XLA (dequantized weight, f32).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from nybble.device import DEFAULT_NUM_SMS
from nybble.kernels.epilogue import swiglu
from nybble.kernels.mosaic_gpu.common import Problem
from nybble.kernels.mosaic_gpu.config import TuningConfig, swiglu_reason
from nybble.kernels.mosaic_gpu.dense import _zero_cotangent, is_supported, kernel_x, plan
from nybble.kernels.mosaic_gpu.kernel import w4a16
from nybble.quant.qweight import QuantizedWeight, dequantize

# Columns of y per gate/up pair block the kernel stores straight into (M, N / 2): its TMA tiles y's GMEM
# side by the SMEM tile, up to 64 columns of bf16, so N / 2 must be a multiple of 64 (every real MLP's is).
OUT_COLUMNS = 64


def unsupported(x2d: Any, qw: QuantizedWeight) -> str | None:
    """Why the kernel cannot run the SwiGLU epilogue on these arguments, or None: what the plain kernel
    refuses, an odd number of columns, or a half N it cannot store straight."""
    return is_supported(x2d, qw) or width_reason(qw.shape[1])


def width_reason(n: int) -> str | None:
    """Why a gate/up weight of N columns (each expert's, for the grouped kernels) cannot be stored straight
    into y by the epilogue, or None: N / 2 must be whole ``OUT_COLUMNS`` TMA tiles."""
    if n % (2 * OUT_COLUMNS):
        return (
            f"the weight's N={n} is not 2 x a multiple of {OUT_COLUMNS} (gate and up, each stored straight "
            "into y)"
        )
    return None


def swiglu_plan(
    m: int,
    qw: QuantizedWeight,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    config: TuningConfig | None = None,
    dtype: Any = jnp.bfloat16,
) -> Problem:
    """The launch of M rows against the gate/up weight ``qw`` with the SwiGLU epilogue: the heuristics' pick
    among the configs that run it (ValueError when none fits, e.g. M > 8), or ``config``."""
    if config is not None and (why := swiglu_reason(config)) is not None:
        raise ValueError(f"swiglu_plan: {why}")
    p = plan(m, qw, num_sms=num_sms, config=config, dtype=dtype, allow=runs_swiglu)
    return dataclasses.replace(p, n=qw.shape[1] // 2, swiglu=True)


def runs_swiglu(config: TuningConfig) -> bool:
    """The heuristics' predicate for this epilogue: one function, so their cache answers each problem once."""
    return swiglu_reason(config) is None


def fits(m: int, qw: QuantizedWeight, num_sms: int = DEFAULT_NUM_SMS, family: str = "hopper") -> bool:
    """Whether a config with the SwiGLU epilogue fits M rows against ``qw`` (on ``family``'s kernel)."""
    if family == "blackwell":
        from nybble.kernels.mosaic_gpu.blackwell import swiglu as blackwell

        return blackwell.fits(m, qw, num_sms)
    try:
        swiglu_plan(m, qw, num_sms=num_sms)
    except ValueError:
        return False
    return True


def reference(
    x2d: jax.Array, qw: QuantizedWeight, sum_of_squares: jax.Array, norm: tuple[float, float] = (1.0, 1.0)
) -> jax.Array:
    """The same function through XLA: the dequantized weight in x's dtype, one f32 dot, the epilogue's
    arithmetic (``nybble.kernels.epilogue.swiglu``), rounded once to x's dtype."""
    y = jnp.dot(x2d, dequantize(qw, x2d.dtype), preferred_element_type=jnp.float32)
    return swiglu(y, sum_of_squares, norm).astype(x2d.dtype)


def _forward(
    x2d: jax.Array,
    qw: QuantizedWeight,
    sum_of_squares: jax.Array,
    norm: tuple[float, float],
    config: Any,
    num_sms: int,
    family: str,
) -> jax.Array:
    if family == "blackwell":
        from nybble.kernels.mosaic_gpu.blackwell import swiglu as blackwell

        return blackwell.forward(x2d, qw, sum_of_squares, norm, config, num_sms)
    m = x2d.shape[0]
    p = swiglu_plan(m, qw, num_sms=num_sms, config=config, dtype=x2d.dtype)
    x2d = kernel_x(x2d, p)
    # K-sliced configs stage y in Mosaic's 8-row SMEM tiles: y takes x's rows (zero rows where M * S would
    # not fill them, config.x_rows), sliced after (as the plain kernel's wrapper does).
    if p.x_rows != m:
        sum_of_squares = jnp.pad(sum_of_squares, (0, p.x_rows - m))
    y = w4a16(
        x2d, qw.codes, qw.scales, qw.offsets, n=p.n, group=qw.group, config=p.config, m=p.x_rows,
        sum_of_squares=sum_of_squares, norm=norm,
    )  # fmt: skip
    return y if p.x_rows == m else y[:m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _swiglu(
    x2d: jax.Array,
    qw: QuantizedWeight,
    sum_of_squares: jax.Array,
    norm: tuple[float, float],
    config: Any,
    num_sms: int,
    family: str,
) -> jax.Array:
    return _forward(x2d, qw, sum_of_squares, norm, config, num_sms, family)


def _swiglu_fwd(x2d, qw, sum_of_squares, norm, config, num_sms, family):
    return _forward(x2d, qw, sum_of_squares, norm, config, num_sms, family), (x2d, qw, sum_of_squares)


def _swiglu_bwd(norm, config, num_sms, family, saved, g):
    x2d, qw, sum_of_squares = saved
    _, vjp = jax.vjp(lambda x, s: reference(x, qw, s, norm), x2d, sum_of_squares)
    dx, ds = vjp(g)
    return dx, jax.tree.map(_zero_cotangent, qw), ds


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def mosaic_gpu_swiglu(
    x2d: jax.Array,
    qw: QuantizedWeight,
    sum_of_squares: jax.Array | None = None,
    *,
    norm: tuple[float, float] = (1.0, 1.0),
    config: Any = None,
    num_sms: int = DEFAULT_NUM_SMS,
    family: str = "hopper",
) -> jax.Array:
    """``silu(r (x2d @ W_gate)) * (r (x2d @ W_up))`` with the Hopper kernel's SwiGLU epilogue: (M, K) bf16/f16
    -> (M, N / 2) in x's dtype, for ``qw`` holding gate and up interleaved (``nybble.packing.gate_up``).

    Args:
      x2d: (M, K) activations; M <= 8 (the decode configs that run the epilogue).
      qw: a ``wgmma_int4`` gate/up weight of N = 2 x a multiple of 64.
      sum_of_squares: (M,) float32 s, each row's scale r = rsqrt(s / dim + eps) (an RMSNorm's, deferred
        past the projection: ``nybble.models``' ``RMSNorm.deferred_sum``); None: r = 1.
      norm: (dim, eps) of that scale.
      config: a TuningConfig that runs the epilogue (``config.swiglu_reason``; a BlackwellConfig for
        ``family="blackwell"``: ``blackwell.swiglu.swiglu_reason``); None: the heuristics'.
      num_sms: SMs of the target GPU.
      family: "hopper" (the WGMMA kernel) or "blackwell" (the tcgen05 kernel, the same epilogue).

    Differentiable with respect to x2d and sum_of_squares (through XLA). Raises ValueError naming the rule
    when no config runs these shapes, NotImplementedError when the kernel cannot read the arguments at all
    (:func:`unsupported`).
    """
    if getattr(x2d, "ndim", None) != 2:
        raise ValueError(f"mosaic_gpu_swiglu: x2d must be 2-D (M, K), got {getattr(x2d, 'shape', None)}")
    if (why := unsupported(x2d, qw)) is not None:
        raise NotImplementedError(f"mosaic_gpu_swiglu cannot run these arguments: {why}")
    m = x2d.shape[0]
    if sum_of_squares is None:
        sum_of_squares, norm = jnp.zeros((m,), jnp.float32), (1.0, 1.0)
    sum_of_squares = jnp.asarray(sum_of_squares, jnp.float32)
    if sum_of_squares.shape != (m,):
        raise ValueError(
            f"mosaic_gpu_swiglu: sum_of_squares has shape {sum_of_squares.shape}, expected (M,) = ({m},)"
        )
    norm = (float(norm[0]), float(norm[1]))
    if family not in ("hopper", "blackwell"):
        raise ValueError(f"mosaic_gpu_swiglu: family={family!r} must be 'hopper' or 'blackwell'")
    return _swiglu(x2d, qw, sum_of_squares, norm, config, int(num_sms), family)


__all__ = [
    "OUT_COLUMNS", "fits", "mosaic_gpu_swiglu", "reference", "runs_swiglu", "swiglu_plan", "unsupported",
    "width_reason",
]  # fmt: skip
