"""One trace and one lowering of a kernel per problem, however many places a program calls it.

A model's step calls the same projection kernel (same shapes, config and epilogue) once a layer. Traced at
each call, every call site is a ``pallas_call`` of a jaxpr of its own, and jax lowers each one again
through Mosaic GPU (~0.4 s a kernel on a 2-core CPU, most of a step's compile). :func:`per_problem` runs
the kernel's launch under ``jax.jit`` with the problem static: every site of one problem calls the one
jaxpr jit traced, which jax lowers once per program (its lowering cache keys on the jaxpr) and XLA inlines
at each site. The inlined kernel's op name is prefixed with its site's scope (``layer_1/...``), so
profiles and ``bench.decode`` still see each launch where it runs.

What a launch reads at trace time besides its arguments is part of jit's cache key: interpret mode
(``plgpu.force_gpu_interpret_mode``, a jax config value that ``nybble.kernels.interpret`` sets). The
target architecture (``blackwell.target.target_arch``) is read when the program is lowered, after the
cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax


def per_problem(launch: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``launch(p, operands, work=None)`` traced once per (``p``, ``work``): both static (hashable frozen
    dataclasses), the operands (arrays) traced. Same outputs; the jitted function keeps ``launch``'s name,
    which op names show (``.../w4a16_single_wg/nybble_w4a16_<config>``)."""

    def traced(p: Any, work: Any, *operands: Any) -> jax.Array:
        return launch(p, list(operands), work)

    traced.__name__ = traced.__qualname__ = launch.__name__
    jitted = jax.jit(traced, static_argnums=(0, 1))

    @functools.wraps(launch)
    def call(p: Any, operands: list[Any], work: Any = None) -> jax.Array:
        return jitted(p, work, *operands)

    return call


__all__ = ["per_problem"]
