"""Deliberate kernel bugs, for proving that the kernel tests can fail (``NYBBLE_GPU_TESTS_INJECT`` in
tests/test_kernel_gpu.py). Off by default: the kernel consults :func:`injected` while tracing, and with no
bug injected it traces exactly the ops it would without this module (no runtime cost, nothing lowered).

The bugs (each a plausible mistake that shifts results by a little, as measured in issue 13):
  * ``asym-bf16-dequant``: the accumulator route adds each group's offset term ``o * sum(x)`` rounded to
    the activation dtype (the weights route computes ``q * s + o`` in that dtype by design);
  * ``last-group-scale-row``: the last scale (and offset) row of K (of each K slice) is read from the
    row before it: the wrong scales for the last group only (for the last step's rows when a step holds
    several groups; per-column weights, with one row, are unaffected);
  * ``last-n-tile-zero``: the CTAs of the last N tile store zeros;
  * ``split-k-partial-sum``: the split-K reduction (split_k.py) leaves out the last K partition's partial.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

BUGS = ("asym-bf16-dequant", "last-group-scale-row", "last-n-tile-zero", "split-k-partial-sum")
# The bug kernels traced in this context get: a context variable, not a module global, so that one test
# (or thread) injecting a bug never leaks it into another's kernels.
_INJECTED: contextvars.ContextVar[str | None] = contextvars.ContextVar("nybble_kernel_bug", default=None)


def injected() -> str | None:
    """The bug currently injected in this context, or None (the default)."""
    return _INJECTED.get()


def _check(bug: str | None) -> None:
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown kernel bug {bug!r}; known bugs: {', '.join(BUGS)}")


def inject(bug: str | None) -> None:
    """Injects ``bug`` (one of :data:`BUGS`) into kernels traced from now on in this context; None removes
    it. Clears jax's caches so that no kernel traced before is reused. Prefer :func:`injecting`."""
    _check(bug)
    _INJECTED.set(bug)
    jax.clear_caches()


@contextlib.contextmanager
def injecting(bug: str | None) -> Iterator[None]:
    """``with injecting("last-n-tile-zero"): ...``: kernels traced inside get ``bug``; the bug before is
    back afterwards (jax's caches cleared on the way in and out)."""
    _check(bug)
    token = _INJECTED.set(bug)
    jax.clear_caches()
    try:
        yield
    finally:
        _INJECTED.reset(token)
        jax.clear_caches()
