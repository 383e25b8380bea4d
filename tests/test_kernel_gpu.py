"""The Mosaic GPU W4A16 kernel on a real Hopper GPU, against the XLA path. Skipped cleanly elsewhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nybble.kernels.api import hopper_device, num_sms
from nybble.kernels.mosaic_gpu import TuningConfig, mosaic_gpu_matmul
from nybble.kernels.reference import relative_error
from nybble.kernels.xla import xla_matmul
from nybble.quant import quantize

NUM_SMS = num_sms() if hopper_device() is not None else None  # never raises on a CPU
pytestmark = pytest.mark.skipif(NUM_SMS is None, reason="needs an NVIDIA Hopper GPU (sm90)")


@pytest.mark.parametrize("m", [1, 7, 16, 100, 512, 2048])
@pytest.mark.parametrize(
    "k, n, group, symmetric",
    [(4096, 4096, 128, True), (576, 1536, 128, False), (1536, 576, None, True), (10944, 7392, 32, False)],
)
def test_matches_xla(m, k, n, group, symmetric):
    rng = np.random.default_rng(m + k + n)
    qw = quantize(rng.standard_normal((k, n)).astype(np.float32), group_size=group, symmetric=symmetric)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    y = jax.jit(lambda x, qw: mosaic_gpu_matmul(x, qw, num_sms=NUM_SMS))(x, qw)
    y_xla = jax.jit(xla_matmul)(x, qw)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    # Same dequantized weights, both accumulate in f32: only summation order and the final rounding differ.
    assert relative_error(y, y_xla) < 1e-2


@pytest.mark.parametrize(
    "config",
    [
        TuningConfig(
            tiles=2, tile_m=8, tile_k=128, max_concurrent_steps=6, split_k=4, scales_on="accumulators"
        ),
        TuningConfig(tiles=1, tile_m=64, tile_k=64, max_concurrent_steps=4, split_k=2),
        TuningConfig(tiles=2, tile_m=128, tile_k=128, max_concurrent_steps=4, split_k=1),
        TuningConfig(tiles=2, tile_m=128, tile_k=64, max_concurrent_steps=4, compute_wgs=2),
        TuningConfig(tiles=1, tile_m=16, tile_k=128, max_concurrent_steps=3, split_k=2, compute_wgs=2),
    ],
    ids=str,
)
def test_explicit_configs(config):
    rng = np.random.default_rng(0)
    qw = quantize(rng.standard_normal((4096, 1024)).astype(np.float32), group_size=64, symmetric=False)
    x = jnp.asarray(rng.standard_normal((37, 4096)), jnp.float16)
    y = mosaic_gpu_matmul(x, qw, config=config, num_sms=NUM_SMS)
    assert relative_error(y, xla_matmul(x, qw)) < 1e-2


def test_grad_wrt_x():
    rng = np.random.default_rng(1)
    qw = quantize(rng.standard_normal((1024, 512)).astype(np.float32), group_size=128)
    x = jnp.asarray(rng.standard_normal((8, 1024)), jnp.bfloat16)
    loss = lambda f: lambda x: f(x, qw).astype(jnp.float32).sum()
    dx = jax.grad(loss(lambda x, qw: mosaic_gpu_matmul(x, qw, num_sms=NUM_SMS)))(x)
    assert relative_error(dx, jax.grad(loss(xla_matmul))(x)) < 1e-2
