"""The SwiGLU epilogue (``nybble.kernels.swiglu_matmul``; the Hopper kernel's ``mosaic_gpu/swiglu.py``) and
the gate/up layout it reads (``nybble.packing.gate_up``), against float64.

The kernel runs where tests/test_kernel_gpu.py's do (``kernel_checks.gpu_tests_mode``): on a Hopper GPU
(``make gpu-check`` runs this module there), else in GPU interpret mode. Small-integer weights and
activations (``kernel_checks.exact_weight``) make the gate and up products exact in f32, so the only
errors left are the epilogue's f32 arithmetic and the one rounding of y: each element must be within half
a unit in the last place of its float64 value (and a hair for the f32 epilogue).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
import nybble.kernels.mosaic_gpu as mg
from nybble.kernels import swiglu_matmul
from nybble.kernels.mosaic_gpu import swiglu
from nybble.kernels.mosaic_gpu.config import TuningConfig, swiglu_reason
from nybble.kernels.mosaic_gpu.hardware import structure
from nybble.packing.gate_up import concatenated_order, gate_up_order, interleavable, split_gate_up
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


def test_gate_up_order_interleaves_blocks_of_eight():
    n = 24
    order = gate_up_order(n)
    concat = np.arange(2 * n)  # gate columns 0..23, up columns 24..47
    np.testing.assert_array_equal(order[:16], [*range(8), *range(24, 32)])
    np.testing.assert_array_equal(order[16:32], [*range(8, 16), *range(32, 40)])
    np.testing.assert_array_equal(order[concatenated_order(n)], concat)
    gate, up = split_gate_up(concat[order][None])
    np.testing.assert_array_equal(gate[0], np.arange(n))
    np.testing.assert_array_equal(up[0], np.arange(n, 2 * n))
    assert interleavable(8) and not interleavable(12) and not interleavable(0)
    with pytest.raises(ValueError, match="multiple of 8"):
        gate_up_order(12)


def _float64_swiglu(x, qw, sum_of_squares, norm):
    """silu(r g) * (r u) in float64 from the weight's exact values, gate/up taken by the fused layout."""
    y = np.asarray(x, np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64)[:, : qw.shape[1]]
    n = qw.shape[1] // 2
    concat = y[:, concatenated_order(n)]
    gate, up = concat[:, :n], concat[:, n:]
    if sum_of_squares is None:
        r = np.ones((x.shape[0], 1))
    else:
        r = 1.0 / np.sqrt(np.asarray(sum_of_squares, np.float64)[:, None] / norm[0] + norm[1])
    z = gate * r
    return z / (1.0 + np.exp(-z)) * (up * r)


def _assert_within_half_ulp(y, ref, dtype) -> None:
    """Every element of y within half an ulp of its float64 value ``ref`` (plus 1e-5 of it: the f32
    epilogue's exp, rsqrt and division), the rounding bound of y's dtype; below the dtype's smallest normal
    number (silu of a large negative z), within that number."""
    info = jnp.finfo(dtype)
    got = np.asarray(y, np.float64)
    bound = np.maximum(np.abs(ref) * (2.0 ** -(info.nmant + 1)) * (1 + 1e-5), float(info.tiny))
    bad = np.abs(got - ref) > bound
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} elements off by more than half an ulp, e.g. {got[bad][:4]} vs "
        f"{ref[bad][:4]}"
    )


# One config of each epilogue geometry the heuristics pick (tests/test_swiglu.py's lowering below covers
# every pick at real shapes): 8, 4 and 2 K slices (8, 16 and 32 output rows an A tile), two and four A
# tiles, with and without a producer warpgroup, both scale routes, rows that do not fill the M tile, and
# x padded with zero rows (M = 3 over 4 slices: config.x_rows).
ACC = dict(scales_on="accumulators", max_concurrent_steps=2)
CASES = [
    pytest.param(
        TuningConfig(tiles=4, tile_m=1, tile_k=256, slices=8, **ACC),
        1, True, jnp.bfloat16, True, id="s8t4m1",
    ),
    pytest.param(
        TuningConfig(
            tiles=4, tile_m=4, tile_k=256, slices=2, scales_on="accumulators", producer=True,
            max_concurrent_steps=2,
        ),
        3, False, jnp.bfloat16, True, id="s2t4m4-producer-asym",
    ),
    pytest.param(
        TuningConfig(tiles=4, tile_m=8, tile_k=128, slices=8, scales_on="weights", max_concurrent_steps=2),
        5, True, jnp.float16, True, id="s8t4m8-weights-f16",
    ),
    pytest.param(
        TuningConfig(tiles=2, tile_m=4, tile_k=256, slices=4, **ACC),
        3, False, jnp.bfloat16, False, id="s4t2m4-xpad-nonorm",
    ),
]  # fmt: skip


@pytest.mark.parametrize("config, m, symmetric, dtype, with_norm", CASES)
def test_kernel_epilogue_within_rounding_of_float64(config, m, symmetric, dtype, with_norm):
    assert swiglu_reason(config) is None
    rng = np.random.default_rng(7)
    group = 128
    k = k_wrapping_the_pipeline(config, group)
    n = max(128, 2 * config.cta_rows)  # two CTAs or more; N / 2 a multiple of 64 (swiglu.OUT_COLUMNS)
    qw = exact_weight(rng, k, n, group, symmetric)
    x = activations(rng, m, k, dtype, exact=True)
    norm = (float(k), 1e-5)
    # r = rsqrt(s / K + eps) in 3e-4..3e-3: r times the exact products (thousands) spans silu's range.
    s = jnp.asarray(rng.uniform(1e5, 1e7, m) * k, jnp.float32) if with_norm else None
    y = run_where_gpu_tests_run(
        lambda: swiglu.mosaic_gpu_swiglu(x, qw, s, norm=norm, config=config, num_sms=NUM_SMS), MODE
    )
    assert y.shape == (m, n // 2) and y.dtype == dtype
    ref = _float64_swiglu(x, qw, s, norm)
    assert np.abs(ref).max() > 1.0 and np.isfinite(ref).all()  # the check below has something to check
    _assert_within_half_ulp(y, ref, dtype)
    # The XLA path computes the same f32 arithmetic from the same exact products.
    xla = swiglu_matmul(x, qw, sum_of_squares=s, norm=norm, implementation="xla")
    _assert_within_half_ulp(xla, ref, dtype)


def test_gradient_through_the_kernel_is_the_xla_paths():
    """The kernel's backward pass (XLA's, custom_vjp) gives the XLA path's gradients for x and the sums of
    squares."""
    rng = np.random.default_rng(3)
    k, n = 512, 256
    qw = nybble.quantize(jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32), group_size=64)
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
    s = jnp.asarray([float(k)], jnp.float32)
    config = TuningConfig(tiles=2, tile_m=1, tile_k=64, slices=8, **ACC)
    weights = jnp.arange(n // 2, dtype=jnp.float32)
    kernel = lambda x, s: swiglu.mosaic_gpu_swiglu(x, qw, s, norm=(k, 1e-5), config=config, num_sms=NUM_SMS)
    xla = lambda x, s: swiglu_matmul(x, qw, sum_of_squares=s, norm=(k, 1e-5), implementation="xla")
    loss = lambda f: lambda x, s: jnp.sum(f(x, s).astype(jnp.float32) * weights)
    with nybble.kernels.interpret():
        dx, ds = jax.grad(loss(kernel), argnums=(0, 1))(x, s)
    ex, es = jax.grad(loss(xla), argnums=(0, 1))(x, s)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(ex, np.float32), rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(ds), np.asarray(es), rtol=1e-3)
    assert float(jnp.abs(ds).max()) > 0 and float(jnp.abs(dx.astype(jnp.float32)).max()) > 0


def test_xla_path_with_leading_dims_against_float64():
    rng = np.random.default_rng(5)
    k, n = 96, 64
    qw = exact_weight(rng, k, n, 32, True)
    x = activations(rng, 6, k, jnp.float32, exact=True).reshape(2, 3, k)
    s = jnp.asarray(rng.uniform(10, 1000, (2, 3, 1)), jnp.float32)
    y = swiglu_matmul(x, qw, sum_of_squares=s, norm=(k, 1e-6), implementation="xla")
    assert y.shape == (2, 3, n // 2)
    ref = _float64_swiglu(np.asarray(x).reshape(6, k), qw, np.asarray(s).reshape(6), (k, 1e-6))
    np.testing.assert_allclose(np.asarray(y).reshape(6, n // 2), ref, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused_by_name():
    rng = np.random.default_rng(1)
    x = jnp.ones((2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        swiglu_matmul(x, exact_weight(rng, 64, 24, 32, True))
    qw = exact_weight(rng, 64, 32, 32, True)
    with pytest.raises(ValueError, match="sum_of_squares has shape"):
        swiglu_matmul(x, qw, sum_of_squares=jnp.ones((3,)))
    with pytest.raises(TypeError, match="QuantizedWeight"):
        swiglu_matmul(x, jnp.ones((64, 32)))
    with pytest.raises(ValueError, match="K slices"):
        swiglu.swiglu_plan(1, qw, config=TuningConfig(tiles=2, tile_m=8, tile_k=64))
    # A config whose CTA holds no whole 16-column block: 64 * 1 / 8 = 8 columns.
    assert "no whole 16-column" in swiglu_reason(TuningConfig(tiles=1, tile_m=1, tile_k=256, slices=8))
    # M past the K-sliced configs: no config runs the epilogue, and the op takes the unfused route.
    big = exact_weight(rng, 4096, 256, 128, True)
    assert not swiglu.fits(64, big) and swiglu.fits(1, big)


def _abstract_gate_up(k, n, group, symmetric):
    return jax.eval_shape(
        lambda w: nybble.quantize(w, group_size=group, symmetric=symmetric),
        jax.ShapeDtypeStruct((k, n), jnp.float32),
    )


def _picks():
    """Every config structure (``hardware.structure``) the heuristics pick for the epilogue at Llama-3-8B/70B
    and Qwen3 dense gate/up shapes, M = 1..8, g128 and g64, each once (at its first shape), asymmetric: the
    symmetric kernel is the asymmetric one without the offsets (the bias fold aside: the plain kernel's,
    lowered in tests/test_kernel_lowering.py), with the same epilogue."""
    seen = {}
    for k, n in [(4096, 28672), (8192, 57344), (2048, 12288), (5120, 51200)]:
        for group in (128, 64):
            qw = _abstract_gate_up(k, n, group, symmetric=False)
            for m in range(1, 9):
                config = swiglu.swiglu_plan(m, qw, num_sms=NUM_SMS).config
                seen.setdefault(structure(config), (config.tag, m, qw))
    return [pytest.param(m, qw, id=tag) for tag, m, qw in seen.values()]


@pytest.mark.sweep
@pytest.mark.parametrize("m, qw", _picks())
def test_every_pick_lowers_for_cuda(m, qw):
    fn = lambda x, qw, s: swiglu.mosaic_gpu_swiglu(x, qw, s, norm=(4096.0, 1e-5), num_sms=NUM_SMS)
    x = jax.ShapeDtypeStruct((m, qw.shape[0]), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((m,), jnp.float32)
    text = jax.jit(fn).trace(x, qw, s).lower(lowering_platforms=("cuda",)).as_text()
    assert "_swiglu" in text


def test_on_a_real_hopper_gpu_the_epilogue_waits_for_a_hardware_check(monkeypatch):
    """implementation=None leaves the unverified epilogue out on a real Hopper GPU (the op then runs the
    plain kernel and the SiLU product after it); a forced "mosaic_gpu" runs it; interpret mode runs it."""
    from nybble.kernels.mosaic_gpu import backend, hardware

    qw = _abstract_gate_up(4096, 28672, 128, symmetric=True)
    x = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)
    with nybble.kernels.interpret():
        assert backend.swiglu_unsupported(x, qw, forced=False) is None
    monkeypatch.setattr(backend, "family", lambda: "hopper")
    monkeypatch.setattr(backend, "on_hopper_hardware", lambda: True)
    assert "SWIGLU_VERIFIED" in backend.swiglu_unsupported(x, qw, forced=False)
    assert backend.swiglu_unsupported(x, qw, forced=True) is None
    monkeypatch.setattr(hardware, "SWIGLU_VERIFIED", True)
    assert backend.swiglu_unsupported(x, qw, forced=False) is None
    big = jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16)
    assert "fits M=64" in backend.swiglu_unsupported(big, qw, forced=True)
    # A real B200: the Blackwell kernel's epilogue, gated the same way.
    monkeypatch.setattr(backend, "family", lambda: "blackwell")
    monkeypatch.setattr(backend, "on_hopper_hardware", lambda: False)
    assert backend.swiglu_unsupported(x, qw, forced=False) is None  # SWIGLU_VERIFIED is set above
    monkeypatch.setattr(hardware, "SWIGLU_VERIFIED", False)
    assert "SWIGLU_VERIFIED" in backend.swiglu_unsupported(x, qw, forced=False)
    assert backend.swiglu_unsupported(x, qw, forced=True) is None


# ------------------------------------------------------------------------------- the Blackwell kernel's

# Both places the warpgroup that stores y stages the sums of squares: warpgroup 0 on the accumulator route
# (symmetric g128, bf16), the last step's warpgroup on the weights route with alternating warpgroups
# (asymmetric: two K steps, so warpgroup 1); M = 5 pads x to 6 rows (config.x_rows).
BLACKWELL_CASES = [
    pytest.param(2048, 512, 1, True, id="fold-wg0-m1"),
    pytest.param(1024, 256, 5, False, id="weights-wg1-m5"),
]


@pytest.mark.parametrize("k, n, m, symmetric", BLACKWELL_CASES)
def test_blackwell_epilogue_within_rounding_of_float64(k, n, m, symmetric):
    from nybble.kernels.mosaic_gpu.blackwell import swiglu as blackwell

    rng = np.random.default_rng(11)
    qw = exact_weight(rng, k, n, 128, symmetric)
    x = activations(rng, m, k, jnp.bfloat16, exact=True)
    s = jnp.asarray(rng.uniform(1e5, 1e7, m) * k, jnp.float32)
    norm = (float(k), 1e-5)
    p = blackwell.swiglu_plan(m, qw, num_sms=148)
    assert p.config.slices > 1 and p.swiglu
    mg.reset_state()
    with nybble.kernels.interpret(detect_races=True, gpu="b200"):
        y = jax.block_until_ready(swiglu_matmul(x, qw, sum_of_squares=s, norm=norm))
    assert not mg.races_found(), "the race detector flagged a data race"
    assert y.shape == (m, n // 2)
    ref = _float64_swiglu(x, qw, s, norm)
    assert np.abs(ref).max() > 1.0 and np.isfinite(ref).all()
    _assert_within_half_ulp(y, ref, jnp.bfloat16)


@pytest.mark.sweep
def test_blackwell_picks_lower_for_sm100a():
    """The B200 heuristics' picks for the epilogue at Llama-3-8B and 70B gate/up, M = 1, 8, 16, 32 (each
    tiling once), lowered for sm_100a with the epilogue in the kernel's name."""
    from nybble.kernels.mosaic_gpu.blackwell import swiglu as blackwell
    from nybble.kernels.mosaic_gpu.blackwell.target import target_arch

    seen = set()
    for k, n in [(4096, 28672), (8192, 57344)]:
        qw = _abstract_gate_up(k, n, 128, symmetric=False)
        for m in (1, 8, 16, 32):
            config = blackwell.swiglu_plan(m, qw).config
            if config.tag in seen:
                continue
            seen.add(config.tag)
            fn = lambda x, qw, s, k=k: swiglu.mosaic_gpu_swiglu(x, qw, s, norm=(k, 1e-5), family="blackwell")
            args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), qw, jax.ShapeDtypeStruct((m,), jnp.float32))
            with target_arch(10, 0):
                text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert "tcgen05" in text and f"{config.tag}_o_swiglu" in text, config.tag
    assert len(seen) >= 2
