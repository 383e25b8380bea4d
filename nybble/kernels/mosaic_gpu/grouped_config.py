"""Configs of the grouped (mixture-of-experts) W4A16 kernel, chosen by the dense kernels' cost model.

The grouped kernel (grouped.py) runs, in one launch, one dense problem per expert: the rows of x routed to
expert e against expert e's (K, N) weight. Its CTAs are the dense kernel's (the same
:class:`~nybble.kernels.mosaic_gpu.config.TuningConfig`, the same K loop and epilogue) over work items
(expert, M tile of that expert's rows, N tile). At trace time only the number of rows and of experts are
known, not how the rows fall: the config is chosen for the balanced case, every expert that can have rows
(``min(experts, rows)``) holding ``ceil(rows / active)`` of them (:func:`planned_rows`; at decode, 1 token
with top-k of E experts: k experts of 1 row each, exactly). The dense heuristics then rank every candidate
on ``active`` experts' weights and CTAs at once (``heuristic_config(..., experts=active)``), so a decode
launch over 8 experts of a 2048 x 768 weight picks the tiles a 2048 x (8 x 768) dense weight would, each
CTA within one expert. Not candidates (:func:`grouped_allows`): split-K (its cluster reduction stores
whole 8-row slabs, the grouped epilogue a ragged run of rows) and a persistent grid (its CTAs would loop
over a count of tiles known only on the device).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from nybble.device import DEFAULT_NUM_SMS
from nybble.kernels.mosaic_gpu.compat import STRICT_LAYOUT_INFERENCE
from nybble.kernels.mosaic_gpu.config import WIDE_STEP_K, TuningConfig
from nybble.kernels.mosaic_gpu.heuristics import heuristic_config


def active_experts(rows: int, experts: int) -> int:
    """Experts that can hold rows: at most one per row."""
    return max(1, min(experts, rows))


def planned_rows(rows: int, experts: int) -> int:
    """Rows per active expert the config is chosen for: the balanced case, ceil(rows / active experts)."""
    return max(1, -(-rows // active_experts(rows, experts)))


def grouped_allows(config: TuningConfig) -> bool:
    """Whether the grouped kernel runs ``config``: no split-K and no persistent grid (module docstring);
    and not 512-deep steps of 64 accumulator columns (tiles x WGMMA N) with a producer warpgroup, whose
    compute warpgroup sits at 255 registers and spills the grouped CTA's state. Under jax 0.12's layout
    inference (``compat.STRICT_LAYOUT_INFERENCE``) also not the accumulator route with 4 tiles and no K
    slices: Mosaic GPU finds no layout for it there (3 MoE kernels, symmetric and asymmetric, found by
    ``make test-jax-latest``), so another candidate is picked and an explicit one is refused by name."""
    return grouped_refusal(config) is None


def grouped_refusal(config: TuningConfig) -> str | None:
    """Why the grouped kernel does not run ``config`` (:func:`grouped_allows`), or None."""
    if config.split_k != 1 or config.persistent_ctas != 0:
        return "the grouped kernel runs without split-K or a persistent grid"
    if (
        config.producer
        and config.tile_k == WIDE_STEP_K
        and config.scales_on == "accumulators"
        and config.tiles * config.wgmma_n >= 64
    ):
        return "512-deep steps of 64 accumulator columns with a producer warpgroup spill the grouped CTA"
    if (
        STRICT_LAYOUT_INFERENCE
        and config.scales_on == "accumulators"
        and config.tiles == 4
        and config.slices == 1
    ):
        return (
            "on this jax (0.12's layout inference) the accumulator route with 4 tiles and no K slices "
            "finds no layout in Mosaic GPU's grouped kernel"
        )
    return None


def max_m_tiles(rows: int, experts: int, tile_m: int, align: int = 1) -> int:
    """An upper bound on the M tiles of any grouping of ``rows`` rows into ``experts`` groups plus the rows
    past their sum (zeroed by the kernel, a group of their own), when a group of g rows from row r takes
    ceil((r % align + g) / tile_m) tiles (grouped.py): each group with rows at most floor((g + align - 1)
    / tile_m) + 1, and at most one group per row has rows; exact where tiles start on multiples of tile_m
    (align = tile_m: every decode config whose WGMMA N is 8)."""
    if tile_m == 1:
        return rows
    busy = min(experts + 1, rows)
    if align == tile_m:
        # Tiles on a grid of tile_m rows: the groups partition the rows, so the tiles they take are the
        # grid's ceil(rows / tile_m) plus one per boundary between groups inside a tile.
        return -(-rows // tile_m) + busy - 1
    return min((rows + busy * (align - 1)) // tile_m + busy, (experts + 1) * -(-(rows + align - 1) // tile_m))


@functools.cache
def _grouped_and(allow: Callable[[TuningConfig], bool]) -> Callable[[TuningConfig], bool]:
    """:func:`grouped_allows` and ``allow``: one function per ``allow``, so the heuristics' cache answers
    each problem once (a new lambda per call missed it every time)."""
    return lambda c: grouped_allows(c) and allow(c)


def grouped_heuristic_config(
    rows: int,
    experts: int,
    n_pad: int,
    k_pad: int,
    group_size: int | None,
    num_sms: int = DEFAULT_NUM_SMS,
    allow: Callable[[TuningConfig], bool] | None = None,
    **options: Any,
) -> TuningConfig:
    """The config of a grouped matmul of ``rows`` rows of x over ``experts`` (K_pad, N_pad) weights: the
    dense heuristic's pick for :func:`planned_rows` rows on :func:`active_experts` weights at once,
    among the configs :func:`grouped_allows` (and ``allow``, where given: on a real GPU, the configs that
    passed the hardware check). ``options``: the dense heuristic's (``has_offsets``, ``scale_bytes``),
    passed on as given."""
    if rows < 1 or experts < 1:
        raise ValueError(f"grouped_heuristic_config: bad problem rows={rows}, experts={experts}")
    config = heuristic_config(
        planned_rows(rows, experts),
        n_pad,
        k_pad,
        group_size,
        num_sms,
        experts=active_experts(rows, experts),
        allow=grouped_allows if allow is None else _grouped_and(allow),
        **options,
    )
    # The dense heuristic puts a warp-specialized pick on a persistent grid where tiles outnumber SMs.
    return dataclasses.replace(config, persistent_ctas=0)
