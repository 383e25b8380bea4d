"""QuantizedWeight owns its geometry (padded shape, group rows, scale rows), checks itself, packs codes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble.packing import MIN_GROUP_SIZE, check_group_size, group_rows, num_groups
from nybble.quant import QuantizedWeight


@pytest.mark.parametrize(
    ("k", "n", "group_size", "padded", "group", "groups"),
    [
        (576, 1536, 128, (576, 1536), 128, 5),  # 4.5 groups: the last one partial
        (100, 10, 32, (128, 64), 32, 4),
        (1536, 576, None, (1536, 576), 1536, 1),
        (64, 64, 16, (64, 64), 16, 4),
        (65, 1, 256, (128, 64), 256, 1),  # one partial group
    ],
)
@pytest.mark.parametrize("layout", ["wgmma_int4", "nk_int4"])
def test_geometry_by_hand(k, n, group_size, padded, group, groups, layout):
    qw = nybble.quantize(np.ones((k, n), np.float32), group_size=group_size, layout=layout)
    assert (qw.padded_shape, qw.group, qw.num_groups) == (padded, group, groups)
    stored = {
        "wgmma_int4": ((padded[1] // 8, padded[0]), np.uint32),
        "nk_int4": ((padded[1], padded[0] // 2), np.uint8),
    }
    assert qw.scales.shape == (groups, padded[1]) and (qw.codes.shape, qw.codes.dtype) == stored[layout]
    assert group_rows(padded[0], group_size) == group and num_groups(padded[0], group_size) == groups


def test_group_size_rule():
    for ok in (None, 16, 32, 64, 128, 4096, np.int64(64)):
        check_group_size(ok)
    for bad in (0, 8, MIN_GROUP_SIZE - 1, 24, 100, -16, 64.0, "64"):
        with pytest.raises(ValueError, match="power of two >= 16"):
            check_group_size(bad)


def _random_codes(k_pad, n_pad, seed=0):
    return np.random.default_rng(seed).integers(-8, 8, (k_pad, n_pad)).astype(np.int8)


@pytest.mark.parametrize("layout", ["wgmma_int4", "nk_int4"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_from_codes_packs_pads_and_round_trips(symmetric, layout):
    """Logical (K, N) codes in, padded and packed; dequantize gives q * s + o exactly (small integers)."""
    k, n, g = 100, 70, 32  # padded to (128, 128), 4 groups
    rng = np.random.default_rng(1)
    q = rng.integers(-8, 8, (k, n)).astype(np.int8)
    s = rng.integers(1, 5, (-(-k // g), n)).astype(np.float32) / 4
    o = None if symmetric else rng.integers(-3, 4, s.shape).astype(np.float32) / 2
    qw = QuantizedWeight.from_codes(q, s, o, shape=(k, n), group_size=g, layout=layout)
    assert qw.symmetric is symmetric and qw.padded_shape == (128, 128) and qw.num_groups == 4
    assert (
        isinstance(qw.codes, jax.Array)
        and qw.codes.dtype == {"wgmma_int4": np.uint32, "nk_int4": np.uint8}[layout]
    )
    rows = np.arange(k) // g
    want = q * s[rows] + (0 if o is None else o[rows])
    np.testing.assert_array_equal(np.asarray(nybble.dequantize(qw)), want)
    logical = np.asarray(qw.logical_codes())
    np.testing.assert_array_equal(logical[:k, :n], q)
    assert not logical[k:].any() and not logical[:, n:].any()  # padding holds code 0


def test_from_codes_under_jit_matches_eager():
    k, n = 128, 64
    q = jnp.asarray(_random_codes(k, n))
    s = jnp.full((1, n), 0.5, jnp.bfloat16)
    build = lambda q, s: QuantizedWeight.from_codes(q, s, shape=(k, n), group_size=None)
    a, b = build(q, s), jax.jit(build)(q, s)
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    assert a.group == b.group == k


def _weight(**change):
    qw = nybble.quantize(
        np.random.default_rng(0).normal(size=(200, 96)).astype(np.float32), group_size=64, layout="nk_int4"
    )
    return dataclasses.replace(qw, **change)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(group_size=48), "power of two"),
        (dict(group_size=8), "power of two"),
        (dict(layout="kn_int8"), "unknown weight layout 'kn_int8'"),
        (dict(shape=(200,)), r"shape must be \(K, N\)"),
        (dict(shape=(0, 96)), r"shape must be \(K, N\)"),
        (dict(shape=(300, 96)), r"codes of shape \(128, 128\) do not fit"),
        (dict(symmetric=False), "offsets are None exactly when symmetric"),
        (dict(codes=jnp.zeros((128, 128), jnp.int8)), "stores uint8 codes, got dtype int8"),
        (dict(layout="wgmma_int4"), r"stores uint32 codes, got dtype uint8"),
        (dict(scales=jnp.zeros((3, 128), jnp.bfloat16)), r"expected \(num_groups, N_pad\) = \(4, 128\)"),
        (dict(scales=jnp.zeros((4, 128), jnp.int32)), "scales must be one of"),
        (dict(group_size=128), r"expected \(num_groups, N_pad\) = \(2, 128\)"),
    ],
)
def test_construction_refuses_inconsistent_weights(change, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _weight(**change)


def test_offsets_must_match_scales():
    qw = nybble.quantize(np.ones((64, 64), np.float32), group_size=32, symmetric=False)
    with pytest.raises(ValueError, match="offsets of shape"):
        dataclasses.replace(qw, offsets=qw.offsets[:1])


def test_the_int4_view_is_the_same_weight():
    """The codes' bytes viewed as jnp.int4 (N_pad, K_pad) are accepted and dequantize identically."""
    qw = _weight()
    view = dataclasses.replace(qw, codes=nybble.packing.nk_int4_as_int4(qw.codes))
    assert view.codes.dtype == jnp.int4 and view.codes.shape == (128, 256)
    np.testing.assert_array_equal(np.asarray(nybble.dequantize(view)), np.asarray(nybble.dequantize(qw)))


def test_pytree_transformations_still_build_weights():
    """JAX rebuilds the dataclass with whatever leaves it maps to: those are not validated as arrays."""
    qw = _weight()
    abstract = jax.eval_shape(lambda w: w, qw)
    assert isinstance(abstract, QuantizedWeight) and abstract.codes.shape == qw.codes.shape
    assert jax.tree.map(lambda a: None, qw).scales is None
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), qw)  # leading batch axes are allowed
    out = jax.vmap(lambda w: nybble.dequantize(w))(stacked)
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(nybble.dequantize(qw)))
    x = jnp.ones((3, 200), jnp.float32)
    grad = jax.grad(lambda x: nybble.matmul(x, qw).sum())(x)
    np.testing.assert_allclose(
        np.asarray(grad), np.broadcast_to(np.asarray(nybble.dequantize(qw)).sum(1), (3, 200)), rtol=1e-5
    )
