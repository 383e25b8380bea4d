"""The grouped (mixture-of-experts) Blackwell kernel in GPU interpret mode as a B200, races checked.

Every (tile_m, tile_k) the grouped B200 heuristics can pick runs once
(:func:`test_heuristics_pick_only_covered_configs` keeps that true at the MoE shapes), bit-exact on
small-integer data against each group's rows times its expert's float64 weight (zeros past the groups),
or, on random data, within the rounding bound of the float64 reference group by group. Along the way:
empty experts, rows past the sum, groups across M tiles, one expert holding every row, per-column and
16-row groups, f16, asymmetric and symmetric weights, N an odd multiple of 64, K and N not multiples of
64. Tiny shapes: interpret mode is slow. The Hopper grouped kernel's own tests are
tests/test_grouped_interpret.py; lowering for sm_100a is tests/test_blackwell_lowering.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
import nybble.kernels.mosaic_gpu as mg
from bench.xray.moe_cases import MOE_SHAPES
from nybble.kernels.mosaic_gpu.blackwell import BlackwellConfig
from nybble.kernels.mosaic_gpu.blackwell.config import DEFAULT_NUM_SMS
from nybble.kernels.mosaic_gpu.blackwell.grouped import (
    blackwell_grouped_matmul,
    grouped_heuristic_config,
    grouped_plan,
)
from nybble.kernels.mosaic_gpu.interpret import interpret
from tests.kernel_checks import activations, assert_kernel_within_rounding, exact_weight, random_weight
from tests.test_grouped_interpret import assert_exact, reference

f16, bf16 = jnp.float16, jnp.bfloat16
# (sizes, rows, K, N, group, symmetric, x dtype, exact) -> the (tile_m, tile_k, slices) the heuristics pick.
CASES = [
    (([0, 7, 0], 9, 192, 192, 64, True, f16, True), (16, 64, 1)),  # one expert, N = 3 x 64
    (([3, 0, 5, 2], 12, 128, 128, 32, False, bf16, True), (16, 128, 1)),  # 2 rows past the sum
    (([1, 0], 2, 256, 64, 128, True, bf16, True), (16, 256, 1)),  # group accumulators, a row past the sum
    (([25, 10], 40, 128, 100, 16, True, bf16, False), (32, 128, 1)),  # random data, N = 100, 16-row groups
    (([0, 60, 40], 100, 150, 128, 32, False, bf16, False), (64, 64, 1)),  # random, K = 150
    (([50, 40], 90, 384, 64, 128, True, bf16, True), (64, 128, 1)),  # groups across 64-row tiles
    (([0, 150], 200, 192, 64, 64, True, bf16, True), (128, 64, 1)),  # 50 rows past the sum, K = 3 x 64
    (([170, 130], 300, 256, 64, 128, True, bf16, True), (128, 128, 1)),  # two 128-row tiles an expert
    (([260, 240], 500, 64, 64, None, False, bf16, True), (256, 64, 1)),  # 256-row tiles (FEW_SMS), per column
    (([200, 150], 350, 64, 64, 32, False, bf16, True), (192, 64, 1)),  # 192-row tiles (FEW_SMS), 2 for one
    # K slices: an M tile holds tile_m / S rows of one expert
    (([6, 1], 8, 256, 64, 64, False, bf16, True), (16, 64, 4)),  # an expert across two 4-row M tiles, 1 past
    (([2, 0], 2, 512, 64, 128, True, f16, True), (16, 128, 4)),  # group accumulators, f16 (exact q)
    (([0, 1], 2, 1024, 64, 128, True, bf16, True), (16, 256, 4)),  # 2 accumulators a step, the bias fold
    # K = 1536 (Qwen3-235B-A22B's down): 4 slices of 384 take 128-deep steps, 2 of 768 256-deep ones
    # (config.with_deeper_steps; one SM, so that the 4 slices' CTAs take two waves)
    (([1, 1], 2, 1536, 64, 128, True, bf16, True), (16, 256, 2)),
]
# SMs the heuristics plan for, where not a B200's 148: every tiny case fits one wave there, where 128-row M
# tiles beat wider ones. On two SMs 250 rows an expert tie in waves x tile_m (256 x 1 = 128 x 2; 192 x 2),
# and ties go to the wider tile; 175 rows an expert take one 192-row tile each (one wave) over two of 128.
FEW_SMS = {(500, 64): 2, (350, 64): 2, (2, 1536): 1}
# Wider sliced tiles, which the picks leave (grouped.MAX_SLICED_TILE_M) but a config may name: (sizes, rows,
# K, N, group, symmetric, exact, config).
EXPLICIT_SLICED = [
    # per-column scales, an empty expert; 2 slices of 64-row tiles, random data
    ([20, 0, 30], 50, 512, 64, None, False, False,
     BlackwellConfig(tile_m=128, tile_k=64, max_concurrent_steps=2, slices=2)),
]  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    mg.reset_state()


def _stacked(rng, experts, k, n, group, symmetric, exact):
    make = exact_weight if exact else random_weight
    ws = [make(rng, k, n, group, symmetric) for _ in range(experts)]
    return jax.tree.map(lambda *a: jnp.stack(a), *ws), ws


def _run(x, qw, sizes, config=None, *, jit=False, num_sms=DEFAULT_NUM_SMS):
    fn = lambda x, s: blackwell_grouped_matmul(x, qw, s, config=config, num_sms=num_sms)
    with interpret(detect_races=True, gpu="b200"):
        y = (jax.jit(fn) if jit else fn)(x, jnp.asarray(sizes, jnp.int32))
    assert not mg.races_found(), "the race detector flagged a data race"
    return y


def _assert_random_close(y, x, qw, ws, sizes, config=None):
    """Each group's rows within the rounding bound of the float64 reference of the kernel's scale route
    (``scales_on``); zeros past the sum."""
    route = grouped_plan(x.shape[0], qw, config=config)[0].scales_on
    row = 0
    for w, g in zip(ws, sizes, strict=True):
        if g:
            assert_kernel_within_rounding(y[row : row + g], x[row : row + g], w, route)
        row += g
    assert (np.asarray(y[row:], np.float64) == 0).all()


@pytest.mark.sweep
@pytest.mark.parametrize("case,tiling", CASES, ids=[f"m{t[0]}_k{t[1]}_x{t[2]}" for _, t in CASES])
def test_heuristic_configs(case, tiling):
    sizes, rows, k, n, group, symmetric, dtype, exact = case
    rng = np.random.default_rng(rows * 100 + k)
    qw, ws = _stacked(rng, len(sizes), k, n, group, symmetric, exact)
    num_sms = FEW_SMS.get((rows, k), DEFAULT_NUM_SMS)
    c = grouped_plan(rows, qw, num_sms=num_sms)[0].config
    assert (c.tile_m, c.tile_k, c.slices) == tiling
    x = activations(rng, rows, k, dtype, exact=exact)
    y = _run(x, qw, sizes, num_sms=num_sms)
    assert y.shape == (rows, n) and y.dtype == x.dtype
    if exact:
        assert_exact(np.asarray(y, np.float64), reference(x, ws, sizes))
    else:
        _assert_random_close(y, x, qw, ws, sizes)


@pytest.mark.parametrize("sizes,rows,k,n,group,symmetric,exact,config", EXPLICIT_SLICED)
def test_explicit_sliced_tiles(sizes, rows, k, n, group, symmetric, exact, config):
    rng = np.random.default_rng(rows + k)
    qw, ws = _stacked(rng, len(sizes), k, n, group, symmetric, exact)
    x = activations(rng, rows, k, bf16, exact=exact)
    y = _run(x, qw, sizes, config)
    assert y.shape == (rows, n)
    if exact:
        assert_exact(np.asarray(y, np.float64), reference(x, ws, sizes))
    else:
        _assert_random_close(y, x, qw, ws, sizes, config)


def test_traced_sizes_and_the_dispatcher():
    """Under jit the sizes are traced: a negative one counts as zero, rows past x's are dropped (as in the
    XLA path); ``nybble.ragged_matmul`` inside ``interpret(gpu="b200")`` runs this kernel; no rows in any
    group stores zeros without reading a weight."""
    rng = np.random.default_rng(3)
    qw, ws = _stacked(rng, 3, 128, 64, 64, True, True)
    x = activations(rng, 6, 128, exact=True)
    config = BlackwellConfig(tile_m=16, tile_k=128, max_concurrent_steps=2)
    y = _run(x, qw, [2, -3, 9], config, jit=True)
    assert_exact(np.asarray(y, np.float64), reference(x, ws, [2, 0, 4]))
    sliced = BlackwellConfig(tile_m=16, tile_k=64, max_concurrent_steps=2, slices=2)  # 8-row M tiles
    y = _run(x, qw, [2, -3, 9], sliced, jit=True)
    assert_exact(np.asarray(y, np.float64), reference(x, ws, [2, 0, 4]))
    assert (np.asarray(_run(x, qw, [0, 0, 0], config)) == 0).all()
    sizes = jnp.asarray([4, 0, 2], jnp.int32)
    with interpret(detect_races=True, gpu="b200"):
        text = str(
            jax.make_jaxpr(lambda x: nybble.ragged_matmul(x, qw, sizes, implementation="mosaic_gpu"))(x)
        )
        y = nybble.ragged_matmul(x, qw, sizes, implementation="mosaic_gpu")
    assert "nybble_grouped_w4a16_bw_" in text and not mg.races_found()
    assert_exact(np.asarray(y, np.float64), reference(x, ws, [4, 0, 2]))


def test_refusals_by_name():
    """What the Hopper grouped kernel refuses, refused with its words; and K slices, by name."""
    rng = np.random.default_rng(1)
    qw, _ = _stacked(rng, 3, 128, 64, 128, True, True)
    x = jnp.zeros((5, 128), bf16)
    sizes = jnp.asarray([1, 2, 2], jnp.int32)
    one = exact_weight(rng, 128, 64, 128, True)
    for args, match in [
        ((x, one, sizes), "stacked expert weight"),
        ((x, qw, jnp.asarray([1, 2], jnp.int32)), r"expected \(3,\)"),
        ((jnp.zeros((5, 100), bf16), qw, sizes), "K=100"),
        ((x.astype(jnp.float32), qw, sizes), "float32"),
    ]:
        with pytest.raises(NotImplementedError, match=match):
            blackwell_grouped_matmul(*args)
        with pytest.raises(NotImplementedError, match=match):
            mg.grouped_matmul(*args)
    with pytest.raises(ValueError, match=">= 0"):
        blackwell_grouped_matmul(x, qw, jnp.asarray([3, -1, 2], jnp.int32))
    with pytest.raises(ValueError, match="more than x's 5 rows"):
        blackwell_grouped_matmul(x, qw, jnp.asarray([3, 2, 1], jnp.int32))
    with pytest.raises(TypeError, match="must be a BlackwellConfig"):
        blackwell_grouped_matmul(x, qw, sizes, config=mg.TuningConfig())
    assert blackwell_grouped_matmul(x[:0], qw, jnp.zeros(3, jnp.int32)).shape == (0, 64)


def test_heuristics_pick_only_covered_configs():
    """At the MoE shapes (gate-up and down of each model) for 1..8192 tokens and every group size, every
    config the grouped B200 heuristics pick is one of :data:`CASES`' tilings (K slices included)."""
    covered = {tiling for _, tiling in CASES}
    picked = set()
    for hidden, inter, experts, top_k in MOE_SHAPES.values():
        for kk, nn in ((hidden, inter), (hidden, 2 * inter), (inter, hidden)):
            for tokens in (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192):
                for group in (16, 32, 64, 128, 256, kk):
                    c = grouped_heuristic_config(tokens * top_k, experts, -(-nn // 64) * 64, kk, group)
                    picked.add((c.tile_m, c.tile_k, c.slices))
    assert picked <= covered, f"configs picked but never interpreted: {sorted(picked - covered)}"
