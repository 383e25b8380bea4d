"""End-to-end tuning of group scales and offsets (``nybble.models.quantization.tune``) on tiny models."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nybble
from nybble.models.definitions.layers import QLinear
from nybble.models.quantization.tune import float_logits, tune_group_params

VOCAB, DIM, GROUP = 48, 64, 32


class TinyLM(nnx.Module):
    """Embedding then an LM head: logits = embed(ids) @ w."""

    def __init__(self, w: np.ndarray):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=nnx.Rngs(0))
        self.embed.embedding[...] = jnp.asarray(np.random.default_rng(1).standard_normal((VOCAB, DIM)))
        self.head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=nnx.Rngs(0))
        self.head.kernel[...] = jnp.asarray(w)

    def __call__(self, ids):
        return self.head(self.embed(ids))


def problem(symmetric: bool, seed: int = 0):
    """A float model whose head is exactly ``qw`` dequantized, and a quantized copy with the same codes but
    every scale (and offset) moved by up to 8%: the optimum is known, ``qw`` itself (KL 0)."""
    rng = np.random.default_rng(seed)
    qw = nybble.quantize(rng.standard_normal((DIM, VOCAB)) * 0.3, group_size=GROUP, symmetric=symmetric)
    float_model = TinyLM(np.asarray(nybble.dequantize(qw)))

    def moved(a):
        return None if a is None else (a * (1 + rng.uniform(-0.08, 0.08, a.shape))).astype(a.dtype)

    start = dataclasses.replace(qw, scales=moved(qw.scales), offsets=moved(qw.offsets))
    model = TinyLM(np.zeros((DIM, VOCAB), np.float32))
    model.head = QLinear(start)
    ids = rng.integers(0, VOCAB, (8, 16))
    return qw, start, float_model, model, ids


def relative_error(a, b):
    a, b = np.asarray(a, np.float64)[:, :VOCAB], np.asarray(b, np.float64)[:, :VOCAB]
    return np.median(np.abs(a / b - 1))


@pytest.mark.parametrize("symmetric", [True, False])
def test_recovers_the_known_scales(symmetric):
    qw, start, float_model, model, ids = problem(symmetric)
    target = float_logits(float_model, ids)
    assert target.dtype == jnp.bfloat16 and target.shape == (8, 16, VOCAB)
    res = tune_group_params(model, ids, target, epochs=10, lr=0.02, progress=False)
    tuned = model.head.weight
    assert res.kept and res.steps == 80 and res.loss < 0.05 * res.loss_start, res
    np.testing.assert_array_equal(np.asarray(tuned.codes), np.asarray(qw.codes))  # codes fixed
    assert tuned.scales.dtype == qw.scales.dtype
    before, after = relative_error(start.scales, qw.scales), relative_error(tuned.scales, qw.scales)
    assert after < 0.25 * before, (before, after)
    if not symmetric:
        assert not np.array_equal(np.asarray(tuned.offsets), np.asarray(start.offsets))
        offset_error = [np.median(np.abs(np.asarray(o, np.float64) - np.asarray(qw.offsets, np.float64)))
                        for o in (start.offsets, tuned.offsets)]  # fmt: skip
        assert offset_error[1] < 0.7 * offset_error[0], offset_error


def test_deterministic_and_never_worse():
    runs = []
    for lr in (0.02, 0.02, 2.0):  # 2.0: steps of up to 200% overshoot the factors' range
        _, start, float_model, model, ids = problem(True, seed=3)
        res = tune_group_params(model, ids, float_logits(float_model, ids), epochs=2, lr=lr, progress=False)
        assert res.loss <= res.loss_start, res
        if not res.kept:  # the model is left exactly as it was
            np.testing.assert_array_equal(np.asarray(model.head.weight.scales), np.asarray(start.scales))
        runs.append((res, np.asarray(model.head.weight.scales)))
    assert runs[0][0] == runs[1][0] and runs[0][0].kept
    assert not runs[2][0].kept  # the overshooting run ended worse, so the model was left as it was
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    # No steps: nothing is kept and nothing changes.
    _, start, float_model, model, ids = problem(True)
    res = tune_group_params(model, ids, float_logits(float_model, ids), epochs=0, progress=False)
    assert not res.kept and res.steps == 0 and res.loss == res.loss_start > 0
    np.testing.assert_array_equal(np.asarray(model.head.weight.scales), np.asarray(start.scales))


def test_errors():
    _, _, float_model, model, ids = problem(True)
    target = float_logits(float_model, ids)
    with pytest.raises(ValueError, match=r"ids must be \(windows, length\)"):
        tune_group_params(model, ids[0], target, progress=False)
    with pytest.raises(ValueError, match="do not match ids"):
        tune_group_params(model, ids[:4], target, progress=False)
    with pytest.raises(ValueError, match="epochs must be an int >= 0"):
        tune_group_params(model, ids, target, epochs=-1, progress=False)
    with pytest.raises(ValueError, match="no QLinear layers"):
        tune_group_params(float_model, ids, target, progress=False)
    with pytest.raises(ValueError, match=r"float_logits: ids must be"):
        float_logits(float_model, ids[0])
    assert jax.tree.leaves(model.head.weight)  # untouched, still a QuantizedWeight
