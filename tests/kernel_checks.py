"""Data and checks shared by the kernel tests (interpret mode and GPU): exact small-integer weights, random
weights, and comparisons with the float64 reference of ``nybble.kernels.ops.matmul.reference``."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from nybble.kernels.ops.matmul.reference import reference_codes, reference_dequantize, rounding_bound
from nybble.packing import get_layout, padded_weight_dims
from nybble.quant import QuantizedWeight, quantize

# The magic-number dequantization's bias per activation dtype (nybble/kernels/mosaic_gpu/
# dequant_registers.py), restated: the accumulator route sums x_k (BIAS + q_k) and subtracts BIAS s
# sum(x) per group.
KERNEL_BIAS = {"bfloat16": 136.0, "float16": 1032.0}


def exact_weight(
    rng, k, n, group, symmetric, *, scale_dtype=jnp.bfloat16, layout="wgmma_int4"
) -> QuantizedWeight:
    """Codes in [-8, 7], scales 2^-2..2^1, offsets multiples of 1/4 in [-1, 1]: every weight is a multiple
    of 1/4 below 17 in magnitude, exact in bf16 and f16, so with small-integer activations every product
    and partial sum is exact in float32 and the only rounding is the final one."""
    k_pad, n_pad = padded_weight_dims(k, n, group)
    g = k_pad if group is None else group
    num_groups = -(-k_pad // g)
    q = rng.integers(-8, 8, (k_pad, n_pad)).astype(np.int8)
    q[k:] = 0  # padding holds code 0, as nybble.quantize writes it
    q[:, n:] = 0
    scales = jnp.asarray(2.0 ** rng.integers(-2, 2, (num_groups, n_pad)), scale_dtype)
    offsets = None
    if not symmetric:
        offsets = jnp.asarray(rng.integers(-4, 5, (num_groups, n_pad)) / 4, scale_dtype)
    codes = jnp.asarray(get_layout(layout).pack(q))
    return QuantizedWeight(
        codes=codes,
        scales=scales,
        offsets=offsets,
        shape=(k, n),
        group_size=group,
        symmetric=symmetric,
        layout=layout,
    )


def random_weight(rng, k, n, group, symmetric, *, scale_dtype=jnp.bfloat16) -> QuantizedWeight:
    """A standard normal weight quantized by round to nearest: realistic codes, scales and offsets."""
    w = rng.standard_normal((k, n)).astype(np.float32)
    return quantize(w, group_size=group, symmetric=symmetric, scale_dtype=scale_dtype)


def activations(rng, m, k, dtype=jnp.bfloat16, *, exact=False):
    """Standard normal activations, or (``exact``) integers in [-16, 16]: with :func:`exact_weight`'s
    weights every product and partial sum stays exact in float32 for K up to 2^24 / (4 * 16 * 17) = 15420,
    and per-group sums of x are large enough (tens to hundreds) that rounding any of the kernel's
    intermediate terms (say an offset times sum(x)) to bf16 shows."""
    if exact:
        return jnp.asarray(rng.integers(-16, 17, (m, k)), dtype)
    return jnp.asarray(rng.standard_normal((m, k)), dtype)


def check_rows(m: int, tile: int, rng=None) -> np.ndarray:
    """Output rows to compare: all of them up to 256, else the first and last row of every ``tile`` rows
    (so every M tile of a kernel is seen) and 32 more at random."""
    if m <= 256:
        return np.arange(m)
    starts = np.arange(0, m, tile)
    rows = np.concatenate([starts, np.minimum(starts + tile, m) - 1])
    rng = np.random.default_rng(m) if rng is None else rng
    return np.unique(np.concatenate([rows, rng.integers(0, m, 32)]))


def _reference_rows(y, x, qw, rows, w=None):
    y = np.asarray(y, np.float64)
    x = np.asarray(x)
    expected_shape = (x.shape[0], qw.shape[1])
    assert y.shape == expected_shape, f"output shape {y.shape}, expected {expected_shape}"
    if rows is not None:
        y, x = y[rows], x[rows]
    return y, x, reference_dequantize(qw, x.dtype) if w is None else w


def assert_exact(y, x, qw, rows=None) -> None:
    """``y`` equals the float64 reference rounded once to ``y``'s dtype, bit for bit (exact data only)."""
    out_dtype = np.dtype(y.dtype)
    y, x, w = _reference_rows(y, x, qw, rows)
    ref = np.asarray(x, np.float64) @ w
    assert (ref.astype(np.float32) == ref).all(), "test data is not exact in float32: use exact_weight"
    expected = ref.astype(np.float32).astype(out_dtype).astype(np.float64)
    bad = ~(y == expected)  # NaN (an element never written) counts as a mismatch
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise AssertionError(
            f"{int(bad.sum())} of {bad.size} outputs differ from the exact reference; first at {i}: "
            f"got {y[i]}, expected {expected[i]}"
        )


def assert_within_rounding(y, x, qw, rows=None, w=None, terms=None) -> None:
    """Every element of ``y`` within :func:`rounding_bound` of the float64 reference: the weight rounded
    once to x's dtype, float32 accumulation, one rounding to ``y``'s dtype; nothing else. ``rows``: the
    rows of ``y`` to compare; ``w``: the weight multiplied (default ``reference_dequantize(qw, x.dtype)``);
    ``terms``: the accumulation's term magnitudes (see :func:`rounding_bound`)."""
    out_dtype = np.dtype(y.dtype)
    y, x, w = _reference_rows(y, x, qw, rows, w)
    ref = np.asarray(x, np.float64) @ w
    bound = rounding_bound(x, w, out_dtype, terms=terms)
    err = np.abs(y - ref)
    bad = ~(err <= bound)  # NaN fails
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        worst = tuple(int(v) for v in np.unravel_index(np.nanargmax(err / bound), err.shape))
        rel = np.linalg.norm(np.nan_to_num(y - ref, nan=np.inf)) / np.linalg.norm(ref)
        raise AssertionError(
            f"{int(bad.sum())} of {bad.size} outputs outside the rounding bound (relative error {rel:.3g}); "
            f"first at {i}: |{y[i]} - {ref[i]:.6g}| > {bound[i]:.3g}; worst at {worst}: "
            f"{err[worst] / bound[worst]:.3g} x the bound"
        )


def _per_k(a, qw) -> np.ndarray:
    """Per-group rows (num_groups, N_pad) expanded to (K, N) float64, the reference's group indexing."""
    k_pad = qw.padded_shape[0]
    rows = np.arange(k_pad) // (k_pad if qw.group_size is None else qw.group_size)
    k, n = qw.shape
    return np.asarray(a, np.float64)[rows][:k, :n]


def kernel_weight_models(qw, x_dtype, scales_on: str) -> list[tuple[str, np.ndarray, np.ndarray | None]]:
    """What the Mosaic GPU kernel multiplies, per route, as (name, float64 weight (K, N), terms or None).

    accumulators: the exact weight (codes times f32 scales after the sum over a group), summing
      x_k (BIAS + q_k) and x_k per group before scaling: the accumulation allowance covers those terms.
    weights: w = q * s (+ o) in x's dtype, scales and offsets rounded to x's dtype first; a GPU may fuse
      the multiply-add (one rounding) or not (two), so both are models and the output must match one.
    """
    if scales_on == "accumulators":
        w = reference_dequantize(qw)
        terms = np.abs(w) + KERNEL_BIAS[np.dtype(x_dtype).name] * np.abs(_per_k(qw.scales, qw))
        if qw.offsets is not None:
            terms = terms + np.abs(_per_k(qw.offsets, qw))
        return [("accumulators", w, terms)]
    dt = np.dtype(x_dtype)
    k, n = qw.shape
    q = reference_codes(qw)[:k, :n].astype(np.float64)
    s = _per_k(np.asarray(qw.scales, np.float32).astype(dt), qw)
    qs = q * s  # exact: a 4-bit code times an 8/11-bit significand
    if qw.offsets is None:
        return [("weights", qs.astype(dt).astype(np.float64), None)]
    o = _per_k(np.asarray(qw.offsets, np.float32).astype(dt), qw)
    fused = (qs + o).astype(np.float32).astype(dt).astype(np.float64)
    unfused = (qs.astype(dt).astype(np.float64) + o).astype(np.float32).astype(dt).astype(np.float64)
    return [("weights, fused multiply-add", fused, None), ("weights, two roundings", unfused, None)]


def simulate_accumulator_route(x, qw) -> np.ndarray:
    """The accumulator route's own arithmetic, in float32, as (M, N) float64: per group g (and column),
    ``acc = sum_k x_k (BIAS + q_k)`` and ``sx = sum_k x_k`` summed in float32, then ``y = sum_g s_g (acc -
    BIAS sx) + o_g sx`` in float32, before y's rounding to its dtype. The kernel sums the same float32
    terms in another order (WGMMA's, K slices, split-K, the folded -BIAS tile), nothing else."""
    x = np.asarray(x)
    dt = np.dtype(x.dtype).name
    k = x.shape[1]
    n = qw.shape[1]
    bias = np.float32(KERNEL_BIAS[dt])
    q = reference_codes(qw)[:k, :n].astype(np.float32)
    xf = x.astype(np.float32)
    group = qw.padded_shape[0] if qw.group_size is None else qw.group_size
    scales = np.asarray(qw.scales, np.float32)[:, :n]
    offsets = None if qw.offsets is None else np.asarray(qw.offsets, np.float32)[:, :n]
    y = np.zeros((x.shape[0], n), np.float32)
    for g, start in enumerate(range(0, k, group)):
        xs, qs = xf[:, start : start + group], q[start : start + group]
        acc = xs @ (bias + qs)  # float32 (products of 16-bit values are exact in it)
        sx = xs.sum(axis=1, dtype=np.float32)[:, None]
        y += scales[g] * (acc - bias * sx)
        if offsets is not None:
            y += offsets[g] * sx
    return y.astype(np.float64)


def assert_accumulator_route_close(y, x, qw, rows=None) -> None:
    """The accumulator route's output against :func:`simulate_accumulator_route`: within half an ulp of
    y's dtype (the final rounding) plus 1e-4 of the output's RMS for the float32 sums' order (expected
    ~1e-5 of it; the worst-case bound of :func:`assert_within_rounding` allows ~5%, where a scale bug of
    a few percent hides)."""
    y = np.asarray(y, np.float64)
    out_eps = np.finfo(np.dtype(np.asarray(x).dtype)).eps
    if rows is not None:
        y, x = y[rows], np.asarray(x)[rows]
    sim = simulate_accumulator_route(x, qw)
    bound = out_eps / 2 * np.abs(sim) + 1e-4 * np.sqrt(np.mean(sim**2))
    err = np.abs(y - sim)
    bad = ~(err <= bound)
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise AssertionError(
            f"{int(bad.sum())} of {bad.size} outputs off the accumulator route's float32 simulation; first "
            f"at {i}: |{y[i]} - {sim[i]:.6g}| > {bound[i]:.3g}"
        )


def assert_kernel_within_rounding(y, x, qw, scales_on: str, rows=None) -> None:
    """The kernel's output within :func:`rounding_bound` of the float64 reference of its route (the
    weight as :func:`kernel_weight_models` says, f32 accumulation, one rounding of y), element by element,
    for one of the route's models; on the accumulator route also tightly against its own float32
    arithmetic (:func:`assert_accumulator_route_close`)."""
    if scales_on == "accumulators":
        assert_accumulator_route_close(y, x, qw, rows=rows)
    errors = []
    for name, w, terms in kernel_weight_models(qw, x.dtype, scales_on):
        try:
            assert_within_rounding(y, x, qw, rows=rows, w=w, terms=terms)
            return
        except AssertionError as e:
            errors.append(f"[{name}] {e}")
    raise AssertionError("\n".join(errors))


def env_flag(name: str) -> bool:
    """An environment switch: set to anything but '', '0' or 'false'."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false")


def gpu_tests_mode() -> tuple[str, str]:
    """Where tests/test_kernel_gpu.py runs its kernels, and why: ("gpu", the device) on a Hopper GPU,
    else ("interpret", the reason). NYBBLE_GPU_TESTS_INTERPRET=1 forces interpret mode.

    Raises:
      RuntimeError: NYBBLE_GPU_TESTS_REQUIRE_GPU=1 is set and the kernels would not run on a Hopper GPU.
    """
    from nybble.device import hopper_device

    device = hopper_device()
    if env_flag("NYBBLE_GPU_TESTS_INTERPRET"):
        mode = ("interpret", "NYBBLE_GPU_TESTS_INTERPRET=1")
    elif device is None:
        mode = ("interpret", f"no Hopper GPU; jax's default backend is {jax.default_backend()!r}")
    else:
        mode = ("gpu", str(getattr(device, "device_kind", device)))
    if env_flag("NYBBLE_GPU_TESTS_REQUIRE_GPU") and mode[0] != "gpu":
        raise RuntimeError(
            f"NYBBLE_GPU_TESTS_REQUIRE_GPU=1 but the GPU tests would run in interpret mode ({mode[1]}): "
            f"run them on a Hopper GPU, or unset NYBBLE_GPU_TESTS_REQUIRE_GPU"
        )
    return mode


def run_where_gpu_tests_run(run, mode: str):
    """``run()`` (a Hopper kernel call) where :func:`gpu_tests_mode` says: under ``jit`` on the GPU, or in
    GPU interpret mode with the race detector, asserting it flagged no race."""
    import nybble.kernels
    import nybble.kernels.mosaic_gpu as mg

    if mode != "interpret":
        return jax.block_until_ready(jax.jit(run)())
    mg.reset_state()
    with nybble.kernels.interpret(detect_races=True):
        y = jax.block_until_ready(run())
    assert not mg.races_found(), "the race detector flagged a data race"
    return y


def k_wrapping_the_pipeline(config, group: int | None, *, past_k: bool = False) -> int:
    """K_pad of a test problem for ``config`` whose every split-K partition runs one K step more than
    its pipeline slots (``max_concurrent_steps + 1``), so that every slot is released and refilled once,
    with two groups or more per K slice and whole groups per slice. ``past_k``: the last step runs past
    K_pad (one 64-wide chunk of it inside), as the config does at the shape it was picked for
    (``TuningConfig.runs_past_k``). Shared by the GPU test's smallest problems and the interpret sweep
    over the heuristic configs."""
    unit = config.k_span() * config.split_k
    k_pad = unit * (config.max_concurrent_steps + 1)
    if past_k:
        return k_pad - unit + 64
    while group is not None and (k_pad < 2 * group * config.slices or (k_pad // config.slices) % group):
        k_pad += unit
    return k_pad
