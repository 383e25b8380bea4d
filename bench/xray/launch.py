"""The facts of a planned nybble kernel launch that only the X-ray's model reads (threads, CTAs, bytes in
flight, weights dequantized), from the ``Problem`` the kernel's ``plan`` returns: the kernel itself needs
none of them."""

from __future__ import annotations

import dataclasses
from typing import Any


def threads(p: Any) -> int:
    """Threads per CTA: 128 per compute warpgroup, plus the TMA warpgroup when warp-specialized or with a
    producer."""
    c = p.config
    return 128 * (c.compute_wgs + (1 if c.compute_wgs > 1 or c.producer else 0))


def weight_bytes_per_step(p: Any) -> int:
    """Code bytes one pipeline step of one CTA brings in (scales not counted)."""
    c = p.config
    return c.tiles * c.compute_wgs * 32 * c.tile_k


def steps_in_flight(p: Any) -> int:
    """Steps a CTA keeps requested: one per pipeline slot (the whole K when it is shorter)."""
    return min(p.config.max_concurrent_steps, p.steps_per_split)


def dense_launch(p: Any) -> dict[str, Any]:
    """The dense kernel's launch as the X-ray's model reads it: config, M as the tensor cores see it (WGMMA
    N per M tile), CTAs, threads, code bytes a CTA keeps requested, and the weights dequantized over the
    whole launch (every M tile dequantizes all of W again; a partial last K step its zero-filled rows
    too)."""
    c = p.config
    return {
        "config": dataclasses.asdict(c),
        "m_pad": p.m_tiles * c.wgmma_n,
        "m_tiles": p.m_tiles,
        "ctas": c.ctas(p.m, p.n_pad),
        "threads": threads(p),
        "weight_bytes_in_flight": steps_in_flight(p) * weight_bytes_per_step(p),
        "dequantized_weights": c.dequantized_weights(p.m, p.n_pad, p.k_pad),
    }


__all__ = ["dense_launch", "steps_in_flight", "threads", "weight_bytes_per_step"]
