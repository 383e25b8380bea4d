"""The Mosaic GPU W4A16 kernel against the float64 reference: on a Hopper GPU, or in interpret mode.

Where it runs (the pytest header says which; see ``gpu_tests_mode`` in tests/kernel_checks.py):
  * on a Hopper GPU: every case below;
  * without one (CI), or with ``NYBBLE_GPU_TESTS_INTERPRET=1``: in GPU interpret mode on the CPU, the
    cases marked cheap (the same tests and checks at small shapes: interpret mode takes seconds a kernel);
    ``NYBBLE_GPU_TESTS_ALL=1`` runs every case there too (select some with ``-k``: the largest would
    take hours);
  * ``NYBBLE_GPU_TESTS_REQUIRE_GPU=1`` (bench/gpu_check.sh sets it): the module refuses to be collected
    unless a Hopper GPU runs it, so a GPU check never passes on interpret mode;
  * ``NYBBLE_GPU_TESTS_INJECT=<bug>`` (a key of ``INJECTABLE_BUGS``): the kernel is broken on purpose
    (see ``inject_bug``) and the run must fail, which proves these tests catch such a bug.

What is checked:
  * bit-exact small-integer cases (``kernel_checks.exact_weight``): every config the heuristics pick at
    the lowering tests' real-model shapes, each on the smallest problem of its structure (two M tiles, the
    last partial; two CTA columns; each split's pipeline wrapping around its slots; two groups or more);
    and every kernel family, code path, codes storage, group size 16..256 and per column, symmetric and
    asymmetric, bf16 and f16 activations, bf16 and f32 scales, partial last groups, odd K and N;
  * random data at real shapes: every output element within the rounding bound of the float64 reference
    (``nybble.kernels.reference.rounding_bound``), not a norm ratio;
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
from nybble.kernels import available_implementations, interpret
from nybble.kernels.mosaic_gpu import TuningConfig, heuristic_cases, mosaic_gpu_matmul
from nybble.kernels.reference import reference_dequantize, rounding_bound
from tests.kernel_checks import (
    activations,
    assert_exact,
    assert_within_rounding,
    check_rows,
    env_flag,
    exact_weight,
    gpu_tests_mode,
    random_weight,
)
from tests.test_kernel_lowering import BATCHES, GROUPS, WEIGHT_SHAPES

INTERPRET = gpu_tests_mode()[0] == "interpret"  # raises under NYBBLE_GPU_TESTS_REQUIRE_GPU=1 off-GPU
ALL_CASES = not INTERPRET or env_flag("NYBBLE_GPU_TESTS_ALL")
NUM_SMS = nybble.kernels.num_sms()  # the GPU's own count; 132 (H100/H200) without one

# Deliberately broken kernels (NYBBLE_GPU_TESTS_INJECT=<key>), each a bug these tests must catch.
INJECTABLE_BUGS = {
    "asym-bf16-dequant": "asymmetric dequantization rounded in bf16: bf16(bf16(q * s) + o)",
    "last-group-scale-row": "the last group of K is scaled with the scale row before it",
    "last-n-tile-zero": "the last tile_n output columns are zero",
}
INJECT = os.environ.get("NYBBLE_GPU_TESTS_INJECT") or None
if INJECT is not None and INJECT not in INJECTABLE_BUGS:
    raise ValueError(f"NYBBLE_GPU_TESTS_INJECT={INJECT!r}: choose one of {sorted(INJECTABLE_BUGS)}")


def inject_bug(monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    """Breaks the kernel on purpose, from the test side (the kernel files stay untouched).

    The injection points follow the kernel's structure: the dequantization of one register tile
    (``common._scale_rows``), and the padded kernel call the op wraps (``api.w4a16_padded``).
    """
    from nybble.kernels.mosaic_gpu import api, common

    if bug == "asym-bf16-dequant":
        scale_rows = common._scale_rows

        def rounded_in_bf16(p, s_smem, o_smem, w, k0, k_stride):
            ws = scale_rows(p, s_smem, None, w, k0, k_stride)
            if o_smem is None:
                return ws
            o = scale_rows(p, o_smem, None, w * 0 + 1, k0, k_stride)  # offsets, laid out like the scales
            return (ws.astype(jnp.bfloat16) + o.astype(jnp.bfloat16)).astype(jnp.float32)

        monkeypatch.setattr(common, "_scale_rows", rounded_in_bf16)
        return
    padded = api.w4a16_padded

    def broken(x_pad, codes, scales, offsets, *, group, config):
        if bug == "last-group-scale-row" and scales.shape[0] > 1:
            scales = scales.at[-1].set(scales[-2])
        y = padded(x_pad, codes, scales, offsets, group=group, config=config)
        if bug == "last-n-tile-zero":
            y = y.at[..., -config.tile_n :].set(0)
        return y

    monkeypatch.setattr(api, "w4a16_padded", broken)


@pytest.fixture(autouse=True)
def _bug_injection(monkeypatch):
    if INJECT is not None:
        inject_bug(monkeypatch, INJECT)


def _on_device():
    """Where kernels run: the GPU itself, or GPU interpret mode on the CPU."""
    return interpret() if INTERPRET else contextlib.nullcontext()


def _cases(rows):
    """pytest params from (cheap, id, values...): all of them on a GPU, the cheap ones in interpret mode."""
    return [pytest.param(*values, id=name) for cheap, name, *values in rows if cheap or ALL_CASES]


def _config_id(c: TuningConfig) -> str:
    return (
        f"n{c.tile_n}m{c.tile_m}k{c.tile_k}s{c.max_concurrent_steps}x{c.split_k}b{c.grid_tile_m}"
        f"w{c.compute_wgs}{c.codes_as}"
    )


def _run_exact(config, m, k, n, group, symmetric, *, x_dtype, scale_dtype, codes_dtype, seed):
    rng = np.random.default_rng(seed)
    qw = exact_weight(rng, k, n, group, symmetric, scale_dtype=scale_dtype, codes_dtype=codes_dtype)
    x = activations(rng, m, k, x_dtype, exact=True)
    with _on_device():
        y = mosaic_gpu_matmul(x, qw, config=config, num_sms=NUM_SMS)
    assert y.shape == (m, n) and y.dtype == x_dtype
    assert_exact(y, x, qw)


# ---------------------------------------------------------------- every config the heuristics pick


def _smallest_problem(config: TuningConfig, group: int | None, odd: bool) -> tuple[int, int, int]:
    """(M, K, N) with the config's structure: two M tiles (the last partial), two CTA columns, each
    split's pipeline running one step more than its slots, and two groups or more (a partial last one
    when G does not divide K_pad). ``odd``: K and N 5 and 3 short of their padded sizes."""
    step = config.tile_k * config.split_k
    k_pad = step * (config.max_concurrent_steps + 1)
    while group is not None and k_pad < 2 * group:
        k_pad += step
    n_pad = 2 * config.tile_n * config.compute_wgs
    return 2 * config.tile_m - 3, k_pad - 5 * odd, n_pad - 3 * odd


def _heuristic_rows():
    """Each (config, symmetric) the heuristics pick at the lowering tests' shapes (78 kernels at 132 SMs:
    every pick lowers in test_kernel_lowering.py, 258 with the group structures), each with the group
    structure it was picked for that has been used least so far, so that every structure occurs."""
    picks: dict[tuple[TuningConfig, bool], list[tuple[object, int | None, str]]] = {}
    all_picks = heuristic_cases(WEIGHT_SHAPES, BATCHES, GROUPS, NUM_SMS)
    for (config, structure, symmetric), case in all_picks.items():
        picks.setdefault((config, symmetric), []).append((structure, case[3], case[5]))
    used: dict[object, int] = {}
    rows, cheapest = [], {}
    for i, ((config, symmetric), candidates) in enumerate(picks.items()):
        structure, group, codes_dtype = min(candidates, key=lambda c: used.get(c[0], 0))
        used[structure] = used.get(structure, 0) + 1
        m, k, n = _smallest_problem(config, group, odd=i % 2 == 1)
        name = f"{i:02d}-{_config_id(config)}-g{group}-{'sym' if symmetric else 'asym'}-{codes_dtype}"
        rows.append([False, name, config, m, k, n, group, symmetric, codes_dtype])
        # Interpret mode runs the smallest problem of each kernel family.
        family = config.compute_wgs
        if family not in cheapest or m * k * n < cheapest[family][0]:
            cheapest[family] = (m * k * n, len(rows) - 1)
    for _, index in cheapest.values():
        rows[index][0] = True
    return rows


@pytest.mark.parametrize("config, m, k, n, group, symmetric, codes_dtype", _cases(_heuristic_rows()))
def test_every_heuristic_config_exact(config, m, k, n, group, symmetric, codes_dtype):
    _run_exact(
        config, m, k, n, group, symmetric,
        x_dtype=jnp.bfloat16, scale_dtype=jnp.bfloat16, codes_dtype=codes_dtype, seed=m + k + n,
    )  # fmt: skip


# ---------------------------------------------------------------- families x paths x groups x dtypes

# Decode family: one warpgroup, split-K (3 steps a split through 2 slots), 64-wide K steps, K_pad = 576.
_DECODE = TuningConfig(tile_n=64, tile_m=8, tile_k=64, max_concurrent_steps=2, split_k=3, grid_tile_m=1)
# Prefill family: warp-specialized, two compute warpgroups, 128-wide K steps (5 through 2 slots), K_pad 640.
_PREFILL = TuningConfig(tile_n=64, tile_m=64, tile_k=128, max_concurrent_steps=2, compute_wgs=2)


def _family_rows():
    """Group sizes x symmetric x family, each with one combination of code path, codes storage,
    activation dtype and scale dtype (all 16 combinations occur); every other case has odd K and N."""
    rows = []
    for j, (group, symmetric, prefill) in enumerate(
        (g, s, f) for g in (16, 32, 64, 128, 256, None) for s in (True, False) for f in (False, True)
    ):
        combo = (7 * j) % 16
        codes_as = ("int4", "uint8")[combo & 1]
        codes_dtype = ("uint8", "int4")[(combo >> 1) & 1]
        x_dtype = (jnp.bfloat16, jnp.float16)[(combo >> 2) & 1]
        scale_dtype = (jnp.bfloat16, jnp.float32)[(combo >> 3) & 1]
        base = _PREFILL if prefill else _DECODE
        config = dataclasses.replace(base, codes_as=codes_as)
        m, k_pad, n_pad = (125, 640, 256) if prefill else (13, 576, 128)
        odd = j % 2
        name = (
            f"{'prefill' if prefill else 'decode'}-g{group}-{'sym' if symmetric else 'asym'}-{codes_as}-"
            f"{codes_dtype}-x{jnp.dtype(x_dtype).name}-s{jnp.dtype(scale_dtype).name}{'-odd' if odd else ''}"
        )
        # Cheap in interpret mode: decode, g256 asymmetric (K = 576: a quarter-full last group), f16
        # activations and f32 scales, int4 path; and prefill, g32 symmetric, uint8 path, odd K and N.
        cheap = (group, symmetric, prefill) in ((256, False, False), (32, True, True))
        rows.append([cheap, name, config, m, k_pad - 5 * odd, n_pad - 3 * odd, group, symmetric,
                     codes_dtype, x_dtype, scale_dtype])  # fmt: skip
    return rows


@pytest.mark.parametrize(
    "config, m, k, n, group, symmetric, codes_dtype, x_dtype, scale_dtype", _cases(_family_rows())
)
def test_families_paths_groups_exact(config, m, k, n, group, symmetric, codes_dtype, x_dtype, scale_dtype):
    _run_exact(
        config, m, k, n, group, symmetric,
        x_dtype=x_dtype, scale_dtype=scale_dtype, codes_dtype=codes_dtype, seed=k + n + (group or 0),
    )  # fmt: skip


# ---------------------------------------------------------------- random data, elementwise bound

_REAL = [(4096, 4096, 128, True), (576, 1536, 128, False), (1536, 576, None, True), (10944, 7392, 32, False)]
_EXPLICIT = [
    TuningConfig(tile_n=128, tile_m=8, tile_k=128, max_concurrent_steps=6, split_k=4),
    TuningConfig(tile_n=64, tile_m=64, tile_k=64, max_concurrent_steps=4, split_k=2),
    TuningConfig(tile_n=128, tile_m=128, tile_k=128, max_concurrent_steps=4, split_k=1),
    TuningConfig(tile_n=128, tile_m=128, tile_k=64, max_concurrent_steps=4, compute_wgs=2),
    TuningConfig(tile_n=64, tile_m=16, tile_k=128, max_concurrent_steps=3, split_k=2, compute_wgs=2),
]
_BF16, _F16, _F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _random_rows():
    rows = [  # weight-major, so that consecutive cases share the cached weights
        [False, f"M{m}-K{k}-N{n}-g{g}-{'sym' if s else 'asym'}", m, k, n, g, s, _BF16, _BF16, None]
        for k, n, g, s in _REAL
        for m in (1, 7, 16, 100, 512, 2048)
    ]
    rows += [
        [False, f"M37-K4096-N1024-g64-asym-f16-{_config_id(c)}", 37, 4096, 1024, 64, False, _F16, _BF16, c]
        for c in _EXPLICIT
    ]
    rows += [
        [False, "M16-K4096-N4096-g128-asym-f16-f32scales", 16, 4096, 4096, 128, False, _F16, _F32, None],
        [False, "M300-K1536-N576-g32-sym-f32scales", 300, 1536, 576, 32, True, _BF16, _F32, None],
        [True, "M5-K384-N256-g64-asym", 5, 384, 256, 64, False, _BF16, _BF16, None],
        [True, "M9-K512-N192-col-sym-f16-f32scales", 9, 512, 192, None, True, _F16, _F32, None],
    ]
    return rows


@functools.lru_cache(maxsize=1)
def _random_weight(k, n, group, symmetric, scale_dtype, x_dtype):
    """One weight per shape, shared by the M values, with its float64 reference rounded to x's dtype
    (quantizing and the float64 weight take seconds at the largest shapes)."""
    qw = random_weight(np.random.default_rng(k * n), k, n, group, symmetric, scale_dtype=scale_dtype)
    return qw, reference_dequantize(qw, x_dtype)


@pytest.mark.parametrize("m, k, n, group, symmetric, x_dtype, scale_dtype, config", _cases(_random_rows()))
def test_random_within_rounding(m, k, n, group, symmetric, x_dtype, scale_dtype, config):
    qw, w = _random_weight(k, n, group, symmetric, scale_dtype, x_dtype)
    x = activations(np.random.default_rng(m + k), m, k, x_dtype)
    with _on_device():
        y = jax.jit(lambda x, qw: mosaic_gpu_matmul(x, qw, config=config, num_sms=NUM_SMS))(x, qw)
    assert y.shape == (m, n) and y.dtype == x_dtype
    assert np.isfinite(np.asarray(y, np.float32)).all(), "NaN or Inf in the output"
    assert_within_rounding(y, x, qw, rows=check_rows(m, 128), w=w)


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
        assert available_implementations(x, qw)["mosaic_gpu"] is None
        assert "wgmma" in str(jax.make_jaxpr(nybble.matmul)(x, qw))  # the kernel, not XLA's dot
        y = jax.jit(nybble.matmul)(x, qw)
        yv = jax.vmap(lambda xb: nybble.matmul(xb, qw))(x)
        dx = jax.grad(lambda x: jnp.vdot(nybble.matmul(x, qw).astype(jnp.float32), c.astype(jnp.float32)))(x)
    for out in (y, yv):
        assert out.shape == (*batch, n) and out.dtype == jnp.bfloat16
        assert_within_rounding(out.reshape(-1, n), x.reshape(-1, k), qw)
    # d/dx <x @ W, c> = c @ W^T; the backward pass rounds W once to c's dtype (bf16).
    assert dx.shape == x.shape and dx.dtype == x.dtype
    w_t = reference_dequantize(qw, jnp.bfloat16).T
    c64 = np.asarray(c, np.float64)
    err = np.abs(np.asarray(dx, np.float64) - c64 @ w_t)
    assert (err <= rounding_bound(c64, w_t, jnp.bfloat16)).all(), float(err.max())
