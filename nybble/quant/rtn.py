"""Round-to-nearest int4 quantization of a float (K, N) weight."""

from __future__ import annotations

import functools
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from nybble.packing import default_layout, group_rows, num_groups, pad_to, padded_weight_dims
from nybble.quant.qformat import (
    ZERO_POINTS,
    FormatFields,
    QuantFormat,
    check_scale_dtype,
    check_zero_point,
    with_fields,
)
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.stacked import quantize_stacked


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
            f"{tuple(w.shape)}; a 3-D stack of expert weights (experts, K, N) is accepted too"
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
    format: QuantFormat | None = None,
    *,
    clip_search: bool = False,
    **fields: Unpack[FormatFields],
) -> QuantizedWeight:
    """Quantizes a float weight of shape (K, N) = (in_features, out_features) to int4, round to nearest.

    The stored format is one :class:`nybble.QuantFormat` (``format``, default ``QuantFormat()``), or built
    from its fields given as keywords (``quantize(w, group_size=64, symmetric=False)``); keywords given
    beside a ``format`` override its fields.

    Args:
      w: float numpy/jax array, the layout of a Flax ``kernel`` (``y = x @ w``); or a stack of expert
        weights (E, K, N), which gives a stacked weight (``nybble.quant.stacked``): each expert
        quantized on its own, arrays stacked on axis 0, ``shape`` (K, N).
      format: the stored format; its fields, or the keywords of the same names:
      group_size: rows of K sharing one scale (a power of two >= 16), or None for one scale per column.
        K that is not a multiple is padded with zero rows, never refused. Default 128.
      symmetric: signed codes in [-8, 7] and one scale per group (``max(-min / 8, max / 7)``); else a zero
        point per group too, stored as an offset so that dequantization is one multiply-add. Default True.
      scale_dtype: dtype of the stored scales and offsets (bf16, the default: 4.125 bits/weight at g128).
      layout: the memory layout of the codes (see ``nybble.packing.LAYOUTS``). Not given (neither the keyword
        nor a ``format``): the local GPU's, ``nybble.packing.default_layout()``: ``planes_nk_int4`` (the
        Triton kernel's) on an NVIDIA GPU without a nybble Mosaic GPU kernel, else ``wgmma_int4``.
      zero_point: asymmetric groups only. "float" (default): the offset maps code -8 to the group
        minimum. "integer": unsigned codes u in 0..15 with an integer zero z per group, ``w = (u - z) * s``,
        as compressed-tensors, GPTQ and AWQ store them (the range is widened to include 0, as GPTQ's
        quantizer does, so z = round(-min / s) is a code; it is kept in 1..15, which GPTQ v1's stored
        ``z - 1`` can hold). Stored as ``q = u - 8`` and offsets
        ``(8 - z) * s`` kept in float32, where they are exact (see ``ZERO_POINTS``).
      clip_search: per group, try shrinking the range (``CLIP_GRID``) and keep the scale with the least
        squared error; clips outliers for a finer step, so the half-step bound below no longer holds.

    Without ``clip_search``, every element dequantizes to within half a quantization step of its input
    (for asymmetric groups, plus the rounding of the stored offset to ``scale_dtype``). An all-zero group
    dequantizes to exact zeros.
    """
    if format is None and fields.get("layout") is None:  # the local GPU's layout, chosen once, here
        fields["layout"] = default_layout()
    fmt = with_fields(format, dict(fields), "quantize")
    if getattr(w, "ndim", None) == 3:  # a stack of experts (E, K, N): each expert on its own, stacked
        return quantize_stacked(quantize, w, format=fmt, clip_search=clip_search)
    check_weight(w)
    return _quantize(w, fmt=fmt, clip_search=bool(clip_search))


# One XLA program per (shape, dtype, format), not one per jnp operation: called eagerly, ``quantize``
# compiles once per weight shape instead of some thirty times (and runs as one fused program).
@functools.partial(jax.jit, static_argnames=("fmt", "clip_search"))
def _quantize(w: Any, *, fmt: QuantFormat, clip_search: bool) -> QuantizedWeight:
    k, n = w.shape
    k_pad, n_pad = padded_weight_dims(k, n)
    g, ng = group_rows(k_pad, fmt.group_size), num_groups(k_pad, fmt.group_size)
    # The last group may be partial: padded to whole groups for the statistics only.
    wf = pad_to(jnp.asarray(w, jnp.float32), (ng * g, n_pad)).reshape(ng, g, n_pad)
    # Padded rows take no part in the statistics and get code 0.
    valid = (jnp.arange(ng * g) < k).reshape(ng, g, 1)
    scales, offsets = group_params(wf, valid, fmt, clip_search=clip_search)
    b = 0.0 if offsets is None else offsets.astype(jnp.float32)[:, None, :]
    q, _ = round_to_codes(wf, scales.astype(jnp.float32)[:, None, :], b)
    q = jnp.where(valid, q, 0).astype(jnp.int8).reshape(ng * g, n_pad)[:k_pad]
    return QuantizedWeight.from_codes(
        q, scales, offsets, shape=(k, n), group_size=fmt.group_size, layout=fmt.layout
    )


def integer_zero_factor(scales: jax.Array, offsets: jax.Array) -> jax.Array:
    """``8 - z`` (float32) of integer-zero parameters (``offsets == (8 - z) * scales``); 0 where s = 0."""
    s = scales.astype(jnp.float32)
    return jnp.where(s == 0, 0.0, jnp.round(offsets.astype(jnp.float32) / jnp.where(s == 0, 1.0, s)))


# Shrink factors of the group range tried by the clipping search (1.0: no clipping).
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def group_params(
    wg: jax.Array, valid: jax.Array, fmt: QuantFormat, *, clip_search: bool = False
) -> tuple[jax.Array, jax.Array | None]:
    """Scales and offsets (None when symmetric) of weight groups ``wg`` (..., G, N) in float32, in the
    format ``fmt`` (its symmetry, zero-point kind and scale dtype).

    ``valid`` (..., G, 1) masks padded rows out of the statistics; a group of padding only gets scale 0
    and offset 0. Symmetric: ``scale = max(-min / 8, max / 7)``. Asymmetric: ``scale = (max - min) / 15``,
    rounded up if the scale dtype rounded it down (so [min, max] still fits 16 codes), and an offset
    mapping code -8 to the group minimum. Shared by round to nearest and GPTQ: one set of conventions.

    ``clip_search``: per group and column, shrink the range by each factor of ``CLIP_GRID`` and keep the
    parameters whose codes give the smallest squared error (clipping a few outliers for a finer step).

    ``fmt.zero_point == "integer"`` (asymmetric): the range is widened to include 0, ``z = round(-min / s)``
    is an integer in 1..15 (a group without negative values: z = 1, step max / 14) and the offsets
    ``(8 - z) * s`` are returned in float32 (exact; ``scale_dtype`` could not hold them: up to 12
    significant bits for bfloat16 scales).
    """
    integer, symmetric, scale_dtype = fmt.integer_zero, fmt.symmetric, fmt.dtype
    if not clip_search:
        return _range_params(wg, valid, symmetric, scale_dtype, 1.0, integer)
    best = None
    for shrink in CLIP_GRID:
        scales, offsets = _range_params(wg, valid, symmetric, scale_dtype, shrink, integer)
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


def _over(x: jax.Array, d: int) -> jax.Array:
    """``x / d`` as XLA computes it under jit: ``x * float32(1 / d)`` (its simplifier rewrites a division by a
    constant so). Written out, the scales are the same bits in every program that computes them: jax 0.12.1
    divides exactly where the divisor does not reach XLA as a constant (1 ulp apart in about half the
    cases), and AutoRound's starting scales differed from RTN's there (tests/test_autoround.py)."""
    return x * (1.0 / d)


def _range_params(
    wg: jax.Array, valid: jax.Array, symmetric: bool, scale_dtype: Any, shrink: float, integer: bool = False
) -> tuple[jax.Array, jax.Array | None]:
    """``group_params`` for the group range [min, max] scaled by ``shrink``."""
    if symmetric:
        # Codes run -8..7: the most negative value may take code -8 and the most positive 7, so the
        # step is the smaller of what each side needs (up to 12.5% finer than max|w| / 7).
        neg = -jnp.min(jnp.where(valid, wg, 0.0), axis=-2)
        pos = jnp.max(jnp.where(valid, wg, 0.0), axis=-2)
        return (shrink * jnp.maximum(neg / 8, _over(pos, 7))).astype(scale_dtype), None
    has = jnp.any(valid, axis=-2)
    wmin = shrink * jnp.where(has, jnp.min(jnp.where(valid, wg, jnp.inf), axis=-2), 0.0)
    wmax = shrink * jnp.where(has, jnp.max(jnp.where(valid, wg, -jnp.inf), axis=-2), 0.0)
    if integer:
        # GPTQ's quantizer: the range includes 0, so the zero round(-min / s) is a code. It is kept in
        # 1..15 (GPTQ v1 checkpoints store z - 1 in 4 bits, so z = 0 cannot be written): a group with no
        # negative values takes z = 1 and a step of max / 14 (codes 1..15 cover [0, max]).
        wmin, wmax = jnp.minimum(wmin, 0.0), jnp.maximum(wmax, 0.0)
        scales = _over(wmax - wmin, 15).astype(scale_dtype)
        s = scales.astype(jnp.float32)
        low = -wmin <= 0.5 * s  # would round to z = 0 (round half to even: -min = s / 2 rounds to 0 too)
        scales = jnp.where(low, _over(wmax, 14).astype(scale_dtype), scales)
        short = low & (scales.astype(jnp.float32) * 14 < wmax)
        scales = jnp.where(short, jnp.nextafter(scales, jnp.asarray(jnp.inf, scales.dtype)), scales)
        s = scales.astype(jnp.float32)
        z = jnp.clip(jnp.round(-wmin / jnp.where(s == 0, 1.0, s)), 1, 15)
        return scales, jnp.where(s == 0, 0.0, (8.0 - z) * s)  # float32: exact
    scales = _over(wmax - wmin, 15).astype(scale_dtype)
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


# Re-exported: their home is nybble.quant.qformat.
__all__ = [
    "CLIP_GRID",
    "ZERO_POINTS",
    "QuantFormat",
    "check_scale_dtype",
    "check_weight",
    "check_zero_point",
    "group_params",
    "integer_zero_factor",
    "quantize",
    "round_to_codes",
]
