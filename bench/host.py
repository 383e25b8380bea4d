"""The work users wait for outside the matmul: packing nibbles on the host and quantizing weights.

``pack_int4`` / ``unpack_int4`` (numpy) are timed against ``np.copy`` of the same int8 codes, measured in
the same run, so the ratio says how far from a plain memory copy the packing is. ``nybble.quantize`` is
timed in parameters per second on the default JAX device (eager, as users call it, after one warm-up).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import nybble
from bench.timing import time_host


def packing_throughput(k: int = 4096, n: int = 4096, repeats: int = 5) -> list[dict[str, Any]]:
    """Rows for np.copy, pack_int4 and unpack_int4 over a (N, K) int8 code matrix."""
    rng = np.random.default_rng(0)
    codes = rng.integers(-8, 8, size=(n, k), dtype=np.int8)
    packed = nybble.pack_int4(codes, axis=-1)
    if not np.array_equal(nybble.unpack_int4(packed, k, axis=-1), codes):
        raise AssertionError("unpack_int4(pack_int4(codes)) != codes")
    values = codes.size
    t_copy = time_host(lambda: np.copy(codes), repeats=repeats)
    t_pack = time_host(lambda: nybble.pack_int4(codes, axis=-1), repeats=repeats)
    t_unpack = time_host(lambda: nybble.unpack_int4(packed, k, axis=-1), repeats=repeats)
    rows = []
    for op, t, moved in (
        ("np.copy (int8 codes)", t_copy, 2 * codes.nbytes),
        ("pack_int4", t_pack, codes.nbytes + packed.nbytes),
        ("unpack_int4", t_unpack, packed.nbytes + codes.nbytes),
    ):
        rows.append(
            {
                "op": op,
                "shape": [n, k],
                "values": values,
                "bytes_moved": moved,
                "median_ms": t * 1e3,
                "values_per_s": values / t,
                "gbps": moved / t / 1e9,
                "x_copy_time": t / t_copy,
            }
        )
    return rows


def quantize_throughput(
    k: int = 4096, n: int = 4096, group_size: int | None = 128, repeats: int = 3
) -> list[dict[str, Any]]:
    """Parameters per second of ``nybble.quantize`` (symmetric and asymmetric) on the default device."""
    w = 0.02 * jax.random.normal(jax.random.key(3), (k, n), jnp.float32)
    rows = []
    for symmetric in (True, False):
        t = time_host(
            lambda s=symmetric: jax.block_until_ready(nybble.quantize(w, group_size=group_size, symmetric=s)),
            repeats=repeats,
        )
        rows.append(
            {
                "op": f"quantize {'sym' if symmetric else 'asym'} "
                f"{'per-column' if group_size is None else f'g{group_size}'}",
                "shape": [k, n],
                "device": jax.default_backend(),
                "params": k * n,
                "median_ms": t * 1e3,
                "params_per_s": k * n / t,
            }
        )
    return rows
