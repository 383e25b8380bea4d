"""Learned rounding (nybble.quant.autoround): never worse than its start, deterministic, near an optimum."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gptq import codes_of, correlated_inputs

import nybble
from nybble.quant.autoround import AutoRoundConfig, WeightSpec, autoround, autoround_block, block_loss
from nybble.quant.gptq import gptq

# A short run on small synthetic blocks; scale_lr 0.1 (the default is tuned on a real model: 1.0) keeps the
# scale factors from wandering off GPTQ's already fitted scales in 40 steps.
FAST = AutoRoundConfig(steps=40, batch_size=8, chunk=20, scale_lr=0.1)


def mlp(params, x):
    """A small block: two weights with a nonlinearity between them."""
    h = jax.nn.gelu(jnp.matmul(x, params["fc1"]["kernel"], precision="highest"))
    return jnp.matmul(h, params["fc2"]["kernel"], precision="highest")


def mlp_case(seed=0, k=96, hidden=128, n=80, samples=48):
    rng = np.random.default_rng(seed)
    params = {
        "fc1": {"kernel": (rng.standard_normal((k, hidden)) / np.sqrt(k)).astype(np.float32)},
        "fc2": {"kernel": (rng.standard_normal((hidden, n)) / np.sqrt(hidden)).astype(np.float32)},
        "scale": np.ones(3, np.float32),  # a leaf that is not quantized
    }
    x = correlated_inputs(rng, samples * 4, k).reshape(samples, 4, k)  # samples of 4 rows each
    return params, x


def float64_loss(params, x, qweights, loss="relative"):
    """The block's output error with the quantized weights, recomputed in float64: "relative" (each output
    vector's squared error over its squared norm, averaged) or "mse"."""

    def run(p):
        h = x.astype(np.float64) @ np.asarray(p["fc1"], np.float64)
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))  # gelu, tanh form
        return h @ np.asarray(p["fc2"], np.float64)

    def weight(name):  # a quantized weight, else the float one
        qw = qweights.get(f"{name}.kernel")
        return params[name]["kernel"] if qw is None else nybble.dequantize(qw)

    ref = run({k: params[k]["kernel"] for k in ("fc1", "fc2")})
    got = run({k: weight(k) for k in ("fc1", "fc2")})
    if loss == "mse":
        return float(np.mean((got - ref) ** 2))
    return float(np.mean(np.sum((got - ref) ** 2, -1) / np.sum(ref**2, -1)))


SPECS = {"fc1.kernel": WeightSpec(32, True), "fc2.kernel": WeightSpec(64, False)}


def run_block(params, x, config=FAST, start=None, specs=SPECS):
    return autoround_block(mlp, params, specs, [x], mlp(params, x), config=config, start=start)


@pytest.fixture(scope="module")
def learned():
    """One learned block (round-to-nearest start), shared: most tests reuse its compilation."""
    params, x = mlp_case()
    return params, x, run_block(params, x)


def test_block_improves_and_never_worsens_its_start(learned):
    params, x, res = learned
    rtn = {
        p: nybble.quantize(params[p.split(".")[0]]["kernel"], group_size=s.group_size, symmetric=s.symmetric)
        for p, s in SPECS.items()
    }
    assert res.learned and res.loss < 0.7 * res.loss_start
    # The reported losses are the true ones: round to nearest at the start, the returned weights at the end.
    np.testing.assert_allclose(res.loss_start, float64_loss(params, x, rtn), rtol=2e-3)
    np.testing.assert_allclose(res.loss, float64_loss(params, x, res.weights), rtol=2e-3)
    for path, spec in SPECS.items():
        qw = res.weights[path]
        assert (qw.group_size, qw.symmetric, qw.shape) == (spec.group_size, spec.symmetric, rtn[path].shape)
        assert qw.scales.dtype == jnp.bfloat16 and (qw.offsets is None) == spec.symmetric
    # A step so large that training only makes things worse: the start comes back unchanged.
    bad = run_block(params, x, dataclasses.replace(FAST, steps=20, lr=3.0))
    assert not bad.learned and bad.loss == bad.loss_start == res.loss_start
    for path in SPECS:
        for field in ("codes", "scales", "offsets"):
            got, want = getattr(bad.weights[path], field), getattr(rtn[path], field)
            assert (got is None) == (want is None)
            if got is not None:
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_gptq_start_is_improved(learned):
    params, x, _ = learned
    start = {
        p: gptq(w, inputs=x.reshape(-1, w.shape[0]), group_size=spec.group_size, symmetric=spec.symmetric)
        for p, spec in SPECS.items()
        for w in [params[p.split(".")[0]]["kernel"]]
    }
    # fc2's GPTQ sees the float fc1's outputs; the block's loss sees the quantized ones: room to learn.
    h = jax.nn.gelu(jnp.matmul(x, params["fc1"]["kernel"], precision="highest"))
    w2 = params["fc2"]["kernel"]
    start["fc2.kernel"] = gptq(w2, inputs=h.reshape(-1, w2.shape[0]), group_size=64, symmetric=False)
    res = run_block(params, x, start=start)
    np.testing.assert_allclose(res.loss_start, float64_loss(params, x, start), rtol=2e-3)
    np.testing.assert_allclose(res.loss, float64_loss(params, x, res.weights), rtol=2e-3)
    assert res.learned and res.loss < 0.97 * res.loss_start


def test_no_steps_returns_the_start(learned):
    params, x, _ = learned
    start = {p: nybble.quantize(params[p.split(".")[0]]["kernel"], group_size=spec.group_size,
                                symmetric=spec.symmetric) for p, spec in SPECS.items()}  # fmt: skip
    res = run_block(params, x, dataclasses.replace(FAST, steps=0), start=start)
    assert not res.learned and res.loss == res.loss_start
    for path, qw in start.items():
        for field in ("codes", "scales", "offsets"):
            want, got = getattr(qw, field), getattr(res.weights[path], field)
            assert (want is None) == (got is None)
            if want is not None:
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_deterministic_given_the_seed(learned):
    params, x, a = learned
    b = run_block(params, x)
    c = run_block(params, x, dataclasses.replace(FAST, seed=1))
    for path in SPECS:
        for field in ("codes", "scales", "offsets"):
            u, v = getattr(a.weights[path], field), getattr(b.weights[path], field)
            if u is not None:
                np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert a.loss == b.loss
    assert a.loss != c.loss  # another seed, another mini-batch order
    # block_loss measures the same objective for any weights.
    np.testing.assert_allclose(block_loss(mlp, params, a.weights, [x], mlp(params, x)), a.loss, rtol=1e-5)


def test_layer_near_the_brute_force_optimum():
    """16 weights a column, scales fixed: the best of all 2^16 up/down roundings is known exactly."""
    rng = np.random.default_rng(0)
    k, n = 16, 4
    x = rng.standard_normal((64, k)) * rng.uniform(0.3, 3, k)
    x[:, 1] += x[:, 0]  # correlated inputs: round to nearest is not optimal
    x[:, 3] -= 0.8 * x[:, 2]
    x = x.astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    rtn = nybble.quantize(w, group_size=16, scale_dtype=jnp.float32)
    s = np.asarray(rtn.scales, np.float64)[0, :n]
    floor = np.floor(w / s)
    choices = np.array(list(itertools.product([0, 1], repeat=k)))  # (65536, 16)

    def column_loss(q, col):  # mean squared output error of one column, for each row of codes q
        return np.mean(((w[:, col] - q * s[col]) @ x.T.astype(np.float64)) ** 2, axis=-1)

    best = sum(column_loss(np.clip(floor[:, c] + choices, -8, 7), c).min() for c in range(n))
    start = sum(column_loss(codes_of(rtn)[:, c], c) for c in range(n))
    cfg = AutoRoundConfig(steps=300, batch_size=64, learn_scales=False, optimizer="adam")
    qw = autoround(w, x, group_size=16, scale_dtype=jnp.float32, config=cfg)
    codes = codes_of(qw)
    got = sum(column_loss(codes[:, c], c) for c in range(n))
    assert np.all((codes == floor) | (codes == floor + 1))  # radius 0.5: each weight rounds up or down
    np.testing.assert_array_equal(np.asarray(qw.scales), np.asarray(rtn.scales))  # scales not learned
    assert best < got < start
    assert start - got > 0.5 * (start - best), (best, got, start)


def test_layer_per_column_asymmetric():
    group_size, symmetric = None, False
    rng = np.random.default_rng(3)
    k, n = 160, 72  # padded to (192, 128): one group of 192 rows a column, 32 of them padding
    x = correlated_inputs(rng, 256, k)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    rtn = nybble.quantize(w, group_size=group_size, symmetric=symmetric)
    qw = autoround(
        w, x, group_size=group_size, symmetric=symmetric, config=AutoRoundConfig(steps=30, batch_size=64)
    )
    assert (qw.shape, qw.group_size, qw.symmetric) == ((k, n), group_size, symmetric)
    assert qw.scales.shape == rtn.scales.shape and (qw.offsets is None) == symmetric

    def err(q):
        return np.mean((x.astype(np.float64) @ (np.asarray(nybble.dequantize(q), np.float64) - w)) ** 2)

    assert err(qw) < 0.9 * err(rtn)


def test_errors():
    params, x = mlp_case(samples=8)
    y = mlp(params, x)
    with pytest.raises(ValueError, match="steps"):
        AutoRoundConfig(steps=-1)
    with pytest.raises(ValueError, match="optimizer"):
        AutoRoundConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="batch_size"):
        AutoRoundConfig(batch_size=0)
    with pytest.raises(ValueError, match="preset"):
        autoround_block(mlp, params, SPECS, [x], y, config="slow")
    with pytest.raises(ValueError, match=r"no leaf at path\(s\) \['fc3.kernel'\]"):
        autoround_block(mlp, params, {"fc3.kernel": WeightSpec()}, [x], y)
    with pytest.raises(ValueError, match="selects no leaf"):
        autoround_block(mlp, params, {}, [x], y)
    with pytest.raises(ValueError, match="samples on axis 0"):
        autoround_block(mlp, params, SPECS, [x], y[:3])
    with pytest.raises(ValueError, match="group_size"):
        autoround_block(mlp, params, {"fc1.kernel": WeightSpec(group_size=24)}, [x], y)
    w1 = params["fc1"]["kernel"]
    with pytest.raises(ValueError, match=r"start weight for fc1\.kernel"):
        autoround_block(
            mlp,
            params,
            {"fc1.kernel": WeightSpec(32, True)},
            [x],
            y,
            start={"fc1.kernel": nybble.quantize(w1, group_size=64)},
        )
    with pytest.raises(ValueError, match="unselected"):
        autoround_block(
            mlp,
            params,
            {"fc1.kernel": WeightSpec(32, True)},
            [x],
            y,
            start={"fc2.kernel": nybble.quantize(params["fc2"]["kernel"], group_size=32)},
        )
    with pytest.raises(ValueError, match=r"inputs must be \(n, 96\)"):
        autoround(w1, x)
    with pytest.raises(ValueError, match="NaN"):
        autoround(np.full((32, 32), np.nan, np.float32), np.ones((4, 32), np.float32))
