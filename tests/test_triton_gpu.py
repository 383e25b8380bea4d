"""The portable Triton kernels on a real NVIDIA GPU (compute capability 8.0+) against the float64 reference.

Where it runs:
  * on an NVIDIA GPU of compute capability 8.0 or newer (an H200 in ``make gpu-check``): every case below,
    compiled by Triton with each config's own launch parameters (warps, pipeline stages), which interpret
    mode does not model;
  * without one (CI): the first case of each test in Pallas' interpret mode (a smoke check of this module;
    tests/test_triton_interpret.py is CI's full check of the numbers);
  * ``NYBBLE_GPU_TESTS_REQUIRE_GPU=1`` (bench/gpu_check.sh sets it): the module refuses to be collected
    unless a GPU runs it, so a GPU check never passes on interpret mode.

What is checked: every config the heuristics can pick for any GPU of ``nybble.kernels.gpu.GPUS``, bit-exact on
small integers on the smallest problem that runs each code path; ``nybble.matmul(implementation="triton")``
at Llama-3-8B shapes and M = 1, 16, 64, 2048 on random data within the rounding bound of the float64
reference; f16 and f32 activations; the grouped kernel with empty experts and rows past the group sizes;
the decode attention kernel and the MoE routing kernels (one token's, 2 to 16 tokens') against float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble.kernels.triton import backend, dense, grouped
from nybble.kernels.triton.config import TuningConfig
from tests.kernel_checks import activations, assert_exact, env_flag, exact_weight
from tests.test_triton_interpret import CONFIGS, _random_weight, _shape_for, _stack, assert_kernel_close


def _mode() -> tuple[str, str]:
    """("gpu", the device) where Triton compiles for a real GPU here, else ("interpret", why not)."""
    reason = backend.not_here()
    mode = ("interpret", reason) if reason is not None else ("gpu", str(jax.devices()[0].device_kind))
    if env_flag("NYBBLE_GPU_TESTS_REQUIRE_GPU") and mode[0] != "gpu":
        raise RuntimeError(
            f"NYBBLE_GPU_TESTS_REQUIRE_GPU=1 but the Triton GPU tests would run in interpret mode ({mode[1]})"
        )
    return mode


MODE = _mode()
ON_GPU = MODE[0] == "gpu"
INTERPRET = not ON_GPU


def _cases(cases: list) -> list:
    """Every case on a GPU; the first one (a smoke check) in interpret mode."""
    return cases if ON_GPU else cases[:1]


@pytest.mark.parametrize("cfg", _cases(CONFIGS), ids=str)
def test_every_config_exact(cfg):
    rng = np.random.default_rng(abs(hash(str(cfg))) % 2**32)
    m, k, n = _shape_for(cfg)
    for symmetric, group in ((True, cfg.block_kw if cfg.block_kw < 64 else 128), (False, None)):
        qw = exact_weight(rng, k, n, group, symmetric, layout="planes_nk_int4")
        x = activations(rng, m, k, exact=True)
        y = dense.dense_matmul(x, qw, cfg, interpret=INTERPRET)
        assert_exact(y, x, qw)


_REAL_SHAPES = [  # (M, K, N, group, symmetric): Llama-3-8B's q/o, gate/up and down projections
    (1, 4096, 4096, 128, True),
    (16, 4096, 14336, 128, True),
    (1, 14336, 4096, 128, False),
    (64, 4096, 4096, 32, False),
    (2048, 4096, 4096, 128, True),
    (16, 14336, 4096, None, True),
]
if INTERPRET:
    _REAL_SHAPES = [(3, 512, 256, 128, True)]


@pytest.mark.parametrize("m, k, n, group, symmetric", _REAL_SHAPES)
def test_matmul_through_the_heuristics_within_rounding(m, k, n, group, symmetric):
    rng = np.random.default_rng(m + k + n)
    qw = _random_weight(rng, k, n, group, symmetric)
    x = activations(rng, m, k)
    cfg = backend.plan(m, qw, x.dtype)
    if ON_GPU:
        y = jax.jit(lambda x, w: nybble.matmul(x, w, implementation="triton"))(x, qw)
    else:
        with backend.interpret("h200"):
            y = jax.jit(lambda x, w: nybble.matmul(x, w, implementation="triton"))(x, qw)
    y.block_until_ready()
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert_kernel_close(y, x, qw, cfg.route)


@pytest.mark.parametrize(
    "x_dtype, cfg",
    _cases(
        [
            (jnp.float16, TuningConfig(block_m=16, block_n=64, block_kw=16, splits=2)),
            (jnp.float32, TuningConfig(block_m=64, block_n=128, block_kw=16)),
            (jnp.float16, TuningConfig(block_m=128, block_n=128, block_kw=16, num_warps=8, num_stages=3)),
        ]
    ),
    ids=str,
)
def test_f16_f32_activations(x_dtype, cfg):
    rng = np.random.default_rng(2)
    qw = _random_weight(rng, 750, 200, 32, symmetric=False, scale_dtype=jnp.float16)
    x = activations(rng, 37, 750, dtype=x_dtype)
    y = dense.dense_matmul(x, qw, cfg, interpret=INTERPRET)
    assert y.dtype == x_dtype and y.shape == (37, 200)
    assert_kernel_close(y, x, qw, cfg.route)


@pytest.mark.parametrize(
    "symmetric, cfg",
    _cases(
        [
            (True, TuningConfig(block_m=16, block_n=64, block_kw=16)),
            (False, TuningConfig(block_m=64, block_n=128, block_kw=16)),
        ]
    ),
    ids=str,
)
def test_grouped_exact_with_empty_experts_and_tail(symmetric, cfg):
    rng = np.random.default_rng(5)
    qw = _stack(rng, 4, 256, 128, 32, symmetric, exact=True)
    x = activations(rng, 41, 256, exact=True)
    sizes = jnp.asarray([9, 0, 20, 3], jnp.int32)  # rows 32..40 past the sum: zeros
    y = grouped.grouped_matmul(x, qw, sizes, cfg, interpret=INTERPRET)
    expected = grouped.reference(x, qw, sizes).astype(np.float32).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y), expected)
    assert (np.asarray(y)[32:] == 0).all() and np.abs(np.asarray(y)[:32]).sum() > 0


# (batch, kv_heads, groups, head_dim, max_len, position, window, row scale, q/k norms): the smallest first
# (interpret mode's smoke check), then Llama-3-8B's layer at batch 1 and 8 (the heuristics' 16 and 4
# splits), Qwen3's 8 groups with its q/k norms, a sliding window, a cache of 48 positions (blocks of 16).
ATTENTION_CASES = [
    (1, 2, 4, 64, 128, 77, None, True, False),
    (1, 8, 4, 128, 4096, 3000, None, True, False),
    (8, 8, 4, 128, 4096, 4095, None, True, False),
    (2, 4, 8, 128, 2048, 1, None, True, True),
    (1, 8, 4, 128, 4096, 2500, 1024, False, False),
    (3, 3, 3, 64, 48, 40, None, False, False),
]


ATTENTION_ID = "b{}h{}g{}d{}s{}p{}w{}-scale{}-norm{}"


@pytest.mark.parametrize("merged", [False, True], ids=["combine-launch", "last-split-merges"])
@pytest.mark.parametrize("case", _cases(ATTENTION_CASES), ids=lambda c: ATTENTION_ID.format(*c))
def test_decode_attention_against_float64(case, merged):
    # merged: the splits' last program merges them in the launch (arrival counters, an acq_rel atomic): on
    # a GPU the call runs 10 times, each checked, so that an ordering the memory model does not promise
    # shows as a wrong output
    from nybble.kernels.triton import decode_attention as kernel

    b, h, g, d, s, position, window, with_scale, with_norms = case
    rng = np.random.default_rng(sum(case[:6]))
    qkv, k_cache, v_cache = (
        np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16), np.float64)
        for shape in ((b, h * g + 2 * h, d), (b, h, s, d), (b, h, s, d))
    )
    k_cache[:, :, position:] = v_cache[:, :, position:] = 4096.0  # never seen (the new row replaces its own)
    row_ssq = (rng.uniform(0.25, 4.0, b) * 4096).astype(np.float32) if with_scale else None
    norms = (rng.uniform(0.5, 1.5, (2, d)).astype(np.float32)) if with_norms else None
    row_norm = (4096, 1e-5) if with_scale else None
    token = kernel.NewToken(h * g, h, row_norm, (1e-6, 1e-6) if with_norms else None)
    inv_freq = 1.0 / (500000.0 ** (np.arange(0, d, 2) / d))
    ref, k_ref, v_ref = kernel.reference(
        qkv, k_cache, v_cache, position, window, token, inv_freq, row_ssq,
        None if norms is None else (norms[0], norms[1]),
    )  # fmt: skip
    cfg = kernel.choose_config(b, h, s, backend.target_gpu().sms)
    for _ in range(10 if merged and not INTERPRET else 1):
        out, k_out, v_out = kernel.write_and_attend(
            *(jnp.asarray(a, jnp.bfloat16) for a in (qkv, k_cache, v_cache)), jnp.int32(position), window,
            cfg, token, kernel.rope_factors(jnp.int32(position), inv_freq),
            row_sum_of_squares=None if row_ssq is None else jnp.asarray(row_ssq),
            norm_weights=None if norms is None else (jnp.asarray(norms[0]), jnp.asarray(norms[1])),
            arrivals=jnp.zeros((b, h + 1), jnp.int32) if merged and cfg.splits > 1 else None,
            interpret=INTERPRET,
        )  # fmt: skip
        others = np.arange(s) != position
        for got, want in ((k_out, k_ref), (v_out, v_ref)):
            got = np.asarray(got, np.float64)
            np.testing.assert_array_equal(got[:, :, others], want[:, :, others])
            np.testing.assert_allclose(got[:, :, position], want[:, :, position], rtol=0.024, atol=0.024)
        np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=0, atol=2e-2)


# (experts, top k, hidden): Qwen3-30B-A3B's routing, Mixtral's, the kernel's largest expert count
ROUTING_CASES = [(128, 8, 2048), (8, 2, 4096), (256, 8, 7168)]


@pytest.mark.parametrize("case", _cases(ROUTING_CASES), ids=lambda c: "e{}k{}h{}".format(*c))
def test_moe_routing_against_float64(case):
    # One decode token's routing (nybble.kernels.triton.moe_routing): the float64 top k, exactly (logits
    # spread 1e-3 apart at least: no rounding reorders them), its scores in slot order, the k rows
    from nybble.kernels.triton import moe_routing as kernel

    experts, top_k, hidden = case
    rng = np.random.default_rng(experts + hidden)
    logits = (rng.permutation(experts) * 1e-3 + rng.standard_normal() * 0.1).astype(np.float32)
    parts = [np.asarray(jnp.asarray(rng.standard_normal(hidden), jnp.bfloat16), np.float64) for _ in range(2)]
    weight = np.asarray(jnp.asarray(rng.uniform(0.5, 1.5, hidden), jnp.bfloat16), np.float64)
    x = np.asarray(jnp.asarray(parts[0] + parts[1], jnp.float32).astype(jnp.bfloat16), np.float64)
    sums = np.full(experts, (x * x).sum(), np.float32)
    cfg = kernel.choose_config(hidden, top_k, 1e-6)
    sizes, slot_scores, total, rows = kernel.route_one(
        jnp.asarray(logits), [jnp.asarray(p, jnp.bfloat16) for p in parts], jnp.asarray(weight, jnp.bfloat16),
        jnp.asarray(sums), cfg, interpret=INTERPRET,
    )  # fmt: skip
    ref_sizes, ref_scores, ref_total, ref_rows = kernel.reference(
        logits, x, weight, float(sums[0]), top_k, hidden, 1e-6
    )
    np.testing.assert_array_equal(np.asarray(sizes), ref_sizes)
    np.testing.assert_allclose(np.asarray(slot_scores), ref_scores, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(total), ref_total, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(rows, np.float64), ref_rows, rtol=3 * 2**-8, atol=1e-6)


# (tokens, experts, top k, hidden): Mixtral at batch 3 (first: CI's interpret-mode smoke check, the
# cheapest), Qwen3-30B-A3B at 8 and 16 (16: the 8-warp config), the kernel's largest expert count at 16
TOKENS_ROUTING_CASES = [(3, 8, 2, 4096), (8, 128, 8, 2048), (16, 128, 8, 2048), (16, 256, 8, 7168)]


@pytest.mark.parametrize("case", _cases(TOKENS_ROUTING_CASES), ids=lambda c: "t{}e{}k{}h{}".format(*c))
def test_moe_routing_tokens_against_float64(case):
    # 2 to 16 decode tokens' routing (nybble.kernels.triton.moe_routing_tokens): each token's float64 top k,
    # exactly (its logits spread 1e-3 apart at least), the group sizes, each chosen row's place among the
    # rows sorted by expert, the scores, totals and rows, on every config choose_config picks
    from nybble.kernels.triton import moe_routing_tokens as kernel

    tokens, experts, top_k, hidden = case
    rng = np.random.default_rng(tokens * experts + hidden)
    spread = np.stack([rng.permutation(experts) for _ in range(tokens)]) * 1e-3
    logits = (spread + rng.standard_normal((tokens, 1)) * 0.1).astype(np.float32)
    parts = [jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16) for _ in range(2)]
    weight = jnp.asarray(rng.uniform(0.5, 1.5, hidden), jnp.bfloat16)
    x = (parts[0].astype(jnp.float32) + parts[1].astype(jnp.float32)).astype(jnp.bfloat16)
    x = np.asarray(x, np.float64)
    sums = (x * x).sum(1).astype(np.float32)
    cfg = kernel.choose_config(hidden, top_k, 1e-6, tokens, experts)
    sizes, slots, scores, totals, rows = kernel.route_tokens(
        jnp.asarray(logits), parts, weight, jnp.asarray(np.repeat(sums[:, None], experts, 1)), cfg,
        interpret=INTERPRET,
    )  # fmt: skip
    ref = kernel.reference(logits, x, np.asarray(weight, np.float64), sums, top_k, 1e-6)
    np.testing.assert_array_equal(np.asarray(sizes), ref[0])
    np.testing.assert_array_equal(np.asarray(slots), ref[1])
    np.testing.assert_allclose(np.asarray(scores), ref[2], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(totals), ref[3], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(rows, np.float64), ref[4], rtol=3 * 2**-8, atol=1e-6)
