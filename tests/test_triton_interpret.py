"""The portable Triton kernels (nybble.kernels.triton) in Pallas' interpret mode on the CPU: every config the
heuristics can pick, bit-exact on small integers and within the rounding bound of the float64 reference on
random data; the planes layouts against the reference's own decoding."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble.kernels.gpu import GPUS
from nybble.kernels.ops.matmul.reference import reference_codes, reference_dequantize
from nybble.kernels.triton import backend, dense, grouped
from nybble.kernels.triton.config import DECODE_M, TuningConfig, candidate_configs, choose_config, code_path
from nybble.kernels.triton.dequant import bias
from nybble.packing import TRITON_LAYOUT, get_layout
from nybble.quant.qweight import relayout
from nybble.quant.stacked import stack_weights
from tests.kernel_checks import _per_k, activations, assert_exact, assert_within_rounding, exact_weight

CONFIGS = sorted(candidate_configs(tuple(GPUS.values())), key=str)
# The configs up to Triton's launch parameters (warps, pipeline stages), which interpret mode does not model
# (the deviceless compile tests, tests/test_triton_lowering.py, compile with them): one run per code path.
CODE_PATHS = sorted({dataclasses.replace(c, num_warps=4, num_stages=2) for c in CONFIGS}, key=str)


def _random_weight(rng, k, n, group, symmetric, scale_dtype=jnp.bfloat16):
    w = rng.standard_normal((k, n)).astype(np.float32)
    qw = nybble.quantize(
        w, group_size=group, symmetric=symmetric, scale_dtype=scale_dtype, layout=TRITON_LAYOUT
    )
    return qw


def _terms(qw, x_dtype) -> np.ndarray:
    """What the kernel's f32 accumulation sums per (k, n): x_k (B + 8 + q_k) s, then x_k (o - (B + 8) s)."""
    s = np.abs(_per_k(qw.scales, qw))
    terms = np.abs(reference_dequantize(qw)) + 2 * bias(x_dtype) * s
    return terms if qw.offsets is None else terms + np.abs(_per_k(qw.offsets, qw))


def assert_kernel_close(y, x, qw, route: str = "accumulators") -> None:
    """y within the rounding bound of the float64 reference for the kernel's route: the exact weight with
    the accumulators route's summed terms, or each weight rounded once to x's dtype (the weights route)."""
    if route == "weights":
        assert_within_rounding(y, x, qw)
    else:
        assert_within_rounding(y, x, qw, w=reference_dequantize(qw), terms=_terms(qw, x.dtype))


@pytest.mark.parametrize("layout, stored", [("planes_int4", (24, 72)), ("planes_nk_int4", (72, 24))])
def test_planes_layouts_match_reference_decoding(layout, stored):
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, (192, 72)).astype(np.int8)
    words = get_layout(layout).pack(q)
    assert words.dtype == np.uint32 and words.shape == stored and words.flags.c_contiguous
    np.testing.assert_array_equal(get_layout(layout).unpack(words, 192), q)
    qw = nybble.QuantizedWeight.from_codes(
        q, np.ones((3, 72), np.float32), shape=(192, 72), group_size=64, layout=layout
    )
    np.testing.assert_array_equal(reference_codes(qw)[:192, :72], q)
    # Nibble i of word (j, n) (planes_nk_int4: of word (n, j)) is row i * 24 + j, offset binary.
    word = words[5, 7] if layout == "planes_int4" else words[7, 5]
    assert (int(word) >> 12) & 0xF == q[3 * 24 + 5, 7] + 8
    # The Triton kernel's layout: each column's words contiguous along K.
    assert (layout == TRITON_LAYOUT) == (layout == "planes_nk_int4")


def test_candidate_configs_are_what_the_heuristics_pick():
    seen = {
        code_path(choose_config(m, k, n, g, 2, gpu))
        for gpu in GPUS.values()
        for m in (1, 8, 16, 33, 64, 500, 2048)
        for n in (128, 192, 1024, 4096, 14336, 28672)
        for k, g in ((4096, 128), (14336, 128), (8192, 4096), (1024, 32), (2048, 64))
    }
    assert seen <= set(CONFIGS)
    assert {c.block_m for c in seen} == {16, 64, 128, 256} and any(c.splits > 1 for c in seen)


def _shape_for(cfg: TuningConfig) -> tuple[int, int, int]:
    """(M, K, N): the smallest problem that runs every code path of ``cfg``: two steps per split (the loop
    carries), a partial last M tile, two N tiles."""
    m = 3 if cfg.block_m == 16 else cfg.block_m + 5
    k = 8 * cfg.block_kw * 2 * cfg.splits
    return m, k, 2 * cfg.block_n


@pytest.mark.sweep
@pytest.mark.parametrize("cfg", CODE_PATHS, ids=str)
def test_every_config_exact(cfg):
    rng = np.random.default_rng(hash(str(cfg)) % 2**32)
    m, k, n = _shape_for(cfg)
    symmetric = (cfg.block_kw // 16 + cfg.splits) % 2 == 0  # both kinds over the set
    group = cfg.block_kw if cfg.block_kw < 64 else None  # the most groups, and per-column
    qw = exact_weight(rng, k, n, group, symmetric, layout=TRITON_LAYOUT)
    x = activations(rng, m, k, exact=True)
    y = dense.dense_matmul(x, qw, cfg, interpret=True)
    assert_exact(y, x, qw)


@pytest.mark.sweep
@pytest.mark.parametrize(
    "cfg",
    [
        c
        for c in CODE_PATHS
        if c.block_kw == {16: 128, 64: 32, 128: 16, 256: 16}[c.block_m]
        and (c.splits > 1 or c.block_m > 16 or c.block_n < 64)
    ],
    ids=str,
)
def test_every_config_random_within_rounding(cfg):
    rng = np.random.default_rng(1)
    m, k, n = _shape_for(cfg)
    qw = _random_weight(rng, k, n, 2 * cfg.block_kw, symmetric=cfg.block_n == 128)
    x = activations(rng, m, k)
    y = dense.dense_matmul(x, qw, cfg, interpret=True)
    assert_kernel_close(y, x, qw, cfg.route)
    np.testing.assert_allclose(
        np.asarray(y, np.float64), dense.reference(x, qw, cfg), rtol=2**-7, atol=1e-2 * float(np.abs(y).max())
    )


@pytest.mark.parametrize(
    "x_dtype, cfg",
    [
        (jnp.float16, TuningConfig(block_m=16, block_n=64, block_kw=16, splits=2)),  # accumulators route
        (jnp.float32, TuningConfig(block_m=64, block_n=128, block_kw=16)),  # weights route
    ],
    ids=["f16-accumulators", "f32-weights"],
)
def test_f16_f32_activations(x_dtype, cfg):
    rng = np.random.default_rng(2)
    qw = _random_weight(rng, 750, 100, 32, symmetric=False, scale_dtype=jnp.float16)  # K, N padded
    x = activations(rng, 5, 750, dtype=x_dtype)
    y = dense.dense_matmul(x, qw, cfg, interpret=True)
    assert y.dtype == x_dtype and y.shape == (5, 100)
    assert_kernel_close(y, x, qw, cfg.route)
    exact = exact_weight(rng, 256, 128, 32, True, layout=TRITON_LAYOUT)
    xe = activations(rng, 4, 256, dtype=x_dtype, exact=True)
    assert_exact(dense.dense_matmul(xe, exact, cfg, interpret=True), xe, exact)


def test_backend_matmul_through_the_heuristics():
    rng = np.random.default_rng(3)
    qw = _random_weight(rng, 512, 128, 64, symmetric=True)
    x = activations(rng, 2, 512)
    assert backend.unsupported(x, qw) is None
    with backend.interpret("l40s"):
        assert backend.not_here() is None
        y = jax.jit(backend.matmul)(x, qw)
        assert "l40s" in backend.describe(2, qw)
    assert_kernel_close(y, x, qw)
    assert backend.plan(2, qw, gpu=GPUS["a100"]).block_m == DECODE_M


def test_backend_refuses_clearly():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((512, 128)).astype(np.float32)
    x = jnp.zeros((2, 512), jnp.bfloat16)
    hopper = nybble.quantize(w, group_size=64)
    assert "relayout" in backend.unsupported(x, hopper)
    assert backend.unsupported(x, relayout(hopper, TRITON_LAYOUT)) is None
    odd_k = nybble.quantize(
        rng.standard_normal((576, 64)).astype(np.float32), group_size=64, layout=TRITON_LAYOUT
    )
    assert "multiples of 16" in backend.unsupported(jnp.zeros((2, 576), jnp.bfloat16), odd_k)
    assert "int8" in backend.unsupported(jnp.zeros((2, 512), jnp.int8), relayout(hopper, TRITON_LAYOUT))
    if jax.default_backend() == "cpu":
        assert "interpret" in backend.not_here()


def _stack(rng, experts, k, n, group, symmetric, exact):
    if exact:
        return stack_weights(
            [exact_weight(rng, k, n, group, symmetric, layout=TRITON_LAYOUT) for _ in range(experts)]
        )
    w = rng.standard_normal((experts, k, n)).astype(np.float32)
    return nybble.quantize(w, group_size=group, symmetric=symmetric, layout=TRITON_LAYOUT)


@pytest.mark.parametrize(
    "symmetric, cfg",
    [
        (True, TuningConfig(block_m=16, block_n=64, block_kw=16)),  # decode: accumulators route
        (False, TuningConfig(block_m=64, block_n=128, block_kw=16)),  # prefill: weights route, y^T
    ],
    ids=["sym-accumulators", "asym-weights"],
)
def test_grouped_exact_with_empty_experts_and_tail(symmetric, cfg):
    rng = np.random.default_rng(5)
    qw = _stack(rng, 4, 256, 128, 32, symmetric, exact=True)
    x = activations(rng, 41, 256, exact=True)
    sizes = jnp.asarray([9, 0, 20, 3], jnp.int32)  # rows 32..40 past the sum: zeros
    y = grouped.grouped_matmul(x, qw, sizes, cfg, interpret=True)
    expected = grouped.reference(x, qw, sizes).astype(np.float32).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y), expected)
    assert (np.asarray(y)[32:] == 0).all() and np.abs(np.asarray(y)[:32]).sum() > 0


def test_grouped_random_traced_sizes_through_backend():
    rng = np.random.default_rng(6)
    qw = _stack(rng, 3, 512, 64, None, True, exact=False)
    x = activations(rng, 24, 512)
    sizes = jnp.asarray([7, 17, -2], jnp.int32)  # traced: a negative size counts as zero, rows past 24 drop
    assert backend.ragged_unsupported(x, qw, sizes) is None
    with backend.interpret("rtx5090"):
        y = jax.jit(backend.ragged_matmul)(x, qw, sizes)
    ref = grouped.reference(x, qw, sizes)
    one = dataclasses.replace(qw, codes=qw.codes[1], scales=qw.scales[1])
    assert_kernel_close(y[7:24], x[7:24], one)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=2**-7, atol=0.05)


@pytest.mark.parametrize("x_dtype", ["bfloat16", "float16"])
def test_pair_trick_exhaustive(x_dtype):
    """The compiled kernel's inline PTX (``dequant.pair_codes_word``: ``lop3`` (a & b) | c, then one
    ``fma.rn`` per 16-bit half) emulated bit by bit in numpy over every pair of nibbles at every shift,
    against q = u - 8; and the interpret-mode jnp path gives the same bits."""
    import ml_dtypes

    from nybble.kernels.triton import dequant

    trick = dequant.PAIR_TRICK[x_dtype]
    fmt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[x_dtype]
    u = np.arange(16, dtype=np.uint32)
    lo, hi = np.meshgrid(u, u, indexing="ij")
    rng = np.random.default_rng(5)
    for shift in (0, 4, 8, 12):
        noise = rng.integers(0, 2**32, lo.shape, dtype=np.uint32) & ~np.uint32(0x000F000F << shift)
        words = (lo << shift) | (hi << (16 + shift)) | noise  # other planes' nibbles: random bits
        shifted = words >> shift
        t = (shifted & np.uint32(dequant.NIBBLE_PAIR_MASK)) | np.uint32(trick["magic"])  # lop3 0xEA
        halves = [(t & 0xFFFF).astype(np.uint16), (t >> 16).astype(np.uint16)]
        consts = [np.uint16(trick[k] & 0xFFFF) for k in ("one", "minus_bias")]
        one, minus_bias = (np.array(c).view(fmt).astype(np.float64) for c in consts)
        assert one == 1.0 and minus_bias == -(dequant.MAGIC[x_dtype][1] + 8)
        for half, want in zip(halves, (lo, hi), strict=True):
            value = half.view(fmt).astype(np.float64) * one + minus_bias  # exact: small integers
            np.testing.assert_array_equal(value.astype(fmt).astype(np.float64), want.astype(np.int64) - 8)
        got = np.asarray(dequant.pair_codes_word(jnp.asarray(shifted), getattr(jnp, x_dtype), asm=False))
        want_bits = [
            ((half.view(fmt).astype(np.float64) + minus_bias).astype(fmt)).view(np.uint16).astype(np.uint32)
            for half in halves
        ]
        np.testing.assert_array_equal(got, want_bits[0] | (want_bits[1] << 16))


@pytest.mark.parametrize("x_dtype", ["bfloat16", "float16"])
def test_scaled_pair_every_code_and_scale(x_dtype):
    """The weights route's multiply (``dequant.scaled_pair_word``; compiled: ``fma.rn.{b}f16x2(q, s, -0.0)``,
    which by PTX's rules rounds the exact product once, as ``q s`` rounded once from float64) for every code
    q in each half and every finite scale of the 16-bit format, each half with its own scale; and the pair
    path is taken exactly where it keeps ``nybble.dequantize``'s value."""
    import ml_dtypes

    from nybble.kernels.triton import dequant

    fmt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[x_dtype]
    bits = np.arange(1 << 16, dtype=np.uint32)
    with np.errstate(invalid="ignore"):  # the NaN patterns, dropped next
        scales = bits.astype(np.uint16).view(fmt).astype(np.float64)
    bits, scales = bits[np.isfinite(scales)], scales[np.isfinite(scales)]
    q = np.arange(-8, 8, dtype=np.float64)
    q_bits = q.astype(fmt).view(np.uint16).astype(np.uint32)
    for lo, hi in ((0, 15), (7, 8), (3, 12)):  # the two halves' codes; scales reversed in the high half
        pair = np.full(bits.shape, q_bits[lo] | (q_bits[hi] << 16), np.uint32)
        scale_pair = bits | (bits[::-1] << 16)
        args = (jnp.asarray(pair), jnp.asarray(scale_pair), getattr(jnp, x_dtype))
        got = np.asarray(dequant.scaled_pair_word(*args, asm=False))
        for half, (code, s) in enumerate(((q[lo], scales), (q[hi], scales[::-1]))):
            with np.errstate(over="ignore"):  # |q s| past the format's range: inf, in both
                want = (code * s).astype(fmt).astype(np.float64)
            got_half = ((got >> (16 * half)) & 0xFFFF).astype(np.uint16).view(fmt).astype(np.float64)
            # Scales and products below f32's normal range: the jnp twin computes in f32, which XLA's CPU
            # flushes to zero.
            tiny = np.finfo(np.float32).tiny
            normal = ~(((np.abs(code * s) < tiny) & (code * s != 0)) | ((np.abs(s) < tiny) & (s != 0)))
            assert normal.sum() > 60000
            np.testing.assert_array_equal(got_half[normal], want[normal])
    bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
    assert dequant.pairs_weights("weights", bf16, bf16, asymmetric=False)
    assert dequant.pairs_weights("weights", f16, f16, asymmetric=False)
    assert not dequant.pairs_weights("weights", bf16, bf16, asymmetric=True)  # the offset rounds in f32
    assert not dequant.pairs_weights("weights", f16, bf16, asymmetric=False)  # a bf16 scale is no f16
    assert not dequant.pairs_weights("weights", f32, f32, asymmetric=False)
    assert not dequant.pairs_weights("accumulators", bf16, bf16, asymmetric=False)
