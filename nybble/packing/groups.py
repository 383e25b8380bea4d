"""Group geometry: which rows of K share one scale row. ``QuantizedWeight`` and the kernels both use it.

G rows of K (the group size, a power of two >= ``MIN_GROUP_SIZE``) share one scale, and one offset, per
column; ``group_size=None`` is one group over the whole padded K (per-column quantization). The scales
have ceil(K_pad / G) rows, so the last group may be partial: K = 576 at g128 is 5 scale rows, the last
covering 64 rows of K. Row k of the codes uses scale row k // G.
"""

from __future__ import annotations

import numpy as np

# The narrowest group nybble stores, and the narrowest the Mosaic GPU kernel scales inside one 64-wide
# dequantization chunk (kernels/mosaic_gpu/config.py).
MIN_GROUP_SIZE = 16


def check_group_size(group_size: int | None) -> None:
    """Raises ValueError unless ``group_size`` is None (per column) or a power of two >= MIN_GROUP_SIZE."""
    if group_size is None:
        return
    power_of_two = isinstance(group_size, int | np.integer) and not group_size & (group_size - 1)
    if not power_of_two or group_size < MIN_GROUP_SIZE:
        raise ValueError(
            f"group_size must be None (one group per column) or a power of two >= {MIN_GROUP_SIZE} "
            f"(16, 32, 64, 128, 256, ...), got {group_size!r}"
        )


def group_rows(k_pad: int, group_size: int | None) -> int:
    """Rows of K per scale row: the group size, or all of K_pad for per-column quantization."""
    return k_pad if group_size is None else int(group_size)


def num_groups(k_pad: int, group_size: int | None) -> int:
    """Scale rows of a weight with K_pad rows: ceil(K_pad / G); the last group may be partial."""
    return -(-k_pad // group_rows(k_pad, group_size))
