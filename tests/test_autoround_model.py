"""Learned rounding through a whole (tiny, random) NNX Llama and through a Linen params pytree."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import linen, nnx
from test_gptq_model import CFG, tiny_model  # the same model: GPTQ's compilations are shared

import nybble
import nybble.models as nm
from nybble.models.definitions.layers import QLinear
from nybble.models.quantization.autoround import quantize_autoround
from nybble.quant.autoround import key_path_str

OPTIONS = dict(steps=40, batch_size=2, chunk=20)


def calibration(seed=0):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, (8, 32))


def weights_of(model):
    return {
        path: m.weight
        for path, m in ((key_path_str(p), m) for p, m in nnx.iter_modules(model))
        if isinstance(m, QLinear)
    }


@pytest.fixture(scope="module")
def learned():
    """The tiny model through method="autoround" (g32 symmetric, the LM head chosen by a rule), shared."""
    ids = calibration()
    model, report = nm.quantize(
        tiny_model(), method="autoround", calibration=ids, group_size=32, return_report=True, progress=False,
        rules=[nm.QuantRule(pattern=r"lm_head$")], **OPTIONS,
    )  # fmt: skip
    return ids, model, report


def test_whole_model_beats_round_to_nearest(learned):
    ids, model, report = learned
    ref = np.asarray(tiny_model().hidden_states(ids))
    rtn = nm.quantize(tiny_model(), group_size=32, progress=False)
    weights = weights_of(model)
    assert len(weights) == 15 and report.method == "autoround" and len(report.quantized) == 15
    assert all(w.group_size == 32 and w.symmetric for w in weights.values())
    # hidden_states() never reaches the LM head: it is outside every block, round to nearest, reported.
    head = next(r for r in report.layers if r.path == "lm_head")
    assert head.quantized and "outside the calibrated blocks" in head.reason
    head_rtn = nybble.quantize(tiny_model().lm_head.kernel[...], group_size=32)
    np.testing.assert_array_equal(np.asarray(weights["lm_head"].codes), np.asarray(head_rtn.codes))
    err = [np.linalg.norm(np.asarray(m.hidden_states(ids)) - ref) for m in (rtn, model)]
    assert err[1] < 0.7 * err[0], err
    assert np.isfinite(np.asarray(model(ids))).all()


def test_deterministic_and_a_later_failure_keeps_earlier_blocks(learned):
    ids, model, _ = learned
    a = weights_of(model)
    rules = [nm.QuantRule(pattern=r"lm_head$")]
    options = dict(method="autoround", calibration=ids, group_size=32, rules=rules, progress=False, **OPTIONS)
    b = weights_of(nm.quantize(tiny_model(), **options))
    assert a.keys() == b.keys() and len(a) == 15
    for path in a:
        np.testing.assert_array_equal(np.asarray(a[path].codes), np.asarray(b[path].codes))
        np.testing.assert_array_equal(np.asarray(a[path].scales), np.asarray(b[path].scales))

    def failing_forward(m, tokens):  # block 0 runs (and is quantized), then the pass fails
        x = m.embed(tokens)
        m.layers[0](x, np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape))
        raise RuntimeError("boom")

    model = tiny_model()
    with pytest.raises(RuntimeError, match="boom"):
        quantize_autoround(model, calibration=ids, forward=failing_forward, group_size=32, rules=rules,
                           progress=False, **OPTIONS)  # fmt: skip
    got = weights_of(model)
    assert sorted(got) == sorted(p for p in a if p.startswith("layers.0."))  # block 1 is float again
    for path, qw in got.items():  # the same result as in the complete run
        np.testing.assert_array_equal(np.asarray(qw.codes), np.asarray(a[path].codes))
    assert isinstance(model.layers[1].attn.q_proj, nnx.Linear) and isinstance(model.layers[1], nnx.Module)


def kl_to_float(model, ids):
    log_p = jax.nn.log_softmax(np.asarray(tiny_model()(ids), np.float64), -1)
    log_q = jax.nn.log_softmax(np.asarray(model(ids), np.float64), -1)
    return float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), -1)))


def test_end_to_end_stage_keeps_codes_and_lowers_the_models_kl(learned):
    ids, model, _ = learned
    rules = [nm.QuantRule(pattern=r"lm_head$")]
    options = dict(method="autoround", calibration=ids, group_size=32, rules=rules, progress=False, **OPTIONS)
    tuned = nm.quantize(tiny_model(), end_to_end_epochs=3, end_to_end_lr=0.01, **options)
    a, b = weights_of(model), weights_of(tuned)
    assert a.keys() == b.keys() and len(a) == 15
    changed = 0
    for path in a:  # the blocks' codes, then only scales move
        np.testing.assert_array_equal(np.asarray(a[path].codes), np.asarray(b[path].codes))
        changed += not np.array_equal(np.asarray(a[path].scales), np.asarray(b[path].scales))
    assert changed == 15
    kl = [kl_to_float(m, ids) for m in (model, tuned)]
    assert kl[1] < 0.9 * kl[0], kl


def test_gptq_start_and_own_target():
    ids = calibration()
    ref = np.asarray(tiny_model().hidden_states(ids))
    gptq = nm.quantize(tiny_model(), method="gptq", calibration=ids, group_size=32, progress=False)
    model = nm.quantize(
        tiny_model(),
        method="autoround",
        calibration=ids,
        group_size=32,
        start="gptq",
        target="own",
        progress=False,
        **OPTIONS,
    )
    err = [np.linalg.norm(np.asarray(m.hidden_states(ids)) - ref) for m in (gptq, model)]
    assert err[1] < err[0], err


def test_model_errors_leave_the_model_float():
    model = tiny_model()
    ids = calibration()
    with pytest.raises(ValueError, match="calibration"):
        nm.quantize(model, method="autoround", progress=False)
    with pytest.raises(ValueError, match="start must be one of"):
        nm.quantize(model, method="autoround", calibration=ids, start="awq", progress=False)
    with pytest.raises(ValueError, match="target must be one of"):
        nm.quantize(model, method="autoround", calibration=ids, target="teacher", progress=False)
    with pytest.raises(TypeError, match=r"takes no option\(s\) \['bogus'\]"):
        nm.quantize(model, method="autoround", calibration=ids, bogus=1, progress=False)
    with pytest.raises(ValueError, match="unknown preset 'slow'"):
        nm.quantize(model, method="autoround", calibration=ids, config="slow", progress=False)
    assert not weights_of(model)


class MLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        x = nm.QDense(128, name="fc1")(x)
        return nm.QDense(48, name="fc2")(linen.gelu(x))


def test_params_pytree_entry_point():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((16, 8, 64)) * rng.uniform(0.2, 3.0, 64)).astype(np.float32)
    mod = MLP()
    params = mod.init(nnx.Rngs(0)(), x[:1])

    def apply(p, inputs):
        return mod.apply(p, inputs)

    ref = np.asarray(apply(params, x))
    rtn = nm.quantize_params(params, group_size=32)
    q, report = nm.quantize_params(
        params,
        method="autoround",
        apply_fn=apply,
        calibration=x,
        group_size=32,
        return_report=True,
        progress=False,
        **OPTIONS,
    )
    assert report.method == "autoround" and len(report.quantized) == 2
    assert isinstance(q["params"]["fc1"]["kernel"], nybble.QuantizedWeight)
    err = [np.linalg.norm(np.asarray(apply(p, x)) - ref) for p in (rtn, q)]
    assert err[1] < 0.9 * err[0], err
    with pytest.raises(ValueError, match="apply_fn"):
        nm.quantize_params(params, method="autoround", calibration=x)
    with pytest.raises(ValueError, match="calibration"):
        nm.quantize_params(params, method="autoround", apply_fn=apply)
    with pytest.raises(ValueError, match="only used by method='autoround'"):
        nm.quantize_params(params, calibration=x)
    with pytest.raises(ValueError, match="method must be"):
        nm.quantize_params(params, method="gptq")
