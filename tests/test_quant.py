"""Round-to-nearest quantization: error bounds, padding, footprint, pytree behaviour, refusals."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import nybble
from nybble.kernels.ops.matmul.reference import reference_codes, reference_dequantize
from nybble.quant.qweight import expand_groups

GROUPS = [None, 16, 32, 64, 128, 256]


def _rule_params(w, group_size, symmetric):
    """Each group's scale (and offset) by the documented rule, in float64 from ``w`` alone: symmetric
    ``max(-min / 8, max / 7)`` (min and max taken with 0), asymmetric ``(max - min) / 15`` and offset
    ``min + 8 * scale``; per column (None) one group over all of K. Shapes (real groups, N)."""
    w = np.asarray(w, np.float64)
    k = w.shape[0]
    g = k if group_size is None else group_size
    blocks = [w[i : i + g] for i in range(0, k, g)]
    lo = np.stack([b.min(0) for b in blocks])
    hi = np.stack([b.max(0) for b in blocks])
    if symmetric:
        return np.maximum(np.maximum(-lo, 0) / 8, np.maximum(hi, 0) / 7), None
    s = (hi - lo) / 15
    return s, lo + 8 * s


def _check_params_and_bound(qw, w):
    """The stored scales (and offsets) follow the rule within the rounding of the scale dtype, and the
    allowed error per element: half a step of the rule's scale (plus the rounding of the offset)."""
    k, n = qw.shape
    s_rule, o_rule = _rule_params(w, qw.group_size, qw.symmetric)
    groups = s_rule.shape[0]
    info = jnp.finfo(qw.scales.dtype)
    u, tiny = float(info.eps) / 2, float(info.smallest_subnormal)
    stored = np.asarray(qw.scales, np.float64)
    # Groups and columns made only of padding hold 0.
    assert (stored[groups:] == 0).all() and (stored[:, n:] == 0).all()
    stored = stored[:groups, :n]
    # Computed in float32 (2^-22: a few float32 roundings), rounded to nearest; asymmetric scales may then
    # be rounded up one ulp (2u) so that 15 steps cover the range.
    s_hi = s_rule * (1 + 2 * u + 2**-22) + tiny
    assert (stored <= s_hi).all(), float((stored / np.maximum(s_rule, 1e-300)).max())
    assert (stored >= s_rule * (1 - u - 2**-22) - tiny).all(), float((stored - s_rule).min())
    rows = np.minimum(np.arange(k) // (k if qw.group_size is None else qw.group_size), groups - 1)
    bound = 0.5 * s_hi[rows]
    if o_rule is not None:
        o_stored = np.asarray(qw.offsets, np.float64)[:groups, :n]
        o_want = o_rule + 8 * (stored - s_rule)  # min + 8 * (the stored scale)
        # One float32 add of min and 8 * scale (its error relative to their sizes), one rounding.
        o_err = u * np.abs(o_want) + 2**-23 * (np.abs(o_rule - 8 * s_rule) + 8 * stored) + tiny
        assert (np.abs(o_stored - o_want) <= o_err).all()
        bound = bound + 2 * o_err[rows]
    return bound * (1 + 1e-6) + 1e-30


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


@settings(max_examples=15, deadline=None)
@given(weights(), st.sampled_from(GROUPS), st.booleans(),
       st.sampled_from([jnp.bfloat16, jnp.float16, jnp.float32]))
def test_every_element_within_half_a_step(w, group_size, symmetric, scale_dtype):
    qw = nybble.quantize(w, group_size=group_size, symmetric=symmetric, scale_dtype=scale_dtype)
    deq = np.asarray(nybble.dequantize(qw))
    assert deq.shape == w.shape
    bound = _check_params_and_bound(qw, w)
    err = np.abs(deq - w)
    assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize("symmetric", [True, False])
def test_all_zero_group_is_exact_zero(symmetric):
    w = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    w[128:, :] = 0
    deq = np.asarray(nybble.dequantize(nybble.quantize(w, group_size=128, symmetric=symmetric)))
    assert np.isfinite(deq).all()
    np.testing.assert_array_equal(deq[128:], 0)


@pytest.mark.parametrize("symmetric", [True, False])
def test_zero_groups_and_padded_rows_hold_code_0(symmetric):
    """An all-zero group (scale 0) and the rows padding K up to the layout's granule hold code 0."""
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((100, 64)) + 0.5).astype(np.float32)  # K = 100 pads to 128
    w[:32, :16] = 0  # one whole group of zeros in 16 columns
    qw = nybble.quantize(w, group_size=32, symmetric=symmetric)
    codes = reference_codes(qw)
    assert codes.shape == (128, 64)
    np.testing.assert_array_equal(np.asarray(qw.scales, np.float32)[0, :16], 0)
    np.testing.assert_array_equal(codes[:32, :16], 0)
    np.testing.assert_array_equal(codes[100:], 0)
    assert (codes[32:100, :64] != 0).mean() > 0.8  # real groups do use nonzero codes


@pytest.mark.parametrize("scale_dtype", [jnp.bfloat16, jnp.float16])
def test_asymmetric_scale_is_rounded_up_to_cover_the_range(scale_dtype):
    """Asymmetric: where the scale dtype rounds (max - min) / 15 down, the stored scale is one ulp up,
    so 15 steps of it span the group's range (no code needs clipping at the top)."""
    w = np.random.default_rng(5).standard_normal((512, 256)).astype(np.float32)
    qw = nybble.quantize(w, group_size=64, symmetric=False, scale_dtype=scale_dtype)
    wg = w.reshape(8, 64, 256)
    span = wg.max(1) - wg.min(1)  # float32, as quantize computes it
    stored = np.asarray(qw.scales, np.float32)[:, :256]
    nearest = (span / 15).astype(scale_dtype).astype(np.float32)
    assert (nearest * 15 < span).mean() > 0.2  # the case arises often on random data
    assert (stored * 15 >= span).all()
    # Rounded up only where needed: elsewhere it is the nearest value.
    fits = nearest * 15 >= span
    np.testing.assert_array_equal(stored[fits], nearest[fits])


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


@pytest.mark.parametrize(("k", "n", "group", "symmetric", "scale_dtype", "nbytes"), [
    # codes N_pad * K_pad / 2 + scales (and offsets) ceil(K_pad / G) * N_pad * itemsize, by hand
    (4096, 4096, 128, True, jnp.bfloat16, 4096 * 2048 + 32 * 4096 * 2),  # 4.125 bits/weight
    (4096, 14336, 128, False, jnp.bfloat16, 14336 * 2048 + 2 * 32 * 14336 * 2),  # 4.25
    (576, 1536, 64, True, jnp.bfloat16, 1536 * 288 + 9 * 1536 * 2),  # 4.25
    (14336, 4096, 32, False, jnp.bfloat16, 4096 * 7168 + 2 * 448 * 4096 * 2),  # 5.0
    (100, 70, None, True, jnp.float32, 128 * 64 + 1 * 128 * 4),  # padded to 128 x 128: 9.65
    (576, 200, 256, False, jnp.float16, 256 * 288 + 2 * 3 * 256 * 2),  # partial last group
])
def test_footprint_by_hand(k, n, group, symmetric, scale_dtype, nbytes):
    w = jax.ShapeDtypeStruct((k, n), jnp.float32)
    qw = jax.eval_shape(
        lambda w: nybble.quantize(w, group_size=group, symmetric=symmetric, scale_dtype=scale_dtype), w
    )
    assert qw.nbytes == nbytes
    assert qw.bits_per_weight == pytest.approx(8 * nbytes / (k * n), rel=1e-12)


def test_bits_per_weight_of_the_common_formats():
    assert nybble.quantize(np.ones((4096, 4096), np.float32)).bits_per_weight == 4.125
    qw = nybble.quantize(np.ones((14336, 4096), np.float32), group_size=32, symmetric=False)
    assert qw.bits_per_weight == 5.0


def test_pytree_jit_vmap_and_repr():
    w = np.random.default_rng(2).standard_normal((128, 64)).astype(np.float32)
    qw = nybble.quantize(w, group_size=64, symmetric=False)
    leaves, treedef = jax.tree.flatten(qw)
    assert len(leaves) == 3
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert isinstance(rebuilt, nybble.QuantizedWeight) and rebuilt.shape == qw.shape
    # Under jit, against the float64 reference (computed from the stored arrays with numpy alone).
    deq_jit = np.asarray(jax.jit(nybble.dequantize)(qw), np.float64)
    np.testing.assert_allclose(deq_jit, reference_dequantize(qw), rtol=2**-23, atol=1e-7)
    # quantize under jit, on a weight whose codes, scales and offsets are known by hand: every group
    # spans codes -8..7 with step 1/4 and offset 1/2 (w = q / 4 + 1/2).
    rng = np.random.default_rng(3)
    q = rng.integers(-8, 8, (128, 64))
    q[[0, 64]], q[[1, 65]] = -8, 7
    exact = (q / 4 + 0.5).astype(np.float32)
    q_jit = jax.jit(lambda w: nybble.quantize(w, group_size=64, symmetric=False))(exact)
    np.testing.assert_array_equal(np.asarray(q_jit.scales, np.float32), 0.25)
    np.testing.assert_array_equal(np.asarray(q_jit.offsets, np.float32), 0.5)
    np.testing.assert_array_equal(reference_codes(q_jit)[:, :64], q)
    np.testing.assert_array_equal(np.asarray(jax.jit(nybble.dequantize)(q_jit)), exact)
    # vmap: 2w has the same codes and twice the scales (scaling by 2 is exact throughout).
    stacked = jax.vmap(lambda w: nybble.quantize(w, group_size=64))(np.stack([w, 2 * w]))
    assert stacked.codes.shape == (2, 64 // 8, 128)
    np.testing.assert_array_equal(np.asarray(stacked.codes[1]), np.asarray(stacked.codes[0]))
    np.testing.assert_array_equal(
        np.asarray(stacked.scales[1], np.float32), 2 * np.asarray(stacked.scales[0], np.float32)
    )
    one = nybble.quantize(w, group_size=64)
    np.testing.assert_array_equal(np.asarray(stacked.codes[0]), np.asarray(one.codes))
    deq2 = jax.vmap(nybble.dequantize)(stacked)
    np.testing.assert_array_equal(np.asarray(deq2[0], np.float64), reference_dequantize(one))
    np.testing.assert_array_equal(np.asarray(deq2[1]), 2 * np.asarray(deq2[0]))
    text = repr(qw)
    assert "shape=(128, 64)" in text and "g64" in text and "asymmetric" in text and "bits/weight" in text
    assert "codes=uint32[8, 128], scales=bfloat16[2, 64], offsets=bfloat16[2, 64]" in text
    assert "offsets" not in repr(nybble.quantize(w, group_size=64))
    with pytest.raises(dataclasses.FrozenInstanceError):
        qw.group_size = 32  # static metadata: a weight never changes under a traced function


def test_expand_groups_by_hand():
    """Each group row repeated G times along K (axis 0 by default), cut to K_pad: a partial last group."""
    per_group = jnp.asarray([[1.0, 2.0], [3.0, 4.0]], jnp.bfloat16)
    np.testing.assert_array_equal(expand_groups(per_group, 2, 3), [[1, 2], [1, 2], [3, 4]])
    assert expand_groups(per_group, 2, 3).dtype == jnp.float32
    np.testing.assert_array_equal(expand_groups(per_group.T, 2, 3, axis=1), [[1, 1, 3], [2, 2, 4]])


@pytest.mark.parametrize(("w", "kwargs", "error", "match"), [
    (np.zeros((2, 4, 4, 4), np.float32), {}, ValueError, r"2-D weight of shape \(K, N\)"),
    (np.zeros((4, 4), np.int32), {}, ValueError, "floating-point weight, got dtype int32"),
    (np.zeros((64, 64), np.float32), {"group_size": 48}, ValueError, "power of two >= 16"),
    (np.zeros((64, 64), np.float32), {"group_size": 8}, ValueError, "power of two >= 16"),
    (np.zeros((64, 64), np.float32), {"scale_dtype": jnp.int8}, ValueError, "scale_dtype"),
    (np.zeros((64, 64), np.float32), {"layout": "nope"}, ValueError, "unknown weight layout"),
    ([[1.0]], {}, TypeError, r"expected a \(K, N\) array"),
    (types.SimpleNamespace(shape=(2, 2)), {}, TypeError, r"expected a \(K, N\) array, got SimpleNamespace"),
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
    bound = _check_params_and_bound(qw, w)
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


def _grid_points_for(factor, symmetric, g, rng):
    """One column of ``g`` weights whose best shrink is ``factor``: the range's end(s) as outliers, every
    other weight exactly on the code grid the range shrunk by ``factor`` gives (no rounding error there)."""
    hi = rng.uniform(0.5, 2.0)
    if symmetric:  # the step is hi / 7 (the negative side stays within 8 steps)
        col = factor * hi / 7 * rng.integers(-7, 8, g).astype(np.float64)
        col[0] = hi
    else:
        lo = -hi * rng.uniform(0.5, 1.0)
        col = factor * (lo + rng.integers(0, 16, g) * (hi - lo) / 15)
        col[:2] = lo, hi
    return rng.permutation(col)


@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_search_picks_the_best_factor_of_the_documented_grid(symmetric):
    """Per group, the stored scale is the documented rule's scale times the factor (of 1.0, 0.95, ..., 0.7)
    whose codes give the least squared error, searched here in float64; columns are built so that every
    factor of the grid is the best for some, so a wrong factor in the grid cannot go unseen."""
    grid = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
    rng = np.random.default_rng(11)
    g, n = 256, 7 * 24
    w64 = np.stack([_grid_points_for(grid[j % 7], symmetric, g, rng) for j in range(n)], axis=1)
    w = w64.astype(np.float32)
    w64 = w.astype(np.float64)
    qw = nybble.quantize(w, group_size=g, symmetric=symmetric, scale_dtype=jnp.float32, clip_search=True)
    stored = np.asarray(qw.scales, np.float64)[0, :n]
    errors, scales = [], []
    for f in grid:
        s, o = _rule_params(w64 * f, g, symmetric)  # the rule on the range shrunk by f
        s = s[0].astype(np.float32).astype(np.float64)
        b = 0.0 if o is None else o[0].astype(np.float32).astype(np.float64)
        q = np.clip(np.round((w64 - b) / s), -8, 7)
        errors.append(((q * s + b - w64) ** 2).sum(0))
        scales.append(s)
    errors, scales = np.stack(errors), np.stack(scales)
    best = errors.argmin(0)
    np.testing.assert_array_equal(best, np.arange(n) % 7)  # the construction worked: each factor wins
    np.testing.assert_allclose(stored, scales[best, np.arange(n)], rtol=1e-6)


@pytest.mark.parametrize("symmetric", [True, False])
def test_group_params_default_is_the_plain_rule(symmetric):
    """``group_params`` without ``clip_search`` (as AutoRound's start calls it) is the documented rule, with
    no range shrink, even where a shrink would lower the error (an outlier per column)."""
    from nybble.quant.qformat import QuantFormat
    from nybble.quant.rtn import group_params

    rng = np.random.default_rng(12)
    w = rng.standard_normal((64, 32))
    w[5] = 9.0
    scales, offsets = group_params(
        jnp.asarray(w, jnp.float32).reshape(2, 32, 32), jnp.ones((2, 32, 1), bool),
        QuantFormat(symmetric=symmetric, scale_dtype=jnp.float32),
    )
    want_s, want_o = _rule_params(w.astype(np.float32), 32, symmetric)
    np.testing.assert_allclose(np.asarray(scales), want_s, rtol=1e-6)
    if not symmetric:
        np.testing.assert_allclose(np.asarray(offsets), want_o, rtol=1e-5, atol=1e-6)


def test_tree_map_to_dtypes_and_shapes():
    """JAX may put non-arrays in a QuantizedWeight's leaf slots: a dtype (it has ``shape`` but no ``dtype``),
    a shape tuple. The weight's checks run on arrays only, so these round-trip through ``jax.tree.map``."""
    qw = nybble.quantize(np.random.default_rng(13).standard_normal((64, 32)).astype(np.float32))
    dtypes = jax.tree.map(lambda a: a.dtype, qw)
    assert (dtypes.codes, dtypes.scales) == (qw.codes.dtype, qw.scales.dtype)
    shapes = jax.tree.map(lambda a: a.shape, qw)
    assert (shapes.codes, shapes.scales) == (qw.codes.shape, qw.scales.shape)


def test_relayout_stores_the_codes_in_the_asked_layout():
    """Each layout's stored codes by its own packer from the logical codes; same layout: the same object."""
    from nybble.quant.qweight import relayout

    w = np.random.default_rng(14).standard_normal((200, 96)).astype(np.float32)
    qw = nybble.quantize(w, group_size=64)
    codes = np.asarray(reference_codes(qw))
    for name in nybble.packing.LAYOUTS:
        moved = relayout(qw, name)
        assert moved.layout == name
        want = nybble.packing.get_layout(name).pack(jnp.asarray(codes))  # padded (K_pad, N_pad)
        np.testing.assert_array_equal(np.asarray(moved.codes), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(reference_codes(moved)), codes)
    assert relayout(qw, qw.layout) is qw


def test_quantized_weight_refuses_inconsistent_fields():
    """Each field is checked against the others when a QuantizedWeight is built by hand; the message names
    the field, what it got and what fits."""
    qw = nybble.quantize(np.random.default_rng(15).standard_normal((200, 160)).astype(np.float32))
    fields = dict(
        codes=qw.codes, scales=qw.scales, offsets=None, shape=qw.shape, group_size=128, symmetric=True
    )
    nybble.QuantizedWeight(**fields)  # as quantize built it: accepted
    with pytest.raises(ValueError, match=r"shape must be \(K, N\), two positive ints, got \[200, 160\]"):
        nybble.QuantizedWeight(**{**fields, "shape": [200, 160]})  # a list is not hashable: no static field
    for shape in [(200.0, 160), (0, 160), (200, -160)]:
        with pytest.raises(ValueError, match="two positive ints"):
            nybble.QuantizedWeight(**{**fields, "shape": shape})
    # nk_int4 codes may also arrive viewed as int4 (two values a byte: (N_pad, K_pad) instead of K_pad / 2).
    nk = nybble.quant.relayout(qw, "nk_int4")
    as_int4 = nybble.packing.nk_int4_as_int4(nk.codes)
    viewed = nybble.QuantizedWeight(**{**fields, "codes": as_int4, "layout": "nk_int4"})
    assert viewed.codes.shape == (192, 256)  # N_pad != K_pad / 2, so the two axes cannot be confused
    with pytest.raises(ValueError, match=r"codes of shape \(120, 256\) do not fit layout 'nk_int4'"):
        nybble.QuantizedWeight(**{**fields, "codes": as_int4[:120], "layout": "nk_int4"})
    with pytest.raises(ValueError, match=r"codes of shape \(192, 240\) do not fit layout 'nk_int4'"):
        nybble.QuantizedWeight(**{**fields, "codes": as_int4[:, :240], "layout": "nk_int4"})
    with pytest.raises(ValueError, match="stores uint32 codes, got dtype int32"):
        nybble.QuantizedWeight(**{**fields, "codes": qw.codes.astype(jnp.int32)})
    with pytest.raises(ValueError, match=r"at g128: expected \(num_groups, N_pad\) = \(2, 192\)"):
        nybble.QuantizedWeight(**{**fields, "scales": qw.scales[:1]})
    per_column = nybble.quantize(np.ones((200, 160), np.float32), group_size=None)
    with pytest.raises(ValueError, match=r"at per column: expected \(num_groups, N_pad\) = \(1, 192\)"):
        nybble.QuantizedWeight(**{**fields, "scales": per_column.scales[:, :64], "group_size": None})


def test_stacked_weight_dequantizes_and_counts_bits_per_expert():
    """A stack of 2 experts (nybble.quant.stacked): dequantize gives each expert's float64 reference, and
    bits per weight are one expert's, counted by hand (the padding included: K, N = 96, 80 pad to 128)."""
    from nybble.quant.stacked import stack_weights

    rng = np.random.default_rng(38)
    experts = [
        nybble.quantize(rng.standard_normal((96, 80)).astype(np.float32), group_size=32, symmetric=False)
        for _ in range(2)
    ]
    stacked = stack_weights(experts)
    assert np.ndim(stacked.codes) == 3
    deq = np.asarray(nybble.dequantize(stacked), np.float64)
    assert deq.shape == (2, 96, 80)
    for e, one in enumerate(experts):
        np.testing.assert_array_equal(deq[e], reference_dequantize(one))
    # codes 128 x 128 / 2 B, scales and offsets 4 groups x 128 columns x 2 B (bf16), per 96 x 80 weights
    bits = 8 * (128 * 128 // 2 + 2 * 4 * 128 * 2) / (96 * 80)
    assert experts[0].bits_per_weight == bits
    assert stacked.bits_per_weight == bits


def test_integer_zero_point_scales_by_hand():
    """zero_point="integer": a group with min -1, max 20 takes s = bf16(21 / 15) (1.3984375, rounded down
    and kept: only a group whose zero would round to 0 is widened), z = round(1 / s) = 1, offset (8 - 1) s;
    a group of 0..14 takes s = 14 / 14 = 1 (exact: no ulp more), z = 1, offset 7; one of -0.2..1.4 takes
    s = bf16(1.6 / 15), z = 2. The float zero point differs (for contrast)."""
    w = np.zeros((16, 64), np.float32)
    w[:, 0] = np.linspace(-1, 20, 16)
    w[:, 1] = np.arange(16) * 14 / 15
    w[:, 2] = np.linspace(-0.2, 1.4, 16)  # -min = 0.2 > s / 2 = 0.053: no widening either
    qw = nybble.quantize(w, group_size=16, symmetric=False, zero_point="integer")
    s0, s2 = (float(np.float32(jnp.bfloat16(v))) for v in (21 / 15, 1.6 / 15))
    assert s0 == 1.3984375 and s2 == 0.1064453125
    assert round(0.2 / s2) == 2
    np.testing.assert_array_equal(np.asarray(qw.scales[0, :3], np.float64), [s0, 1.0, s2])
    np.testing.assert_array_equal(np.asarray(qw.offsets[0, :3], np.float64), [7 * s0, 7.0, 6 * s2])
    # Column 3 zeros: s = 0 and offset 0. Column 4, 2..16: widened to [0, 16], z would round to 0, so
    # s = 16 / 14 = 1.142857 -> bf16 1.140625, and 14 s < 16 takes one ulp more: 1.1484375, z = 1.
    # Column 5, -3..-1: widened to [-3, 0], s = bf16(0.2) = 0.2001953125, z = round(14.99) = 15.
    w[:, 4], w[:, 5] = np.linspace(2, 16, 16), np.linspace(-3, -1, 16)
    qw = nybble.quantize(w, group_size=16, symmetric=False, zero_point="integer")
    s5 = 0.2001953125
    np.testing.assert_array_equal(np.asarray(qw.scales[0, 3:6], np.float64), [0.0, 1.1484375, s5])
    np.testing.assert_array_equal(np.asarray(qw.offsets[0, 3:6], np.float64), [0.0, 7 * 1.1484375, -7 * s5])
    float_zero = nybble.quantize(w, group_size=16, symmetric=False)
    assert float(np.float32(float_zero.scales[0, 0])) == 1.40625  # 21 / 15 rounded up: [min, max] fits


def test_integer_zero_point_at_half_a_step_widens():
    """A group with min -1, max 29: s = 30 / 15 = 2 and -min = s / 2 exactly, which rounds (half to even)
    to z = 0, as for any -min below s / 2: the range is widened (s = 29 / 14, z = 1), so every value stays
    within half a step of its dequantized value (a z of 1 on s = 2 would leave 29 a whole step out)."""
    w = np.zeros((16, 64), np.float32)
    w[:, 0] = np.concatenate([[-1.0], np.linspace(0, 28, 14), [29.0]])
    qw = nybble.quantize(w, group_size=16, symmetric=False, zero_point="integer", scale_dtype=jnp.float32)
    s = float(qw.scales[0, 0])
    assert s * 14 >= 29 and s - 29 / 14 < 1e-6  # 29 / 14, or an ulp more where 14 s fell short
    assert float(qw.offsets[0, 0]) == np.float32(7 * s)  # z = 1
    err = np.abs(np.asarray(nybble.dequantize(qw), np.float64)[:, 0] - w[:, 0])
    assert err.max() <= s / 2 + 1e-6, err.max()


def test_integer_zero_point_stays_in_one_to_fifteen_on_subnormal_scales():
    """An all-negative group so small that its float16 scale is subnormal (rounded well below -min / 15):
    round(-min / s) would be 17, and z is clipped to 15, what GPTQ v1 can store (z - 1 in 4 bits):
    offset / scale = 8 - z >= -7."""
    w = np.zeros((16, 64), np.float32)
    w[:, 0] = np.linspace(-1e-6, -1e-7, 16)
    qw = nybble.quantize(w, group_size=16, symmetric=False, zero_point="integer", scale_dtype=jnp.float16)
    s, o = float(qw.scales[0, 0]), float(qw.offsets[0, 0])
    assert 0 < s < 1e-6 / 15 and round(1e-6 / s) >= 16  # the subnormal scale: z would pass 15
    assert o / s == -7.0  # z = 15


def test_clip_search_is_invariant_to_power_of_two_scaling():
    """Clip search compares each candidate's squared error over a group's real rows: scaling the weight by
    2^-12 scales every error by 2^-24, exactly, so the same shrink wins in every group (the last group of
    K = 576 at g128 is half padding, which must not enter the errors)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((576, 64)).astype(np.float32) * 0.02
    for symmetric in (True, False):
        a = nybble.quantize(w, group_size=128, symmetric=symmetric, clip_search=True, scale_dtype=jnp.float32)
        b = nybble.quantize(
            w * 2.0**-12, group_size=128, symmetric=symmetric, clip_search=True, scale_dtype=jnp.float32
        )
        np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
        np.testing.assert_array_equal(np.asarray(a.scales) * 2.0**-12, np.asarray(b.scales))
        plain = nybble.quantize(w, group_size=128, symmetric=symmetric, scale_dtype=jnp.float32)
        assert not np.array_equal(np.asarray(a.scales), np.asarray(plain.scales))  # the search did clip


def test_integer_zero_factor_and_stacked_quantize():
    """integer_zero_factor: 8 - z = offset / s, rounded, and 0 where s = 0; a float (E, K, N) stack is
    quantized expert by expert (the same codes and scales as one expert alone)."""
    from nybble.quant.rtn import integer_zero_factor

    scales = jnp.asarray([0.0, 2.0, 0.5], jnp.bfloat16)
    offsets = jnp.asarray([3.0, 14.0, -3.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(integer_zero_factor(scales, offsets)), [0.0, 7.0, -6.0])
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 64, 64)).astype(np.float32)
    stacked = nybble.quantize(w, group_size=32)
    for e in range(2):
        one = nybble.quantize(w[e], group_size=32)
        np.testing.assert_array_equal(np.asarray(stacked.codes[e]), np.asarray(one.codes))
        np.testing.assert_array_equal(np.asarray(stacked.scales[e]), np.asarray(one.scales))


def test_a_params_dict_gets_the_pytree_hint():
    with pytest.raises(TypeError) as refused:
        nybble.quantize({"kernel": np.zeros((64, 64), np.float32)})
    assert "quantize_params" in str(refused.value) and "Flax model" not in str(refused.value)
