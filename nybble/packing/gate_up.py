"""The gate/up layout the SwiGLU epilogue reads: a SwiGLU MLP's gate and up weights side by side along N,
interleaved in blocks of :data:`GATE_UP_BLOCK` columns.

    fused column 16 b + i      = gate column 8 b + i      (i < 8)
    fused column 16 b + 8 + i  = up column 8 b + i

so every 16 consecutive output columns of ``x @ W`` hold 8 gate columns and the 8 up columns they multiply.
A kernel CTA that computes a run of whole 16-column blocks (any run aligned to 16, whatever its tiling) then
holds both operands of each of its SiLU products, and stores ``silu(gate) * up`` (half its columns) instead
of both halves: the launch XLA would spend on the product is saved. Column permutations of a weight are
exact (codes, scales and offsets move together), so checkpoints keep gate and up apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Columns of gate (then of up) per interleaved block: a CTA of the Hopper kernel with 8 K slices covers 8
# output columns an A tile, so two A tiles hold one block of each.
GATE_UP_BLOCK = 8


def interleavable(n: int) -> bool:
    """Whether gate and up weights of ``n`` columns each can be interleaved: whole blocks only."""
    return n > 0 and n % GATE_UP_BLOCK == 0


def gate_up_order(n: int) -> np.ndarray:
    """The fused layout as a gather: fused column j is column ``order[j]`` of ``concat([gate, up])`` (each of
    ``n`` columns)."""
    if not interleavable(n):
        raise ValueError(
            f"gate/up of N={n} columns cannot be interleaved: N must be a positive multiple of "
            f"{GATE_UP_BLOCK} (whole blocks)"
        )
    blocks = n // GATE_UP_BLOCK
    block = np.arange(GATE_UP_BLOCK)
    # (block b, half h, i) -> column h * n + 8 b + i of the concatenation.
    cols = np.arange(2)[None, :, None] * n + GATE_UP_BLOCK * np.arange(blocks)[:, None, None] + block
    return cols.reshape(-1)


def concatenated_order(n: int) -> np.ndarray:
    """The inverse of :func:`gate_up_order`: column j of ``concat([gate, up])`` is fused column
    ``order[j]``."""
    return np.argsort(gate_up_order(n))


def split_gate_up(y: Any) -> tuple[Any, Any]:
    """``(gate, up)`` of an output ``y`` (..., 2 n) in the fused layout: reshapes and slices (XLA fuses them
    into their consumer)."""
    *lead, width = y.shape
    blocks = y.reshape(*lead, width // (2 * GATE_UP_BLOCK), 2, GATE_UP_BLOCK)
    n = width // 2
    return blocks[..., 0, :].reshape(*lead, n), blocks[..., 1, :].reshape(*lead, n)


__all__ = ["GATE_UP_BLOCK", "concatenated_order", "gate_up_order", "interleavable", "split_gate_up"]
