"""The decode step's fused parts (issue 46): one-token attention after the cache write, the norm's deferred
row scale, fused projections by default; against float64 references and the model's own full forward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nybble.models import QLinear, quantize
from nybble.models.definitions.decode_attention import attend_one
from nybble.models.definitions.fuse import FusedLinear
from nybble.models.definitions.llama import Llama, RMSNorm, norm_heads_together
from nybble.models.evaluate.zoo import TINY_CONFIG


def _reference(q, k, v, position, window):
    """Softmax attention in float64 over positions <= position (and within window)."""
    pos = np.arange(k.shape[2])
    seen = (pos <= position) & ((position - pos < window) if window else True)
    d = q.shape[-1]
    s = np.einsum("bhgd,bhsd->bhgs", q, k) / np.sqrt(d)
    s = np.where(seen, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhgs,bhsd->bhgd", p, v)


@pytest.mark.parametrize("window", [None, 3])
def test_attend_one_equals_float64_softmax(window):
    rng = np.random.default_rng(0)
    b, h, g, s, d, position = 2, 2, 3, 16, 8, 9
    q = rng.standard_normal((b, h, g, d))
    k = rng.standard_normal((b, h, s, d))
    v = rng.standard_normal((b, h, s, d))
    k[:, :, position + 1 :] = 1e4  # stale positions: they must not be seen
    v[:, :, position + 1 :] = -1e4
    ref = _reference(q, k, v, position, window)
    got = attend_one(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), jnp.int32(position), window)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5)


def test_deferred_norm_scale_commutes_with_the_projection():
    rng = np.random.default_rng(1)
    norm = RMSNorm(32, eps=1e-5)
    norm.weight = nnx.Param(jnp.asarray(rng.uniform(0.5, 2.0, 32), jnp.float32))
    x = jnp.asarray(rng.standard_normal((3, 1, 32)) * 5, jnp.float32)
    w = rng.standard_normal((32, 16))
    h, r = norm.deferred(x)
    x64, g64 = np.asarray(x, np.float64), np.asarray(norm.weight[...], np.float64)
    ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * g64 @ w
    np.testing.assert_allclose(np.asarray(h, np.float64) @ w * np.asarray(r), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(norm(x), np.float64) @ w, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "changes",
    [{"sliding_window": 3}, {"qk_norm": True}, {"qkv_bias": True}],
    ids=["window", "qk_norm", "bias"],
)
def test_decode_steps_equal_the_full_forward(changes):
    # The decode path (write, then attend_one; deferred norm scale where no bias) against model(ids).
    cfg = dataclasses.replace(TINY_CONFIG, num_layers=2, **changes)
    model = Llama(cfg, rngs=nnx.Rngs(5), dtype=jnp.float32)
    quantize(model, group_size=64, progress=False)
    ids = np.random.RandomState(2).randint(0, cfg.vocab_size, (2, 9)).astype(np.int32)
    full = np.asarray(model(ids))
    _, cache = model.prefill(ids[:, :2], max_len=12)
    step = nnx.jit(lambda m, t, c, p: m.decode_step(t, c, p))  # one compile, position traced
    for pos in range(2, ids.shape[1]):
        out, cache = step(model, ids[:, pos : pos + 1], cache, jnp.int32(pos))
        np.testing.assert_allclose(np.asarray(out)[:, 0], full[:, pos], rtol=2e-5, atol=2e-5)


def test_a_bf16_model_prefills_eagerly_as_its_forward():
    # jax 0.11.2's XLA:CPU ran no bf16 x bf16 = f32 dot whose result puts the query positions before the
    # batch dims: an eager bf16 prefill failed ("Unsupported element type for DotThunk::Execute").
    model = Llama(TINY_CONFIG, rngs=nnx.Rngs(3), dtype=jnp.bfloat16)
    ids = np.random.RandomState(6).randint(0, TINY_CONFIG.vocab_size, (2, 7)).astype(np.int32)
    logits, cache = model.prefill(ids, max_len=16)
    full = np.asarray(model(ids), np.float64)
    got = np.asarray(logits, np.float64)
    np.testing.assert_allclose(got, full, rtol=0, atol=0.03 * np.abs(full).max())
    assert np.abs(full).max() > 0.1 and np.isfinite(np.asarray(cache.k[0], np.float32)).all()


def test_quantize_fuses_on_request_and_the_parts_still_read():
    model = Llama(TINY_CONFIG, rngs=nnx.Rngs(1), dtype=jnp.float32)
    kernel = np.asarray(model.layers[0].attn.k_proj.kernel[...])
    plain = quantize(Llama(TINY_CONFIG, rngs=nnx.Rngs(1), dtype=jnp.float32), progress=False)
    assert "qkv_proj" not in vars(plain.layers[0].attn)  # not fused by default: the model keeps its modules
    quantize(model, progress=False, fuse_projections=True)
    attn = model.layers[0].attn
    assert isinstance(attn.qkv_proj, FusedLinear) and "k_proj" not in vars(attn)
    part = attn.k_proj  # split off the fused layer: the same codes and scales as the unfused one
    assert isinstance(part, QLinear) and part.weight.shape == kernel.shape
    ref = plain.layers[0].attn.k_proj.weight
    np.testing.assert_array_equal(np.asarray(part.weight.codes), np.asarray(ref.codes))
    np.testing.assert_array_equal(np.asarray(part.weight.scales), np.asarray(ref.scales))
    with pytest.raises(AttributeError, match="no attribute 'kk_proj'"):
        attn.kk_proj  # noqa: B018


def test_moe_gate_up_fused_gives_the_unfused_numbers():
    # int4 expert stacks fuse into a FusedExpertsGateUp: each expert's columns interleaved 8 by 8
    # (nybble.packing.gate_up), the parts split back bit for bit, the SiLU product taken by the grouped
    # SwiGLU op (its XLA path here: in f32, where the unfused MLP takes it in x's dtype; f32 here).
    from nybble.models import fuse_projections, unfuse_projections
    from nybble.models.definitions.fuse import FusedExpertsGateUp
    from nybble.models.definitions.moe import MoE, MoEConfig, QExperts

    moe = MoE(MoEConfig(hidden_size=64, intermediate_size=64, num_experts=4, top_k=2), rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 64)), jnp.float32)
    quantize(moe, group_size=32, progress=False, fuse_projections=False)
    gate, up = moe.experts.gate_proj.weight, moe.experts.up_proj.weight
    ref = np.asarray(moe(x))
    assert fuse_projections(moe) == 1
    fused = moe.experts.gate_up_proj
    assert isinstance(fused, FusedExpertsGateUp) and isinstance(fused.inner, QExperts)
    assert fused.inner.weight.shape == (64, 128) and fused.inner.num_experts == 4
    codes = np.asarray(jax.vmap(lambda w: w.logical_codes())(fused.inner.weight))[:, :64]
    np.testing.assert_array_equal(
        codes[:, :, 8:16], np.asarray(jax.vmap(lambda w: w.logical_codes())(up))[:, :64, :8]
    )
    np.testing.assert_array_equal(
        codes[:, :, 16:24], np.asarray(jax.vmap(lambda w: w.logical_codes())(gate))[:, :64, 8:16]
    )
    np.testing.assert_allclose(np.asarray(moe(x)), ref, rtol=1e-5, atol=1e-6)
    assert np.abs(ref).max() > 0.1
    for name, original in (("gate_proj", gate), ("up_proj", up)):
        split = getattr(moe.experts, name).weight  # FusedParts: the part split off
        for field in ("codes", "scales"):
            np.testing.assert_array_equal(
                np.asarray(getattr(split, field)), np.asarray(getattr(original, field))
            )
    assert unfuse_projections(moe) == 1 and isinstance(moe.experts.up_proj, QExperts)
    np.testing.assert_array_equal(np.asarray(moe(x)), ref)
    np.testing.assert_array_equal(np.asarray(moe.experts.gate_proj.weight.codes), np.asarray(gate.codes))


@pytest.mark.parametrize("k_eps", [1e-6, 1e-5])
def test_query_and_key_norms_in_one_reduction_equal_the_two_norms(k_eps):
    """Qwen3's per-head norms of q and k with one sum of squares over both (one launch): each head's
    values are those of its own norm, bit for bit, and both against float64."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 16)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 3, 2, 16)) * 5, jnp.bfloat16)
    q_norm, k_norm = RMSNorm(16, eps=1e-6), RMSNorm(16, eps=k_eps)
    q_norm.weight[...] = jnp.asarray(rng.uniform(0.5, 2, 16), jnp.float32)
    k_norm.weight[...] = jnp.asarray(rng.uniform(0.5, 2, 16), jnp.float32)
    qn, kn = norm_heads_together(q_norm, k_norm, q, k)
    np.testing.assert_array_equal(np.asarray(qn, np.float32), np.asarray(q_norm(q), np.float32))
    np.testing.assert_array_equal(np.asarray(kn, np.float32), np.asarray(k_norm(k), np.float32))
    for x, norm, out in ((q, q_norm, qn), (k, k_norm, kn)):
        x64 = np.asarray(x, np.float64)
        ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + norm.eps) * np.asarray(norm.weight[...])
        np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=2**-7)
