"""Mosaic GPU's layout inference without re-verifying the kernel for each sort key (jax 0.11.2).

jax 0.11.2's ``constraints.compute_transitively_equal_vars`` sorts the layout variables of a kernel by
``str``; a variable's ``str`` (``layout_inference.ValueSite.__str__``) prints its operation with MLIR's
default flags and keeps the first token (``%12 = arith.addf``). Those flags verify the operation before
printing it, regions included, so a variable of the kernel's ``scf.for`` re-verifies the whole main loop:
~1.6 ms a key, a quarter of an X-ray compile's CPU time and a seventh of a lowering (measured 2026-12-05,
docs/logs/performance-log.md). jax 0.12 no longer sorts there, and keeps its own.

:func:`install` gives ``ValueSite`` the same ``__str__`` printed with ``assume_verified=True`` and
``skip_regions=True``: the first line of the print, and so the key, is the same string (the one case where
it would differ, an operation failing verification, which MLIR prints in generic form, is checked by
tests/test_kernel_lowering.py: every key of the Hopper, grouped and Blackwell kernels' lowerings compared
with jax's own). Only the development processes that lower kernels install it (the test suite and the X-ray's
compile workers); the ``nybble`` package never patches jax. Installed only over the exact function it
replaces: a jax whose ``ValueSite.__str__`` differs keeps its own.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from typing import Any

# sha256 of ``inspect.getsource(ValueSite.__str__)`` in the jax releases whose key this reproduces (0.11.2;
# 0.12.0.1 has the same method but no longer sorts by it: :func:`sorts_by_key` is False there).
_KNOWN_SOURCES = frozenset({"1bb28d7f7ca409251e91d92507b8f5c59188027b558857c7060d47cbdc23faf2"})

_installed: dict[str, Any] = {}


def _source_digest(fn: Callable[..., Any]) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def sorts_by_key() -> bool:
    """Whether this jax's layout inference sorts its variables by ``str`` (jax 0.11.2: yes; 0.12: no)."""
    from jax.experimental.mosaic.gpu import constraints

    return "key=str" in inspect.getsource(constraints.compute_transitively_equal_vars)


def fast_key(site: Any) -> str:
    """``site``'s ``ValueSite.__str__``: its operation's first token, printed without verifying it."""
    from jax.experimental.mosaic.gpu import layout_inference as li

    text = site.operation.get_asm(assume_verified=True, skip_regions=True)
    match = li._op_name_regex.match(text)
    assert match is not None, text[:200]
    if site.type == li.VariableType.OPERAND:
        return f"{match.group(0)}:o-{site.index}"
    if site.type == li.VariableType.RESULT:
        return f"{match.group(0)}:r-{site.index}"
    return f"{match.group(0)}:a-{site.index}"


def install(*, check: bool = False) -> bool:
    """Replaces ``ValueSite.__str__`` with :func:`fast_key` where jax's is the known one and its layout
    inference sorts by it (:func:`sorts_by_key`); True if installed.

    ``check``: also compute jax's own key each time and raise ``AssertionError`` on a difference (slow; the
    tests' proof). Installing again (with or without ``check``) replaces the previous installation."""
    try:
        from jax.experimental.mosaic.gpu import layout_inference as li
    except ImportError:  # a jax without Mosaic GPU: nothing to speed up
        return False
    if not check and li.ValueSite.__str__ is fast_key:  # installed already (each X-ray compile asks)
        return True
    original = _installed.get("original", li.ValueSite.__str__)
    if _source_digest(original) not in _KNOWN_SOURCES or not sorts_by_key():
        return False

    if check:

        def key(site: Any) -> str:
            fast, own = fast_key(site), original(site)
            _installed["checked"] = _installed.get("checked", 0) + 1
            assert fast == own, f"layout key differs: {fast!r} (fast) != {own!r} (jax)"
            return fast

    else:
        key = fast_key
    _installed["original"] = original
    li.ValueSite.__str__ = key
    return True


def uninstall() -> None:
    """Puts jax's own ``ValueSite.__str__`` back (if :func:`install` replaced it)."""
    if "original" in _installed:
        from jax.experimental.mosaic.gpu import layout_inference as li

        li.ValueSite.__str__ = _installed.pop("original")


def keys_checked() -> int:
    """How many keys an ``install(check=True)`` compared with jax's own so far."""
    return int(_installed.get("checked", 0))
