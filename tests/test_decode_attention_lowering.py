"""The Triton decode attention kernel lowered for CUDA on a CPU, with no GPU and no toolchain: Pallas'
Triton lowering reads its target from an abstract mesh's device (``jax.sharding.use_abstract_mesh``), so
this runs on every jax of the range (the compile and the SASS: tests/test_decode_attention_sass.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nybble.kernels.triton import decode_attention as kernel

# sm_80, sm_89 (an L40S lowers as the L40), sm_90, sm_100, sm_120
KINDS = ("NVIDIA A100-SXM4-80GB", "NVIDIA L40", "NVIDIA H200", "NVIDIA B200", "NVIDIA RTX PRO 6000")


def _lowered(kind: str, token: kernel.NewToken, window: int | None, merged: bool = False) -> str:
    cfg = kernel.choose_config(1, token.kv_heads, 4096, 132)
    inv_freq = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
    norms = (jnp.ones(128), jnp.ones(128)) if token.norm_eps else None

    def step(qkv, row_ssq, k_cache, v_cache, position):
        rope = kernel.rope_factors(position, inv_freq)
        arrivals = (jnp.zeros_like(qkv[:, 0]) * row_ssq[:, None]).astype(jnp.int32) if merged else None
        return kernel.write_and_attend(
            qkv, k_cache, v_cache, position, window, cfg, token, rope,
            row_sum_of_squares=row_ssq if token.row_norm else None, norm_weights=norms, arrivals=arrivals,
            out_dtype=jnp.bfloat16,
        )  # fmt: skip

    cache = jax.ShapeDtypeStruct((1, token.kv_heads, 4096, 128), jnp.bfloat16)
    args = (
        jax.ShapeDtypeStruct((1, token.heads + 2 * token.kv_heads, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((1,), jnp.float32),
        cache,
        cache,
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        return jax.jit(step, donate_argnums=(2, 3)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "token, window",
    [
        (kernel.NewToken(32, 8, (4096, 1e-5)), None),  # Llama-3-8B: the input norm's deferred scale
        (kernel.NewToken(32, 4, (2048, 1e-6), (1e-6, 1e-6)), None),  # Qwen3-30B-A3B: the q/k norms too
        (kernel.NewToken(32, 8), 1024),  # a sliding window, no deferred scale
    ],
    ids=["llama3", "qwen3", "window"],
)
def test_lowers_to_two_triton_calls_updating_the_caches_in_place(kind, token, window):
    text = _lowered(kind, token, window)
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 2, calls  # the kernel and the splits' merge
    # the kernel's last two results alias its last two operands (the caches): updated in place
    assert "output_operand_aliases" in text and text.count("#stablehlo.output_operand_alias") == 2, calls


@pytest.mark.parametrize("kind", KINDS)
def test_the_splits_merged_in_the_kernel_lower_to_one_triton_call(kind):
    # With arrival counters the splits' last program merges them: one call, its caches and counters updated
    # in place (three aliases).
    text = _lowered(kind, kernel.NewToken(32, 8, (4096, 1e-5)), None, merged=True)
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1, calls
    assert text.count("#stablehlo.output_operand_alias") == 3, calls
