"""Round-to-nearest quantization: error bounds, padding, footprint, pytree behaviour, refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import nybble
from nybble.quant.qweight import expand_groups

GROUPS = [None, 16, 32, 64, 128, 256]


def _step_and_bound(qw, w):
    """Per-element quantization step (the stored scale) and the allowed error, as (K, N) arrays."""
    k, n = qw.shape
    k_pad, _ = qw.padded_shape
    s = np.asarray(expand_groups(qw.scales, qw.block_k, k_pad))[:k, :n]
    bound = 0.5 * s
    if qw.offsets is not None:  # plus the rounding of the stored offset
        b = np.abs(np.asarray(expand_groups(qw.offsets, qw.block_k, k_pad))[:k, :n])
        info = jnp.finfo(qw.scales.dtype)  # relative rounding, or the subnormal spacing near zero
        bound = bound + b * float(info.eps) + float(info.smallest_subnormal)
    return s, bound * (1 + 1e-6) + 1e-30


@st.composite
def weights(draw):
    k = draw(st.integers(1, 200))
    n = draw(st.integers(1, 70))
    scale = draw(st.sampled_from([1e-3, 1.0, 300.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) * scale
    if draw(st.booleans()):  # some all-zero groups and columns
        w[: k // 2, : n // 3] = 0
    return w


@settings(max_examples=60, deadline=None)
@given(weights(), st.sampled_from(GROUPS), st.booleans(),
       st.sampled_from([jnp.bfloat16, jnp.float16, jnp.float32]))
def test_every_element_within_half_a_step(w, group_size, symmetric, scale_dtype):
    qw = nybble.quantize(w, group_size=group_size, symmetric=symmetric, scale_dtype=scale_dtype)
    deq = np.asarray(nybble.dequantize(qw))
    assert deq.shape == w.shape
    _, bound = _step_and_bound(qw, w)
    err = np.abs(deq - w)
    assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize("symmetric", [True, False])
def test_all_zero_group_is_exact_zero(symmetric):
    w = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    w[128:, :] = 0
    deq = np.asarray(nybble.dequantize(nybble.quantize(w, group_size=128, symmetric=symmetric)))
    assert np.isfinite(deq).all()
    np.testing.assert_array_equal(deq[128:], 0)


def test_codes_are_exact_for_representable_weights():
    """Small integers times a power-of-two scale quantize and dequantize exactly."""
    rng = np.random.default_rng(1)
    q = rng.integers(-7, 8, size=(192, 96))
    q[[0, 64, 128], :] = 7  # pin each group's max to 7 (its min is >= -7) so the scale is exactly 0.25
    w = (q * 0.25).astype(np.float32)
    qw = nybble.quantize(w, group_size=64)
    np.testing.assert_array_equal(np.asarray(qw.scales, np.float32)[:, :96], 0.25)
    np.testing.assert_array_equal(np.asarray(qw.scales, np.float32)[:, 96:], 0)  # padded columns
    np.testing.assert_array_equal(np.asarray(nybble.dequantize(qw)), w)


@pytest.mark.parametrize(("k", "n", "group", "padded", "groups"), [
    (576, 1536, 128, (576, 1536), 5),
    (10944, 7392, 128, (10944, 7424), 86),
    (100, 70, None, (128, 128), 1),
    (4096, 14336, 32, (4096, 14336), 128),
])
def test_padding_keeps_logical_shape(k, n, group, padded, groups):
    w = jax.ShapeDtypeStruct((k, n), jnp.float32)
    qw = jax.eval_shape(lambda w: nybble.quantize(w, group_size=group), w)
    assert qw.shape == (k, n) and qw.padded_shape == padded and qw.num_groups == groups
    # The default layout, wgmma_int4: uint32 words, one row per band of 8 output rows.
    assert qw.codes.shape == (padded[1] // 8, padded[0]) and qw.scales.shape == (groups, padded[1])


@pytest.mark.parametrize(("k", "n", "group", "symmetric", "bits"), [
    (4096, 4096, 128, True, 4.125),
    (4096, 14336, 128, False, 4.25),
    (576, 1536, 64, True, 4.25),
    (14336, 4096, 32, False, 5.0),
])
def test_footprint_on_real_layer_shapes(k, n, group, symmetric, bits):
    qw = nybble.quantize(np.ones((k, n), np.float32), group_size=group, symmetric=symmetric)
    assert qw.bits_per_weight == pytest.approx(bits, rel=0.03)
    assert qw.nbytes == sum(a.nbytes for a in jax.tree.leaves(qw))


def test_pytree_jit_vmap_and_repr():
    w = np.random.default_rng(2).standard_normal((128, 64)).astype(np.float32)
    qw = nybble.quantize(w, group_size=64, symmetric=False)
    leaves, treedef = jax.tree.flatten(qw)
    assert len(leaves) == 3
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert isinstance(rebuilt, nybble.QuantizedWeight) and rebuilt.shape == qw.shape
    deq_jit = jax.jit(nybble.dequantize)(qw)
    np.testing.assert_array_equal(np.asarray(deq_jit), np.asarray(nybble.dequantize(qw)))
    q_jit = jax.jit(lambda w: nybble.quantize(w, group_size=64, symmetric=False))(w)
    np.testing.assert_array_equal(np.asarray(q_jit.codes), np.asarray(qw.codes))
    stacked = jax.vmap(lambda w: nybble.quantize(w, group_size=64))(np.stack([w, 2 * w]))
    assert stacked.codes.shape == (2, 64 // 8, 128)
    deq2 = jax.vmap(nybble.dequantize)(stacked)
    np.testing.assert_allclose(np.asarray(deq2[1]), 2 * np.asarray(deq2[0]), rtol=1e-2, atol=1e-2)
    text = repr(qw)
    assert "shape=(128, 64)" in text and "g64" in text and "asymmetric" in text and "bits/weight" in text


@pytest.mark.parametrize(("w", "kwargs", "error", "match"), [
    (np.zeros((4, 4, 4), np.float32), {}, ValueError, r"2-D weight of shape \(K, N\)"),
    (np.zeros((4, 4), np.int32), {}, ValueError, "floating-point weight, got dtype int32"),
    (np.zeros((64, 64), np.float32), {"group_size": 48}, ValueError, "power of two >= 16"),
    (np.zeros((64, 64), np.float32), {"group_size": 8}, ValueError, "power of two >= 16"),
    (np.zeros((64, 64), np.float32), {"scale_dtype": jnp.int8}, ValueError, "scale_dtype"),
    (np.zeros((64, 64), np.float32), {"layout": "nope"}, ValueError, "unknown weight layout"),
    ([[1.0]], {}, TypeError, r"expected a \(K, N\) array"),
])
def test_refusals(w, kwargs, error, match):
    with pytest.raises(error, match=match):
        nybble.quantize(w, **kwargs)


def test_nan_and_inf_are_located():
    w = np.ones((64, 32), np.float32)
    w[3, 5] = np.nan
    w[10, 1] = np.inf
    with pytest.raises(ValueError, match=r"2 NaN/Inf value\(s\); first at \(k, n\) = \(3, 5\)"):
        nybble.quantize(w)


def test_dequantize_type_error():
    with pytest.raises(TypeError, match="expects a QuantizedWeight"):
        nybble.dequantize(np.zeros((2, 2)))


@settings(max_examples=20, deadline=None)
@given(hnp.arrays(np.float32, (64, 8), elements=st.floats(-1e3, 1e3, width=32)))
def test_asymmetric_covers_shifted_ranges(w):
    w = w + 500.0  # groups far from zero: the offset carries them
    qw = nybble.quantize(w, group_size=64, symmetric=False, scale_dtype=jnp.float32)
    _, bound = _step_and_bound(qw, w)
    assert (np.abs(np.asarray(nybble.dequantize(qw)) - w) <= bound + 1e-3).all()


@pytest.mark.parametrize("symmetric", [True, False])
def test_groups_made_only_of_padding_stay_finite(symmetric):
    """K = 96 at g32 pads to 128 rows: the last group has no real rows and must hold zeros, not NaN."""
    w = np.random.default_rng(3).standard_normal((96, 16)).astype(np.float32)
    qw = nybble.quantize(w, group_size=32, symmetric=symmetric)
    assert qw.num_groups == 4
    for a in (qw.scales, qw.offsets):
        if a is not None:
            assert np.isfinite(np.asarray(a, np.float32)).all()
            np.testing.assert_array_equal(np.asarray(a, np.float32)[3], 0)
    y = nybble.matmul(jnp.ones((2, 96), jnp.float32), qw, implementation="xla")
    np.testing.assert_allclose(np.asarray(y), np.ones((2, 96)) @ np.asarray(nybble.dequantize(qw)), rtol=1e-5)


def test_symmetric_uses_code_minus_8():
    """A group whose extreme is negative maps it to -8: the step is max|w| / 8, not / 7."""
    w = np.zeros((64, 2), np.float32)
    w[:, 0] = np.linspace(-8.0, 4.0, 64)  # extreme negative: step 1, min -> -8
    w[:, 1] = np.linspace(-3.0, 7.0, 64)  # extreme positive: step 1, max -> 7
    qw = nybble.quantize(w, group_size=64, scale_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(qw.scales)[0, :2], [1.0, 1.0])
    codes = np.asarray(nybble.packing.get_layout(qw.layout).unpack(np.asarray(qw.codes), 64)).T
    assert codes[0].min() == -8 and codes[0].max() == 4 and codes[1].min() == -3 and codes[1].max() == 7


@settings(max_examples=15, deadline=None)
@given(weights(), st.sampled_from([32, 128, None]), st.booleans())
def test_clip_search_never_increases_group_error(w, group_size, symmetric):
    """The search includes the unclipped range, so each column's error can only shrink."""
    plain = np.asarray(nybble.dequantize(nybble.quantize(w, group_size=group_size, symmetric=symmetric)))
    searched = nybble.quantize(w, group_size=group_size, symmetric=symmetric, clip_search=True)
    err_plain = ((plain - w) ** 2).sum(0)
    err_searched = ((np.asarray(nybble.dequantize(searched)) - w) ** 2).sum(0)
    assert (err_searched <= err_plain * (1 + 1e-5) + 1e-12).all()


def test_clip_search_clips_an_outlier():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((128, 64)).astype(np.float32)
    w[3, :] = 12.0  # one outlier per column
    plain = nybble.quantize(w, group_size=128)
    searched = nybble.quantize(w, group_size=128, clip_search=True)
    assert (np.asarray(searched.scales, np.float32)[0] < np.asarray(plain.scales, np.float32)[0]).all()
    err = lambda qw: float(((np.asarray(nybble.dequantize(qw)) - w) ** 2).sum())
    assert err(searched) < 0.9 * err(plain)
