"""The Triton MoE routing kernel lowered for CUDA on a CPU, with no GPU and no toolchain: Pallas' Triton
lowering reads its target from an abstract mesh's device (``jax.sharding.use_abstract_mesh``), so this runs
on every jax of the range (the compile and the SASS: tests/test_moe_routing_sass.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from nybble.kernels.triton import moe_routing as kernel
from nybble.kernels.triton import moe_routing_tokens as tokens_kernel

EPS = 1e-6

# sm_80, sm_89 (an L40S lowers as the L40), sm_90, sm_100, sm_120
KINDS = ("NVIDIA A100-SXM4-80GB", "NVIDIA L40", "NVIDIA H200", "NVIDIA B200", "NVIDIA RTX PRO 6000")


@pytest.mark.parametrize("kind", KINDS)
def test_lowers_to_one_triton_call(kind):
    # Qwen3-30B-A3B's routing (128 experts, top 8, hidden 2048) for a GPU, with none here: Pallas' Triton
    # lowering reads its target from the abstract mesh's device
    cfg = kernel.choose_config(2048, 8, EPS)
    args = (
        jax.ShapeDtypeStruct((128,), jnp.float32),
        jax.ShapeDtypeStruct((2048,), jnp.bfloat16),
        jax.ShapeDtypeStruct((2048,), jnp.bfloat16),
        jax.ShapeDtypeStruct((2048,), jnp.bfloat16),
        jax.ShapeDtypeStruct((128,), jnp.float32),
    )

    def route(logits, x, a, weight, sums):
        return kernel.route_one(logits, [x, a], weight, sums, cfg)

    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        text = jax.jit(route).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1, calls
    assert "tensor<8x2048xbf16>" in calls[0] and "tensor<8xf32>" in calls[0], calls


@pytest.mark.parametrize("kind", KINDS)
def test_the_tokens_kernel_lowers_to_one_triton_call(kind):
    # Qwen3-30B-A3B's routing of a batch-8 step (8 tokens, 128 experts, top 8, hidden 2048)
    cfg = tokens_kernel.choose_config(2048, 8, EPS, 8, 128)
    args = (
        jax.ShapeDtypeStruct((8, 128), jnp.float32),
        jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((2048,), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 128), jnp.float32),
    )

    def route(logits, x, a, weight, sums):
        return tokens_kernel.route_tokens(logits, [x, a], weight, sums, cfg)

    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        text = jax.jit(route).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1, calls
    assert "tensor<64x2048xbf16>" in calls[0] and "tensor<8x8xi32>" in calls[0], calls
