"""The Hopper kernel with the residual epilogue: ``x = residual + x_in @ W`` and ``h = x * w`` in one launch.

A pre-norm transformer layer ends ``x = x + down(...)`` and the next layer starts with its input norm's
product ``h = x * w`` (its row scale deferred past the projections that read h: ``RMSNorm.deferred_sum``).
XLA spends a launch on the add and the product between the down projection and the next layer's q/k/v
GEMM; here the K slices' epilogue (``dequant_registers.sum_slices``) does both and stores two outputs, x
(the residual stream, which the attention kernel sums the squares of and the next residual add reads) and
h. Each CTA copies its output columns of the residual stream and of w into SMEM at its start (two TMAs on
one barrier, waited on in the epilogue: the K loop hides them). The main loop is the plain kernel's.

Rounding: y to x's dtype (as the projection returns it), then the sum and the product in f32, each
rounded to x's dtype, as the unfused step rounds them (``nybble.kernels.epilogue.residual_norm``), so a
model's tokens do not change with it.

Configs: the decode ones with K slices and one output tile per CTA (``config.residual_reason``); the
heuristics choose among those. Forward on the kernel; gradients through XLA.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from nybble.device import DEFAULT_NUM_SMS
from nybble.kernels.epilogue import residual_norm
from nybble.kernels.mosaic_gpu.common import Problem
from nybble.kernels.mosaic_gpu.config import (
    TuningConfig,
    residual_reason,
    residual_smem_bytes,
    smem_bytes,
    smem_fits,
)
from nybble.kernels.mosaic_gpu.dense import _zero_cotangent, is_supported, kernel_x, plan, weight_options
from nybble.kernels.mosaic_gpu.kernel import NORM_WEIGHT_DTYPES, w4a16
from nybble.quant.qweight import QuantizedWeight, dequantize

# y's columns each CTA stores straight into (M, N): N must be whole 64-column TMA tiles (every real
# model's hidden size is), so that x, h and the residual stream share y's (M, N) without padding.
OUT_COLUMNS = 64


def unsupported(x2d: Any, qw: QuantizedWeight) -> str | None:
    """Why the kernel cannot run the residual epilogue on these arguments, or None: what the plain kernel
    refuses, or an N that is not whole ``OUT_COLUMNS`` tiles."""
    if (why := is_supported(x2d, qw)) is not None:
        return why
    if qw.shape[1] % OUT_COLUMNS:
        return f"the weight's N={qw.shape[1]} is not a multiple of {OUT_COLUMNS} (x and h stored straight)"
    return None


def residual_plan(
    m: int,
    qw: QuantizedWeight,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    config: TuningConfig | None = None,
    dtype: Any = jnp.bfloat16,
) -> Problem:
    """The launch of M rows against ``qw`` with the residual epilogue: the heuristics' pick among the
    configs that run it (ValueError when none fits, e.g. M > 8), or ``config``."""
    if config is not None and (why := _reason(config, qw)) is not None:
        raise ValueError(f"residual_plan: {why}")
    p = plan(
        m, qw, num_sms=num_sms, config=config, dtype=dtype, allow=runs_residual,
        extra_smem=residual_smem_bytes,
    )  # fmt: skip
    return dataclasses.replace(p, residual=True)


def runs_residual(config: TuningConfig) -> bool:
    """The heuristics' predicate for this epilogue: one function, so their cache answers each problem once."""
    return residual_reason(config) is None


def _reason(config: TuningConfig, qw: QuantizedWeight) -> str | None:
    """``config.residual_reason``, or the SMEM the epilogue's rows add past the CTA's budget."""
    if (why := residual_reason(config)) is not None:
        return why
    used = smem_bytes(config, group=qw.group, **weight_options(qw)) + residual_smem_bytes(config)
    if not smem_fits(used):
        return f"{config.tag} with the residual epilogue's rows needs {used} bytes of SMEM a CTA"
    return None


def fits(m: int, qw: QuantizedWeight, num_sms: int = DEFAULT_NUM_SMS) -> bool:
    """Whether a config with the residual epilogue fits M rows against ``qw``."""
    try:
        residual_plan(m, qw, num_sms=num_sms)
    except ValueError:
        return False
    return True


def reference(
    x2d: jax.Array, qw: QuantizedWeight, residual: jax.Array, norm_weight: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The same function through XLA: the dequantized weight in x's dtype, one f32 dot, the epilogue's
    arithmetic (``nybble.kernels.epilogue.residual_norm``)."""
    y = jnp.dot(x2d, dequantize(qw, x2d.dtype), preferred_element_type=jnp.float32)
    return residual_norm(y, residual, norm_weight, x2d.dtype)


def _forward(
    x2d: jax.Array,
    qw: QuantizedWeight,
    residual: jax.Array,
    norm_weight: jax.Array,
    config: Any,
    num_sms: int,
) -> tuple[jax.Array, jax.Array]:
    m = x2d.shape[0]
    p = residual_plan(m, qw, num_sms=num_sms, config=config, dtype=x2d.dtype)
    x2d = kernel_x(x2d, p)
    # K-sliced configs stage x and h in Mosaic's 8-row SMEM tiles: both take x's rows (zero rows where
    # M * S would not fill them, config.x_rows), sliced after, as the SwiGLU epilogue's wrapper does.
    if p.x_rows != m:
        residual = jnp.pad(residual, ((0, p.x_rows - m), (0, 0)))
    out, normed = w4a16(
        x2d, qw.codes, qw.scales, qw.offsets, n=p.n, group=qw.group, config=p.config, m=p.x_rows,
        residual=residual, norm_weight=norm_weight,
    )  # fmt: skip
    return (out, normed) if p.x_rows == m else (out[:m], normed[:m])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _residual(x2d, qw, residual, norm_weight, config, num_sms):
    return _forward(x2d, qw, residual, norm_weight, config, num_sms)


def _residual_fwd(x2d, qw, residual, norm_weight, config, num_sms):
    out = _forward(x2d, qw, residual, norm_weight, config, num_sms)
    return out, (x2d, qw, residual, norm_weight)


def _residual_bwd(config, num_sms, saved, g):
    x2d, qw, residual, norm_weight = saved
    _, vjp = jax.vjp(lambda x, r, w: reference(x, qw, r, w), x2d, residual, norm_weight)
    dx, dr, dw = vjp(g)
    return dx, jax.tree.map(_zero_cotangent, qw), dr, dw


_residual.defvjp(_residual_fwd, _residual_bwd)


def mosaic_gpu_residual(
    x2d: jax.Array,
    qw: QuantizedWeight,
    residual: jax.Array,
    norm_weight: jax.Array,
    *,
    config: Any = None,
    num_sms: int = DEFAULT_NUM_SMS,
) -> tuple[jax.Array, jax.Array]:
    """``(x, h)``: x = residual + x2d @ W and h = x * norm_weight, with the Hopper kernel's residual
    epilogue, both (M, N) in x2d's dtype.

    Args:
      x2d: (M, K) bf16/f16 activations; M <= 8 (the decode configs that run the epilogue).
      qw: a ``wgmma_int4`` weight of N a multiple of 64.
      residual: (M, N) in x2d's dtype: the residual stream the product is added to.
      norm_weight: (N,) bf16, f16 or f32: the weight of the norm that reads x next.
      config: a TuningConfig that runs the epilogue (``config.residual_reason``); None: the heuristics'.
      num_sms: SMs of the target GPU.

    Differentiable with respect to x2d, residual and norm_weight (through XLA). Raises ValueError naming
    the rule when no config runs these shapes or an operand's shape or dtype is wrong,
    NotImplementedError when the kernel cannot read the arguments at all (:func:`unsupported`).
    """
    if getattr(x2d, "ndim", None) != 2:
        raise ValueError(f"mosaic_gpu_residual: x2d must be 2-D (M, K), got {getattr(x2d, 'shape', None)}")
    if (why := unsupported(x2d, qw)) is not None:
        raise NotImplementedError(f"mosaic_gpu_residual cannot run these arguments: {why}")
    m, n = x2d.shape[0], qw.shape[1]
    if residual.dtype != x2d.dtype or tuple(residual.shape) != (m, n):
        raise ValueError(
            f"mosaic_gpu_residual: residual must be {x2d.dtype} (M, N) = ({m}, {n}), got {residual.dtype} "
            f"{tuple(residual.shape)}"
        )
    if tuple(norm_weight.shape) != (n,) or jnp.dtype(norm_weight.dtype) not in NORM_WEIGHT_DTYPES:
        raise ValueError(
            f"mosaic_gpu_residual: norm_weight must be (N,) = ({n},) bf16, f16 or f32, got "
            f"{norm_weight.dtype} {tuple(norm_weight.shape)}"
        )
    return _residual(x2d, qw, residual, norm_weight, config, int(num_sms))


__all__ = [
    "OUT_COLUMNS",
    "fits",
    "mosaic_gpu_residual",
    "reference",
    "residual_plan",
    "runs_residual",
    "unsupported",
]
