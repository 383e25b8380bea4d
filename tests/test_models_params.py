"""quantize_params on plain params pytrees, ``dense`` and the Linen ``QDense``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import nybble
from nybble.models import QDense, QuantRule, dense, quantize_params


class MLP(nn.Module):
    dense_cls: type = QDense

    @nn.compact
    def __call__(self, x):
        x = jax.nn.relu(self.dense_cls(256, name="fc1")(x))
        x = jax.nn.relu(self.dense_cls(128, use_bias=False, name="fc2")(x))
        return self.dense_cls(10, name="head")(x)


def _dequantize_tree(params):
    return jax.tree.map(
        lambda leaf: (
            nybble.dequantize(leaf, jnp.float32) if isinstance(leaf, nybble.QuantizedWeight) else leaf
        ),
        params,
        is_leaf=lambda leaf: isinstance(leaf, nybble.QuantizedWeight),
    )


@pytest.fixture(scope="module")
def mlp():
    x = jax.random.normal(jax.random.key(0), (4, 128))
    params = MLP().init(jax.random.key(1), x)
    return x, params


def test_quantize_params_selects_2d_kernels_and_keeps_others(mlp):
    _, params = mlp
    extra = {
        "params": params["params"],
        "stats": {"kernel": jnp.ones(3), "conv": {"kernel": jnp.ones((3, 3, 4, 4))}},
    }
    q, report = quantize_params(extra, group_size=64, return_report=True)
    p = q["params"]
    # the head keeps float by the default rules; fc1/fc2 are int4
    assert isinstance(p["fc1"]["kernel"], nybble.QuantizedWeight)
    assert isinstance(p["fc2"]["kernel"], nybble.QuantizedWeight)
    assert not isinstance(p["head"]["kernel"], nybble.QuantizedWeight)
    assert p["fc1"]["kernel"].group_size == 64
    assert p["fc1"]["bias"] is params["params"]["fc1"]["bias"]
    assert q["stats"]["kernel"] is extra["stats"]["kernel"]  # 1-D: untouched
    assert q["stats"]["conv"]["kernel"] is extra["stats"]["conv"]["kernel"]  # 4-D: untouched
    assert [r.path for r in report.quantized] == ["params.fc1", "params.fc2"]
    assert [r.path for r in report.skipped] == ["params.head"]
    # the input pytree is not modified
    assert not isinstance(params["params"]["fc1"]["kernel"], nybble.QuantizedWeight)


def test_qdense_with_quantized_params_matches_dequantized(mlp):
    x, params = mlp
    rules = [QuantRule(pattern=r"head$", group_size=32, symmetric=False)]
    q = quantize_params(params, rules=rules, group_size=64)
    assert q["params"]["head"]["kernel"].symmetric is False
    apply = jax.jit(MLP().apply)
    got = apply(q, x)
    want = MLP().apply(_dequantize_tree(q), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(nybble.kernels.relative_error(got, MLP().apply(params, x))) > 0  # quantized, not float


def test_nn_dense_params_drop_into_qdense(mlp):
    x, _ = mlp
    params = MLP(dense_cls=nn.Dense).init(jax.random.key(2), x)
    np.testing.assert_allclose(
        np.asarray(MLP().apply(params, x)),
        np.asarray(MLP(dense_cls=nn.Dense).apply(params, x)),
        rtol=1e-5,
        atol=1e-5,
    )
    q = quantize_params(params)
    assert MLP().apply(q, x).shape == (4, 10)


def test_dense_float_and_quantized():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((3, 5, 96)), jnp.float32)
    np.testing.assert_allclose(np.asarray(dense(x, w)), np.asarray(x @ w), rtol=1e-5, atol=1e-4)
    qw = nybble.quantize(w, group_size=32)
    got = dense(x, qw)
    assert got.shape == (3, 5, 40) and got.dtype == jnp.float32
    want = x @ nybble.dequantize(qw, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    assert dense(x.astype(jnp.bfloat16), qw).dtype == jnp.bfloat16


def test_quantize_params_rules_and_warnings(mlp):
    _, params = mlp
    with pytest.warns(UserWarning, match="matched no kernel"):
        quantize_params(params, rules=[QuantRule(pattern="nothing_here")])
    q = quantize_params(params, rules=[QuantRule(pattern="fc", skip=True)])
    assert not any(
        isinstance(leaf, nybble.QuantizedWeight)
        for leaf in jax.tree.leaves(q, is_leaf=lambda t: isinstance(t, nybble.QuantizedWeight))
    )
    with pytest.raises(ValueError, match="power of two"):
        quantize_params(params, group_size=3)


def test_qdense_shape_mismatch(mlp):
    x, params = mlp
    q = quantize_params(params)
    q["params"]["fc2"]["kernel"] = nybble.quantize(np.ones((256, 64), np.float32))
    with pytest.raises(ValueError, match="kernel shape"):
        MLP().apply(q, x)


def test_quantize_params_twice_is_refused(mlp):
    _, params = mlp
    q = quantize_params(params, group_size=64)
    with pytest.raises(ValueError, match=r"already quantized \(2 int4 kernel\(s\).*float model"):
        quantize_params(q, group_size=32)
