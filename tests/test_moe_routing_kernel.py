"""The Triton MoE routing kernel (nybble.kernels.triton.moe_routing) in Pallas' interpret mode: against a
float64 top k and against the XLA path's ``route_ranked`` (ties, signed zeros, a NaN), its rows against
the model's normalized row; its refusals by name; and a Qwen3-MoE model's decode steps on it against the
XLA routing. Lowered for five GPUs: tests/test_moe_routing_lowering.py; compiled: test_moe_routing_sass.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nybble.kernels.triton import moe_routing as kernel
from nybble.kernels.triton.backend import interpret
from nybble.models import Llama, quantize, set_decode_routing
from nybble.models.definitions.moe import MoEConfig, route_ranked
from nybble.models.evaluate.zoo import TINY_CONFIG

EPS = 1e-6


def _inputs(experts: int, hidden: int, seed: int, logits=None):
    rng = np.random.default_rng(seed)
    if logits is None:
        logits = rng.standard_normal(experts).astype(np.float32) * 3
    parts = [jnp.asarray(rng.standard_normal(hidden), jnp.bfloat16) for _ in range(2)]
    weight = jnp.asarray(rng.uniform(0.5, 1.5, hidden), jnp.bfloat16)
    x = (parts[0].astype(jnp.float32) + parts[1].astype(jnp.float32)).astype(jnp.bfloat16)
    xf = np.asarray(x, np.float64)
    sums = np.full(experts, (xf * xf).sum(), np.float32)
    return jnp.asarray(logits, jnp.float32), parts, weight, jnp.asarray(sums), xf


def _route(logits, parts, weight, sums, top_k):
    cfg = kernel.choose_config(parts[0].shape[0], top_k, EPS)
    with interpret():
        return kernel.route_one(logits, parts, weight, sums, cfg, interpret=True)


def _ties(experts: int, nan: bool = False) -> np.ndarray:
    # equal logits (ties go to the lower index), -0 and +0 (+0 ranks above), and a NaN (above +inf)
    logits = np.linspace(-2.0, 2.0, experts).astype(np.float32)
    logits[[1, 3, 6]] = 1.5
    logits[[2, 5]] = [-0.0, 0.0]
    if nan:
        logits[experts - 1] = np.nan
    return logits


@pytest.mark.parametrize(
    "experts, top_k, hidden, ties",
    [(128, 8, 512, False), (8, 2, 256, False), (16, 4, 192, True), (256, 8, 64, True), (128, 1, 128, True)],
    ids=["qwen3", "mixtral", "ties", "e256", "top1"],
)
def test_kernel_routes_as_route_ranked_and_float64(experts, top_k, hidden, ties):
    logits, parts, weight, sums, xf = _inputs(
        experts, hidden, experts + top_k, _ties(experts) if ties else None
    )
    sizes, slot_scores, total, rows = (np.asarray(a) for a in _route(logits, parts, weight, sums, top_k))
    scale = jax.lax.rsqrt(sums[0] / hidden + EPS)
    ranked = route_ranked(logits, top_k, scale)
    # the same experts as the XLA path, exactly, and k of them
    np.testing.assert_array_equal(sizes, np.asarray(ranked.group_sizes))
    assert sizes.sum() == top_k and sizes.dtype == np.int32
    chosen = np.flatnonzero(sizes)
    # slot s holds the s-th chosen expert's score: the XLA path's, to an ulp or two (XLA's CPU exp in a
    # fusion and alone: bit for bit on jax 0.11.2, an ulp apart on 0.12)
    np.testing.assert_allclose(slot_scores, np.asarray(ranked.scores)[chosen], rtol=5e-7, atol=0)
    np.testing.assert_allclose(total[0], np.asarray(ranked.totals)[0], rtol=1e-6)
    if not ties:  # against float64's top k (ties: the order above)
        ref_sizes, ref_scores, ref_total, ref_rows = kernel.reference(
            np.asarray(logits), xf, np.asarray(weight, np.float64), float(sums[0]), top_k, hidden, EPS
        )
        np.testing.assert_array_equal(sizes, ref_sizes)
        np.testing.assert_allclose(slot_scores, ref_scores, rtol=1e-5)
        np.testing.assert_allclose(total, ref_total, rtol=1e-5)
        # the rows: x rounded, times the weight, rounded, times the scale, rounded (bf16: 3 roundings)
        np.testing.assert_allclose(np.asarray(rows, np.float64), ref_rows, rtol=3 * 2**-8, atol=1e-6)
    # each of the k rows is the model's normalized row, as MoE.normed computes it
    h = (jnp.asarray(xf, jnp.float32) * weight.astype(jnp.float32)).astype(jnp.bfloat16)
    expected = (h.astype(jnp.float32) * scale).astype(jnp.bfloat16)
    assert rows.shape == (top_k, hidden)
    for row in rows:
        np.testing.assert_array_equal(np.asarray(row, np.float32), np.asarray(expected, np.float32))


def test_ties_choose_the_lower_index_and_positive_zero():
    # 16 experts, top 4 of _ties with a NaN: the NaN (15) ranks first (as in lax.top_k), then 14 (1.73),
    # then two of the three 1.5s (experts 1, 3 and 6; 13 is 1.47): the lower indices. The experts the XLA
    # path chooses (a NaN's scores are NaN or inf, a broken router's either way)
    logits, parts, weight, sums, _ = _inputs(16, 64, 0, _ties(16, nan=True))
    sizes, _, _, _ = _route(logits, parts, weight, sums, 4)
    assert np.flatnonzero(np.asarray(sizes)).tolist() == [1, 3, 14, 15]
    np.testing.assert_array_equal(sizes, route_ranked(logits, 4).group_sizes)
    # +0 ranks above -0: top 8 of 8 experts with both zeros at the boundary
    zeros = np.array([-5.0, -0.0, 0.0, -4.0, 3.0, 2.0, 1.0, -3.0], np.float32)
    logits, parts, weight, sums, _ = _inputs(8, 64, 1, zeros)
    sizes, _, _, _ = _route(logits, parts, weight, sums, 4)
    assert np.flatnonzero(np.asarray(sizes)).tolist() == [2, 4, 5, 6]


@pytest.mark.parametrize(
    "experts, top_k, hidden, dtype, match",
    [
        (60, 4, 64, jnp.bfloat16, "power-of-two number of experts up to 256, got 60"),
        (512, 8, 64, jnp.bfloat16, "power-of-two number of experts up to 256, got 512"),
        (16, 17, 64, jnp.bfloat16, "1 <= top_k <= experts"),
        (16, 4, 100, jnp.bfloat16, "multiple of 64 columns, got 100"),
        (16, 4, 64, jnp.int8, "x of dtype"),
    ],
)
def test_unsupported_arguments_are_named(experts, top_k, hidden, dtype, match):
    reason = kernel.unsupported(np.zeros(experts, np.float32), np.zeros(hidden, dtype), top_k)
    assert reason is not None and match in reason, reason


def test_configs_take_the_widest_block_dividing_hidden():
    assert kernel.choose_config(2048, 8, EPS).block == 256
    assert kernel.choose_config(192, 4, EPS).block == 64
    assert kernel.choose_config(384, 4, EPS).block == 128


def _tiny_moe(dtype, experts: int = 8, **changes) -> Llama:
    # Qwen3-MoE's block (renormalized top k, no shared expert) at a test's size
    moe = MoEConfig(hidden_size=128, intermediate_size=64, num_experts=experts, top_k=2)
    cfg = dataclasses.replace(TINY_CONFIG, moe=moe, qk_norm=True, **changes)
    return Llama(cfg, rngs=nnx.Rngs(5), dtype=dtype)


def test_set_decode_routing_refuses_unknown_names_and_models():
    with pytest.raises(ValueError, match="unknown implementation 'sort'"):
        set_decode_routing(_tiny_moe(jnp.bfloat16), "sort")
    with pytest.raises(ValueError, match="no nybble MoE block"):
        set_decode_routing(Llama(TINY_CONFIG, rngs=nnx.Rngs(0)), "triton")
    # OLMoE's routing (the softmax's top k, not renormalized): nothing the kernel routes
    moe = MoEConfig(hidden_size=128, intermediate_size=64, num_experts=8, top_k=2, norm_topk_prob=False)
    olmoe = Llama(dataclasses.replace(TINY_CONFIG, moe=moe), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"renormalized top-k.*norm_topk_prob=False.*keep 'xla'"):
        set_decode_routing(olmoe, "triton")
    assert set_decode_routing(olmoe, "xla") is olmoe


def test_model_refuses_the_kernel_by_name():
    # 6 experts: the model says why and the way out, never an error from inside Pallas; a CPU outside
    # interpret mode likewise
    ids = np.zeros((1, 1), np.int32)
    model = set_decode_routing(_tiny_moe(jnp.bfloat16, experts=6), "triton")
    step = nnx.jit(lambda m, c: m.decode_step(ids, c, 3))
    with (
        interpret(),
        pytest.raises(NotImplementedError, match=r"got 6; or set_decode_routing\(model, 'xla'\)"),
    ):
        step.trace(model, model.init_cache(1, 16))
    model = set_decode_routing(_tiny_moe(jnp.bfloat16), "triton")
    with pytest.raises(NotImplementedError, match=r"needs an NVIDIA GPU.*backend\.interpret\(\).*'xla'"):
        step.trace(model, model.init_cache(1, 16))


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_steps_on_the_kernel_equal_the_xla_routing(batch, monkeypatch):
    # The same model, prefilled, then 6 decode steps of the same tokens (teacher-forced): batch 1 routed by
    # the one-token kernel, batch 3 by the tokens' kernel (interpret mode), against XLA's route_ranked and
    # route_scores with sort_by_expert. The experts' rows reach the same kernels; only the weighted sum's
    # order differs (the kernels' choices in expert order, XLA's in top-k order), so logits within
    # float32's rounding of it, and the same greedy tokens.
    from nybble.kernels.triton import moe_routing_tokens

    module, name = (kernel, "route_one") if batch == 1 else (moe_routing_tokens, "route_tokens")
    traced = []  # the kernel as the steps trace it: every layer's, each trace
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: traced.append(1) or original(*a, **kw))
    rng = np.random.RandomState(7)
    ids = rng.randint(0, TINY_CONFIG.vocab_size, (batch, 11)).astype(np.int32)
    results = {}
    for implementation in ("xla", "triton"):
        model = _tiny_moe(jnp.bfloat16)
        quantize(model, group_size=64, progress=False)  # the experts' kernels: XLA's path on a CPU
        set_decode_routing(model, implementation)
        _, cache = nnx.jit(lambda m, i: m.prefill(i, max_len=16))(model, ids[:, :5])
        step = nnx.jit(lambda m, t, c, p: m.decode_step(t, c, p))
        steps = []
        with interpret():
            for pos in range(5, ids.shape[1]):
                logits, cache = step(model, ids[:, pos : pos + 1], cache, jnp.int32(pos))
                steps.append(np.asarray(logits, np.float64)[:, 0])
        results[implementation] = np.stack(steps)
    assert traced and len(traced) % TINY_CONFIG.num_layers == 0  # the triton model's layers, each trace
    xla, tri = results["xla"], results["triton"]
    np.testing.assert_allclose(tri, xla, rtol=0, atol=0.02 * np.abs(xla).max())
    np.testing.assert_array_equal(tri.argmax(-1), xla.argmax(-1))
    assert np.abs(xla).max() > 0.1 and not np.allclose(xla[0], xla[1])  # real, changing logits
