"""The Mosaic GPU W4A16 kernel against the float64 reference: on a Hopper GPU, or in interpret mode.

Where it runs (the pytest header says which; see ``gpu_tests_mode`` in tests/kernel_checks.py):
  * on a Hopper GPU: every case below;
  * without one (CI): in GPU interpret mode on the CPU, the first cheap case of each test (a smoke
    check of this module, ~30 s; tests/test_kernel_interpret.py is CI's full check of the numbers);
  * with ``NYBBLE_GPU_TESTS_INTERPRET=1``: in interpret mode, every case marked cheap (the same tests
    and checks at small shapes: interpret mode takes seconds a kernel; ~90 s on 2 cores with -n 2);
    ``NYBBLE_GPU_TESTS_ALL=1`` runs every case there too (select some with ``-k``: the largest would
    take hours);
  * ``NYBBLE_GPU_TESTS_REQUIRE_GPU=1`` (bench/gpu_check.sh sets it): the module refuses to be collected
    unless a Hopper GPU runs it, so a GPU check never passes on interpret mode;
  * ``NYBBLE_GPU_TESTS_INJECT=<bug>`` (one of ``tests/kernel_faults.BUGS``): the kernel is
    broken on purpose and the run must fail, which proves these tests catch such a bug.

What is checked:
  * bit-exact small-integer cases (``kernel_checks.exact_weight``): every config the heuristics pick at
    the benchmark's named shapes (bench/arg_specs.py) for every M of its sweep and every group size, each
    on the smallest problem of its structure (two M tiles, the last partial, or all K slices; two CTA
    columns; each split's pipeline wrapping around its slots; two groups or more); and both kernel
    families (w4a16, w4a16_ws) x both scale routes x K slices x split-K, groups 16..256 and per column,
    symmetric and asymmetric, bf16 and f16 activations, bf16 and f32 scales, partial last groups, odd K
    and N;
  * random data at real shapes: every output element within the rounding bound of the float64 reference
    for the kernel's scale route (``kernel_checks.assert_kernel_within_rounding``), not a norm ratio;
  * ``nybble.matmul`` with the default implementation (the kernel) under ``jit``, ``vmap`` and ``grad``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from bench.arg_specs import M_SWEEP, SHAPES
from bench.xray.heuristic_cases import heuristic_cases
from nybble.kernels import available_implementations, interpret
from nybble.kernels.mosaic_gpu import TuningConfig, mosaic_gpu_matmul, plan
from nybble.kernels.ops.matmul.reference import reference_dequantize, rounding_bound
from nybble.packing import padded_weight_dims
from tests import kernel_faults as faults
from tests.kernel_checks import (
    activations,
    assert_exact,
    assert_kernel_within_rounding,
    check_rows,
    env_flag,
    exact_weight,
    gpu_tests_mode,
    k_wrapping_the_pipeline,
    random_weight,
)

INTERPRET = gpu_tests_mode()[0] == "interpret"  # raises under NYBBLE_GPU_TESTS_REQUIRE_GPU=1 off-GPU
ALL_CASES = not INTERPRET or env_flag("NYBBLE_GPU_TESTS_ALL")
SMOKE = INTERPRET and not ALL_CASES and not env_flag("NYBBLE_GPU_TESTS_INTERPRET")
NUM_SMS = nybble.kernels.num_sms()  # the GPU's own count; 132 (H100/H200) without one
GROUPS = [128, 16, 32, 64, 256, None]

INJECT = os.environ.get("NYBBLE_GPU_TESTS_INJECT") or None
if INJECT is not None and INJECT not in faults.BUGS:
    raise ValueError(f"NYBBLE_GPU_TESTS_INJECT={INJECT!r}: choose one of {', '.join(faults.BUGS)}")


@pytest.fixture(autouse=True, scope="module")
def _bug_injection():
    """NYBBLE_GPU_TESTS_INJECT: every kernel of this module traced with that bug (tests/kernel_faults.py)."""
    if INJECT is None:
        yield
        return
    with faults.injecting(INJECT):
        yield


def _on_device():
    """Where kernels run: the GPU itself, or GPU interpret mode on the CPU."""
    return interpret() if INTERPRET else contextlib.nullcontext()


def _cases(rows):
    """pytest params from (cheap, id, values...): all of them on a GPU, the cheap ones in interpret mode,
    the first cheap one in CI's smoke check."""
    cases = [pytest.param(*values, id=name) for cheap, name, *values in rows if cheap or ALL_CASES]
    return cases[:1] if SMOKE else cases


def _config_id(c: TuningConfig) -> str:
    return c.tag


def _run_exact(config, m, k, n, group, symmetric, *, x_dtype, scale_dtype, seed):
    rng = np.random.default_rng(seed)
    qw = exact_weight(rng, k, n, group, symmetric, scale_dtype=scale_dtype)
    x = activations(rng, m, k, x_dtype, exact=True)
    with _on_device():
        y = mosaic_gpu_matmul(x, qw, config=config, num_sms=NUM_SMS)
    assert y.shape == (m, n) and y.dtype == x_dtype
    assert_exact(y, x, qw)


# ---------------------------------------------------------------- every config the heuristics pick


def _smallest_problem(
    config: TuningConfig, group: int | None, odd: bool, past_k: bool = False
) -> tuple[int, int, int]:
    """(M, K, N) with the config's structure: two M tiles, the last partial (or, with K slices, every
    slice's rows), two CTA columns or more (the last one real outputs), each split's pipeline running one
    step more than its slots, and two groups or more per slice (a partial last one when G does not divide
    K_pad). ``odd``: K and N 5 and 3 short of their padded sizes (K a multiple of 64 again once padded).
    ``past_k``: the last K step runs past K_pad, where TMA zero-fills (as at the shape it was picked for)."""
    k_pad = k_wrapping_the_pipeline(config, group, past_k=past_k)
    n_pad = max(2 * config.cta_rows, 64)  # N pads to 64: the last CTA column must hold real outputs
    m = config.tile_m if config.slices > 1 else max(1, 2 * config.tile_m - 3)
    return m, k_pad - 5 * odd, n_pad - 3 * odd


def _heuristic_rows():
    """Each (config, symmetric) the heuristics pick at the named shapes for the M sweep and GROUPS, each
    with the group structure it was picked for that has been used least so far, so that every structure
    occurs. Interpret mode runs the smallest problem of each kernel family and scale route."""
    shapes, ms = sorted({(s.k, s.n) for s in SHAPES.values()}), M_SWEEP
    if not ALL_CASES:  # interpret mode runs a few: pick them among fewer problems (seconds, not ten)
        shapes, ms = [(576, 1536), (1536, 576), (4096, 4096)], (1, 16, 4096)
    picks: dict[tuple[TuningConfig, bool], list[tuple[object, int | None]]] = {}
    past_k: set[TuningConfig] = set()  # picked where the last K step runs past K_pad
    for (config, structure, symmetric), case in heuristic_cases(shapes, ms, GROUPS, NUM_SMS).items():
        picks.setdefault((config, symmetric), []).append((structure, case[3]))
        if config.runs_past_k(padded_weight_dims(case[1], case[2])[0]):
            past_k.add(config)
    used: dict[object, int] = {}
    rows, cheapest = [], {}
    for i, ((config, symmetric), candidates) in enumerate(picks.items()):
        structure, group = min(candidates, key=lambda c: used.get(c[0], 0))
        used[structure] = used.get(structure, 0) + 1
        m, k, n = _smallest_problem(config, group, odd=i % 2 == 1, past_k=config in past_k)
        name = f"{i:03d}-{_config_id(config)}-g{group}-{'sym' if symmetric else 'asym'}"
        rows.append([False, name, config, m, k, n, group, symmetric])
        family = (config.compute_wgs, config.slices > 1, config.scales_on, symmetric)
        if family not in cheapest or m * k * n < cheapest[family][0]:
            cheapest[family] = (m * k * n, len(rows) - 1)
    for _, index in cheapest.values():
        rows[index][0] = True
    return rows


@pytest.mark.parametrize("config, m, k, n, group, symmetric", _cases(_heuristic_rows()))
def test_every_heuristic_config_exact(config, m, k, n, group, symmetric):
    _run_exact(
        config, m, k, n, group, symmetric,
        x_dtype=jnp.bfloat16, scale_dtype=jnp.bfloat16, seed=m + k + n,
    )  # fmt: skip


# ---------------------------------------------------------------- families x routes x groups x dtypes

# (config, M, K_pad, N_pad): each family and route, each pipeline wrapping around its slots.
_FAMILIES = {
    # Decode, 8 K slices, scales on the accumulators: 4 steps a slice through 2 slots.
    "slices8-acc": (
        TuningConfig(
            tiles=1, tile_m=1, tile_k=128, slices=8, max_concurrent_steps=2, scales_on="accumulators"
        ),
        1, 4096, 128,
    ),
    # Decode, 4 K slices, weights route, two A tiles: 4 steps a slice through 2 slots.
    "slices4-wt": (TuningConfig(tiles=2, tile_m=2, tile_k=64, slices=4, max_concurrent_steps=2), 2, 1024, 64),
    # Decode, split-K 4 in a cluster (3 steps a split through 2 slots; of the four 8-row slabs of y two
    # hold rows < M = 13, two are not stored), weights route, planar snake of 1.
    "split4-wt": (
        TuningConfig(tiles=1, tile_m=32, tile_k=64, max_concurrent_steps=2, split_k=4, grid_tile_m=1),
        13, 768, 128,
    ),
    # Decode, split-K 4, scales on the accumulators: each CTA of the cluster sums 8 rows of one A tile.
    "split4-acc": (
        TuningConfig(
            tiles=2, tile_m=16, tile_k=128, max_concurrent_steps=2, split_k=4, scales_on="accumulators"
        ),
        5, 1536, 256,
    ),
    # Prefill: warp-specialized, two compute warpgroups, 5 steps through 2 slots.
    "ws": (
        TuningConfig(tiles=1, tile_m=64, tile_k=128, max_concurrent_steps=2, compute_wgs=2), 125, 640, 256
    ),
}  # fmt: skip


def _fits(config: TuningConfig, group: int | None, k_pad: int) -> TuningConfig:
    """The family's config adapted to a group size it cannot take as it is (the same adaptation the
    heuristics make): groups of 16 and 32 run on the weights route without K slices."""
    g = k_pad if group is None else group
    if g % 64 == 0:
        return config
    config = dataclasses.replace(config, scales_on="weights")
    if config.slices > 1:
        config = dataclasses.replace(config, slices=1, tile_m=8)
    return config


def _family_rows():
    """Group sizes x symmetric x family, each with one combination of activation and scale dtype (all
    four occur in each family); every other case has odd K and N."""
    rows = []
    for j, (group, symmetric, family) in enumerate(
        (g, s, f) for g in (16, 32, 64, 128, 256, None) for s in (True, False) for f in _FAMILIES
    ):
        base, m, k_pad, n_pad = _FAMILIES[family]
        config = _fits(base, group, k_pad)
        combo = (3 * j + (j // 20)) % 4
        x_dtype = (jnp.bfloat16, jnp.float16)[combo & 1]
        scale_dtype = (jnp.bfloat16, jnp.float32)[combo >> 1]
        odd = j % 2
        name = (
            f"{family}-g{group}-{'sym' if symmetric else 'asym'}-x{jnp.dtype(x_dtype).name}-"
            f"s{jnp.dtype(scale_dtype).name}{'-odd' if odd else ''}"
        )
        # Cheap in interpret mode: split-K weights route, g256 asymmetric (K = 576: a quarter-full last
        # group); prefill, g32 symmetric; 8 K slices on the accumulators, g128 asymmetric.
        cheap = (group, symmetric, family) in (
            (256, False, "split4-wt"), (32, True, "ws"), (128, False, "slices8-acc"),
        )  # fmt: skip
        rows.append([cheap, name, config, m, k_pad - 5 * odd, n_pad - 3 * odd, group, symmetric,
                     x_dtype, scale_dtype])  # fmt: skip
    return rows


@pytest.mark.parametrize(
    "config, m, k, n, group, symmetric, x_dtype, scale_dtype", _cases(_family_rows())
)
def test_families_routes_groups_exact(config, m, k, n, group, symmetric, x_dtype, scale_dtype):
    _run_exact(
        config, m, k, n, group, symmetric,
        x_dtype=x_dtype, scale_dtype=scale_dtype, seed=k + n + (group or 0),
    )  # fmt: skip


# ---------------------------------------------------------------- random data, elementwise bound

_REAL = [(4096, 4096, 128, True), (576, 1536, 128, False), (1536, 576, None, True), (10944, 7392, 32, False)]
_EXPLICIT = [
    TuningConfig(tiles=2, tile_m=32, tile_k=128, max_concurrent_steps=6, split_k=4, scales_on="accumulators"),
    TuningConfig(tiles=1, tile_m=64, tile_k=64, max_concurrent_steps=4, split_k=2),
    TuningConfig(tiles=2, tile_m=128, tile_k=128, max_concurrent_steps=4, split_k=1),
    TuningConfig(tiles=2, tile_m=128, tile_k=64, max_concurrent_steps=4, compute_wgs=2),
    TuningConfig(tiles=1, tile_m=16, tile_k=128, max_concurrent_steps=3, split_k=2, compute_wgs=2),
    TuningConfig(tiles=2, tile_m=4, tile_k=128, slices=2, max_concurrent_steps=3, scales_on="accumulators"),
]
_BF16, _F16, _F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _random_rows():
    rows = [  # weight-major, so that consecutive cases share the cached weights
        [False, f"M{m}-K{k}-N{n}-g{g}-{'sym' if s else 'asym'}", m, k, n, g, s, _BF16, _BF16, None]
        for k, n, g, s in _REAL
        for m in (1, 7, 16, 100, 512, 2048)
    ]
    rows += [
        [False, f"M{c.tile_m if c.slices > 1 else 37}-K4096-N1024-g64-asym-f16-{_config_id(c)}",
         c.tile_m if c.slices > 1 else 37, 4096, 1024, 64, False, _F16, _BF16, c]
        for c in _EXPLICIT
    ]  # fmt: skip
    rows += [
        [False, "M16-K4096-N4096-g128-asym-f16-f32scales", 16, 4096, 4096, 128, False, _F16, _F32, None],
        [False, "M300-K1536-N576-g32-sym-f32scales", 300, 1536, 576, 32, True, _BF16, _F32, None],
        [True, "M5-K384-N256-g64-asym", 5, 384, 256, 64, False, _BF16, _BF16, None],
        [True, "M1-K1024-N128-g128-asym", 1, 1024, 128, 128, False, _BF16, _BF16, None],
        [True, "M9-K512-N192-col-sym-f16-f32scales", 9, 512, 192, None, True, _F16, _F32, None],
    ]
    return rows


@functools.lru_cache(maxsize=1)
def _random_weight(k, n, group, symmetric, scale_dtype):
    """One weight per shape, shared by the M values (quantizing takes seconds at the largest shapes)."""
    return random_weight(np.random.default_rng(k * n), k, n, group, symmetric, scale_dtype=scale_dtype)


@pytest.mark.parametrize("m, k, n, group, symmetric, x_dtype, scale_dtype, config", _cases(_random_rows()))
def test_random_within_rounding(m, k, n, group, symmetric, x_dtype, scale_dtype, config):
    qw = _random_weight(k, n, group, symmetric, scale_dtype)
    x = activations(np.random.default_rng(m + k), m, k, x_dtype)
    with _on_device():
        y = jax.jit(lambda x, qw: mosaic_gpu_matmul(x, qw, config=config, num_sms=NUM_SMS))(x, qw)
    assert y.shape == (m, n) and y.dtype == x_dtype
    assert np.isfinite(np.asarray(y, np.float32)).all(), "NaN or Inf in the output"
    route = plan(m, qw, num_sms=NUM_SMS, config=config).config.scales_on
    assert_kernel_within_rounding(y, x, qw, route, rows=check_rows(m, 128))


# ---------------------------------------------------------------- the public API


@pytest.mark.parametrize(
    "batch, k, n, group",
    _cases([[True, "small", (2, 3), 256, 192, 64], [False, "smollm2", (4, 5), 576, 1536, 128]]),
)
def test_public_matmul_jit_vmap_grad(batch, k, n, group):
    """nybble.matmul's default implementation is the kernel here; under jit, vmap and grad."""
    rng = np.random.default_rng(k)
    qw = random_weight(rng, k, n, group, False)
    x = activations(rng, int(np.prod(batch)), k).reshape(*batch, k)
    c = jnp.asarray(rng.standard_normal((*batch, n)), jnp.bfloat16)
    with _on_device():
        assert available_implementations(x, qw)["mosaic_gpu"]
        assert "wgmma" in str(jax.make_jaxpr(nybble.matmul)(x, qw))  # the kernel, not XLA's dot
        y = jax.jit(nybble.matmul)(x, qw)
        yv = jax.vmap(lambda xb: nybble.matmul(xb, qw))(x)
        dx = jax.grad(lambda x: jnp.vdot(nybble.matmul(x, qw).astype(jnp.float32), c.astype(jnp.float32)))(x)
    m = int(np.prod(batch))
    route = plan(m, qw, num_sms=NUM_SMS).config.scales_on
    assert y.shape == (*batch, n) and y.dtype == jnp.bfloat16
    assert_kernel_within_rounding(y.reshape(-1, n), x.reshape(-1, k), qw, route)
    # vmap over the first axis: each call has M = batch[1] rows, which may pick another config.
    route_v = plan(batch[1], qw, num_sms=NUM_SMS).config.scales_on
    assert yv.shape == (*batch, n) and yv.dtype == jnp.bfloat16
    for i in range(batch[0]):
        assert_kernel_within_rounding(yv[i], x[i], qw, route_v)
    # d/dx <x @ W, c> = c @ W^T; the backward pass rounds W once to c's dtype (bf16).
    assert dx.shape == x.shape and dx.dtype == x.dtype
    w_t = reference_dequantize(qw, jnp.bfloat16).T
    c64 = np.asarray(c, np.float64)
    err = np.abs(np.asarray(dx, np.float64) - c64 @ w_t)
    assert (err <= rounding_bound(c64, w_t, jnp.bfloat16)).all(), float(err.max())

