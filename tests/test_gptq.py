"""GPTQ against a float64 numpy reference, and against round-to-nearest on correlated inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import nybble
from nybble.kernels.ops.matmul.reference import reference_codes
from nybble.quant.gptq import HessianAccumulator, gptq, hessian_from_inputs


def reference_gptq(w, h, *, group_size, symmetric, damp=0.01, act_order=False, scale_dtype=np.float32):
    """Textbook GPTQ in float64, one row at a time with immediate full updates (no blocking).

    Group parameters follow nybble.quantize's rule; dynamic groups are computed from the current rows
    when quantization reaches them, static ones (act-order) from the original weights. Returns codes.
    """
    w = np.array(w, np.float64)
    h = np.array(h, np.float64)
    k, n = w.shape
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[dead] = 0
    h += damp * np.mean(np.diag(h)) * np.eye(k)

    def params(rows):
        if symmetric:
            neg, pos = np.maximum(-rows.min(0), 0), np.maximum(rows.max(0), 0)
            s = np.maximum(neg / 8, pos / 7).astype(scale_dtype).astype(np.float64)
            return s, np.zeros_like(s)
        lo, hi = rows.min(0), rows.max(0)
        s = ((hi - lo) / 15).astype(scale_dtype)
        s = np.where(s.astype(np.float64) * 15 < hi - lo, np.nextafter(s, np.inf, dtype=s.dtype), s)
        s = s.astype(np.float64)
        b = (lo + 8 * s).astype(scale_dtype).astype(np.float64)
        return s, b

    g = group_size
    static = [params(w[i : i + g]) for i in range(0, k, g)] if act_order else None
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    w, h = w[perm], h[perm][:, perm]
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    q = np.zeros((k, n))
    for i in range(k):
        if act_order:
            s, b = static[perm[i] // g]
        elif i % g == 0:
            s, b = params(w[i : i + g])
        qi = np.clip(np.round((w[i] - b) / np.where(s == 0, 1, s)), -8, 7)
        qi = np.where(s == 0, 0, qi)
        err = (w[i] - (qi * s + b)) / u[i, i]
        w[i + 1 :] -= np.outer(u[i, i + 1 :], err)
        q[i] = qi
    out = np.zeros_like(q)
    out[perm] = q
    return out.astype(np.int8)


def correlated_inputs(rng, n, k):
    """Inputs whose features are strongly correlated (a random low-rank mix plus noise)."""
    mix = rng.standard_normal((k // 4, k))
    x = rng.standard_normal((n, k // 4)) @ mix + 0.1 * rng.standard_normal((n, k))
    return (x * rng.uniform(0.2, 3.0, k)).astype(np.float32)


def codes_of(qw):
    k_pad = qw.padded_shape[0]
    codes = nybble.packing.get_layout(qw.layout).unpack(np.asarray(qw.codes), k_pad)
    return np.asarray(codes)[: qw.shape[0], : qw.shape[1]]


@pytest.mark.parametrize(
    ("k", "n", "g", "sym", "act", "block"),
    [(128, 64, 32, True, False, 64), (192, 64, 64, False, False, 128), (128, 64, 64, True, True, 32)],
)
def test_matches_float64_reference(k, n, g, sym, act, block):
    rng = np.random.default_rng(k + n + g)
    x = correlated_inputs(rng, 512, k)
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    h = hessian_from_inputs(x)
    qw = gptq(w, h, group_size=g, symmetric=sym, act_order=act, block_size=block, scale_dtype=jnp.float32)
    ref = reference_gptq(w, np.asarray(h), group_size=g, symmetric=sym, act_order=act)
    same = np.mean(codes_of(qw) == ref)
    assert same > 0.995, same  # identical in practice
    assert qw.shape == (k, n) and qw.group_size == g and qw.symmetric == sym


@pytest.mark.parametrize(
    ("g", "sym", "act", "clip"),
    [
        (64, True, False, False),
        (32, False, False, False),
        (64, True, True, False),
        (None, True, False, False),
        (64, True, True, True),
        (32, False, False, True),
    ],
)
def test_beats_rtn_on_correlated_inputs(g, sym, act, clip):
    rng = np.random.default_rng(5)
    k, n = 256, 96
    x = correlated_inputs(rng, 1024, k)
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    ref = x @ w
    err_rtn = np.linalg.norm(
        x @ np.asarray(nybble.dequantize(nybble.quantize(w, group_size=g, symmetric=sym, clip_search=clip)))
        - ref
    )
    qw = gptq(w, inputs=x, group_size=g, symmetric=sym, act_order=act, clip_search=clip)
    err_gptq = np.linalg.norm(x @ np.asarray(nybble.dequantize(qw)) - ref)
    assert err_gptq < 0.75 * err_rtn, (err_gptq, err_rtn)


def test_odd_shapes_padding_and_dead_inputs():
    rng = np.random.default_rng(9)
    k, n = 200, 72  # K, N not multiples of 64; partial last group
    x = correlated_inputs(rng, 256, k)
    x[:, 5] = 0  # a dead input
    w = rng.standard_normal((k, n)).astype(np.float32)
    for sym, act in ((True, False), (False, True)):
        qw = gptq(w, inputs=x, group_size=64, symmetric=sym, act_order=act)
        k_pad = qw.padded_shape[0]
        full = np.asarray(nybble.packing.get_layout(qw.layout).unpack(np.asarray(qw.codes), k_pad))
        assert np.all(full[k:] == 0) and np.all(full[:, n:] == 0)  # padding holds code 0
        assert np.all(np.asarray(qw.scales, np.float32)[:, n:] == 0)
        deq = np.asarray(nybble.dequantize(qw))
        assert np.isfinite(deq).all()
        if sym:  # the dead input holds weight 0: code 0, exactly 0
            np.testing.assert_array_equal(deq[5], 0)
        else:  # weight 0 takes the nearest code against its group's parameters (before the refit,
            # which keeps the codes): -o / s rounded, within half a step of 0
            plain = gptq(w, inputs=x, group_size=64, symmetric=sym, act_order=act, refit_scales=False)
            np.testing.assert_array_equal(np.asarray(plain.codes), np.asarray(qw.codes))
            s = np.asarray(plain.scales, np.float64)[0, :n]
            o = np.asarray(plain.offsets, np.float64)[0, :n]
            np.testing.assert_array_equal(reference_codes(plain)[5, :n], np.clip(np.round(-o / s), -8, 7))
            assert (np.abs(np.asarray(nybble.dequantize(plain))[5]) <= 0.5 * s * (1 + 2**-7)).all()
        y = nybble.matmul(jnp.asarray(x), qw)  # a normal QuantizedWeight every implementation runs
        np.testing.assert_allclose(np.asarray(y), x @ deq, rtol=1e-2, atol=1e-2)


def test_hessian_accumulation_and_jit():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 10, 64)).astype(np.float32)
    acc = HessianAccumulator(64)
    for batch in x:
        acc.add(batch)
    xf = x.reshape(-1, 64).astype(np.float64)
    np.testing.assert_allclose(np.asarray(acc.hessian), 2 * xf.T @ xf / 60, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(hessian_from_inputs(list(x))), np.asarray(acc.hessian), rtol=1e-6)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    h = acc.hessian
    eager = gptq(w, h, group_size=32)
    jitted = jax.jit(lambda w, h: gptq(w, h, group_size=32))(jnp.asarray(w), h)
    np.testing.assert_array_equal(np.asarray(eager.codes), np.asarray(jitted.codes))
    assert jitted.scales.dtype == ml_dtypes.bfloat16


def test_errors():
    w = np.zeros((64, 64), np.float32)
    with pytest.raises(ValueError, match="exactly one"):
        gptq(w)
    with pytest.raises(ValueError, match=r"Hessian must be \(64, 64\)"):
        gptq(w, np.eye(32))
    with pytest.raises(ValueError, match="static_groups=True"):
        gptq(w, np.eye(64), act_order=True, static_groups=False)
    with pytest.raises(ValueError, match="group_size"):
        gptq(w, np.eye(64), group_size=100)
    with pytest.raises(ValueError, match="not positive definite"):
        gptq(w, -np.eye(64), group_size=32)
