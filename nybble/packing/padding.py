"""Padding to tile-aligned, whole-byte blocks: every block a kernel copies is made of these."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

# Both weight dimensions are padded to a multiple of this: one 64-row WGMMA operand, one 64-wide K step.
# No kernel tile is ever partial, and every row is whole bytes: 64 int4 = 32 bytes, a multiple of the
# 16 bytes TMA needs between rows. 64 (not 128) keeps small real layers unpadded (576, 192, 1536).
WEIGHT_TILE = 64


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    if multiple <= 0:
        raise ValueError(f"round_up: multiple must be positive, got {multiple}")
    return -(-value // multiple) * multiple


def padded_weight_dims(k: int, n: int, group_size: int | None = None) -> tuple[int, int]:
    """(K_pad, N_pad) of a (K, N) weight: both rounded up to the weight tile.

    The group size does not enter: a last group of K may be partial (K = 576 at g128 is 4.5 groups, stored
    as 5 scale rows), which keeps real layer shapes unpadded.
    """
    del group_size
    return round_up(k, WEIGHT_TILE), round_up(n, WEIGHT_TILE)


def pad_to(x: Any, shape: tuple[int, ...], value: float = 0) -> Any:
    """Pads ``x`` at the end of each axis up to ``shape`` (numpy in, numpy out; jax in, jax out)."""
    if len(shape) != x.ndim:
        raise ValueError(f"pad_to: target shape {shape} has {len(shape)} dims, array has {x.ndim}")
    widths = [(0, t - s) for s, t in zip(x.shape, shape, strict=True)]
    if any(w < 0 for _, w in widths):
        raise ValueError(f"pad_to: cannot pad shape {x.shape} down to {shape}")
    if not any(w for _, w in widths):
        return x
    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.pad(x, widths, constant_values=value)
