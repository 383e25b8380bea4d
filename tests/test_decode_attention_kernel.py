"""The Triton decode attention kernel (nybble.kernels.triton.decode_attention) in Pallas' interpret mode:
against float64 softmax attention, the cache rows it writes exactly, stale rows never seen; its configs;
its refusals by name; and a model's decode steps on it against the XLA path."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nybble.kernels.triton import decode_attention as kernel
from nybble.kernels.triton.backend import interpret, target_gpu
from nybble.models import Llama, quantize, set_decode_attention
from nybble.models.evaluate.zoo import TINY_CONFIG

STALE = 8192.0  # cache rows past the position (and before a window) hold this: a row seen shows at once


# (batch, kv_heads, groups, head_dim, max_len, position, window, block_s, splits, row scale, q/k norms)
CASES = [
    (1, 2, 4, 64, 128, 77, None, 16, 2, False, False),  # position inside split 1 of 2
    (2, 1, 3, 32, 64, 63, None, 16, 1, True, False),  # groups not a power of two; the last position
    (1, 2, 8, 64, 256, 5, None, 16, 4, False, True),  # splits 1..3 see nothing: their state must weigh 0
    (1, 1, 4, 64, 128, 100, 20, 16, 2, True, True),  # a sliding window starting inside a block
    (1, 2, 1, 16, 64, 0, None, 16, 4, False, False),  # position 0: one row seen; groups = 1
    (2, 2, 16, 32, 128, 64, None, 32, 2, True, False),  # the first row of split 1; 16 groups (no padding)
    (1, 1, 4, 128, 256, 191, 64, 16, 4, False, True),  # head_dim 128; a window across a split boundary
]


def _inputs(case, dtype):
    b, h, g, d, s, _, _, _, _, with_scale, with_norms = case
    rng = np.random.default_rng(sum(case[:6]))

    def rounded(shape, scale=1.0):
        return np.asarray(jnp.asarray(rng.standard_normal(shape) * scale, dtype), np.float64)

    qkv = rounded((b, h * g + 2 * h, d), 3.0)
    k_cache, v_cache = rounded((b, h, s, d)), rounded((b, h, s, d))
    hidden = 4 * d  # the input norm's width: its scale is rsqrt(sum / hidden + eps), about 0.2 .. 0.6
    row_ssq = (rng.uniform(3.0, 25.0, b) * hidden).astype(np.float32) if with_scale else None
    norms = None
    if with_norms:
        norms = (rng.uniform(0.5, 1.5, d).astype(np.float32), rng.uniform(0.5, 1.5, d).astype(np.float32))
    row_norm = (hidden, 1e-5) if with_scale else None
    token = kernel.NewToken(h * g, h, row_norm, (1e-6, 1e-5) if with_norms else None)
    return qkv, k_cache, v_cache, row_ssq, norms, token


CASE_ID = "b{}h{}g{}d{}s{}p{}w{}-bs{}x{}-scale{}-norm{}"


@pytest.mark.sweep
@pytest.mark.parametrize("case", CASES, ids=lambda c: CASE_ID.format(*c))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_kernel_equals_float64_attention_and_writes_one_row(case, dtype):
    _, _, _, d, s, position, window, block_s, splits, _, _ = case
    qkv, k_cache, v_cache, row_ssq, norms, token = _inputs(case, dtype)
    lowest = 0 if window is None else max(0, position - window + 1)
    for cache in (k_cache, v_cache):  # poison every row the query must not see
        cache[:, :, position:] = STALE
        cache[:, :, :lowest] = -STALE
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    ref, k_ref, v_ref = kernel.reference(
        qkv, k_cache, v_cache, position, window, token, inv_freq, row_ssq, norms
    )
    cfg = kernel.AttentionConfig(block_s=block_s, splits=splits)
    out, k_out, v_out = kernel.write_and_attend(
        jnp.asarray(qkv, dtype), jnp.asarray(k_cache, dtype), jnp.asarray(v_cache, dtype),
        jnp.int32(position), window, cfg, token, kernel.rope_factors(jnp.int32(position), inv_freq),
        row_sum_of_squares=None if row_ssq is None else jnp.asarray(row_ssq),
        norm_weights=None if norms is None else tuple(jnp.asarray(w) for w in norms),
        interpret=True,
    )  # fmt: skip
    k_out, v_out = np.asarray(k_out, np.float64), np.asarray(v_out, np.float64)
    others = np.arange(s) != position  # every other row untouched
    np.testing.assert_array_equal(k_out[:, :, others], k_ref[:, :, others])
    np.testing.assert_array_equal(v_out[:, :, others], v_ref[:, :, others])
    # the new rows: rounded to the dtype after the scale, the norm and the rotation (as the model rounds)
    ulps = 3 * float(jnp.finfo(dtype).eps)
    for got, ref_rows in ((k_out, k_ref), (v_out, v_ref)):
        np.testing.assert_allclose(got[:, :, position], ref_rows[:, :, position], rtol=ulps, atol=ulps)
    # products of the rounded inputs exact in f32; the probabilities rounded to the cache's dtype
    atol = 2e-2 if dtype == jnp.bfloat16 else 8e-3
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=0, atol=atol)
    assert np.abs(ref).max() > 0.1  # the reference is not trivially small


@pytest.mark.parametrize("case", CASES, ids=lambda c: CASE_ID.format(*c))
def test_the_last_split_merges_as_the_combine_launch_does(case):
    # With arrival counters the last program of each (sequence, KV head) merges the splits' states in the
    # attention's launch: the same output, bit for bit, as the second launch's merge. With one split both
    # calls write the output from the program (no state, no merge, counters or not); float64 checks it.
    b, h, _, d, _, position, window, block_s, splits, _, _ = case
    qkv, k_cache, v_cache, row_ssq, norms, token = _inputs(case, jnp.bfloat16)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    cfg = kernel.AttentionConfig(block_s=block_s, splits=splits)
    args = (
        *(jnp.asarray(a, jnp.bfloat16) for a in (qkv, k_cache, v_cache)),
        jnp.int32(position), window, cfg, token, kernel.rope_factors(jnp.int32(position), inv_freq),
    )  # fmt: skip
    kw = dict(
        row_sum_of_squares=None if row_ssq is None else jnp.asarray(row_ssq),
        norm_weights=None if norms is None else tuple(jnp.asarray(w) for w in norms),
        out_dtype=jnp.bfloat16,
        interpret=True,
    )
    two, k_two, v_two = kernel.write_and_attend(*args, **kw)
    arrivals = jnp.zeros((b, h + 3), jnp.int32)  # wider than the KV heads, as the model's (its x's width)
    one, k_one, v_one = kernel.write_and_attend(*args, arrivals=arrivals, **kw)
    assert one.shape == two.shape and one.dtype == two.dtype
    np.testing.assert_array_equal(np.asarray(one), np.asarray(two))
    np.testing.assert_array_equal(np.asarray(k_one), np.asarray(k_two))
    np.testing.assert_array_equal(np.asarray(v_one), np.asarray(v_two))
    ref, _, _ = kernel.reference(qkv, k_cache, v_cache, position, window, token, inv_freq, row_ssq, norms)
    np.testing.assert_allclose(np.asarray(one, np.float64), ref, rtol=0, atol=3e-2)
    for bad in (
        jnp.zeros((b + 1, h), jnp.int32),
        jnp.zeros((b, h), jnp.float32),
        jnp.zeros((b * h,), jnp.int32),
    ):
        with pytest.raises(ValueError, match="arrivals must be int32"):
            kernel.write_and_attend(*args, arrivals=bad, **kw)


@pytest.mark.parametrize("case", [c for c in CASES if c[9]], ids=lambda c: CASE_ID.format(*c))
def test_the_kernel_sums_the_norm_input_rows_as_given_sums_scale(case):
    # The input norm's scale from its input rows (the model's residual stream), whose squares the kernel
    # sums itself in chunks (576 wide: SmolLM2's, 9 chunks of 64), against the same kernel given their f32
    # sums (as XLA's reduction makes them) and float64. The sums' orders differ: a scale an f32 ulp apart
    # may round a new q/k/v element one bf16 ulp apart, no more.
    b, _, _, d, _, position, window, block_s, splits, _, _ = case
    qkv, k_cache, v_cache, _, norms, token = _inputs(case, jnp.bfloat16)
    hidden = 576
    token = dataclasses.replace(token, row_norm=(hidden, 1e-5))
    rng = np.random.default_rng(position)
    rows = jnp.asarray(rng.standard_normal((b, hidden)) * rng.uniform(0.5, 4.0, (b, 1)), jnp.bfloat16)
    sums = (np.asarray(rows, np.float32) ** 2).sum(-1)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    args = (
        *(jnp.asarray(a, jnp.bfloat16) for a in (qkv, k_cache, v_cache)),
        jnp.int32(position), window, kernel.AttentionConfig(block_s, splits), token,
        kernel.rope_factors(jnp.int32(position), inv_freq),
    )  # fmt: skip
    weights = None if norms is None else tuple(jnp.asarray(w) for w in norms)
    kw = dict(norm_weights=weights, out_dtype=jnp.float32, interpret=True)
    summed, k_summed, v_summed = kernel.write_and_attend(*args, row_inputs=rows, **kw)
    given, k_given, v_given = kernel.write_and_attend(*args, row_sum_of_squares=jnp.asarray(sums), **kw)
    bf16_ulp = float(jnp.finfo(jnp.bfloat16).eps)
    for got, want in ((k_summed, k_given), (v_summed, v_given)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        np.testing.assert_allclose(got, want, rtol=bf16_ulp, atol=0)
    np.testing.assert_allclose(np.asarray(summed), np.asarray(given), rtol=0, atol=1e-2)
    ref, k_ref, _ = kernel.reference(
        qkv, k_cache, v_cache, position, window, token, inv_freq, norm_weights=norms, row_inputs=rows
    )
    np.testing.assert_allclose(np.asarray(summed, np.float64), ref, rtol=0, atol=2e-2)
    new_key = np.asarray(k_summed, np.float64)[:, :, position]
    np.testing.assert_allclose(new_key, k_ref[:, :, position], rtol=3 * bf16_ulp, atol=3 * bf16_ulp)
    assert np.abs(ref).max() > 0.1
    for bad in (rows[:, : hidden - 64], rows[None]):
        with pytest.raises(ValueError, match=rf"row_inputs must be \({b}, 576\)"):
            kernel.write_and_attend(*args, row_inputs=bad, **kw)
    with pytest.raises(ValueError, match="multiple of 16"):
        narrow = dataclasses.replace(token, row_norm=(40, 1e-5))
        kernel.write_and_attend(*args[:6], narrow, args[7], row_inputs=rows[:, :40], **kw)
    with pytest.raises(ValueError, match="one of row_sum_of_squares and row_inputs"):
        kernel.write_and_attend(*args, row_inputs=rows, row_sum_of_squares=jnp.asarray(sums), **kw)


def test_output_in_the_projection_dtype_is_the_f32_output_rounded():
    case = CASES[0]
    qkv, k_cache, v_cache, _, _, token = _inputs(case, jnp.bfloat16)
    args = [jnp.asarray(a, jnp.bfloat16) for a in (qkv, k_cache, v_cache)]
    cfg = kernel.AttentionConfig(block_s=16, splits=2)
    rope = kernel.rope_factors(jnp.int32(40), np.linspace(1.0, 0.01, case[3] // 2))
    f32, _, _ = kernel.write_and_attend(*args, jnp.int32(40), None, cfg, token, rope, interpret=True)
    bf16, _, _ = kernel.write_and_attend(
        *args, jnp.int32(40), None, cfg, token, rope, out_dtype=jnp.bfloat16, interpret=True
    )
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16), np.asarray(f32.astype(jnp.bfloat16)))


@pytest.mark.parametrize(
    "args, expected",
    [
        ((1, 8, 4096, 132), kernel.AttentionConfig(64, 16)),  # Llama-3-8B, batch 1 on an H200: 128 programs
        ((8, 8, 4096, 132), kernel.AttentionConfig(64, 4)),  # 256 programs: 128 would leave 4 SMs idle
        ((64, 8, 4096, 132), kernel.AttentionConfig(64, 1)),  # 512 programs without splits
        ((1, 8, 48, 132), kernel.AttentionConfig(16, 1)),  # 3 blocks: no split of 4 blocks
        ((1, 1, 96, 132), kernel.AttentionConfig(32, 1)),  # 96 = 3 x 32
    ],
)
def test_configs(args, expected):
    cfg = kernel.choose_config(*args)
    assert cfg == expected
    assert args[2] % (cfg.block_s * cfg.splits) == 0


@pytest.mark.parametrize(
    "k_dtype, d, max_len, match",
    [
        (jnp.float32, 64, 64, "bf16 or f16 caches"),
        (jnp.bfloat16, 48, 64, "power of two >= 16"),
        (jnp.bfloat16, 64, 40, "multiple of 16 positions"),
    ],
)
def test_unsupported_arguments_are_named(k_dtype, d, max_len, match):
    qkv = np.zeros((1, 12, d), np.float32)
    cache = np.zeros((1, 2, max_len, d), k_dtype)
    assert match in kernel.unsupported(qkv, cache, cache, kernel.NewToken(8, 2))


def _tiny(dtype, **changes):
    cfg = dataclasses.replace(TINY_CONFIG, **changes)
    model = Llama(cfg, rngs=nnx.Rngs(7), dtype=dtype)
    return quantize(model, group_size=64, progress=False, fuse_projections=True)


def test_model_refuses_the_kernel_for_an_f32_cache_by_name():
    model = set_decode_attention(_tiny(jnp.float32), "triton")
    _, cache = model.prefill(np.zeros((1, 3), np.int32), max_len=16)
    with pytest.raises(NotImplementedError, match=r"bf16 or f16 caches.*set_decode_attention"):
        model.decode_step(np.zeros((1, 1), np.int32), cache, 3)


def test_a_cpu_outside_interpret_mode_is_refused_by_name():
    # Pallas would say "Only interpret mode is supported on CPU backend" at lowering; the model says which
    # GPU it needs and the two ways out
    model = set_decode_attention(_tiny(jnp.bfloat16), "triton")
    _, cache = nnx.jit(lambda m, i: m.prefill(i, max_len=16))(model, np.zeros((1, 3), np.int32))
    with pytest.raises(NotImplementedError, match=r"needs an NVIDIA GPU.*backend\.interpret\(\).*'xla'"):
        model.decode_step(np.zeros((1, 1), np.int32), cache, 3)


def test_set_decode_attention_refuses_unknown_names_and_models():
    with pytest.raises(ValueError, match="unknown implementation 'flash'"):
        set_decode_attention(_tiny(jnp.bfloat16), "flash")
    with pytest.raises(ValueError, match="no nybble Attention layer"):
        set_decode_attention(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "triton")


@pytest.mark.parametrize(
    "changes, max_len",
    [({}, 32), ({"sliding_window": 5}, 32), ({"qk_norm": True}, 32), ({"qk_norm": True}, 512)],
    ids=["llama", "window", "qk_norm", "qk_norm-splits"],
)
def test_decode_steps_on_the_kernel_equal_the_xla_path(changes, max_len):
    # The same bf16 model, prefilled, then 6 decode steps of the same tokens (teacher-forced: an untrained
    # model's near ties would let the two paths' greedy tokens part at the first rounding difference): the
    # kernel (interpret mode) against XLA's fused reductions. Layer 0's cache bit for bit (the same new
    # rows), logits within bf16's rounding of the probabilities, the same greedy token wherever the XLA
    # path's top two logits are further apart than that. A cache of 512 positions is read in splits, which
    # the last of them merges in the kernel's launch (arrival counters from the model).
    cfg = _tiny(jnp.bfloat16, **changes).config
    with interpret():  # the SMs of the GPU interpret mode plans for
        splits = kernel.choose_config(2, cfg.num_kv_heads, max_len, target_gpu().sms).splits
    assert (splits > 1) == (max_len == 512)
    rng = np.random.RandomState(4)
    ids = rng.randint(0, TINY_CONFIG.vocab_size, (2, 11)).astype(np.int32)
    results = {}
    for implementation in ("xla", "triton"):
        model = set_decode_attention(_tiny(jnp.bfloat16, **changes), implementation)
        _, cache = nnx.jit(lambda m, i: m.prefill(i, max_len=max_len))(model, ids[:, :5])
        step = nnx.jit(lambda m, t, c, p: m.decode_step(t, c, p))
        steps = []
        with interpret():
            for pos in range(5, ids.shape[1]):
                logits, cache = step(model, ids[:, pos : pos + 1], cache, jnp.int32(pos))
                steps.append(np.asarray(logits, np.float64)[:, 0])
        results[implementation] = steps, cache
    (xla_steps, xla_cache), (tri_steps, tri_cache) = results["xla"], results["triton"]
    compared = 0
    for xla_logits, tri_logits in zip(xla_steps, tri_steps, strict=True):
        tolerance = 0.02 * np.abs(xla_logits).max()
        np.testing.assert_allclose(tri_logits, xla_logits, rtol=0, atol=tolerance)
        top2 = np.sort(xla_logits, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * tolerance
        np.testing.assert_array_equal(tri_logits.argmax(-1)[clear], xla_logits.argmax(-1)[clear])
        compared += int(clear.sum())
    assert compared >= 6, f"only {compared} of 12 greedy tokens were clear of ties"
    for layer, (a, b) in enumerate(zip(xla_cache.k + xla_cache.v, tri_cache.k + tri_cache.v, strict=True)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if layer % len(xla_cache.k) == 0:  # layer 0's rows come before any attention output
            np.testing.assert_array_equal(b, a)
        else:
            np.testing.assert_allclose(b, a, rtol=0, atol=0.02 * np.abs(a).max())
