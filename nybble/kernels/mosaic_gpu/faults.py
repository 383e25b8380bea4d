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

import jax

BUGS = ("asym-bf16-dequant", "last-group-scale-row", "last-n-tile-zero", "split-k-partial-sum")
_injected: str | None = None


def injected() -> str | None:
    """The bug currently injected, or None (the default)."""
    return _injected


def inject(bug: str | None) -> None:
    """Injects ``bug`` (one of :data:`BUGS`) into kernels traced from now on; None removes it. Clears
    jax's caches so that no kernel traced before is reused."""
    global _injected
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown kernel bug {bug!r}; known bugs: {', '.join(BUGS)}")
    _injected = bug
    jax.clear_caches()
