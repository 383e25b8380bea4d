"""The ``wgmma_int4`` layout: its definition checked element by element against an independent formula,
exact inverses (property-tested), and the whole stack (quantize, dequantize, the XLA path, relayout,
save/load) giving the same numbers as ``nk_int4``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nybble
from nybble.packing import get_layout
from nybble.packing.fragments import pack_wgmma_int4, unpack_wgmma_int4
from nybble.quant import relayout


def _lane_fragment(words: np.ndarray, n: int, k: int) -> int:
    """The code at (k, n) read the way a kernel lane does: band, lane, word, nibble (module docstring)."""
    band, r8 = divmod(n, 8)
    chunk, within = divmod(k, 64)
    q, within = divmod(within, 32)
    u, within = divmod(within, 8)
    c4, e = divmod(within, 2)
    lane = 4 * r8 + c4
    word = int(words[band, 64 * chunk + 2 * lane + q])
    nibble = (word >> (4 * (u + 4 * e))) & 0xF
    return nibble - 16 if nibble >= 8 else nibble


def test_definition_by_lane_reads():
    rng = np.random.default_rng(0)
    codes = rng.integers(-8, 8, (128, 64)).astype(np.int8)
    words = pack_wgmma_int4(codes)
    assert words.dtype == np.uint32 and words.shape == (8, 128)
    for n in range(64):
        for k in range(128):
            assert _lane_fragment(words, n, k) == codes[k, n]


def test_one_word_by_hand():
    # Band 0, chunk 0, lane 0 (row 0, c4 = 0), word q = 0 holds k = 8u + e for u = 0..3, e = 0, 1:
    # nibble u + 4e. Put code 1 at k = 0 (nibble 0), -1 at k = 1 (nibble 4), 7 at k = 24 (nibble 3).
    codes = np.zeros((64, 8), np.int8)
    codes[0, 0], codes[1, 0], codes[24, 0] = 1, -1, 7
    words = pack_wgmma_int4(codes)
    assert int(words[0, 0]) == 0x1 | (0xF << 16) | (0x7 << 12)
    assert not words.reshape(-1)[1:].any()


@settings(max_examples=40, deadline=None)
@given(
    k_chunks=st.integers(1, 4),
    n_bands=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_exact_inverse(k_chunks, n_bands, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(-8, 8, (64 * k_chunks, 8 * n_bands)).astype(np.int8)
    words = pack_wgmma_int4(codes)
    assert words.shape == (n_bands, 64 * k_chunks)
    np.testing.assert_array_equal(unpack_wgmma_int4(words), codes)
    # A permutation of nk_int4's nibbles: the same multiset of codes, the same bytes count.
    nk = get_layout("nk_int4").pack(codes)
    assert nk.nbytes == words.nbytes


def test_jax_and_numpy_agree():
    import jax.numpy as jnp

    codes = np.random.default_rng(3).integers(-8, 8, (128, 16)).astype(np.int8)
    np.testing.assert_array_equal(np.asarray(pack_wgmma_int4(jnp.asarray(codes))), pack_wgmma_int4(codes))
    words = pack_wgmma_int4(codes)
    np.testing.assert_array_equal(np.asarray(unpack_wgmma_int4(jnp.asarray(words))), codes)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_wgmma_int4(np.zeros((100, 8), np.int8))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_wgmma_int4(np.zeros((64, 12), np.int8))
    with pytest.raises(ValueError, match="K_pad = 128, expected 64"):
        unpack_wgmma_int4(np.zeros((1, 128), np.uint32), 64)


@pytest.mark.parametrize("symmetric", [True, False])
def test_same_numbers_as_nk_int4(symmetric, tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((576, 200)).astype(np.float32)
    a = nybble.quantize(w, group_size=64, symmetric=symmetric, layout="nk_int4")
    b = nybble.quantize(w, group_size=64, symmetric=symmetric)
    assert nybble.packing.DEFAULT_LAYOUT == "wgmma_int4"
    assert b.layout == "wgmma_int4" and b.codes.dtype == np.uint32 and b.nbytes == a.nbytes
    np.testing.assert_array_equal(np.asarray(nybble.dequantize(a)), np.asarray(nybble.dequantize(b)))
    x = rng.standard_normal((5, 576)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(nybble.matmul(x, a)), np.asarray(nybble.matmul(x, b)))
    # relayout both ways is exact.
    np.testing.assert_array_equal(np.asarray(relayout(a, "wgmma_int4").codes), np.asarray(b.codes))
    np.testing.assert_array_equal(np.asarray(relayout(b, "nk_int4").codes), np.asarray(a.codes))
    nybble.save(tmp_path / "w.safetensors", {"w": b})
    back = nybble.load(tmp_path / "w.safetensors")["w"]
    assert back.layout == "wgmma_int4"
    np.testing.assert_array_equal(np.asarray(back.codes), np.asarray(b.codes))
