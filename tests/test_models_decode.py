"""KV-cache decoding on the tiny random Llama: prefill + decode steps equal the full forward."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from nybble.models import QLinear, generate, quantize
from nybble.models.definitions.llama import KVCache
from nybble.models.evaluate.zoo import TINY_CONFIG, tiny_random


def _ids(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, TINY_CONFIG.vocab_size, (batch, length)).astype(np.int32)


def _stepwise_logits(model, ids: np.ndarray, n_prefill: int, max_len: int) -> np.ndarray:
    logits, cache = model.prefill(ids[:, :n_prefill], max_len=max_len)
    assert isinstance(cache, KVCache) and cache.max_len == max_len and cache.batch == ids.shape[0]
    out = [np.asarray(logits)]
    for pos in range(n_prefill, ids.shape[1]):
        step, cache = model.decode_step(ids[:, pos : pos + 1], cache, pos)
        assert step.shape == (ids.shape[0], 1, TINY_CONFIG.vocab_size)
        out.append(np.asarray(step))
    return np.concatenate(out, axis=1)


@pytest.fixture(scope="module")
def models():
    float_model, _ = tiny_random(jnp.float32, seed=0)
    int4_model = quantize(tiny_random(jnp.float32, seed=0)[0], group_size=64, progress=False)
    assert isinstance(int4_model.layers[0].attn.q_proj, QLinear)
    return {"float": float_model, "int4": int4_model}


@pytest.mark.parametrize("kind", ["float", "int4"])
def test_prefill_then_decode_matches_full_forward(models, kind):
    model = models[kind]
    ids = _ids(2, 11)
    full = np.asarray(model(ids))
    got = _stepwise_logits(model, ids, n_prefill=4, max_len=16)
    np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5)
    # A prefill of one token (everything else decoded) agrees too.
    np.testing.assert_allclose(_stepwise_logits(model, ids, 1, 11), full, rtol=1e-5, atol=1e-5)


def test_cache_layout_and_dtype(models):
    cache = models["float"].init_cache(3, 20, jnp.bfloat16)
    cfg = TINY_CONFIG
    assert len(cache.k) == len(cache.v) == cfg.num_layers
    assert cache.k[0].shape == (3, cfg.num_kv_heads, 20, cfg.head_dim) and cache.k[0].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="cache length"):
        models["float"].prefill(_ids(3, 21), cache)


@pytest.mark.parametrize("kind", ["float", "int4"])
def test_generate_cache_equals_no_cache(models, kind):
    model = models[kind]
    prompt = _ids(1, 7, seed=1)[0]
    cached = generate(model, prompt, 12, bucket=8)
    plain = generate(model, prompt, 12, bucket=8, use_cache=False)
    assert cached.shape == (12,)
    np.testing.assert_array_equal(cached, plain)


def test_generate_text_and_eos(models):
    model = models["float"]
    _, tok = tiny_random()
    text = generate(model, "hello", 5, tokenizer=tok)
    assert isinstance(text, str)
    ref = generate(model, list(b"hello"), 5)
    eos = int(ref[2])  # stop at the third token: it is kept, nothing after it
    for use_cache in (True, False):
        out = generate(model, list(b"hello"), 5, eos_id=eos, use_cache=use_cache)
        np.testing.assert_array_equal(out, ref[: list(ref).index(eos) + 1])


def test_generate_batch_equals_each_prompt_alone(models):
    model = models["float"]
    prompts = _ids(2, 6, seed=2)
    for use_cache in (True, False):
        both = generate(model, prompts, 9, use_cache=use_cache)
        assert both.shape == (2, 9)
        for row in range(2):
            np.testing.assert_array_equal(both[row], generate(model, prompts[row], 9, use_cache=use_cache))


def test_generate_batch_rows_finish_at_eos(models):
    """A row that emits eos stops (eos padding after it); the other row runs on unchanged."""
    model = models["float"]
    prompts = _ids(2, 6, seed=3)
    ref = generate(model, prompts, 6)
    # eos: a token row 0 emits early that row 1 never emits
    eos = next(int(t) for t in ref[0, :4] if t not in ref[1])
    out = generate(model, prompts, 6, eos_id=eos)
    first = list(ref[0]).index(eos)
    assert not (ref[0, first + 1 :] == eos).all()  # without eos_id, row 0 goes on past it
    assert (out[0, first:] == eos).all()
    np.testing.assert_array_equal(out[0, : first + 1], ref[0, : first + 1])
    np.testing.assert_array_equal(out[1], ref[1])


def test_generate_rejects_bad_prompts(models):
    with pytest.raises(ValueError, match="empty"):
        generate(models["float"], [], 3)
    with pytest.raises(ValueError, match="batch, length"):
        generate(models["float"], np.zeros((1, 2, 3), np.int32), 3)
