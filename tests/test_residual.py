"""The residual epilogue (``nybble.kernels.residual_matmul``; the Hopper kernel's ``mosaic_gpu/residual.py``):
x = residual + x_in @ W and h = x * w in one launch, against float64.

The kernel runs where tests/test_kernel_gpu.py's do (``kernel_checks.gpu_tests_mode``): on a Hopper GPU
(``make gpu-check`` runs this module there), else in GPU interpret mode with the race detector.
Small-integer weights and activations (``kernel_checks.exact_weight``) make x_in @ W exact in f32, and
small-integer residuals and a bf16/f16 norm weight keep the sum and the product exact in f32 too: the only
errors left are the three roundings to x's dtype, which the float64 reference takes at the same places,
so outputs must equal it bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble.kernels import residual_matmul
from nybble.kernels.epilogue import residual_norm
from nybble.kernels.mosaic_gpu import residual
from nybble.kernels.mosaic_gpu.config import TuningConfig, residual_reason
from nybble.kernels.mosaic_gpu.hardware import structure
from nybble.quant.qweight import dequantize
from tests.kernel_checks import (
    activations,
    exact_weight,
    gpu_tests_mode,
    k_wrapping_the_pipeline,
    run_where_gpu_tests_run,
)

MODE, WHY = gpu_tests_mode()
NUM_SMS = 132


def _round(a: np.ndarray, dtype) -> np.ndarray:
    """float64 values rounded once to ``dtype`` (round to nearest even), back in float64."""
    return np.asarray(jnp.asarray(a, jnp.float32).astype(dtype), np.float64)


def _float64_residual(x, qw, res, w, dtype):
    """(x', h) in float64 with the epilogue's three roundings: y to dtype, residual + y to dtype, x' * w to
    dtype (the weight's exact values; the f32 steps between are exact for these operands)."""
    y = np.asarray(x, np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64)[:, : qw.shape[1]]
    out = _round(np.asarray(res, np.float64) + _round(y, dtype), dtype)
    return out, _round(out * np.asarray(w, np.float64)[None, :], dtype)


# One config of each geometry the heuristics pick for the epilogue (the lowering test below covers every
# pick at real shapes): 8, 4 and 2 K slices, two and four A tiles, with and without a producer
# warpgroup, both scale routes, rows that do not fill the M tile, x padded with zero rows (M = 3 over 4
# slices: config.x_rows), norm weights in bf16, f16 and f32.
ACC = dict(scales_on="accumulators", max_concurrent_steps=2)
CASES = [
    pytest.param(TuningConfig(tiles=2, tile_m=1, tile_k=256, slices=8, **ACC), 1, True, jnp.bfloat16,
                 jnp.bfloat16, id="s8t2m1"),
    pytest.param(TuningConfig(tiles=2, tile_m=8, tile_k=512, slices=4, producer=True, **ACC), 8, False,
                 jnp.bfloat16, jnp.bfloat16, id="s4t2m8-producer-asym"),
    pytest.param(TuningConfig(tiles=4, tile_m=8, tile_k=128, slices=8, scales_on="weights",
                              max_concurrent_steps=2), 5, True, jnp.float16, jnp.float16,
                 id="s8t4m8-weights-f16"),
    pytest.param(TuningConfig(tiles=2, tile_m=4, tile_k=256, slices=4, **ACC), 3, False, jnp.bfloat16,
                 jnp.float32, id="s4t2m4-xpad-f32-weight"),
]  # fmt: skip


@pytest.mark.parametrize("config, m, symmetric, dtype, weight_dtype", CASES)
def test_kernel_epilogue_against_float64(config, m, symmetric, dtype, weight_dtype):
    assert residual_reason(config) is None
    rng = np.random.default_rng(7)
    group = 128
    k = k_wrapping_the_pipeline(config, group)
    n = max(128, 2 * config.cta_rows)  # two CTAs or more
    qw = exact_weight(rng, k, n, group, symmetric)
    x = activations(rng, m, k, dtype, exact=True)
    res = jnp.asarray(rng.integers(-64, 65, (m, n)), dtype)
    w = jnp.asarray(2.0 ** rng.integers(-3, 3, n) * rng.choice([1.0, 1.5, 1.25], n), weight_dtype)
    out, h = run_where_gpu_tests_run(
        lambda: residual.mosaic_gpu_residual(x, qw, res, w, config=config, num_sms=NUM_SMS), MODE
    )
    assert out.shape == h.shape == (m, n) and out.dtype == h.dtype == dtype
    ref_out, ref_h = _float64_residual(x, qw, res, w, dtype)
    assert np.abs(ref_out).max() > 256 and len(np.unique(ref_h)) > m * n // 2  # rounding shows; not constant
    np.testing.assert_array_equal(np.asarray(out, np.float64), ref_out)
    np.testing.assert_array_equal(np.asarray(h, np.float64), ref_h)
    # The XLA path (nybble.matmul, then the same arithmetic) gives the same bits.
    xla_out, xla_h = residual_matmul(x, qw, res, w, implementation="xla")
    np.testing.assert_array_equal(np.asarray(xla_out, np.float64), ref_out)
    np.testing.assert_array_equal(np.asarray(xla_h, np.float64), ref_h)


def test_random_data_matches_the_unfused_arithmetic():
    """Normal data, a real weight, the heuristics' own pick at M = 2: the kernel's two outputs are the
    unfused step's (nybble.matmul's product rounded, then the residual add and the norm's product), which
    is what a model's tokens need; within one rounding where the two products' f32 sums differ in order."""
    rng = np.random.default_rng(3)
    k, n, m = 1024, 256, 2
    qw = nybble.quantize(jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32), group_size=128)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((m, n)) * 4, jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 2.0, n), jnp.bfloat16)
    run = lambda: residual.mosaic_gpu_residual(x, qw, res, w, num_sms=NUM_SMS)
    out, h = run_where_gpu_tests_run(run, MODE)
    y = np.asarray(x, np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64)
    ref_out, ref_h = (np.asarray(a, np.float64) for a in residual_norm(jnp.asarray(y), res, w, jnp.bfloat16))
    # y may round to the neighbouring bf16 value (its f32 sum in another order): an ulp of y, carried
    # through the add (an ulp of the sum more) and the product (w's factor, an ulp of h more).
    ulp = 2.0**-7
    out_bound = (np.abs(y) + np.abs(ref_out)) * ulp
    h_bound = out_bound * np.asarray(w, np.float64) + np.abs(ref_h) * ulp
    assert (np.abs(np.asarray(out, np.float64) - ref_out) <= out_bound).all()
    assert (np.abs(np.asarray(h, np.float64) - ref_h) <= h_bound).all()
    assert (np.asarray(out) == ref_out).mean() > 0.9  # mostly the same bits
    assert (np.abs(np.asarray(out, np.float32)).max(axis=1) > 1).all()  # no zero row left behind


def test_gradient_through_the_kernel_is_the_xla_paths():
    rng = np.random.default_rng(4)
    k, n = 512, 128
    qw = nybble.quantize(jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32), group_size=64)
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((1, n)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 2.0, n), jnp.float32)
    config = TuningConfig(tiles=2, tile_m=1, tile_k=64, slices=8, **ACC)
    weights = jnp.arange(n, dtype=jnp.float32)

    def loss(f):
        def total(x, r, w):
            out, h = f(x, r, w)
            return jnp.sum(out.astype(jnp.float32) * weights) + jnp.sum(h.astype(jnp.float32) * weights[::-1])

        return total

    kernel = lambda x, r, w: residual.mosaic_gpu_residual(x, qw, r, w, config=config, num_sms=NUM_SMS)
    xla = lambda x, r, w: residual_matmul(x, qw, r, w, implementation="xla")
    with nybble.kernels.interpret():
        got = jax.grad(loss(kernel), argnums=(0, 1, 2))(x, res, w)
    want = jax.grad(loss(xla), argnums=(0, 1, 2))(x, res, w)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32), rtol=2e-2, atol=1e-2)
        assert float(jnp.abs(g.astype(jnp.float32)).max()) > 0


def test_xla_path_with_leading_dims_against_float64():
    rng = np.random.default_rng(5)
    k, n = 96, 64
    qw = exact_weight(rng, k, n, 32, True)
    x = activations(rng, 6, k, jnp.float32, exact=True).reshape(2, 3, k)
    res = jnp.asarray(rng.integers(-50, 50, (2, 3, n)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 2.0, n), jnp.float32)
    out, h = residual_matmul(x, qw, res, w, implementation="xla")
    assert out.shape == h.shape == (2, 3, n)
    y = np.asarray(x, np.float64).reshape(6, k) @ np.asarray(dequantize(qw, jnp.float32), np.float64)
    ref = y + np.asarray(res, np.float64).reshape(6, n)  # exact in f32 (integers below 2^24)
    np.testing.assert_array_equal(np.asarray(out, np.float64).reshape(6, n), ref)
    np.testing.assert_allclose(np.asarray(h).reshape(6, n), ref * np.asarray(w, np.float64), rtol=1e-7)


def test_bad_arguments_are_refused_by_name():
    rng = np.random.default_rng(1)
    x = jnp.ones((2, 64), jnp.bfloat16)
    qw = exact_weight(rng, 64, 128, 32, True)
    res, w = jnp.ones((2, 128), jnp.bfloat16), jnp.ones((128,), jnp.float32)
    with pytest.raises(ValueError, match=r"residual has shape \(2, 64\); expected x @ W's \(2, 128\)"):
        residual_matmul(x, qw, jnp.ones((2, 64), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="residual is float32; expected x's dtype bfloat16"):
        residual_matmul(x, qw, res.astype(jnp.float32), w)
    with pytest.raises(ValueError, match=r"norm_weight has shape \(64,\); expected \(N,\) = \(128,\)"):
        residual_matmul(x, qw, res, w[:64])
    with pytest.raises(ValueError, match="floating point"):
        residual_matmul(x, qw, res, jnp.ones((128,), jnp.int32))
    with pytest.raises(TypeError, match="QuantizedWeight"):
        residual_matmul(x, jnp.ones((64, 128)), res, w)
    with pytest.raises(ValueError, match="K slices"):
        residual.residual_plan(1, qw, config=TuningConfig(tiles=2, tile_m=8, tile_k=64))
    with pytest.raises(ValueError, match="bf16, f16 or f32"):
        residual.mosaic_gpu_residual(x, qw, res, jnp.ones((128,), jnp.int8))
    assert "multiple of 64" in residual.unsupported(x, exact_weight(rng, 64, 96, 32, True))
    # M past the K-sliced configs: no config runs the epilogue, and the op takes the unfused route.
    big = exact_weight(rng, 4096, 256, 128, True)
    assert not residual.fits(64, big) and residual.fits(1, big)


def _abstract(k, n, group, symmetric):
    return jax.eval_shape(
        lambda w: nybble.quantize(w, group_size=group, symmetric=symmetric),
        jax.ShapeDtypeStruct((k, n), jnp.float32),
    )


def _picks():
    """Every config structure (``hardware.structure``) the heuristics pick for the epilogue at the down
    projections of Llama-3-8B and 70B, Qwen3's dense 4B and 32B shapes, M = 1..8 where one fits, g128 and
    g64, each once (at its first shape), asymmetric (the symmetric kernel is the same without the
    offsets)."""
    seen = {}
    for k, n in [(14336, 4096), (28672, 8192), (9728, 2560), (25600, 5120)]:
        for group in (128, 64):
            qw = _abstract(k, n, group, symmetric=False)
            for m in range(1, 9):
                if not residual.fits(m, qw, NUM_SMS):  # Qwen3-4B at M = 1: 9728 / 8 is no whole groups
                    continue
                config = residual.residual_plan(m, qw, num_sms=NUM_SMS).config
                seen.setdefault(structure(config), (config.tag, m, qw))
    return [pytest.param(m, qw, id=tag) for tag, m, qw in seen.values()]


def test_an_epilogues_plan_asked_again_comes_from_the_heuristics_cache():
    """Each layer of a model plans its epilogue's launch again: the residual, SwiGLU and grouped SwiGLU plans
    of one problem ask the heuristics once (their predicates are functions, where a new lambda each call
    missed the cache: 32 layers' residual and SwiGLU plans took 142 ms, now 6)."""
    from bench.xray.moe_cases import abstract_weight
    from nybble.kernels.mosaic_gpu import grouped_swiglu, swiglu
    from nybble.kernels.mosaic_gpu.heuristics import heuristic_config
    from nybble.quant import quantize

    def weight(k, n):
        w = jax.ShapeDtypeStruct((k, n), jnp.float32)
        return jax.eval_shape(lambda w: quantize(w, group_size=128), w)

    down, gate_up = weight(14336, 4096), weight(4096, 28672)
    experts = abstract_weight(128, 2048, 1536, 128, True)
    plans = [
        lambda: residual.residual_plan(1, down, num_sms=132),
        lambda: swiglu.swiglu_plan(1, gate_up, num_sms=132),
        lambda: grouped_swiglu.grouped_swiglu_plan(8, experts, num_sms=132),
    ]
    for plan in plans:
        first, before = plan(), heuristic_config.cache_info()
        assert plan() == first
        after = heuristic_config.cache_info()
        assert after.misses == before.misses and after.hits > before.hits, (before, after)


@pytest.mark.sweep
@pytest.mark.parametrize("m, qw", _picks())
def test_every_pick_lowers_for_cuda(m, qw):
    fn = lambda x, qw, r, w: residual.mosaic_gpu_residual(x, qw, r, w, num_sms=NUM_SMS)
    n = qw.shape[1]
    args = (
        jax.ShapeDtypeStruct((m, qw.shape[0]), jnp.bfloat16), qw, jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((n,), jnp.bfloat16),
    )  # fmt: skip
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "_residual" in text


def test_on_a_real_hopper_gpu_the_epilogue_waits_for_a_hardware_check(monkeypatch):
    """implementation=None leaves the unverified epilogue out on a real Hopper GPU (the op then runs the
    plain kernel and the add after it); a forced "mosaic_gpu" runs it; interpret mode runs it; Blackwell's
    kernel has none."""
    from nybble.kernels.mosaic_gpu import backend, hardware

    qw = _abstract(14336, 4096, 128, symmetric=True)
    x = jax.ShapeDtypeStruct((1, 14336), jnp.bfloat16)
    with nybble.kernels.interpret():
        assert backend.residual_unsupported(x, qw, forced=False) is None
    monkeypatch.setattr(backend, "family", lambda: "hopper")
    monkeypatch.setattr(backend, "on_hopper_hardware", lambda: True)
    assert "RESIDUAL_VERIFIED" in backend.residual_unsupported(x, qw, forced=False)
    assert backend.residual_unsupported(x, qw, forced=True) is None
    monkeypatch.setattr(hardware, "RESIDUAL_VERIFIED", True)
    assert backend.residual_unsupported(x, qw, forced=False) is None
    big = jax.ShapeDtypeStruct((64, 14336), jnp.bfloat16)
    assert "fits M=64" in backend.residual_unsupported(big, qw, forced=True)
    monkeypatch.setattr(backend, "family", lambda: "blackwell")
    monkeypatch.setattr(backend, "on_hopper_hardware", lambda: False)
    assert "Hopper kernel only" in backend.residual_unsupported(x, qw, forced=True)


# ------------------------------------------------------------------------------------------- in a model


def _tiny_int4_llama(attention: str):
    """A bf16 int4 Llama of 2 layers whose down projections (K = 512, N = 128, g64) K-sliced configs fit."""
    import dataclasses

    from flax import nnx

    from nybble.models import quantize
    from nybble.models.definitions.llama import Llama, set_decode_attention
    from nybble.models.evaluate.zoo import TINY_CONFIG

    cfg = dataclasses.replace(TINY_CONFIG, intermediate_size=512, num_layers=2)
    model = Llama(cfg, rngs=nnx.Rngs(3), dtype=jnp.bfloat16)
    quantize(model, group_size=64, progress=False, fuse_projections=True)
    return set_decode_attention(model, attention)


# With the sweeps (`make test-sweeps`): ~20 s of interpret mode each, past make test's budget.
@pytest.mark.sweep
@pytest.mark.parametrize("attention", ["xla", "triton"])
def test_decode_steps_chained_through_the_epilogue_equal_the_unchained(attention, monkeypatch):
    """Interpret mode: layer 0 of a decode step takes its successor's input-norm product from the down
    kernel's epilogue (one residual launch a step; layer 1's successor is the final norm, not deferred).
    One layer run eagerly gives the unchained layer's residual stream and product bit for bit; whole
    jitted steps (where XLA may keep excess precision in its own adds, xla_allow_excess_precision) give
    logits within bf16 rounding and the same greedy tokens wherever the top two are clearly apart."""
    from flax import nnx

    from nybble.kernels.mosaic_gpu import backend
    from nybble.kernels.triton.backend import interpret as triton_interpret
    from nybble.models.definitions import llama

    model = _tiny_int4_llama(attention)
    ids = (np.arange(14) * 37 % 256).reshape(2, 7).astype(np.int32)
    _, cache = nnx.jit(lambda m, i: m.prefill(i, max_len=16))(model, ids[:, :4])
    calls = []
    counted = lambda *args: calls.append(args[0].shape) or fused(*args)
    fused = backend.residual_matmul
    monkeypatch.setattr(backend, "residual_matmul", counted)
    layer0, layer1 = model.layers[0], model.layers[1]
    x = model._embed(jnp.asarray(ids[:, 4:5]))
    with nybble.kernels.interpret(), triton_interpret("h200"):
        out = layer0.cached_chain(x, jnp.int32(4), cache.k[0], cache.v[0], next_norm=layer1.input_norm)
        plain = layer0.cached_chain(x, jnp.int32(4), cache.k[0], cache.v[0])
    assert out[3] is not None and plain[3] is None and calls == [(2, 512)]
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), np.asarray(plain[0], np.float32))
    product, _ = layer1.input_norm.deferred_sum(plain[0])
    np.testing.assert_array_equal(np.asarray(out[3].product, np.float32), np.asarray(product, np.float32))

    logits = {}
    for chained in (True, False):
        if not chained:
            monkeypatch.setattr(llama, "residual_fuses", lambda *a, **k: False)
        calls.clear()
        step = nnx.jit(lambda m, t, c, p: m.decode_step(t, c, p))
        c, steps = cache, []
        with nybble.kernels.interpret(), triton_interpret("h200"):
            for pos in range(4, 6):
                lg, c = step(model, ids[:, pos : pos + 1], c, jnp.int32(pos))
                steps.append(np.asarray(lg, np.float64)[:, 0])
        assert len(calls) == (1 if chained else 0)  # traced once: layer 0
        logits[chained] = steps
    compared = 0
    for got, want in zip(logits[True], logits[False], strict=True):
        tolerance = 0.02 * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=tolerance)
        top2 = np.sort(want, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * tolerance
        np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
        compared += int(clear.sum())
    assert compared >= 2, f"only {compared} of 4 greedy tokens were clear of ties"
