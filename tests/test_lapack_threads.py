"""GPTQ's LAPACK calls run with one BLAS thread, and the limit lasts until their results are ready."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from threadpoolctl import threadpool_info

from nybble.quant.lapack_threads import one_blas_thread, ready


def _blas_threads() -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_one_blas_thread_inside_and_restored_after():
    jnp.linalg.cholesky(jnp.eye(4)).block_until_ready()  # loads the LAPACK jax uses on the CPU
    before = _blas_threads()
    assert before  # scipy's OpenBLAS, at least
    with one_blas_thread():
        assert _blas_threads() == [1] * len(before)
    assert _blas_threads() == before


def test_ready_waits_for_arrays_and_passes_tracers():
    a = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
    h = jnp.asarray(a @ a.T + 64 * np.eye(64, dtype=np.float32))
    with one_blas_thread():
        low = ready(jnp.linalg.cholesky(h))
    np.testing.assert_allclose(np.asarray(low @ low.T), np.asarray(h), rtol=1e-5, atol=1e-4)
    traced = jax.jit(lambda h: ready(jnp.linalg.cholesky(h)))(h)  # under jit: a tracer, returned as is
    np.testing.assert_allclose(np.asarray(traced), np.asarray(low), rtol=1e-6)
