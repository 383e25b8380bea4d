"""The backends of nybble's ops and the choice between them, written once for every op.

A backend is one module, imported on first use, that exposes six plain functions:

    unsupported(x, qw) -> str | None                 why it cannot compute these arguments (dtype, layout...)
    not_here() -> str | None                          why it cannot run on this machine now (no such GPU...)
    matmul(x2d, qw) -> jax.Array                      x2d (M, K); called once both checks passed, or forced
    describe(m, qw) -> str                            one line for ``nybble.kernels.explain``
    ragged_unsupported(x, qw, group_sizes) -> str | None
    ragged_matmul(x, qw, group_sizes) -> jax.Array

and, optionally, ``unverified(x, qw)`` / ``ragged_unverified(x, qw, group_sizes)`` -> str | None: why
``implementation=None`` passes it over although it could run (on a real GPU, no config of it has passed a
hardware check for these arguments); a forced implementation ignores it. Also optional, a SwiGLU op of its
own (``nybble.kernels.swiglu_matmul``): ``swiglu_unsupported(x2d, qw, forced=...)`` -> str | None and
``swiglu_matmul(x2d, qw, sum_of_squares, norm)``; without one, the op runs the backend's ``matmul`` and
its SiLU product after it. The grouped one likewise (``nybble.kernels.ragged_swiglu_matmul``):
``ragged_swiglu_unsupported(x, qw, group_sizes, forced=...)`` and ``ragged_swiglu_matmul(x, qw,
group_sizes)``. And a residual op (``nybble.kernels.residual_matmul``): ``residual_unsupported(x2d, qw,
forced=...)`` and ``residual_matmul(x2d, qw, residual, norm_weight)`` -> (x, h).

:data:`BACKENDS` maps each ``implementation=`` name to its module, in the order ``implementation=None``
tries them; adding a backend is one line there. An op (``ops/matmul/api.py``, ``ops/ragged_matmul/api.py``)
names its pair of functions as an :class:`Op` and calls :func:`run`, :func:`availability` and
:func:`check_implementation`: the name checks, the fallback and its one warning per reason live here.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from types import ModuleType
from typing import Any

import jax

from nybble import device

# implementation= name -> the module that plugs it in. XLA runs everywhere and comes last.
BACKENDS: dict[str, str] = {
    "mosaic_gpu": "nybble.kernels.mosaic_gpu.backend",
    "triton": "nybble.kernels.triton.backend",
    "xla": "nybble.kernels.ops.xla_backend",
}
# The names implementation= takes, in the order implementation=None tries them.
IMPLEMENTATIONS: tuple[str, ...] = tuple(BACKENDS)
# One of IMPLEMENTATIONS (a str, so that registering a backend is one line).
Implementation = str
# The backend implementation=None lands on when nothing faster can run; reaching it on a GPU is warned.
FALLBACK = "xla"


@dataclasses.dataclass(frozen=True)
class Availability:
    """Whether an implementation can run given arguments here; ``reason`` says why not. Truthy when it can:
    ``if available_implementations(x, qw)["mosaic_gpu"]: ...``."""

    available: bool
    # Why it cannot run (None when it can).
    reason: str | None = None

    def __bool__(self) -> bool:
        return self.available

    def __repr__(self) -> str:
        return "<available>" if self.available else f"<unavailable: {self.reason}>"


@dataclasses.dataclass(frozen=True)
class Op:
    """One op as the backends see it: the names of its argument check and its computation in a backend
    module, and how its messages name it."""

    what: str  # "nybble.matmul"
    unsupported: str  # "unsupported" / "ragged_unsupported"
    compute: str  # "matmul" / "ragged_matmul"
    unverified: str  # "unverified" / "ragged_unverified"


_LOADED: dict[str, ModuleType | str] = {}


def load(name: str) -> ModuleType | str:
    """The backend module registered as ``name``, or why it cannot be imported (a sentence)."""
    if name not in _LOADED:
        try:
            _LOADED[name] = importlib.import_module(BACKENDS[name])
        except ImportError as e:
            _LOADED[name] = f"the {name!r} backend is not installed in this build ({e})"
    return _LOADED[name]


def check_implementation(what: str, implementation: Any) -> None:
    """Refuses an implementation name that is not one of :data:`IMPLEMENTATIONS` (or None)."""
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"{what}: unknown implementation {implementation!r}; choose one of {IMPLEMENTATIONS} or None"
        )


def _unsupported(op: Op, name: str, args: tuple[Any, ...]) -> str | None:
    """Why backend ``name`` cannot compute these arguments anywhere (or is not installed), or None."""
    backend = load(name)
    return backend if isinstance(backend, str) else getattr(backend, op.unsupported)(*args)


def _reason(op: Op, name: str, args: tuple[Any, ...]) -> str | None:
    """Why backend ``name`` cannot run these arguments here: the arguments first, then the machine."""
    return _unsupported(op, name, args) or load(name).not_here()


def _unverified(op: Op, name: str, args: tuple[Any, ...]) -> str | None:
    """Why ``implementation=None`` passes over backend ``name``, which could run: not hardware-checked."""
    gate = getattr(load(name), op.unverified, None)
    return None if gate is None else gate(*args)


def default_choice(op: Op, args: tuple[Any, ...]) -> tuple[str, list[str]]:
    """The backend ``implementation=None`` runs ``op`` on ``args`` with, and why each one before it was
    passed over ("not 'mosaic_gpu': ..."). NotImplementedError when none can run them."""
    passed_over = []
    for name in IMPLEMENTATIONS:
        why = _reason(op, name, args) or _unverified(op, name, args)
        if why is None:
            return name, passed_over
        passed_over.append(f"not {name!r}: {why}")
    raise NotImplementedError(f"{op.what}: nothing can run these arguments: " + "; ".join(passed_over))


def availability(op: Op, args: tuple[Any, ...]) -> dict[str, Availability]:
    """Each backend, in dispatch order, and whether it can run ``op`` on ``args`` here (with the reason)."""
    reasons = {name: _reason(op, name, args) for name in IMPLEMENTATIONS}
    return {name: Availability(why is None, why) for name, why in reasons.items()}


def run(op: Op, implementation: Implementation | None, args: tuple[Any, ...]) -> jax.Array:
    """``op`` on ``args`` by the backend asked for, or by the first that can run here.

    A forced backend is checked against the arguments only (``NotImplementedError`` saying why): the
    machine is its own business at lowering, so tracing and lowering for a GPU work on a CPU. None takes
    :func:`default_choice`; landing on :data:`FALLBACK` on a GPU machine warns once per reason.
    """
    if implementation is not None:
        why = _unsupported(op, implementation, args)
        if why is not None:
            raise NotImplementedError(f"{op.what}(implementation={implementation!r}) cannot run: {why}")
        return getattr(load(implementation), op.compute)(*args)
    name, passed_over = default_choice(op, args)
    if name == FALLBACK and passed_over:
        _warn_fallback(op.what, "; ".join(passed_over))
    return getattr(load(name), op.compute)(*args)


# Reasons already warned about by implementation=None on a GPU machine (once per reason and process).
_WARNED: set[str] = set()


def _warn_fallback(what: str, reason: str) -> None:
    """On a machine with a GPU, says once per reason that ``implementation=None`` runs the XLA path: there
    the user expects a kernel, and XLA's dequantize-and-dot streams 2 bytes a weight instead of 0.5. On
    a CPU the XLA path is the expected one and nothing is said."""
    if reason in _WARNED or device.gpu_device() is None:
        return
    _WARNED.add(reason)
    warnings.warn(
        f"{what}: running the XLA path (dequantize, then dot), not a GPU kernel: {reason}. Pass "
        f"implementation='xla' to silence this, or see nybble.kernels.explain(x, qw).",
        RuntimeWarning,
        stacklevel=5,
    )


def describe(name: str, m: int, qw: Any) -> str:
    """Backend ``name``'s one line on what it runs for M rows against ``qw``."""
    backend = load(name)
    return backend if isinstance(backend, str) else backend.describe(m, qw)


__all__ = [
    "BACKENDS",
    "FALLBACK",
    "IMPLEMENTATIONS",
    "Availability",
    "Implementation",
    "Op",
    "availability",
    "check_implementation",
    "default_choice",
    "describe",
    "load",
    "run",
]
