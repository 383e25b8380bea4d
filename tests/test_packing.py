"""pack_int4 / unpack_int4: exact round trips, XLA's int4 memory order, every refusal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from nybble.packing import (
    check_group_size,
    get_layout,
    group_rows,
    nk_int4_as_int4,
    num_groups,
    pack_int4,
    pad_to,
    padded_weight_dims,
    round_up,
    unpack_int4,
)

shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=9)


@st.composite
def codes_and_axis(draw, signed=True):
    shape = draw(shapes)
    lo, hi = (-8, 7) if signed else (0, 15)
    values = draw(hnp.arrays(np.int8, shape, elements=st.integers(lo, hi)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    return values, axis


@settings(max_examples=150, deadline=None)
@given(codes_and_axis(signed=True))
def test_signed_round_trip_any_shape_axis_and_odd_length(case):
    values, axis = case
    packed = pack_int4(values, axis=axis)
    assert isinstance(packed, np.ndarray) and packed.dtype == np.uint8
    n = values.shape[axis]
    assert packed.shape[axis] == (n + 1) // 2
    back = unpack_int4(packed, n, axis=axis)
    assert back.dtype == np.int8
    np.testing.assert_array_equal(back, values)


@settings(max_examples=100, deadline=None)
@given(codes_and_axis(signed=False))
def test_unsigned_round_trip(case):
    values, axis = case
    back = unpack_int4(pack_int4(values, axis=axis, signed=False), values.shape[axis], axis=axis,
                       signed=False)
    np.testing.assert_array_equal(back, values)


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.int8, st.tuples(st.integers(1, 6), st.integers(1, 8).map(lambda h: 2 * h)),
                  elements=st.integers(-8, 7)))
def test_byte_order_matches_xla_int4_memory(values):
    """The packed bytes are exactly the memory of a jnp.int4 array: element 2i low, 2i+1 high."""
    as_int4 = jnp.asarray(values, jnp.int4)
    n = values.shape[-1]
    xla_bytes = jax.lax.bitcast_convert_type(as_int4.reshape(*values.shape[:-1], n // 2, 2), jnp.uint8)
    np.testing.assert_array_equal(pack_int4(values), np.asarray(xla_bytes))
    # and back through the layout's free view
    np.testing.assert_array_equal(np.asarray(nk_int4_as_int4(jnp.asarray(pack_int4(values)))), values)


def test_explicit_nibbles():
    packed = pack_int4(np.array([1, -1, 7, -8, 3], np.int8))
    np.testing.assert_array_equal(packed, np.array([0xF1, 0x87, 0x03], np.uint8))


def test_empty_and_default_axis():
    """An empty axis packs to nothing; without axis=, the last axis is packed and unpacked (3-D here)."""
    empty = pack_int4(np.zeros((3, 0), np.int8))
    assert empty.shape == (3, 0) and empty.dtype == np.uint8
    assert unpack_int4(empty, 0).shape == (3, 0)
    values = np.random.default_rng(0).integers(-8, 8, (2, 3, 5)).astype(np.int8)
    packed = pack_int4(values)
    assert packed.shape == (2, 3, 3)
    np.testing.assert_array_equal(unpack_int4(packed, 5), values)


def test_jax_in_jax_out_and_jit():
    values = jax.random.randint(jax.random.key(1), (5, 7), -8, 8, jnp.int32)
    packed = jax.jit(lambda v: pack_int4(v, axis=0))(values)
    assert isinstance(packed, jax.Array) and packed.shape == (3, 7) and packed.dtype == jnp.uint8
    back = jax.jit(lambda p: unpack_int4(p, 5, axis=0))(packed)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(values))
    np.testing.assert_array_equal(np.asarray(packed), pack_int4(np.asarray(values), axis=0))
    # 3-D jax arrays, packed along the middle axis
    values3 = jax.random.randint(jax.random.key(2), (2, 5, 3), -8, 8, jnp.int32)
    packed3 = pack_int4(values3, axis=1)
    assert isinstance(packed3, jax.Array) and packed3.shape == (2, 3, 3)
    np.testing.assert_array_equal(np.asarray(packed3), pack_int4(np.asarray(values3), axis=1))
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed3, 5, axis=1)), np.asarray(values3))


@pytest.mark.parametrize(
    ("values", "kwargs", "match"),
    [
        (np.array([0, 8], np.int8), {}, r"1 value\(s\) outside the signed int4 range \[-8, 7\]"),
        # the bounds themselves are in range: two bad values, the first at index 2
        (np.array([-8, 7, 9, -9], np.int8), {}, r"2 value\(s\) outside .*; first at index \(2,\): 9\."),
        (np.array([0, 15, 16], np.int16), {"signed": False}, r"1 value\(s\) .*first at index \(2,\): 16\."),
        (np.array([-1, 3], np.int8), {"signed": False}, r"outside the unsigned int4 range \[0, 15\]"),
        (np.array([1.0, 2.0]), {}, "integer dtype, got float64"),
        (np.zeros((2, 3), np.int8), {"axis": 2}, "axis 2 is out of bounds"),
        (np.array(3, np.int8), {}, "scalar"),
    ],
)
def test_pack_refusals(values, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack_int4(values, **kwargs)


def test_unpack_refusals():
    packed = np.zeros((4, 3), np.uint8)
    with pytest.raises(ValueError, match=r"length 7 does not fit 3 packed byte\(s\).*5 or 6"):
        unpack_int4(packed, 7)
    with pytest.raises(ValueError, match="must be uint8"):
        unpack_int4(packed.astype(np.int8), 6)
    with pytest.raises(ValueError, match="axis -3 is out of bounds"):
        unpack_int4(packed, 6, axis=-3)


def test_padding_helpers():
    assert round_up(576, 64) == 576 and round_up(577, 64) == 640 and round_up(1, 64) == 64
    assert round_up(5, 1) == 5
    assert padded_weight_dims(10944, 7392, 128) == (10944, 7424)
    assert padded_weight_dims(100, 70, None) == (128, 128)
    x = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(pad_to(x, (3, 4)), [[0, 1, 2, 0], [3, 4, 5, 0], [0, 0, 0, 0]])
    assert pad_to(x, (2, 3)) is x
    with pytest.raises(ValueError, match="cannot pad"):
        pad_to(x, (1, 3))
    with pytest.raises(ValueError, match="positive"):
        round_up(3, 0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4).map(lambda i: 64 * i), st.integers(1, 4).map(lambda i: 64 * i), st.data())
def test_nk_int4_layout_exact_inverse(k, n, data):
    codes = data.draw(hnp.arrays(np.int8, (k, n), elements=st.integers(-8, 7)))
    layout = get_layout("nk_int4")
    stored = layout.pack(codes)
    assert stored.shape == layout.stored_shape(k, n) == (n, k // 2)
    np.testing.assert_array_equal(layout.unpack(stored, k), codes)


def test_unknown_layout():
    with pytest.raises(ValueError, match="unknown weight layout 'nope'"):
        get_layout("nope")


@pytest.mark.parametrize("name", ["nk_int4", "wgmma_int4"])
@pytest.mark.parametrize(("k", "n"), [(64, 64), (128, 192), (320, 64)])
def test_layout_stored_shape_and_granules_are_what_pack_does(name, k, n):
    """``stored_shape`` is the packed array's shape, and ``StoredDim`` says how to slice it: a block of N
    (or K) from one granule multiple to another is the stored array sliced along ``axis`` at indices
    ``value / per_index``, i.e. the packing of that block of codes alone."""
    from nybble.packing import LAYOUTS

    layout = LAYOUTS[name]
    codes = np.random.default_rng(k + n).integers(-8, 8, (k, n)).astype(np.int8)
    stored = np.asarray(layout.pack(codes))
    assert stored.shape == layout.stored_shape(k, n)
    expected = {"nk_int4": ((0, 1, 1), (1, 2, 2)), "wgmma_int4": ((0, 8, 8), (1, 1, 64))}[name]
    as_tuple = lambda d: (d.axis, d.per_index, d.granule)
    assert (as_tuple(layout.n), as_tuple(layout.k)) == expected
    blocks = ((layout.n, n, lambda a, b: codes[:, a:b]), (layout.k, k, lambda a, b: codes[a:b]))
    for dim, length, cut in blocks:
        a, b = dim.granule, length  # the block from the first granule boundary to the end
        if a >= b:
            continue
        sliced = np.take(stored, np.arange(a // dim.per_index, b // dim.per_index), axis=dim.axis)
        np.testing.assert_array_equal(sliced, np.asarray(layout.pack(cut(a, b))))


def test_stored_dim_refuses_bad_granules_and_layouts_are_frozen():
    import dataclasses

    from nybble.packing.layouts import StoredDim, WeightLayout

    for per_index, granule in [(2, 3), (1, 0), (0, 0), (-1, 1)]:
        with pytest.raises(ValueError, match="positive multiple of per_index"):
            StoredDim(axis=0, per_index=per_index, granule=granule)
    layout = get_layout("nk_int4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.k.granule = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.name = "other"
    with pytest.raises(TypeError):  # keyword-only: a positional field list would be too easy to misorder
        WeightLayout("x", layout.pack, layout.unpack, layout.stored_shape, "", layout.n, layout.k)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 2**15), st.sampled_from([None, 16, 32, 64, 128, 256, 1024]))
def test_group_geometry_by_hand(k_pad, group_size):
    """G rows per scale row (all of K when per column) and ceil(K_pad / G) scale rows, the last partial."""
    g = group_rows(k_pad, group_size)
    assert g == (k_pad if group_size is None else group_size)
    rows = num_groups(k_pad, group_size)
    assert (rows - 1) * g < k_pad <= rows * g
    assert [num_groups(576, 128), num_groups(512, 128), num_groups(100, None)] == [5, 4, 1]


@pytest.mark.parametrize("group_size", [16, 32, 64, 128, 256, 2**20, np.int64(64), None])
def test_group_sizes_accepted(group_size):
    check_group_size(group_size)


@pytest.mark.parametrize("group_size", [0, 8, 15, 17, 18, 24, 48, 96, 130, -16, 64.0, "64", True])
def test_group_sizes_refused(group_size):
    with pytest.raises(ValueError, match="power of two >= 16"):
        check_group_size(group_size)
