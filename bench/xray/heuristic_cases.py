"""Every kernel the heuristics can pick at a set of problems: the lists the lowering, interpret and X-ray
checks sweep (a development tool: the library picks one config per call and never enumerates them)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from nybble.device import DEFAULT_NUM_SMS
from nybble.kernels.mosaic_gpu.config import TuningConfig
from nybble.kernels.mosaic_gpu.grouped_config import grouped_heuristic_config
from nybble.kernels.mosaic_gpu.heuristics import heuristic_config
from nybble.packing import padded_weight_dims
from nybble.packing.groups import group_rows


def group_structure(group: int, config: TuningConfig) -> int | str:
    """How groups of ``group`` K rows meet ``config``'s K step, as far as the kernel's code is concerned:
    the group itself when a step holds several, else ``"group >= tile_k"``."""
    return group if group < config.tile_k else "group >= tile_k"


def heuristic_cases(
    weight_shapes: Iterable[tuple[int, int]],
    batches: Iterable[int],
    group_sizes: Iterable[int | None],
    num_sms: int = DEFAULT_NUM_SMS,
) -> dict[tuple[TuningConfig, object, bool], tuple[int, int, int, int | None, bool]]:
    """Every kernel ``heuristic_config`` can build for these problems, each with one problem using it.

    Keys are (config, how groups meet the K step, symmetric): what changes the kernel's code; values are
    (M, K, N, group_size, symmetric). Tests lower every entry for CUDA, so every kernel the heuristics can
    return at those shapes is known to compile. (K, N) are logical.
    """
    cases: dict[tuple[TuningConfig, object, bool], tuple[int, int, int, int | None, bool]] = {}
    for (k, n), m, group_size, symmetric in itertools.product(
        weight_shapes, list(batches), list(group_sizes), (True, False)
    ):
        k_pad, n_pad = padded_weight_dims(k, n, group_size)
        config = heuristic_config(m, n_pad, k_pad, group_size, num_sms, has_offsets=not symmetric)
        structure = group_structure(group_rows(k_pad, group_size), config)
        cases.setdefault((config, structure, symmetric), (m, k, n, group_size, symmetric))
    return cases


def grouped_heuristic_cases(
    problems: Iterable[tuple[int, int, int, int]],
    group_sizes: Iterable[int | None],
    num_sms: int = DEFAULT_NUM_SMS,
) -> dict[tuple[TuningConfig, object, bool], tuple[int, int, int, int, int | None, bool]]:
    """Every grouped kernel ``grouped_heuristic_config`` builds for ``problems`` (rows, experts, K, N),
    each with one problem using it: keys (config, how groups meet the K step, symmetric), values (rows,
    experts, K, N, group_size, symmetric), as ``heuristic_cases`` for the dense kernel."""
    cases: dict[tuple[TuningConfig, object, bool], tuple[int, int, int, int, int | None, bool]] = {}
    for (rows, experts, k, n), group_size, symmetric in itertools.product(
        list(problems), list(group_sizes), (True, False)
    ):
        k_pad, n_pad = padded_weight_dims(k, n, group_size)
        config = grouped_heuristic_config(
            rows, experts, n_pad, k_pad, group_size, num_sms, has_offsets=not symmetric
        )
        structure = group_structure(group_rows(k_pad, group_size), config)
        cases.setdefault((config, structure, symmetric), (rows, experts, k, n, group_size, symmetric))
    return cases
