"""SMEM that stages y on its way to GMEM: one TMA store from it reaches a y of any number of rows."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def y_staging(shape: tuple[int, ...], dtype: Any, *, any_rows: bool) -> Any:
    """SMEM for y rows on their way to GMEM (one TMA store): with ``any_rows`` (``config.stores_any_rows``)
    tiled by single rows of the swizzle's width, else as Mosaic lays it out.

    Mosaic gives a TMA the SMEM side's tiling on the whole GMEM array, and refuses a GMEM dimension that is
    neither at most the tile nor a multiple of it: y rows tiled 8 at a time could not go to a y of, say, 9
    or 100 rows, and the wrapper stored into zero-padded rows and sliced them off (a copy, one more
    launch). One-row tiles store any number of rows (the TMA clips those past M); in SMEM a tile is one
    swizzle row (128 bytes: 64 bf16 columns).
    """
    if not any_rows:
        return plgpu.SMEM(shape, dtype)
    bits = jnp.finfo(dtype).bits
    swizzle = plgpu.find_swizzle(shape[-1] * bits, "y staging")
    tile = (1, swizzle * 8 // bits)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform(tile), plgpu.SwizzleTransform(swizzle)))
