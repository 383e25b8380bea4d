"""Quantize a weight, multiply with it, and see what it cost: `make quickstart`."""

import jax
import jax.numpy as jnp

import nybble
from nybble.kernels import reference_matmul, relative_error

k, n, m = 4096, 4096, 16
w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02  # (in_features, out_features)
x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.bfloat16)

qw = nybble.quantize(w, group_size=128)  # symmetric int4, bf16 scales per 128 rows of K
print(qw)
y = jax.jit(nybble.matmul)(x, qw)  # Mosaic GPU kernel on Hopper, XLA elsewhere

print(nybble.kernels.explain(x, qw))  # what runs here, and why
err = relative_error(y, reference_matmul(x, qw))
print(f"y: {y.shape} {y.dtype}; relative error vs float64 reference: {err:.2e}")
w_err = float(jnp.linalg.norm(nybble.dequantize(qw) - w) / jnp.linalg.norm(w))
print(f"weight quantization error (relative): {w_err:.3f}")
print(f"bytes: bf16 {k * n * 2 / 2**20:.1f} MiB -> int4 {qw.nbytes / 2**20:.2f} MiB "
      f"({k * n * 2 / qw.nbytes:.2f}x smaller, {qw.bits_per_weight:.3f} bits/weight)")
