"""pytest-benchmark entry points for the host-side work: packing nibbles and quantizing (tiny sizes, CI).

``np.copy`` of the same int8 codes is the yardstick for ``pack_int4`` / ``unpack_int4``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble

K, N = 1024, 1024


@pytest.fixture(scope="module")
def codes():
    return np.random.default_rng(0).integers(-8, 8, size=(N, K), dtype=np.int8)


def test_np_copy(benchmark, codes):
    out = benchmark.pedantic(np.copy, args=(codes,), rounds=20, warmup_rounds=1)
    assert np.array_equal(out, codes)


def test_pack_int4(benchmark, codes):
    packed = benchmark.pedantic(nybble.pack_int4, args=(codes,), rounds=10, warmup_rounds=1)
    assert packed.shape == (N, K // 2)


def test_unpack_int4(benchmark, codes):
    packed = nybble.pack_int4(codes)
    out = benchmark.pedantic(nybble.unpack_int4, args=(packed, K), rounds=10, warmup_rounds=1)
    assert np.array_equal(out, codes)


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize(benchmark, symmetric):
    w = 0.02 * jax.random.normal(jax.random.key(0), (K, N), jnp.float32)
    jax.block_until_ready(nybble.quantize(w, symmetric=symmetric))  # warm the op caches
    qw = benchmark.pedantic(
        lambda: jax.block_until_ready(nybble.quantize(w, symmetric=symmetric)), rounds=5, warmup_rounds=1
    )
    assert qw.shape == (K, N)
