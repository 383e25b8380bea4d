"""The float64 reference itself (nybble/kernels/ops/matmul/reference.py): hand-computed cases, and agreement
with nybble.dequantize, which shares no code with it."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble.kernels.ops.matmul.reference import (
    reference_codes,
    reference_dequantize,
    reference_matmul,
    relative_error,
    rounding_bound,
)
from nybble.packing import nk_int4_as_int4
from nybble.quant import QuantizedWeight


def _weight(codes, scales, offsets=None, shape=(64, 64), group=None):
    return QuantizedWeight(
        codes=jnp.asarray(codes),
        scales=jnp.asarray(scales),
        offsets=None if offsets is None else jnp.asarray(offsets),
        shape=shape,
        group_size=group,
        symmetric=offsets is None,
        layout="nk_int4",
    )


def test_nibbles_by_hand():
    """Byte (n, j): k = 2j in the low nibble, k = 2j + 1 in the high one, two's complement."""
    codes = np.zeros((64, 32), np.uint8)
    codes[0, 0] = 0x9F  # k=0: 0xF = -1, k=1: 0x9 = -7
    codes[1, 1] = 0x78  # k=2: 0x8 = -8, k=3: 0x7 = 7
    scales = np.zeros((1, 64), np.float32)
    scales[0, :2] = [0.5, 2.0]
    qw = _weight(codes, jnp.asarray(scales, jnp.bfloat16))
    q = reference_codes(qw)
    assert q.shape == (64, 64) and q.dtype == np.int8
    assert (q[0, 0], q[1, 0], q[2, 1], q[3, 1]) == (-1, -7, -8, 7)
    assert np.count_nonzero(q) == 4
    w = reference_dequantize(qw)
    assert (w[0, 0], w[1, 0], w[2, 1], w[3, 1]) == (-0.5, -3.5, -16.0, 14.0)
    assert np.count_nonzero(w) == 4
    # The same codes held as jnp.int4 (N_pad, K_pad).
    np.testing.assert_array_equal(reference_codes(_weight(nk_int4_as_int4(jnp.asarray(codes)), scales)), q)


def test_wgmma_int4_words_by_hand():
    """Band b, word 64c + 2l + q, nibble u + 4e holds (k, n) = (64c + 32q + 8u + 2 c4 + e, 8b + r8) for
    l = 4 r8 + c4: word 1 of band 0 (l = 0, q = 1) nibble 0 is k = 32, n = 0; word 2 (l = 1: c4 = 1) nibble
    5 (u = 1, e = 1) is k = 8 + 2 + 1 = 11, n = 0; band 1 word 64 + 8 (c = 1, l = 4: r8 = 1) nibble 0 is
    k = 64, n = 9."""
    words = np.zeros((8, 128), np.uint32)  # N pads to 64: 8 bands
    words[0, 1] = 0x7  # 7
    words[0, 2] = 0x9 << 20  # -7
    words[1, 72] = 0x8  # -8
    qw = QuantizedWeight(
        codes=jnp.asarray(words), scales=jnp.ones((1, 64), jnp.bfloat16), offsets=None,
        shape=(128, 16), group_size=None, symmetric=True,
    )  # fmt: skip
    q = reference_codes(qw)
    assert q.shape == (128, 64) and np.count_nonzero(q) == 3
    assert (q[32, 0], q[11, 0], q[64, 9]) == (7, -7, -8)
    # And on random codes, the layout's own unpacking agrees (it shares no code with the reference).
    rng = np.random.default_rng()
    qr = nybble.quantize(rng.standard_normal((200, 72)).astype(np.float32), group_size=64)
    np.testing.assert_array_equal(reference_codes(qr), np.asarray(qr.logical_codes()))


def test_groups_offsets_and_partial_last_group_by_hand():
    """K = 96 (K_pad 128) at g64: rows 0..63 use scale row 0, rows 64..95 row 1 (half full)."""
    codes = np.full((64, 64), 0x11, np.uint8)  # every code 1
    scales = np.array([[0.25] * 64, [0.5] * 64], np.float32)
    offsets = np.array([[-1.0] * 64, [2.0] * 64], np.float32)
    qw = _weight(codes, scales, offsets, shape=(96, 50), group=64)
    w = reference_dequantize(qw)
    assert w.shape == (96, 50)
    np.testing.assert_array_equal(w[:64], -0.75)
    np.testing.assert_array_equal(w[64:], 2.5)
    assert reference_dequantize(qw, padded=True).shape == (128, 64)
    x = np.ones((3, 96))
    np.testing.assert_array_equal(reference_matmul(x, qw), np.full((3, 50), 64 * -0.75 + 32 * 2.5))


def test_rounding_to_the_activation_dtype_by_hand():
    """3 * (1 + 2^-10) = 3.0029296875: bf16 (ulp 2^-6 there) rounds it to 3; in f16 it is a tie
    between 3 + 2^-9 and 3 + 2^-8, broken to the even one."""
    codes = np.zeros((64, 32), np.uint8)
    codes[0, 0] = 0x03
    scales = np.zeros((1, 64), np.float32)
    scales[0, 0] = 1 + 2**-10
    qw = _weight(codes, scales)
    assert reference_dequantize(qw)[0, 0] == 3.0029296875
    assert reference_dequantize(qw, jnp.bfloat16)[0, 0] == 3.0
    assert reference_dequantize(qw, jnp.float16)[0, 0] == 3 + 2**-8
    assert reference_dequantize(qw, jnp.float32)[0, 0] == 3.0029296875


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_agrees_with_nybble_dequantize(symmetric, scale_dtype):
    """Two independent implementations of one definition: nybble.dequantize (float32, rounded once)
    equals the float64 reference rounded the same way, bit for bit when a code times a scale is exact
    in float32 (bf16 and f16 scales); with float32 scales within nybble's two float32 roundings."""
    rng = np.random.default_rng()
    w = rng.standard_normal((200, 72)).astype(np.float32)
    qw = nybble.quantize(w, group_size=64, symmetric=symmetric, scale_dtype=scale_dtype)
    if scale_dtype == jnp.float32:
        exact = reference_dequantize(qw)
        product = reference_dequantize(_without_offsets(qw))  # q * s
        err = np.abs(np.asarray(nybble.dequantize(qw), np.float64) - exact)
        # One rounding of q * s, one of the sum: half an ulp each.
        assert (err <= 2**-24 * (np.abs(product) + np.abs(exact)) * (1 + 2**-20)).all()
        assert err.max() > 0  # q * s is rounded in float32: they do differ somewhere
        return
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        np.testing.assert_array_equal(
            np.asarray(nybble.dequantize(qw, dtype), np.float64), reference_dequantize(qw, dtype)
        )


def _without_offsets(qw: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(qw.codes, qw.scales, None, qw.shape, qw.group_size, True, layout=qw.layout)


def test_rounding_bound_by_hand():
    x = np.array([[1.0, 2.0]])
    w = np.array([[1.0], [1.0]])
    acc = 4 * math.sqrt(2) * 2**-24 * 3  # the float32 accumulation allowance for |x| @ |w| = 3
    bound = rounding_bound(x, w, jnp.bfloat16)
    assert bound.shape == (1, 1)
    assert bound[0, 0] == pytest.approx(2**-8 * (3 + acc) + acc, rel=1e-12)
    half_subnormal = 2**-25  # near zero an f16 result is within half its smallest subnormal
    f16 = 2**-11 * (3 + acc) + acc + half_subnormal
    assert rounding_bound(x, w, jnp.float16)[0, 0] == pytest.approx(f16, rel=1e-12)


def test_relative_error():
    assert relative_error([3.0, 4.0], [3.0, 4.0]) == 0.0
    assert relative_error([3.0, 0.0], [3.0, 4.0]) == pytest.approx(0.8)
    assert relative_error([np.nan, 4.0], [3.0, 4.0]) == float("inf")
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error([1.0], [1.0, 2.0])


def test_refusals():
    qw = _weight(np.zeros((64, 32), np.uint8), np.ones((1, 64), np.float32))
    with pytest.raises(TypeError, match="QuantizedWeight"):
        reference_codes(np.zeros((2, 2)))
    other = QuantizedWeight(qw.codes, qw.scales, None, (64, 64), None, True, layout="nk_int4")
    object.__setattr__(other, "layout", "other")  # a layout registered later, unknown to the reference
    with pytest.raises(ValueError, match="wgmma_int4"):
        reference_codes(other)
    # QuantizedWeight refuses such scales itself; the reference checks again, not trusting it.
    bad = _weight(np.zeros((64, 32), np.uint8), np.ones((1, 64), np.float32))
    object.__setattr__(bad, "scales", jnp.ones((2, 64), jnp.float32))
    with pytest.raises(ValueError, match="scales have shape"):
        reference_dequantize(bad)
