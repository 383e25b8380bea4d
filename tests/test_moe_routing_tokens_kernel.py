"""The Triton MoE routing kernel of 2 to 16 tokens (nybble.kernels.triton.moe_routing_tokens) in Pallas'
interpret mode: against a float64 top k and against the XLA path's route_scores and sort_by_expert (ties,
signed zeros, a NaN, a token of equal logits), its rows against the model's normalized rows; its refusals
and configs. A model's decode steps on it: tests/test_moe_routing_kernel.py (batch 3); lowered and compiled
for GPUs: tests/test_moe_routing_lowering.py, tests/test_moe_routing_sass.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nybble.kernels.triton import moe_routing_tokens as kernel
from nybble.kernels.triton.backend import interpret
from nybble.models.definitions.moe import route_scores, sort_by_expert

EPS = 1e-6


def _inputs(tokens: int, experts: int, hidden: int, seed: int, ties: bool):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((tokens, experts)) * 3).astype(np.float32)
    if ties:
        # equal logits (ties go to the lower index), -0 and +0 (+0 ranks above), a token of one logit, a NaN
        logits[:, [1, 3, 6]] = 1.5
        logits[:, [2, 5]] = [-0.0, 0.0]
        logits[0] = 0.25
        logits[-1, experts - 1] = np.nan
    parts = [jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16) for _ in range(2)]
    weight = jnp.asarray(rng.uniform(0.5, 1.5, hidden), jnp.bfloat16)
    x = (parts[0].astype(jnp.float32) + parts[1].astype(jnp.float32)).astype(jnp.bfloat16)
    sums = (np.asarray(x, np.float32) ** 2).sum(1)
    # the router launch's (T, E): each token's sum of squares in every column (MoE.normed)
    return jnp.asarray(logits), parts, weight, jnp.asarray(np.repeat(sums[:, None], experts, 1)), x


def _route(logits, parts, weight, sums, top_k):
    tokens, experts = logits.shape
    cfg = kernel.choose_config(parts[0].shape[1], top_k, EPS, tokens, experts)
    with interpret():
        out = kernel.route_tokens(logits, parts, weight, sums, cfg, interpret=True)
    return tuple(np.asarray(a) for a in out)


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, ties",
    [(8, 128, 8, 512, False), (3, 16, 4, 192, True), (16, 256, 8, 64, True), (2, 8, 2, 256, False),
     (5, 32, 1, 128, True)],
    ids=["qwen3-b8", "ties-b3", "e256-b16", "mixtral-b2", "top1-b5"],
)  # fmt: skip
def test_kernel_routes_as_the_xla_path_and_float64(tokens, experts, top_k, hidden, ties):
    logits, parts, weight, sums, x = _inputs(tokens, experts, hidden, tokens * experts + top_k, ties)
    sizes, slots, scores, totals, rows = _route(logits, parts, weight, sums, top_k)
    scale = jax.lax.rsqrt(sums[:, :1] / hidden + EPS)
    # The XLA path: route_scores' experts (top-k order) and scores, sort_by_expert's rows of them
    xla = route_scores(logits, top_k, norm_topk_prob=True, logit_scale=scale)
    xla_scores, xla_totals, experts_chosen = (np.asarray(a) for a in xla)
    _, inverse, group_sizes = sort_by_expert(experts_chosen, experts)
    np.testing.assert_array_equal(sizes, np.asarray(group_sizes))
    assert sizes.sum() == tokens * top_k and sizes.dtype == np.int32
    xla_slots = np.asarray(inverse).reshape(tokens, top_k)
    finite = np.isfinite(np.asarray(logits)).all(1)  # a NaN logit's scores: NaN or inf, either way broken
    for t in range(tokens):  # the kernel's choices in expert order: the same (expert, row, score) each
        order = np.argsort(experts_chosen[t])
        np.testing.assert_array_equal(slots[t], xla_slots[t][order])
        if finite[t]:
            np.testing.assert_allclose(scores[t], xla_scores[t][order], rtol=5e-7, atol=0)
    np.testing.assert_allclose(totals[finite], xla_totals[finite, 0], rtol=1e-6)
    if not ties:  # float64's top k (ties: the XLA path's order above)
        ref = kernel.reference(
            np.asarray(logits), np.asarray(x, np.float64), np.asarray(weight, np.float64),
            np.asarray(sums)[:, 0], top_k, EPS,
        )  # fmt: skip
        np.testing.assert_array_equal(sizes, ref[0])
        np.testing.assert_array_equal(slots, ref[1])
        np.testing.assert_allclose(scores, ref[2], rtol=1e-5)
        np.testing.assert_allclose(totals, ref[3], rtol=1e-5)
        # x rounded, times the weight, rounded, times the scale, rounded (bf16: 3 roundings)
        np.testing.assert_allclose(rows.astype(np.float64), ref[4], rtol=3 * 2**-8, atol=1e-6)
    # row slots[t, j] is token t's normalized row, as MoE.normed computes it, and every row is written
    h = (x.astype(jnp.float32) * weight.astype(jnp.float32)).astype(jnp.bfloat16)
    expected = np.asarray((h.astype(jnp.float32) * scale).astype(jnp.bfloat16), np.float32)
    assert rows.shape == (tokens * top_k, hidden) and sorted(slots.reshape(-1)) == list(range(tokens * top_k))
    for t in range(tokens):
        for j in range(top_k):
            np.testing.assert_array_equal(rows[slots[t, j]].astype(np.float32), expected[t])


def test_a_token_of_equal_logits_takes_the_lowest_experts_and_a_nan_ranks_first():
    logits, parts, weight, sums, _ = _inputs(3, 16, 64, 0, ties=True)
    sizes, slots, _, _, _ = _route(logits, parts, weight, sums, 4)
    # token 0: all 0.25, the 4 lowest indices; token 2: its NaN (15) first; the group sizes count them
    _, _, experts = route_scores(logits, 4, norm_topk_prob=True)
    assert sorted(np.asarray(experts)[0].tolist()) == [0, 1, 2, 3]
    assert 15 in np.asarray(experts)[2].tolist()
    np.testing.assert_array_equal(sizes, np.bincount(np.asarray(experts).reshape(-1), minlength=16))
    # token 0's rows: the first of each of its experts' groups (no earlier token), after the lower experts'
    assert slots[0].tolist() == (np.cumsum(sizes) - sizes)[:4].tolist()


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, dtype, match",
    [
        (1, 16, 4, 64, jnp.bfloat16, "2 to 16 tokens, got 1"),
        (17, 16, 4, 64, jnp.bfloat16, "2 to 16 tokens, got 17"),
        (4, 60, 4, 64, jnp.bfloat16, "power-of-two number of experts up to 256, got 60"),
        (4, 16, 17, 64, jnp.bfloat16, "1 <= top_k <= experts"),
        (4, 16, 4, 100, jnp.bfloat16, "multiple of 64 columns, got 100"),
        (4, 16, 4, 64, jnp.int8, "x of dtype"),
    ],
)
def test_unsupported_arguments_are_named(tokens, experts, top_k, hidden, dtype, match):
    logits = np.zeros((tokens, experts), np.float32)
    reason = kernel.unsupported(logits, np.zeros((tokens, hidden), dtype), top_k)
    assert reason is not None and match in reason, reason


def test_configs():
    assert kernel.choose_config(2048, 8, EPS, 8, 128) == kernel.TokensRoutingConfig(8, EPS, 256, 4)
    # 16 tokens of 128 experts: 2048 entries a table, 8 warps (4 spilled at 16 x 256)
    assert kernel.choose_config(2048, 8, EPS, 16, 128).num_warps == 8
    assert kernel.choose_config(192, 4, EPS, 3, 16).block == 64
