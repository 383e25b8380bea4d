"""Round-to-nearest int4 quantization of a float (K, N) weight."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nybble.packing import DEFAULT_LAYOUT, get_layout, pad_to, padded_weight_dims
from nybble.quant.qweight import QuantizedWeight

SUPPORTED_SCALE_DTYPES = ("bfloat16", "float16", "float32")


def check_group_size(group_size: int | None) -> None:
    """Group sizes are None (per column) or powers of two from 16 up."""
    if group_size is None:
        return
    if not isinstance(group_size, int | np.integer) or group_size < 16 or group_size & (group_size - 1):
        raise ValueError(
            f"group_size must be None (one group per column) or a power of two >= 16 "
            f"(32, 64, 128, 256, ...), got {group_size!r}"
        )


def check_weight(w: Any, what: str = "quantize") -> None:
    """A 2-D float weight; NaN/Inf reported with count and first position when the values are concrete."""
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        raise TypeError(f"{what}: expected a (K, N) array, got {type(w).__name__}")
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
) -> QuantizedWeight:
    """Quantizes a float weight of shape (K, N) = (in_features, out_features) to int4, round to nearest.

    Args:
      w: float numpy/jax array, the layout of a Flax ``kernel`` (``y = x @ w``).
      group_size: rows of K sharing one scale (a power of two >= 16), or None for one scale per column.
        K that is not a multiple is padded with zero rows, never refused.
      symmetric: signed codes in [-8, 7] and one scale per group (``scale = max|w| / 7``); else a zero
        point per group too, stored as an offset so that dequantization is one multiply-add.
      scale_dtype: dtype of the stored scales and offsets (bf16: 4.125 bits/weight at g128).
      layout: the memory layout of the codes (see ``nybble.packing.LAYOUTS``).

    Every element dequantizes to within half a quantization step of its input (for asymmetric groups, plus
    the rounding of the stored offset to ``scale_dtype``). An all-zero group dequantizes to exact zeros.
    """
    check_weight(w)
    check_group_size(group_size)
    if np.dtype(scale_dtype).name not in SUPPORTED_SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SUPPORTED_SCALE_DTYPES}, got {scale_dtype}")
    packer = get_layout(layout)
    k, n = w.shape
    k_pad, n_pad = padded_weight_dims(k, n, group_size)
    g = k_pad if group_size is None else group_size
    num_groups = -(-k_pad // g)  # the last group may be partial: pad it for the statistics only
    wf = pad_to(jnp.asarray(w, jnp.float32), (num_groups * g, n_pad)).reshape(num_groups, g, n_pad)
    # Padded rows take no part in the statistics and get code 0.
    valid = (jnp.arange(num_groups * g) < k).reshape(num_groups, g, 1) if num_groups * g != k else None

    def stat(fn, x, fill):
        return fn(x if valid is None else jnp.where(valid, x, fill), axis=1)

    if symmetric:
        amax = stat(jnp.max, jnp.abs(wf), 0.0)
        scales = (amax / 7).astype(scale_dtype)
        s = scales.astype(jnp.float32)[:, None, :]
        q = jnp.round(wf / jnp.where(s == 0, 1, s))
        offsets = None
    else:
        wmin, wmax = stat(jnp.min, wf, jnp.inf), stat(jnp.max, wf, -jnp.inf)
        # A group made only of padding rows (K = 96 at g32 pads to 128) has no statistics: make it zero.
        wmin, wmax = jnp.where(jnp.isfinite(wmin), wmin, 0.0), jnp.where(jnp.isfinite(wmax), wmax, 0.0)
        scales = ((wmax - wmin) / 15).astype(scale_dtype)
        # Round the scale up if the dtype rounded it down, so that [min, max] still fits 16 codes.
        s = scales.astype(jnp.float32)
        short = s * 15 < (wmax - wmin)
        scales = jnp.where(short, _next_up(scales), scales)
        s = scales.astype(jnp.float32)
        # The offset maps code -8 to the group minimum; codes are then chosen against the stored offset.
        offsets = (wmin + 8 * s).astype(scale_dtype)
        b = offsets.astype(jnp.float32)[:, None, :]
        s = s[:, None, :]
        q = jnp.round((wf - b) / jnp.where(s == 0, 1, s))
    if valid is not None:
        q = jnp.where(valid, q, 0)
    q = jnp.clip(q, -8, 7).astype(jnp.int8).reshape(num_groups * g, n_pad)[:k_pad]
    codes = packer.pack(q)
    if isinstance(w, np.ndarray):  # numpy in: keep host arrays concrete but as jax arrays
        codes = jnp.asarray(codes)
    return QuantizedWeight(
        codes=codes,
        scales=scales,
        offsets=offsets,
        shape=(k, n),
        group_size=group_size,
        symmetric=symmetric,
        layout=layout,
    )


def _next_up(x: jax.Array) -> jax.Array:
    """The next representable value above ``x`` (for positive finite x) in x's own dtype."""
    return jnp.nextafter(x, jnp.asarray(jnp.inf, x.dtype))
