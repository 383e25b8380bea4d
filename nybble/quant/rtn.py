"""Round-to-nearest int4 quantization of a float (K, N) weight."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nybble.packing import (
    DEFAULT_LAYOUT,
    check_group_size,
    group_rows,
    num_groups,
    pad_to,
    padded_weight_dims,
)
from nybble.quant.qweight import SCALE_DTYPES, QuantizedWeight


def _model_hint(obj: Any) -> str:
    """Where a model or a params pytree goes instead of one weight (``nybble.quantize`` takes an array)."""
    if any(c.__module__.split(".")[0] == "flax" for c in type(obj).__mro__):
        return (
            "; nybble.quantize quantizes one weight array. For a Flax model's layers, in place: "
            "nybble.models.quantize(model, ...)"
        )
    if isinstance(obj, dict | list | tuple):
        return (
            "; nybble.quantize quantizes one weight array. For a params pytree: "
            "nybble.models.quantize_params(params, ...)"
        )
    return ""


def check_weight(w: Any, what: str = "quantize") -> None:
    """A 2-D float weight; NaN/Inf reported with count and first position when the values are concrete."""
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        raise TypeError(f"{what}: expected a (K, N) array, got {type(w).__name__}{_model_hint(w)}")
    if w.ndim != 2:
        raise ValueError(
            f"{what}: expected a 2-D weight of shape (K, N) = (in_features, out_features), got shape "
            f"{tuple(w.shape)}; reshape stacked weights to 2-D or quantize each matrix"
        )
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{what}: expected a floating-point weight, got dtype {np.dtype(w.dtype).name}")
    if isinstance(w, jax.core.Tracer):
        return
    finite = np.isfinite(np.asarray(w, dtype=np.float32))
    if not finite.all():
        bad = np.argwhere(~finite)
        first = tuple(int(i) for i in bad[0])
        raise ValueError(
            f"{what}: weight of shape {tuple(w.shape)} has {len(bad)} NaN/Inf value(s); first at "
            f"(k, n) = {first}, value {np.asarray(w)[first]}. Fix the checkpoint before quantizing."
        )


def quantize(
    w: Any,
    *,
    group_size: int | None = 128,
    symmetric: bool = True,
    scale_dtype: Any = jnp.bfloat16,
    layout: str = DEFAULT_LAYOUT,
    clip_search: bool = False,
) -> QuantizedWeight:
    """Quantizes a float weight of shape (K, N) = (in_features, out_features) to int4, round to nearest.

    Args:
      w: float numpy/jax array, the layout of a Flax ``kernel`` (``y = x @ w``).
      group_size: rows of K sharing one scale (a power of two >= 16), or None for one scale per column.
        K that is not a multiple is padded with zero rows, never refused.
      symmetric: signed codes in [-8, 7] and one scale per group (``max(-min / 8, max / 7)``); else a zero
        point per group too, stored as an offset so that dequantization is one multiply-add.
      scale_dtype: dtype of the stored scales and offsets (bf16: 4.125 bits/weight at g128).
      layout: the memory layout of the codes (see ``nybble.packing.LAYOUTS``).
      clip_search: per group, try shrinking the range (``CLIP_GRID``) and keep the scale with the least
        squared error; clips outliers for a finer step, so the half-step bound below no longer holds.

    Without ``clip_search``, every element dequantizes to within half a quantization step of its input
    (for asymmetric groups, plus the rounding of the stored offset to ``scale_dtype``). An all-zero group
    dequantizes to exact zeros.
    """
    check_weight(w)
    check_group_size(group_size)
    check_scale_dtype(scale_dtype)
    return _quantize(
        w,
        group_size=group_size,
        symmetric=symmetric,
        scale_dtype=scale_dtype,
        layout=layout,
        clip_search=clip_search,
    )


# One XLA program per (shape, dtype, settings), not one per jnp operation: called eagerly, ``quantize``
# compiles once per weight shape instead of some thirty times (and runs as one fused program).
@functools.partial(
    jax.jit, static_argnames=("group_size", "symmetric", "scale_dtype", "layout", "clip_search")
)
def _quantize(
    w: Any, *, group_size: int | None, symmetric: bool, scale_dtype: Any, layout: str, clip_search: bool
) -> QuantizedWeight:
    k, n = w.shape
    k_pad, n_pad = padded_weight_dims(k, n)
    g, ng = group_rows(k_pad, group_size), num_groups(k_pad, group_size)
    # The last group may be partial: padded to whole groups for the statistics only.
    wf = pad_to(jnp.asarray(w, jnp.float32), (ng * g, n_pad)).reshape(ng, g, n_pad)
    # Padded rows take no part in the statistics and get code 0.
    valid = (jnp.arange(ng * g) < k).reshape(ng, g, 1)
    scales, offsets = group_params(wf, valid, symmetric, scale_dtype, clip_search=clip_search)
    b = 0.0 if offsets is None else offsets.astype(jnp.float32)[:, None, :]
    q, _ = round_to_codes(wf, scales.astype(jnp.float32)[:, None, :], b)
    q = jnp.where(valid, q, 0).astype(jnp.int8).reshape(ng * g, n_pad)[:k_pad]
    return QuantizedWeight.from_codes(q, scales, offsets, shape=(k, n), group_size=group_size, layout=layout)


def check_scale_dtype(scale_dtype: Any, what: str = "quantize") -> None:
    """Raises unless ``scale_dtype`` is one a ``QuantizedWeight`` stores (``SCALE_DTYPES``)."""
    if np.dtype(scale_dtype).name not in SCALE_DTYPES:
        raise ValueError(f"{what}: scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}")


# Shrink factors of the group range tried by the clipping search (1.0: no clipping).
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def group_params(
    wg: jax.Array, valid: jax.Array, symmetric: bool, scale_dtype: Any, *, clip_search: bool = False
) -> tuple[jax.Array, jax.Array | None]:
    """Scales and offsets (None when symmetric) of weight groups ``wg`` (..., G, N) in float32.

    ``valid`` (..., G, 1) masks padded rows out of the statistics; a group of padding only gets scale 0
    and offset 0. Symmetric: ``scale = max(-min / 8, max / 7)``. Asymmetric: ``scale = (max - min) / 15``,
    rounded up if the scale dtype rounded it down (so [min, max] still fits 16 codes), and an offset
    mapping code -8 to the group minimum. Shared by round to nearest and GPTQ: one set of conventions.

    ``clip_search``: per group and column, shrink the range by each factor of ``CLIP_GRID`` and keep the
    parameters whose codes give the smallest squared error (clipping a few outliers for a finer step).
    """
    if not clip_search:
        return _range_params(wg, valid, symmetric, scale_dtype, 1.0)
    best = None
    for shrink in CLIP_GRID:
        scales, offsets = _range_params(wg, valid, symmetric, scale_dtype, shrink)
        b = 0.0 if offsets is None else offsets.astype(jnp.float32)[..., None, :]
        _, deq = round_to_codes(wg, scales.astype(jnp.float32)[..., None, :], b)
        err = jnp.sum(jnp.where(valid, (deq - wg) ** 2, 0.0), axis=-2)
        if best is None:
            best = (err, scales, offsets)
            continue
        take = err < best[0]
        best = (
            jnp.where(take, err, best[0]),
            jnp.where(take, scales, best[1]),
            None if offsets is None else jnp.where(take, offsets, best[2]),
        )
    return best[1], best[2]


def _range_params(
    wg: jax.Array, valid: jax.Array, symmetric: bool, scale_dtype: Any, shrink: float
) -> tuple[jax.Array, jax.Array | None]:
    """``group_params`` for the group range [min, max] scaled by ``shrink``."""
    if symmetric:
        # Codes run -8..7: the most negative value may take code -8 and the most positive 7, so the
        # step is the smaller of what each side needs (up to 12.5% finer than max|w| / 7).
        neg = -jnp.min(jnp.where(valid, wg, 0.0), axis=-2)
        pos = jnp.max(jnp.where(valid, wg, 0.0), axis=-2)
        return (shrink * jnp.maximum(neg / 8, pos / 7)).astype(scale_dtype), None
    has = jnp.any(valid, axis=-2)
    wmin = shrink * jnp.where(has, jnp.min(jnp.where(valid, wg, jnp.inf), axis=-2), 0.0)
    wmax = shrink * jnp.where(has, jnp.max(jnp.where(valid, wg, -jnp.inf), axis=-2), 0.0)
    scales = ((wmax - wmin) / 15).astype(scale_dtype)
    short = scales.astype(jnp.float32) * 15 < (wmax - wmin)
    scales = jnp.where(short, jnp.nextafter(scales, jnp.asarray(jnp.inf, scales.dtype)), scales)
    offsets = (wmin + 8 * scales.astype(jnp.float32)).astype(scale_dtype)
    return scales, offsets


def round_to_codes(w: jax.Array, s: jax.Array, b: jax.Array | float) -> tuple[jax.Array, jax.Array]:
    """Codes in [-8, 7] for ``w`` against the STORED float32 scale/offset, and their dequantized values.

    Choosing codes against the stored (rounded) scale and offset keeps each element within half a step.
    A zero scale (an all-zero or constant group) gets code 0: the offset alone carries the value.
    """
    q = jnp.clip(jnp.round((w - b) / jnp.where(s == 0, 1, s)), -8, 7)
    q = jnp.where(s == 0, 0, q)
    return q, q * s + b
