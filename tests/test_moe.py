"""The NNX MoE block: router math and the whole block against numpy float64 references, int4 via quantize."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nybble
from nybble import models
from nybble.models.definitions.moe import (
    WINDOW_MAX_GROUP,
    Experts,
    MoE,
    MoEConfig,
    QExperts,
    Router,
    route,
    route_ranked,
    route_scores,
    sort_by_expert,
    windowed_experts,
)
from nybble.ops import available_ragged_implementations
from nybble.quant.stacked import num_experts, unstack_weight


def _np_route(logits, k, norm):
    """numpy float64: softmax, the k largest (ties to the lower index), renormalized when ``norm``."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, idx, -1)
    return (w / w.sum(-1, keepdims=True) if norm else w), idx


@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_numpy(norm):
    logits = np.random.default_rng(0).normal(size=(37, 8)) * 3
    w, e = route(jnp.asarray(logits, jnp.float32), 3, norm_topk_prob=norm)
    rw, re_ = _np_route(logits, 3, norm)
    np.testing.assert_array_equal(np.asarray(e), re_)
    np.testing.assert_allclose(np.asarray(w), rw, rtol=1e-6)
    if norm:
        np.testing.assert_allclose(np.asarray(w).sum(-1), 1, rtol=1e-6)
    else:
        assert (np.asarray(w).sum(-1) < 1).all()
    # ties (bf16 logits repeat): the lower expert index first, as the softmax's top k takes them
    ties = np.asarray([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    w, e = route(jnp.asarray(ties, jnp.bfloat16), 2, norm_topk_prob=norm)
    rw, re_ = _np_route(ties, 2, norm)
    np.testing.assert_array_equal(np.asarray(e), [[1, 2], [0, 1]])
    np.testing.assert_array_equal(np.asarray(e), re_)
    np.testing.assert_allclose(np.asarray(w), rw, rtol=1e-6)


@pytest.mark.parametrize("experts,k", [(4, 2), (16, 3), (128, 8)])
def test_route_ranked_chooses_and_weighs_as_the_top_k(experts, k):
    # One token's routing without a sort: the top k's experts and weights, the rows in expert order.
    rng = np.random.default_rng(experts)
    logits = rng.normal(size=(40, experts)) * 3
    logits[:10] = np.round(logits[:10])  # ties: the lower index first, as top_k takes them
    logits[10] = 1.0  # all tied
    logits[11, :2] = 0.0, -0.0  # top_k: +0 above -0
    logits = np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
    ranked = jax.jit(lambda logit, s: route_ranked(logit, k, s))
    for t, row in enumerate(logits):
        scale = np.float32(0.5 + t / 40)
        r = ranked(jnp.asarray(row), scale)
        scores, totals, chosen = route_scores(
            jnp.asarray(row[None]), k, norm_topk_prob=True, logit_scale=scale
        )
        chosen = np.asarray(chosen[0])
        sizes = np.zeros(experts, np.int32)
        sizes[chosen] = 1
        np.testing.assert_array_equal(np.asarray(r.group_sizes), sizes)
        in_order = np.sort(chosen)
        np.testing.assert_array_equal(np.asarray(r.slots)[in_order], np.arange(k))
        weights = np.asarray(scores[0] / totals[0])
        got = np.asarray(r.scores) / np.asarray(r.totals)
        np.testing.assert_allclose(got[chosen], weights, rtol=2e-6)
        assert (np.asarray(r.scores)[sizes == 0] == 0).all()
        np.testing.assert_allclose(np.asarray(r.totals), np.asarray(r.totals)[0], rtol=0)
        ref_w = np.exp((row[chosen].astype(np.float64) - row.max()) * scale)
        np.testing.assert_allclose(got[chosen], ref_w / ref_w.sum(), rtol=1e-5)


def test_route_ranked_chooses_the_top_ks_experts_past_nan_signed_zeros_and_infinities():
    # top_k's order is IEEE total order (+0 above -0, NaN above +inf): the same experts, and always k rows
    row = jnp.asarray([0.5, np.nan, np.inf, -np.inf, 0.0, -0.0, -np.inf, 0.5, -0.0, 0.0], jnp.float32)
    for k in range(1, 11):
        r = route_ranked(row, k)
        _, top = jax.lax.top_k(row, k)
        sizes = np.zeros(10, np.int32)
        sizes[np.asarray(top)] = 1
        np.testing.assert_array_equal(np.asarray(r.group_sizes), sizes)
        np.testing.assert_array_equal(np.asarray(r.slots)[np.sort(np.asarray(top))], np.arange(k))


def test_sort_by_expert():
    experts = jnp.asarray([[2, 0], [0, 3], [2, 1]], jnp.int32)
    order, inverse, sizes = sort_by_expert(experts, 5)
    np.testing.assert_array_equal(np.asarray(sizes), [2, 1, 2, 1, 0])
    flat = np.asarray(experts).reshape(-1)
    np.testing.assert_array_equal(flat[np.asarray(order)], [0, 0, 1, 2, 2, 3])
    np.testing.assert_array_equal(np.asarray(order), [1, 2, 5, 0, 4, 3])  # stable: token order kept
    np.testing.assert_array_equal(np.asarray(order)[np.asarray(inverse)], np.arange(6))


@pytest.mark.parametrize("tokens,k", [(3, 2), (100, 4), (64, 8), (65, 8)])  # 6, 400, 512, 520 pairs
def test_sort_by_expert_both_ways_match_numpy(tokens, k):
    """Up to COMPARE_SORT_PAIRS pairs by comparisons, beyond by argsort: both numpy's stable sort."""
    rng = np.random.default_rng(tokens)
    experts = np.stack([rng.choice(16, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    order, inverse, sizes = sort_by_expert(jnp.asarray(experts), 16)
    flat = experts.reshape(-1)
    expect = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(np.asarray(order), expect)
    np.testing.assert_array_equal(np.asarray(inverse)[expect], np.arange(flat.size))
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(flat, minlength=16))


def _weights(moe, quantized):
    """float64 per-expert kernels (dequantized when int4) and the dense ones."""

    def stack(m):
        if isinstance(m, QExperts):
            return np.asarray(nybble.dequantize(m.weight), np.float64)
        return np.asarray(m.kernel[...], np.float64)

    def dense(lin):
        if isinstance(lin, models.QLinear):
            return np.asarray(nybble.dequantize(lin.weight), np.float64)
        return np.asarray(lin.kernel[...], np.float64)

    ex = moe.experts
    return stack(ex.gate_proj), stack(ex.up_proj), stack(ex.down_proj), dense


def _silu(v):
    return v / (1 + np.exp(-v))


def _np_moe(moe, x, quantized=False):
    """The block token by token in float64: each chosen expert's SwiGLU weighted by its router weight."""
    cfg = moe.config
    x = np.asarray(x, np.float64).reshape(-1, cfg.hidden_size)
    g, u, d, dense = _weights(moe, quantized)
    logits = x @ np.asarray(moe.router.weight[...], np.float64).T
    w, idx = _np_route(logits, cfg.top_k, cfg.norm_topk_prob)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(cfg.top_k):
            e = idx[t, j]
            out[t] += w[t, j] * ((_silu(x[t] @ g[e]) * (x[t] @ u[e])) @ d[e])
    if moe.shared_expert is not None:
        s = moe.shared_expert
        shared = (_silu(x @ dense(s.gate_proj)) * (x @ dense(s.up_proj))) @ dense(s.down_proj)
        if moe.shared_expert_gate is not None:
            shared = shared / (1 + np.exp(-(x @ dense(moe.shared_expert_gate))))
        out += shared
    return out


CONFIGS = {
    "mixtral": MoEConfig(hidden_size=64, intermediate_size=96, num_experts=4, top_k=2),
    "qwen3_moe": MoEConfig(
        hidden_size=64, intermediate_size=32, num_experts=8, top_k=3, norm_topk_prob=False
    ),
    "shared_gated": MoEConfig(
        hidden_size=64,
        intermediate_size=32,
        num_experts=6,
        top_k=2,
        shared_intermediate_size=48,
        shared_expert_gate=True,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_float_block_matches_numpy(name):
    moe = MoE(CONFIGS[name], rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (2, 7, 64), jnp.float32)
    y = moe(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    ref = _np_moe(moe, x).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-4, atol=2e-5)
    yj = nnx.jit(lambda m, x: m(x))(moe, x)  # static shapes under jit
    np.testing.assert_allclose(np.asarray(yj), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 3, 5])  # rows 3, 9 (fewer than the 16 experts), 15
def test_float_experts_gather_below_the_expert_count(tokens, monkeypatch):
    """With fewer rows than experts a float stack multiplies each row by its own expert's matrix, gathered
    (decode: ``lax.ragged_dot`` reads every expert); the block still matches float64, and the rows'
    products equal ragged_dot's."""
    cfg = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=16, top_k=3)
    moe = MoE(cfg, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (tokens, 64), jnp.float32)
    calls = []
    monkeypatch.setattr(jnp, "einsum", lambda *a, **k: calls.append(a[0]) or _EINSUM(*a, **k))
    y = moe(x)
    assert calls.count("ri,rio->ro") == 3  # gate, up, down: the gathered path
    np.testing.assert_allclose(np.asarray(y), _np_moe(moe, x), rtol=2e-4, atol=2e-5)
    stack = moe.experts.gate_proj
    rows = jax.random.normal(jax.random.key(5), (3 * tokens, 64), jnp.float32)
    sizes = jnp.zeros(16, jnp.int32).at[jnp.arange(3 * tokens) % 4 * 3].add(1)
    rows_sorted = rows  # any rows: each meets the expert its position in the sorted order names
    dense = jax.lax.ragged_dot(rows_sorted, stack.kernel[...], sizes, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(stack(rows_sorted, sizes)), np.asarray(dense), rtol=1e-5, atol=1e-5)


_EINSUM = jnp.einsum


def test_float_experts_window_from_the_expert_count_exactly():
    """With at least as many rows as experts and groups bounded by ``max_group`` (a top-k routing's
    tokens) a float stack multiplies a window of max_group rows an expert (XLA's GPU ragged_dot expands the
    rows over every expert): exact on small integers against float64 row by row, with empty groups, a
    group of max_group rows, and the last group's window past the rows' end."""
    rng = np.random.default_rng(0)
    experts, din, dout, max_group = 6, 16, 8, 5
    sizes = np.array([2, 0, 5, 1, 0, 4])  # 12 rows; expert 2 fills its window; expert 5's runs past the end
    x = rng.integers(-4, 5, (sizes.sum(), din)).astype(np.float32)
    w = rng.integers(-3, 4, (experts, din, dout)).astype(np.float32)
    got = np.asarray(
        windowed_experts(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32), max_group)
    )
    expert = np.repeat(np.arange(experts), sizes)
    want = np.stack([x[r].astype(np.float64) @ w[expert[r]] for r in range(len(x))])
    np.testing.assert_array_equal(got, want)
    # bf16 rows: the product accumulated in f32 and rounded once, as ragged_dot
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    got_b = windowed_experts(xb, wb, jnp.asarray(sizes, jnp.int32), max_group)
    assert got_b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got_b, np.float64), want)


# 6 tokens: 18 rows of 16 experts; 70: past WINDOW_MAX_GROUP
@pytest.mark.parametrize("tokens, path", [(6, "eci,eio->eco"), (70, None)])
def test_float_experts_window_a_decode_steps_groups(tokens, path, monkeypatch):
    """The block at 6 tokens (18 rows, 16 experts) multiplies windows of 6 rows an expert and still
    matches float64; past ``WINDOW_MAX_GROUP`` tokens (prefill) ``lax.ragged_dot`` again."""
    cfg = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=16, top_k=3)
    moe = MoE(cfg, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (tokens, 64), jnp.float32)
    calls, ragged = [], []
    monkeypatch.setattr(jnp, "einsum", lambda *a, **k: calls.append(a[0]) or _EINSUM(*a, **k))
    monkeypatch.setattr(jax.lax, "ragged_dot", lambda *a, **k: ragged.append(1) or _RAGGED_DOT(*a, **k))
    y = moe(x)
    if path is None:
        assert tokens > WINDOW_MAX_GROUP and len(ragged) == 3 and "eci,eio->eco" not in calls
    else:
        assert calls.count(path) == 3 and not ragged  # gate, up, down
    np.testing.assert_allclose(np.asarray(y), _np_moe(moe, x), rtol=2e-4, atol=2e-5)


_RAGGED_DOT = jax.lax.ragged_dot


def test_quantized_block():
    moe = MoE(CONFIGS["shared_gated"], rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (9, 64), jnp.float32)
    y_float = np.asarray(moe(x))
    moe, report = models.quantize(moe, group_size=32, progress=False, return_report=True)
    assert (
        isinstance(moe.experts.gate_proj, QExperts)
        and num_experts(moe.experts.down_proj.weight) == moe.config.num_experts
    )
    assert isinstance(moe.router, Router)  # a router is never quantized
    assert any(r.path == "router" and not r.quantized for r in report.layers)
    assert {r.path for r in report.quantized} >= {"experts.gate_proj", "experts.up_proj", "experts.down_proj"}
    y = moe(x)
    # Against the float64 block on the dequantized weights: the same routing (the router is float).
    np.testing.assert_allclose(np.asarray(y), _np_moe(moe, x, True), rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(y) - y_float).max() < 0.2 * np.abs(y_float).max()  # int4 error, not garbage
    yj = nnx.jit(lambda m, x: m(x))(moe, x)
    np.testing.assert_allclose(np.asarray(yj), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_block_on_the_grouped_kernel_in_interpret_mode():
    # bf16 activations, no shared expert (its dense layers would run the dense kernel too): the block's
    # three grouped products on the kernel in GPU interpret mode, against the XLA path (rounding only).
    moe = MoE(CONFIGS["mixtral"], rngs=nnx.Rngs(7))
    models.quantize(moe, group_size=32, progress=False)
    xb = jax.random.normal(jax.random.key(8), (3, 64), jnp.float32).astype(jnp.bfloat16)
    y_xla = np.asarray(moe(xb), np.float32)
    with nybble.kernels.interpret():
        rows, sizes = jnp.zeros((6, 64), jnp.bfloat16), jnp.asarray([3, 3, 0, 0], jnp.int32)
        assert (
            available_ragged_implementations(rows, moe.experts.gate_proj.weight, sizes)["mosaic_gpu"] is None
        )
        y_kernel = np.asarray(moe(xb), np.float32)
    assert np.linalg.norm(y_kernel - y_xla) <= 1e-2 * np.linalg.norm(y_xla)
    assert np.abs(y_xla).max() > 0


def test_rules_exclude_experts_and_shared():
    moe = MoE(CONFIGS["shared_gated"], rngs=nnx.Rngs(5))
    rules = [
        models.QuantRule(pattern=r"shared_expert", skip=True),
        models.QuantRule(pattern=r"down_proj$", skip=True),
    ]
    models.quantize(moe, rules=rules, progress=False)
    assert isinstance(moe.experts.gate_proj, QExperts) and isinstance(moe.experts.down_proj, Experts)
    assert isinstance(moe.shared_expert.gate_proj, nnx.Linear) and isinstance(
        moe.shared_expert_gate, nnx.Linear
    )
    moe2 = MoE(CONFIGS["mixtral"], rngs=nnx.Rngs(6))
    models.quantize(
        moe2, rules=[models.QuantRule(pattern=r"experts\.up_proj$", group_size=64)], progress=False
    )
    assert moe2.experts.up_proj.weight.group_size == 64 and moe2.experts.gate_proj.weight.group_size == 128


def test_bad_config():
    with pytest.raises(ValueError, match="top_k = 5 must be in"):
        MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4, top_k=5)
    with pytest.raises(TypeError, match=r"stacked nybble\.QuantizedWeight"):
        QExperts(jnp.zeros((4, 8, 8)))


def test_gptq_quantizes_each_expert_on_its_routed_tokens():
    cfg = MoEConfig(hidden_size=64, intermediate_size=64, num_experts=5, top_k=1)
    moe = MoE(cfg, rngs=nnx.Rngs(9))
    x = jnp.abs(jax.random.normal(jax.random.key(10), (24, 64), jnp.float32)) + 0.1  # positive rows
    # A router that never picks expert 4 (x > 0 and its row -100): unrouted, round to nearest.
    moe.router.weight[...] = moe.router.weight[...].at[4].set(-100.0)
    w_gate = np.asarray(moe.experts.gate_proj.kernel[...])
    _, experts = moe.routing(x)
    models.quantize(
        moe,
        method="gptq",
        calibration=np.zeros((1, 4), np.int32),
        forward=lambda m, _: m(x),
        group_size=32,
        act_order=False,
        progress=False,
    )
    assert isinstance(moe.experts.down_proj, QExperts)
    gate = moe.experts.gate_proj.weight
    routed = [int((np.asarray(experts)[:, 0] == e).sum()) for e in range(5)]
    assert routed[4] == 0 and sum(r > 0 for r in routed) >= 2, routed
    for e in range(5):
        rows = np.asarray(x)[np.asarray(experts)[:, 0] == e]
        if len(rows) == 0:
            want = nybble.quantize(w_gate[e], group_size=32)
        else:
            want = nybble.quant.gptq(w_gate[e], inputs=rows, group_size=32, act_order=False)
        got = unstack_weight(gate, e)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_save_and_load_a_quantized_block(tmp_path):
    moe = MoE(CONFIGS["mixtral"], rngs=nnx.Rngs(11))
    models.quantize(moe, group_size=32, progress=False)
    x = jax.random.normal(jax.random.key(12), (5, 64), jnp.float32)
    path = models.save_model(tmp_path / "moe", moe)
    back = models.load_model(path, MoE(CONFIGS["mixtral"], rngs=nnx.Rngs(13)))
    assert isinstance(back.experts.up_proj, QExperts)
    for a, b in zip(
        jax.tree.leaves(back.experts.up_proj.weight), jax.tree.leaves(moe.experts.up_proj.weight), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(back(x)), np.asarray(moe(x)))


def test_a_file_of_the_old_router_layout_loads(tmp_path):
    # Files written before the Router module hold an nnx.Linear kernel (hidden, experts) at mlp.router.
    moe = MoE(CONFIGS["mixtral"], rngs=nnx.Rngs(21))
    models.quantize(moe, group_size=32, progress=False)
    state = nnx.to_pure_dict(nnx.state(moe))
    weight = np.asarray(state["router"].pop("weight"))
    state["router"]["kernel"] = weight.T  # (hidden, experts)
    path = nybble.save(tmp_path / "old.safetensors", state)
    back = models.load_model(path, MoE(CONFIGS["mixtral"], rngs=nnx.Rngs(22)))
    np.testing.assert_array_equal(np.asarray(back.router.weight[...]), weight)
    x = jax.random.normal(jax.random.key(23), (5, 64), jnp.float32)
    np.testing.assert_array_equal(np.asarray(back(x)), np.asarray(moe(x)))


def test_the_deferred_norm_block_matches_numpy_on_the_normalized_rows():
    # A decode step's MoE (Block.cached): the post-attention norm's scale applied after the router's product.
    from nybble.models.definitions.llama import RMSNorm

    moe = MoE(CONFIGS["mixtral"], rngs=nnx.Rngs(31))
    norm = RMSNorm(64)
    norm.weight[...] = jax.random.uniform(jax.random.key(32), (64,), minval=0.5, maxval=1.5)
    x = 3.0 * jax.random.normal(jax.random.key(33), (6, 1, 64), jnp.float32)
    h, scale = norm.deferred(x)
    y = nnx.jit(lambda m, h, s: m.deferred(h, s))(moe, h, scale)
    ref = _np_moe(moe, np.asarray(norm(x)).reshape(-1, 64)).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-4, atol=2e-5)
    # normed: the norm's sum of squares taken in the router's reduction; the same numbers (float32 sums).
    z = nnx.jit(lambda m, n, x: m.normed(x, n))(moe, norm, x)
    np.testing.assert_allclose(np.asarray(z), np.asarray(y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(z), ref, rtol=2e-4, atol=2e-5)
    # one token at a time (a batch-1 decode step): routed by ranks (route_ranked), the same numbers
    for t in range(x.shape[0]):
        one = nnx.jit(lambda m, n, x: m.normed(x, n))(moe, norm, x[t : t + 1])
        np.testing.assert_allclose(np.asarray(one[0]), np.asarray(y[t]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(one[0]), ref[t], rtol=2e-4, atol=2e-5)
        h1, s1 = norm.deferred(x[t : t + 1])
        one = nnx.jit(lambda m, h, s: m.deferred(h, s))(moe, h1, s1)
        np.testing.assert_allclose(np.asarray(one[0]), np.asarray(y[t]), rtol=1e-5, atol=1e-6)
    for name in ("qwen3_moe", "shared_gated"):  # softmax before the top k, a shared expert: not deferred
        assert not MoE(CONFIGS[name], rngs=nnx.Rngs(0)).defers_norm
    with pytest.raises(ValueError, match="defers_norm"):
        MoE(CONFIGS["shared_gated"], rngs=nnx.Rngs(0)).deferred(h, scale)
    with pytest.raises(ValueError, match="defers_norm"):
        MoE(CONFIGS["shared_gated"], rngs=nnx.Rngs(0)).normed(x, norm)
