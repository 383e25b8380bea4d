"""Least-squares group parameters (nybble.quant.refit) against a float64 reference, and inside GPTQ."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gptq import codes_of, correlated_inputs

import nybble
from nybble.quant.gptq import gptq, hessian_from_inputs
from nybble.quant.refit import refit_group_params


def reference_refit(codes, w, h, group_size, symmetric, damp=0.01):
    """Per column, the float64 least-squares parameters: one dense (K, P) design matrix, one lstsq."""
    codes = np.asarray(codes, np.float64)
    w = np.asarray(w, np.float64)
    h = np.array(h, np.float64)
    k, n = w.shape
    diag = np.diag(h).copy()
    dead = diag == 0
    h += np.diag(dead * 1.0 + damp * np.mean(np.where(dead, 1.0, diag)))
    chol = np.linalg.cholesky(h)  # |X e|^2 = e^T H e = |L^T e|^2
    groups = -(-k // group_size)
    owner = np.arange(k) // group_size
    scales, offsets = np.zeros((groups, n)), np.zeros((groups, n))
    for col in range(n):
        design = [np.where(owner == j, codes[:k, col], 0.0) for j in range(groups)]
        if not symmetric:
            design += [(owner == j).astype(np.float64) for j in range(groups)]
        sol = np.linalg.lstsq(chol.T @ np.stack(design, 1), chol.T @ w[:, col], rcond=None)[0]
        scales[:, col] = sol[:groups]
        if not symmetric:
            offsets[:, col] = sol[groups:]
    return scales, offsets


def output_error(x, w, qw):
    return np.linalg.norm(x.astype(np.float64) @ (np.asarray(nybble.dequantize(qw), np.float64) - w))


@pytest.mark.parametrize(
    ("k", "n", "g", "sym"), [(128, 64, 32, True), (192, 40, 64, False), (200, 72, 64, True)]
)
def test_matches_float64_reference(k, n, g, sym):
    rng = np.random.default_rng(k * n + g)
    x = correlated_inputs(rng, 512, k)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    h = hessian_from_inputs(x)
    qw = nybble.quantize(w, group_size=g, symmetric=sym, scale_dtype=jnp.float32)
    refit = refit_group_params(qw, w, h)
    ref_s, ref_o = reference_refit(codes_of(qw), w, np.asarray(h), g, sym)
    got_s = np.asarray(refit.scales, np.float64)[: ref_s.shape[0], :n]
    np.testing.assert_allclose(got_s, ref_s, rtol=2e-3, atol=1e-5 * np.abs(ref_s).max())
    if not sym:
        got_o = np.asarray(refit.offsets, np.float64)[: ref_o.shape[0], :n]
        np.testing.assert_allclose(got_o, ref_o, rtol=2e-3, atol=1e-4 * np.abs(ref_o).max())
    np.testing.assert_array_equal(np.asarray(refit.codes), np.asarray(qw.codes))  # codes untouched
    assert np.all(np.asarray(refit.scales, np.float32)[:, n:] == 0)  # padding columns stay zero
    assert output_error(x, w, refit) < output_error(x, w, qw)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    k=st.integers(16, 160),
    n=st.integers(1, 48),
    g=st.sampled_from([16, 32, 64, None]),
    sym=st.booleans(),
)
def test_never_worse_than_rtn(seed, k, n, g, sym):
    """The refit minimizes the calibration output error for the given codes: never above RTN's."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((96, k)).astype(np.float32) * rng.uniform(0.1, 2.0, k).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    qw = nybble.quantize(w, group_size=g, symmetric=sym, scale_dtype=jnp.float32)
    refit = refit_group_params(qw, w, hessian_from_inputs(x), damp=0.0)
    assert np.isfinite(np.asarray(nybble.dequantize(refit))).all()
    assert output_error(x, w, refit) <= output_error(x, w, qw) * (1 + 1e-4) + 1e-6


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_refit_keeps_codes_and_lowers_error(sym):
    rng = np.random.default_rng(11)
    k, n = 256, 96
    x = correlated_inputs(rng, 1024, k)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    plain = gptq(w, inputs=x, group_size=64, symmetric=sym, act_order=True, refit_scales=False)
    refit = gptq(w, inputs=x, group_size=64, symmetric=sym, act_order=True)  # the default
    np.testing.assert_array_equal(np.asarray(refit.codes), np.asarray(plain.codes))
    assert not np.array_equal(np.asarray(refit.scales), np.asarray(plain.scales))
    assert output_error(x, w, refit) < output_error(x, w, plain)


def test_errors():
    w = np.ones((64, 32), np.float32)
    qw = nybble.quantize(w, group_size=32)
    with pytest.raises(ValueError, match=r"w must have the weight's shape \(64, 32\)"):
        refit_group_params(qw, w.T, np.eye(64))
    with pytest.raises(ValueError, match=r"hessian must be \(64, 64\)"):
        refit_group_params(qw, w, np.eye(32))
    with pytest.raises(ValueError, match="damp must be >= 0"):
        refit_group_params(qw, w, np.eye(64), damp=-1.0)
