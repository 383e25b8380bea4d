"""nybble.models.quantize on NNX models: which layers are swapped, rules, reports, numerics under jit."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nybble
from nybble.models import (
    Llama,
    LlamaConfig,
    QLinear,
    QuantizationReport,
    QuantizedParam,
    QuantRule,
    quantize,
)


class Tiny(nnx.Module):
    """Embedding, two blocks of Linear layers, a norm and an untied LM head."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        # K = 128/192 (multiples of 64): no all-padding group at g32 (see the lead's note on rtn)
        self.embed = nnx.Embed(64, 128, rngs=rngs)
        self.blocks = nnx.List(
            [
                nnx.Dict(
                    up=nnx.Linear(128, 192, rngs=rngs),
                    down=nnx.Linear(192, 128, use_bias=False, rngs=rngs),
                )
                for _ in range(2)
            ]
        )
        self.proj = nnx.Linear(128, 128, rngs=rngs)
        self.small = nnx.Linear(128, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(128, rngs=rngs)
        self.lm_head = nnx.Linear(128, 64, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids)
        for b in self.blocks:
            x = x + b["down"](jax.nn.gelu(b["up"](x)))
        x = self.norm(self.proj(x))
        return self.lm_head(x) + self.small(x).sum(-1, keepdims=True)


def _tiny() -> Tiny:
    return Tiny(nnx.Rngs(0))


def _kinds(model: nnx.Module) -> dict[str, str]:
    return {
        ".".join(map(str, p)): type(m).__name__
        for p, m in nnx.iter_modules(model)
        if isinstance(m, nnx.Linear | QLinear)
    }


def test_default_swaps_linear_keeps_embed_norm_and_head():
    model, report = quantize(_tiny(), progress=False, return_report=True)
    kinds = _kinds(model)
    assert kinds == {
        "blocks.0.up": "QLinear",
        "blocks.0.down": "QLinear",
        "blocks.1.up": "QLinear",
        "blocks.1.down": "QLinear",
        "proj": "QLinear",
        "small": "QLinear",
        "lm_head": "Linear",
    }
    assert isinstance(model.embed, nnx.Embed) and isinstance(model.norm, nnx.LayerNorm)
    assert isinstance(report, QuantizationReport)
    assert len(report.quantized) == 6
    assert [(r.path, r.quantized) for r in report.skipped] == [("lm_head", False)]
    assert "lm_head" in report.skipped[0].reason
    assert report.bytes_after < report.bytes_before
    text = report.summary()
    assert "6 layer(s) quantized" in text and "kept lm_head" in text


def test_quantize_returns_same_object_and_keeps_bias():
    model = _tiny()
    bias = np.asarray(model.blocks[0]["up"].bias[...])
    out = quantize(model, progress=False)
    assert out is model
    assert isinstance(model.blocks[0]["up"], QLinear)
    np.testing.assert_array_equal(np.asarray(model.blocks[0]["up"].bias[...]), bias)
    assert model.blocks[0]["down"].bias is None
    assert isinstance(model.blocks[0]["up"].qweight, QuantizedParam)
    # the quantized weight is not trainable state
    assert not jax.tree.leaves(nnx.state(model.blocks[0]["down"], nnx.Param))


def test_rules_first_match_wins_and_settings():
    rules = [
        QuantRule(pattern=r"^blocks\.0\.", skip=True),
        QuantRule(pattern=r"\.down$", group_size=32, symmetric=False),
        QuantRule(pattern=r"up", group_size=None),
        QuantRule(pattern=r"^small$", min_size=10_000),
        QuantRule(pattern=r"^lm_head$", group_size=32),
    ]
    model, report = quantize(_tiny(), rules=rules, group_size=64, progress=False, return_report=True)
    by_path = {r.path: r for r in report.layers}
    assert not by_path["blocks.0.up"].quantized and not by_path["blocks.0.down"].quantized
    assert "skipped by rule" in by_path["blocks.0.up"].reason
    down = model.blocks[1]["down"].weight
    assert (down.group_size, down.symmetric) == (32, False)
    up = model.blocks[1]["up"].weight
    assert (up.group_size, up.symmetric) == (None, True)
    assert model.proj.weight.group_size == 64  # no rule: the call's defaults
    assert not by_path["small"].quantized and "min_size" in by_path["small"].reason
    assert isinstance(model.lm_head, QLinear) and model.lm_head.weight.group_size == 32


def test_unmatched_rule_warns():
    with pytest.warns(UserWarning, match=r"matched no nnx.Linear layer.*paths look like"):
        _, report = quantize(
            _tiny(), rules=[QuantRule(pattern="attention")], progress=False, return_report=True
        )
    assert [r.pattern for r in report.unmatched_rules] == ["attention"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize(_tiny(), rules=[QuantRule(pattern="proj")], progress=False)


def test_bad_arguments():
    with pytest.raises(ValueError, match="regular expression"):
        QuantRule(pattern="(")
    with pytest.raises(ValueError, match="power of two"):
        QuantRule(pattern="x", group_size=48)
    with pytest.raises(ValueError, match="power of two"):
        quantize(_tiny(), group_size=100, progress=False)
    with pytest.raises(ValueError, match="unknown method"):
        quantize(_tiny(), method="awq")
    with pytest.raises(ValueError, match="calibration"):
        quantize(_tiny(), calibration=np.zeros((1, 4), np.int32), progress=False)
    with pytest.raises(TypeError, match="quantize_params"):
        quantize({"kernel": np.zeros((4, 4))})
    with pytest.raises(TypeError, match="from_linear"):
        quantize(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match="QuantRule"):
        quantize(_tiny(), rules=["proj"], progress=False)
    with pytest.raises(dataclasses_error()):
        QuantRule(pattern="x").skip = True  # frozen
    with pytest.raises(TypeError, match=r"method='rtn' takes no option\(s\) \['damp'\]"):
        quantize(_tiny(), damp=0.1, progress=False)


def test_clip_search_passes_through_to_every_layer():
    plain, searched = _tiny(), _tiny()
    kernels = {path: lin.kernel[...] for path, lin in nnx.iter_modules(plain) if isinstance(lin, nnx.Linear)}
    quantize(plain, progress=False)
    quantize(searched, clip_search=True, progress=False)
    for path, w in kernels.items():
        if path == ("lm_head",):
            continue  # kept in float by default

        def err(model, path=path, w=w):
            layer = model
            for name in path:
                layer = layer[name] if isinstance(name, int) else getattr(layer, name)
            return float(jnp.sum((nybble.dequantize(layer.weight) - w) ** 2))

        assert err(searched) <= err(plain) * (1 + 1e-5)


def dataclasses_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_gptq_dispatches_to_calibrate(monkeypatch):
    calls = {}

    def quantize_gptq(model, **kwargs):
        calls.update(kwargs)
        return model, QuantizationReport(method="gptq")

    monkeypatch.setattr(nybble.models.quantization.adapter, "quantize_gptq", quantize_gptq)
    model = _tiny()
    calib = np.zeros((2, 8), np.int32)
    assert quantize(model, method="gptq", calibration=calib, group_size=64, progress=False) is model
    assert calls["calibration"] is calib and calls["format"] == nybble.QuantFormat(group_size=64)
    assert calls["act_order"] and calls["refit_scales"]  # GPTQ()'s defaults, from one place


def _dequantized_copy(model: nnx.Module) -> nnx.Module:
    """The float model whose Linear kernels are the dequantized int4 weights of ``model``."""
    ref = nnx.clone(model)
    for p, m in list(nnx.iter_modules(ref)):
        if isinstance(m, QLinear):
            lin = nnx.Linear(m.in_features, m.out_features, use_bias=m.bias is not None, rngs=nnx.Rngs(0))
            lin.kernel.set_value(nybble.dequantize(m.weight, jnp.float32))
            if m.bias is not None:
                lin.bias.set_value(m.bias[...])
            parent = ref
            for key in p[:-1]:
                parent = (
                    parent[key]
                    if isinstance(key, int) or not hasattr(parent, str(key))
                    else getattr(parent, key)
                )
            if isinstance(p[-1], str) and hasattr(parent, p[-1]):
                setattr(parent, p[-1], lin)
            else:
                parent[p[-1]] = lin
    return ref


def test_quantized_matches_dequantized_float_under_jit():
    model = quantize(_tiny(), group_size=32, symmetric=False, progress=False)
    ref = _dequantized_copy(model)
    assert not any(isinstance(m, QLinear) for _, m in nnx.iter_modules(ref))
    ids = jnp.arange(24).reshape(2, 12) % 64
    want = ref(ids)
    eager = model(ids)
    jitted = nnx.jit(lambda m, x: m(x))(model, ids)
    graphdef, state = nnx.split(model)
    pure = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids)
    for got in (eager, jitted, pure):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_llama_quantized_equivalence_and_closeness():
    cfg = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2
    )
    model = Llama(cfg, rngs=nnx.Rngs(1))
    ids = jnp.arange(20)[None] % 100
    float_logits = model(ids)
    quantize(model, group_size=32, progress=False)
    assert sum(isinstance(m, QLinear) for _, m in nnx.iter_modules(model)) == 14
    q_logits = nnx.jit(lambda m, x: m(x))(model, ids)
    ref = _dequantized_copy(model)
    np.testing.assert_allclose(np.asarray(q_logits), np.asarray(ref(ids)), rtol=1e-4, atol=1e-4)
    # Quantization changed the logits (the layers were swapped, not left float).
    assert float(nybble.kernels.relative_error(q_logits, float_logits)) > 0


def test_qlinear_errors_and_from_linear():
    lin = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    q = QLinear.from_linear(lin, group_size=32)
    x = jnp.ones((3, 64), jnp.bfloat16)
    assert q(x).dtype == jnp.bfloat16 and q(x).shape == (3, 32)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        QLinear(np.zeros((64, 32)))
    other = nybble.quantize(np.ones((32, 32), np.float32))
    with pytest.raises(ValueError, match="shape"):
        QLinear.from_linear(lin, qweight=other)
    with pytest.raises(ValueError, match="bias"):
        QLinear(other, jnp.zeros(5))


def test_quantizing_an_int4_model_again_is_refused_with_the_way_out():
    """It used to do nothing, silently, whatever the new settings."""
    model = quantize(_tiny(), group_size=64, progress=False)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    gptq = dict(method="gptq", calibration=np.zeros((1, 8), np.int32), seq_len=8)
    for options in ({}, gptq):
        with pytest.raises(ValueError, match=r"already quantized \(6 int4 QLinear layer\(s\).*float model"):
            quantize(model, group_size=32, **options)
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    jax.tree.map(np.testing.assert_array_equal, before, after)


def test_quantizing_the_rest_of_a_partly_int4_model_warns():
    model = quantize(_tiny(), rules=[QuantRule(pattern="blocks", skip=True)], progress=False)
    assert sorted(p for p, k in _kinds(model).items() if k == "QLinear") == ["proj", "small"]
    with pytest.warns(UserWarning, match=r"2 QLinear layer\(s\) are already int4.*4 float layer\(s\)"):
        model, report = quantize(model, group_size=32, progress=False, return_report=True)
    quantized = sorted(r.path for r in report.quantized)
    assert quantized == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up"]
    assert all(r.group_size == 32 for r in report.quantized)
