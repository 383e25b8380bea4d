"""Deliberate kernel bugs, for proving that the kernel tests can fail (``NYBBLE_GPU_TESTS_INJECT`` in
tests/test_kernel_gpu.py). The kernel modules know nothing of them: inside :func:`injecting`, a function
the kernel calls while tracing is swapped for a twin that makes the mistake (the production body pays
nothing for it, and outside the context traces exactly as it would without this module).

The bugs (each a plausible mistake that shifts results by a little, as measured in issue 13), and the
function each swaps:
  * ``asym-bf16-dequant`` (``common.add_scaled_group``): the accumulator route adds each group's offset
    term ``o * sum(x)`` rounded to the activation dtype (the weights route computes ``q * s + o`` in that
    dtype by design);
  * ``last-group-scale-row`` (``common.scale_row``): the last scale (and offset) row of K (of each K
    slice) is read from the row before it: the wrong scales for the last group only (for the last step's
    rows when a step holds several groups; per-column weights, with one row, are unaffected);
  * ``last-n-tile-zero`` (``store_tiles``, as the kernel bodies w4a16.py and w4a16_ws.py call it): the
    CTAs of the last N tile store zeros;
  * ``split-k-partial-sum`` (``split_k.sum_partials``): the split-K reduction leaves out the last K
    partition's partial.

The twins are installed for the duration of the outermost :func:`injecting` and consult a context
variable, so that a bug injected in one test (or thread) never reaches another's kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from nybble.kernels.mosaic_gpu import common, split_k

BUGS = ("asym-bf16-dequant", "last-group-scale-row", "last-n-tile-zero", "split-k-partial-sum")
_INJECTED: contextvars.ContextVar[str | None] = contextvars.ContextVar("nybble_kernel_bug", default=None)
_lock = threading.Lock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []


def injected() -> str | None:
    """The bug currently injected in this context, or None (the default)."""
    return _INJECTED.get()


def _scale_row(real: Callable[..., Any]) -> Callable[..., Any]:
    def scale_row(p: Any, step: Any) -> Any:
        row = real(p, step)
        if injected() != "last-group-scale-row":
            return row
        last = -(-p.slice_k // p.group) - 1 if p.group >= p.config.tile_k else p.steps_per_split - 1
        return jnp.where(row == last, row - 1, row) if last > 0 else row

    return scale_row


def _add_scaled_group(real: Callable[..., Any]) -> Callable[..., Any]:
    def add_scaled_group(p: Any, total: Any, acc: Any, xsum: Any, s: Any, offsets: Any, g: int) -> Any:
        if injected() != "asym-bf16-dequant" or offsets is None:
            return real(p, total, acc, xsum, s, offsets, g)
        total = real(p, total, acc, xsum, s, None, g)  # the coefficient without the offset...
        tiles = p.config.tiles
        o = jnp.concatenate([common._row_values(p, offsets, g, t, 0, jnp.float32) for t in range(tiles)])
        xsum = jnp.concatenate([xsum] * tiles) if tiles > 1 else xsum
        term = xsum * lax.broadcast_in_dim(o, acc.shape, [0])  # ...which comes in rounded to x's dtype
        return total + term.astype(p.dtype).astype(jnp.float32)

    return add_scaled_group


def _store_tiles(real: Callable[..., Any]) -> Callable[..., Any]:
    def store_tiles(p: Any, acc: Any, smem: Any, out_gmem: Any, mi: Any, n_start: Any, **kwargs: Any) -> Any:
        if injected() == "last-n-tile-zero":
            acc = acc * jnp.where(n_start >= p.n_pad - p.config.cta_rows, 0.0, 1.0).astype(acc.dtype)
        return real(p, acc, smem, out_gmem, mi, n_start, **kwargs)

    return store_tiles


def _sum_partials(real: Callable[..., Any]) -> Callable[..., Any]:
    def sum_partials(slabs: Any, partitions: int, *rest: Any) -> Any:
        return real(slabs, partitions - (injected() == "split-k-partial-sum"), *rest)

    return sum_partials


# (The kernel bodies' modules by import_module: the package's attribute ``w4a16`` is the kernel function.)
_TWINS = [
    (common, "scale_row", _scale_row),
    (common, "add_scaled_group", _add_scaled_group),
    (importlib.import_module("nybble.kernels.mosaic_gpu.w4a16"), "store_tiles", _store_tiles),
    (importlib.import_module("nybble.kernels.mosaic_gpu.w4a16_ws"), "store_tiles", _store_tiles),
    (split_k, "sum_partials", _sum_partials),
]


def _install() -> None:
    global _depth
    with _lock:
        if _depth == 0:
            for module, name, twin in _TWINS:
                real = getattr(module, name)
                _saved.append((module, name, real))
                setattr(module, name, twin(real))
        _depth += 1


def _uninstall() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0:
            while _saved:
                module, name, real = _saved.pop()
                setattr(module, name, real)


@contextlib.contextmanager
def injecting(bug: str | None) -> Iterator[None]:
    """``with injecting("last-n-tile-zero"): ...``: kernels traced inside get ``bug`` (one of :data:`BUGS`;
    None: none); the bug before is back afterwards (jax's caches cleared on the way in and out, so that
    no kernel traced outside is reused inside, nor the other way)."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown kernel bug {bug!r}; known bugs: {', '.join(BUGS)}")
    token = _INJECTED.set(bug)
    _install()
    jax.clear_caches()
    try:
        yield
    finally:
        _uninstall()
        _INJECTED.reset(token)
        jax.clear_caches()


__all__ = ["BUGS", "injected", "injecting"]
