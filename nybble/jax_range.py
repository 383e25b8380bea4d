"""The jax releases nybble supports: ``jax>=0.11.2,<0.13`` (pyproject.toml), tested at both ends.

CI runs the whole suite on the lower end, and the kernel tests on the newest release in the range (``make
test-jax-latest``) and on the newest one jax's CUDA 12 plugin exists for (``make test-jax-cuda12``). Outside
the range ``import nybble`` warns once (:func:`warn_if_outside`) and the Mosaic GPU kernels refuse to run
(:func:`outside_reason`, in their ``is_supported``): Mosaic GPU's API and layout inference change between jax
releases, so a kernel that lowers on one may not on the next.
"""

from __future__ import annotations

import re
import warnings

__all__ = ["MAX_EXCLUSIVE", "MIN_VERSION", "SPECIFIER", "TESTED", "outside_reason", "warn_if_outside"]

# Keep in step with pyproject.toml's dependencies (tests/test_jax_range.py checks).
MIN_VERSION = (0, 11, 2)
MAX_EXCLUSIVE = (0, 13)
SPECIFIER = ">=0.11.2,<0.13"
# The releases CI tests: the lower end, the newest release jax's CUDA 12 plugin exists for (what
# `pip install "jax[cuda12]"` gets in the range) and the newest release in the range.
TESTED = ("0.11.2", "0.12.0.1", "0.12.1")

_warned = False


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: "0.12.0.1" -> (0, 12, 0, 1), "0.13.0.dev2" ->
    (0, 13, 0)."""
    numbers = []
    for part in version.split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.end() != len(part):
            break
    return tuple(numbers)


def outside_reason(version: str | None = None) -> str | None:
    """None when ``version`` (default: the installed jax's) is in nybble's range, else one sentence naming
    the range, the tested releases and the fix."""
    if version is None:
        import jax

        version = jax.__version__
    release = _release(version)
    if release and MIN_VERSION <= release < MAX_EXCLUSIVE:
        return None
    tested = f"{', '.join(TESTED[:-1])} and {TESTED[-1]}"
    return (
        f"nybble supports jax{SPECIFIER} (tested with jax {tested}) and this is jax {version}; its Mosaic "
        f"GPU kernels are refused outside that range (Mosaic GPU changes between jax releases): install a "
        f"jax in the range, e.g. pip install \"jax{SPECIFIER}\""
    )


def warn_if_outside(version: str | None = None) -> bool:
    """Warns (once per process) when the installed jax is outside nybble's range; True if it warned."""
    global _warned
    reason = outside_reason(version)
    if reason is None or _warned:
        return False
    _warned = True
    warnings.warn(reason, RuntimeWarning, stacklevel=2)
    return True
