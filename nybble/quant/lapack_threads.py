"""One BLAS thread for the LAPACK calls GPTQ and the scale refit make on the CPU.

On the CPU backend jaxlib runs Cholesky factorizations, triangular solves and LU in LAPACK, i.e. in scipy's
OpenBLAS, whose own thread pool spins next to XLA's. On this project's 2-core machine, shared with other
jobs, GPTQ of the whole SmolLM2-135M (`nybble quantize --method gptq`) took 189 s of CPU time with
OpenBLAS's default two threads and 98 s with one. One thread also makes the result independent of the
core count: OpenBLAS's blocked factorizations round differently with one and two threads (0 to 188 codes
of a layer of SmolLM2's first block change, and act-order carries that into every later layer; eval
perplexity 59.36 against 59.38). GPU backends do not use OpenBLAS at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Limits OpenBLAS (and any other BLAS loaded) to one thread inside the ``with`` block.

    JAX dispatches asynchronously: wait for the results (:func:`ready`) before the block ends, or the
    LAPACK calls may run after the limit is lifted. Uses ``threadpoolctl`` (a dependency of nybble); where
    it is missing (a bare ``PYTHONPATH`` checkout) nothing is limited: the same results, maybe slower.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ModuleNotFoundError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def ready(tree: Any) -> Any:
    """``tree`` once its arrays are computed (tracers, under ``jit``, pass through)."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree)):
        return tree
    return jax.block_until_ready(tree)


__all__ = ["one_blas_thread", "ready"]
