"""The Blackwell (tcgen05, TMEM) W4A16 kernel run on the CPU in GPU interpret mode as a B200, races checked.

Every (tile_m, tile_k) the B200 heuristics can pick runs once here (:func:`test_heuristics_pick_only_covered
configs` keeps that true over real model shapes), each case bit-exact on small-integer data or within the
rounding bound of the float64 reference on random data, and each group route of the dequantization (one
scale row per chunk, groups of 16 and 32 inside a chunk, per-column, groups spanning steps) at least once.
Tiny shapes: interpret mode is slow. Lowering for sm_100a is tests/test_blackwell_lowering.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
import nybble.kernels.mosaic_gpu as mg
from nybble.kernels.mosaic_gpu import interpret as mgpu_interpret
from nybble.kernels.mosaic_gpu.blackwell import BlackwellConfig, blackwell_matmul, heuristic_config, plan
from nybble.kernels.mosaic_gpu.blackwell.config import DEFAULT_NUM_SMS
from nybble.kernels.mosaic_gpu.blackwell.kernel import a_in_tmem, folds_scales
from nybble.quant import relayout
from tests.kernel_checks import (
    activations,
    assert_exact,
    assert_kernel_within_rounding,
    exact_weight,
    random_weight,
)

interpret = mgpu_interpret.interpret

bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
# (M, K, N, group, symmetric, x dtype, scale dtype, exact) -> the (tile_m, tile_k, slices) the B200
# heuristics pick there: every one they can pick (test_heuristics_pick_only_covered_configs), once. Along
# the way each group route (groups inside a 64-wide chunk, one row per chunk, groups spanning steps,
# per-column, a partial last group), f16 x, f32 scales, N an odd multiple of 64 and N, K not multiples of
# 64, x rows padded for the K-slice view.
CASES = [
    ((1, 192, 128, 32, True, bf16, bf16, True), (16, 64, 1)),
    ((3, 384, 256, 128, False, f16, bf16, True), (16, 128, 1)),
    ((20, 576, 128, 128, True, bf16, bf16, True), (32, 64, 1)),
    ((30, 384, 192, 16, False, bf16, bf16, False), (32, 128, 1)),
    ((40, 320, 128, 128, False, bf16, bf16, False), (64, 64, 1)),
    ((40, 384, 128, 128, True, bf16, f32, False), (64, 128, 1)),
    ((100, 192, 100, None, False, bf16, bf16, True), (128, 64, 1)),
    ((200, 256, 128, 256, False, f16, f32, False), (256, 64, 1)),
    ((130, 256, 128, 64, False, bf16, bf16, True), (128, 128, 1)),  # two 128-row M tiles (prefill)
    ((300, 192, 128, 128, True, bf16, bf16, False), (192, 64, 1)),  # 192-row M tiles (FEW_SMS)
    ((1, 768, 128, 64, True, bf16, bf16, True), (16, 64, 4)),
    ((4, 1024, 128, 32, False, bf16, bf16, True), (16, 128, 4)),
    ((8, 768, 192, 32, False, f16, bf16, False), (32, 64, 4)),
    ((5, 1000, 128, 128, True, bf16, bf16, False), (32, 128, 4)),
    ((16, 768, 128, None, True, bf16, f32, True), (64, 64, 4)),
    ((13, 1024, 128, 16, False, bf16, bf16, False), (64, 128, 4)),
    ((32, 768, 128, 64, False, bf16, bf16, True), (128, 64, 4)),
    ((25, 1024, 100, 128, True, f16, bf16, False), (128, 128, 4)),
    ((48, 512, 128, 64, True, bf16, bf16, True), (128, 128, 2)),  # 2 slices at 32 < M <= 64
    ((40, 384, 192, 32, False, f16, bf16, False), (128, 64, 2)),
    ((1, 256, 128, 128, False, bf16, bf16, True), (16, 256, 1)),  # 256-deep decode steps
    ((1, 1024, 128, 64, True, f16, bf16, False), (16, 256, 4)),
]
# SMs the heuristics plan for, where not a B200's 148: every tiny case fits one wave there, where 128-row M
# tiles beat wider ones. On one SM 200 rows tie in waves x tile_m (256 x 1 = 128 x 2), and ties go to the
# wider tile; on two, 300 rows take two CTAs of 192 rows (one wave) over three of 128 (two).
FEW_SMS = {(200, 256, 128): 1, (300, 192, 128): 2}


@pytest.fixture(autouse=True)
def _fresh_interpreter(request):
    """Each test starts from a clean interpreter and, when it ran a kernel, must end without races."""
    mg.reset_state()
    yield
    if request.node.get_closest_marker("no_kernel") is None:
        assert not mg.races_found(), "the race detector flagged a data race"


def _weight(rng, k, n, group, symmetric, scale_dtype, exact):
    if exact:
        return exact_weight(rng, k, n, group, symmetric, scale_dtype=scale_dtype)
    return random_weight(rng, k, n, group, symmetric, scale_dtype=scale_dtype)


@pytest.mark.sweep
@pytest.mark.parametrize("case,tiling", CASES, ids=[f"m{t[0]}_k{t[1]}_s{t[2]}" for _, t in CASES])
def test_heuristic_configs(case, tiling):
    m, k, n, group, symmetric, x_dtype, scale_dtype, exact = case
    rng = np.random.default_rng(m * 1000 + k + n)
    qw = _weight(rng, k, n, group, symmetric, scale_dtype, exact)
    num_sms = FEW_SMS.get((m, k, n), DEFAULT_NUM_SMS)
    p = plan(m, qw, num_sms=num_sms)
    c = p.config
    assert (c.tile_m, c.tile_k, c.slices) == tiling
    x = activations(rng, m, k, x_dtype, exact=exact)
    with interpret(detect_races=True, gpu="b200"):
        y = blackwell_matmul(x, qw, num_sms=num_sms)
    assert y.shape == (m, n) and y.dtype == x.dtype
    if exact:  # NaN (an element never written) fails both comparisons
        assert_exact(y, x, qw)
    else:
        assert_kernel_within_rounding(y, x, qw, p.scales_on)


# (M, K, N, group, config (tile_m, tile_k, slices), x dtype, scale dtype, exact): the group-accumulator route
# (kernel.folds_scales) without K slices, which the heuristics pick only at N too wide for interpret mode
# (Llama's gate-up and LM head at decode); the sliced route runs in :data:`CASES`.
UNSLICED_FOLDS = [
    (1, 512, 128, 128, (16, 256, 1), bf16, bf16, True),
    (3, 768, 256, 64, (16, 128, 1), f16, f32, True),
    (2, 512, 192, 128, (16, 256, 1), bf16, bf16, False),
]


@pytest.mark.parametrize("case", UNSLICED_FOLDS, ids=[f"m{c[0]}_g{c[3]}_{c[4][1]}" for c in UNSLICED_FOLDS])
def test_scales_on_group_accumulators_without_slices(case):
    """Symmetric groups of 64 or more, folded on per-group TMEM accumulators (double-buffered, read a step
    late), exact on small integers and within the accumulator route's bound on random data."""
    m, k, n, group, (tile_m, tile_k, slices), x_dtype, scale_dtype, exact = case
    rng = np.random.default_rng(m + k + n)
    qw = _weight(rng, k, n, group, True, scale_dtype, exact)
    config = BlackwellConfig(128, tile_m, tile_k, 3, slices)
    p = plan(m, qw, config=config, dtype=x_dtype)
    assert folds_scales(p) and a_in_tmem(p)  # the A operand through TMEM
    x = activations(rng, m, k, x_dtype, exact=exact)
    with interpret(detect_races=True, gpu="b200"):
        y = blackwell_matmul(x, qw, config=config)
    if exact:
        assert_exact(y, x, qw)
    else:
        assert_kernel_within_rounding(y, x, qw, "accumulators")


def test_group_accumulators_beside_an_a_operand_in_smem():
    """The accumulator route keeps its A operand in SMEM where the double-buffered A halves (tile_k
    columns) do not fit TMEM beside the group accumulators: 32-row M tiles, 256-deep steps, groups of 64
    (4 group accumulators a step, double-buffered, 320 columns, the -BIAS tile's 32 and 256 of A: 608 of
    512). Exact on small integers."""
    rng = np.random.default_rng(7)
    m, k, n = 20, 512, 128
    qw = _weight(rng, k, n, 64, True, bf16, True)
    config = BlackwellConfig(128, 32, 256, 2, 1)
    p = plan(m, qw, config=config)
    assert folds_scales(p) and not a_in_tmem(p)
    x = activations(rng, m, k, bf16, exact=True)
    with interpret(detect_races=True, gpu="b200"):
        y = blackwell_matmul(x, qw, config=config)
    assert_exact(y, x, qw)


@pytest.mark.parametrize(
    "m, k, tag",
    [(1, 4 * 5 * 256, "bw_n128_m16_k256_s4_x4"), (8, 4 * 9 * 128, "bw_n128_m32_k128_s8_x4")],
    ids=["4-slots", "8-slots"],
)
def test_a_tmem_operand_pipelines_in_a_power_of_two_slots_refilled(m, k, tag):
    """Where A goes through TMEM the SMEM holds no A buffer, and the pick's pipeline takes a power of two
    slots (config.power_of_two_depth): the decode tilings of M = 1 (Llama-3-8B's down projection: 4 slots
    where the heuristics' SMEM rule, which counts an A buffer, gives 3) and M = 8 (8 slots where it gives
    6). Each K slice walks one step more than the slots, so every slot is released and refilled. Exact on
    small integers, races checked."""
    rng = np.random.default_rng(11 + m)
    n = 128
    qw = _weight(rng, k, n, 128, True, bf16, True)
    p = plan(m, qw)
    assert a_in_tmem(p) and p.config.tag == tag and p.k_steps == p.config.max_concurrent_steps + 1
    x = activations(rng, m, k, bf16, exact=True)
    with interpret(detect_races=True, gpu="b200"):
        y = blackwell_matmul(x, qw)
    assert_exact(y, x, qw)


@pytest.mark.no_kernel
def test_pipeline_depth_follows_where_the_a_operand_lives():
    """The picks' pipelines: a power of two slots wherever A goes through TMEM (at the Llama-3 and MoE
    expert shapes, every symmetric pick of M tiles up to 64 rows: M <= 16 under 4 K slices), the next one
    up where it fits SMEM without an A buffer, else the one below; the heuristics' own depth where A is in
    SMEM (zero points go on the weights; 128-row tiles fold no scales), whose buffer would not leave room
    for 4 slots of 256-deep steps. An explicit config runs as given. The SMEM rule counts the A buffer
    only where the kernel allocates it."""
    from bench.xray.blackwell import SHAPES
    from nybble.kernels.mosaic_gpu.blackwell.config import power_of_two_depth, smem_bytes

    for k, n in SHAPES.values():
        for symmetric in (True, False):
            qw = jax.eval_shape(
                lambda w, s=symmetric: nybble.quantize(w, group_size=128, symmetric=s),
                jax.ShapeDtypeStruct((k, n), jnp.float32),
            )
            for m in (1, 4, 8, 16, 32, 64):
                p, (k_pad, n_pad) = plan(m, qw), qw.padded_shape
                depth, picked = p.config.max_concurrent_steps, heuristic_config(m, n_pad, k_pad, 128)
                assert p.config == dataclasses.replace(picked, max_concurrent_steps=depth)
                if a_in_tmem(p):
                    assert depth & (depth - 1) == 0 and p.config == power_of_two_depth(picked, 128), p.config
                else:
                    assert depth == picked.max_concurrent_steps, p.config
                assert a_in_tmem(p) == (symmetric and p.config.tile_m <= 64), p.config
    down = jax.eval_shape(
        lambda w: nybble.quantize(w, group_size=128), jax.ShapeDtypeStruct((14336, 4096), jnp.float32)
    )
    four = plan(1, down).config
    assert four.tag == "bw_n128_m16_k256_s4_x4"
    three = dataclasses.replace(four, max_concurrent_steps=3)
    assert plan(1, down, config=three).config == three
    kw = dict(group=128, has_offsets=True, scale_bytes=4)
    assert smem_bytes(four, **kw) - smem_bytes(four, **kw, a_in_smem=False) == 2 * 128 * 256 * 2
    with pytest.raises(ValueError, match="bytes of SMEM"):  # A in SMEM: 4 slots do not fit
        four.check_problem(1, 4096, 14336, 128)


@pytest.mark.no_kernel
def test_the_fold_reads_the_columns_of_x_rows_only():
    """A dense call folds only the accumulator columns of its x rows (m * S + j for row m < M over slice j;
    those of TMA's zero rows hold zeros): 4 of 16 at M = 1 with 4 K slices, 2 (the fewest) at M = 1
    without, all of a tile that M fills or that spans M tiles; a grouped call, whose rows per tile are found
    on the device, all of them. The interpret cases above run M = 1, 3 and 5 through it, exactly."""
    from nybble.kernels.mosaic_gpu.blackwell.kernel import folded_columns

    rng = np.random.default_rng(0)
    qw = _weight(rng, 1024, 128, 128, True, bf16, True)

    def cols(m: int, tile_m: int, tile_k: int, slices: int, dense: bool = True) -> int:
        config = BlackwellConfig(128, tile_m, tile_k, 3, slices)
        return folded_columns(plan(m, qw, config=config), dense=dense)

    assert [cols(1, 16, 256, 4), cols(1, 16, 256, 1), cols(3, 16, 256, 1)] == [4, 2, 4]
    assert cols(16, 64, 128, 4) == 64
    assert cols(40, 16, 256, 1) == 16  # three M tiles
    assert cols(1, 16, 256, 4, dense=False) == 16


@pytest.mark.no_kernel
def test_decode_tiles_dequantize_on_two_warpgroups(monkeypatch):
    """Decode M tiles (<= 64) split the two 64-row A tiles between two dequantizing warpgroups (the cases
    above run both splits, weights and accumulator routes); wider tiles keep one. Interpret mode runs each
    warpgroup on a host thread that a barrier wait holds: with fewer threads than warpgroups the call is
    refused by name before it would hang."""
    from nybble.kernels.mosaic_gpu.blackwell.kernel import dequant_warpgroups

    rng = np.random.default_rng(7)
    qw = exact_weight(rng, 448, 128, 64, True)
    assert dequant_warpgroups(plan(1, qw, config=BlackwellConfig(128, 16, 64, 3, 1))) == 2
    assert dequant_warpgroups(plan(1, qw, config=BlackwellConfig(128, 64, 64, 3, 1))) == 2
    assert dequant_warpgroups(plan(100, qw, config=BlackwellConfig(128, 128, 64, 3, 1))) == 1
    picks = [dequant_warpgroups(plan(c[0], _weight(rng, *c[1:5], c[6], c[7]))) for c, _ in CASES]
    assert picks.count(2) >= 10 and picks.count(1) >= 2
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.setenv("NPROC", "2")
    x = activations(rng, 1, 448, bf16, exact=True)
    with interpret(gpu="b200"), pytest.raises(RuntimeError, match=r"3 warpgroups .* NPROC=4"):
        blackwell_matmul(x, qw, config=BlackwellConfig(128, 16, 64, 3, 1))


@pytest.mark.no_kernel
def test_group_accumulators_only_where_they_save_instructions():
    """The route folds symmetric groups of whole chunks at decode M tiles, never offsets, per-column scales
    or groups of 16/32 (they cut a 64-wide chunk) or M tiles whose FFMAs per group would outnumber what
    they save: with bf16 x the HSUB2 and HMUL2 of a weight pair (the bias folds too: tile_m <= G, at
    most 64), with f16 x the HMUL2 only (4 x tile_m <= G)."""
    import jax

    from nybble.kernels.mosaic_gpu.blackwell.kernel import folds_bias

    def problem(m, n, group, symmetric, dtype=jnp.bfloat16, k=4096):
        quant = lambda w: nybble.quantize(w, group_size=group, symmetric=symmetric)
        qw = jax.eval_shape(quant, jax.ShapeDtypeStruct((k, n), jnp.float32))
        return plan(m, qw, dtype=dtype)

    def folds(*args, **kw):
        return folds_scales(problem(*args, **kw))

    assert folds(1, 4096, 128, True) and folds(1, 28672, 128, True) and folds(4, 1024, 64, True)
    assert not folds(1, 4096, 128, False)  # offsets
    assert not folds(1, 4096, None, True)  # per column: one scale row, applied to the weights
    assert not folds(1, 4096, 32, True)
    sliced_m16 = problem(16, 4096, 128, True)
    assert sliced_m16.config.tile_m == 64 and folds_scales(sliced_m16) and folds_bias(sliced_m16)
    assert folds(16, 4096, 64, True)  # tile_m 64 = G: 32 FFMA2 a group against 64 HSUB2 + HMUL2
    f16 = problem(16, 4096, 128, True, jnp.float16)
    assert not folds_scales(f16) and not folds_bias(f16)  # f16: 64 FFMAs a group against 64 HMUL2
    f16_m1 = problem(1, 4096, 128, True, jnp.float16)
    assert folds_scales(f16_m1) and not folds_bias(f16_m1)  # f16 keeps the exact q (BIAS 1032)
    assert folds_bias(problem(1, 4096, 128, True))
    assert problem(64, 14336, 128, True).config.tile_m == 64 and folds(64, 14336, 128, True)
    # where 2 K slices win at M = 64 (x rows 128: no fold, the weights route), as at Llama's q/o
    wide = problem(64, 4096, 128, True)
    assert (wide.config.tile_m, wide.config.slices) == (128, 2) and not folds_scales(wide)
    assert not folds(128, 4096, 128, True)  # tile_m 128: past the registers


def test_nybble_matmul_runs_the_blackwell_kernel_as_a_b200():
    """``nybble.matmul`` inside ``interpret(gpu="b200")`` runs the tcgen05 kernel (its name says so), and
    the default interpret() still runs the Hopper kernel."""
    import jax

    rng = np.random.default_rng(7)
    qw = exact_weight(rng, 128, 128, 64, True)
    x = activations(rng, 2, 128, exact=True)
    with interpret(detect_races=True, gpu="b200"):
        text = str(jax.make_jaxpr(lambda x: nybble.matmul(x, qw, implementation="mosaic_gpu"))(x))
        y = nybble.matmul(x, qw, implementation="mosaic_gpu")
    assert "nybble_w4a16_bw_" in text
    assert_exact(y, x, qw)
    with interpret(detect_races=True):
        hopper = str(jax.make_jaxpr(lambda x: nybble.matmul(x, qw, implementation="mosaic_gpu"))(x))
    assert "nybble_w4a16_bw_" not in hopper and "nybble_w4a16" in hopper


@pytest.mark.no_kernel
def test_heuristics_pick_only_covered_configs():
    """Over the Llama-3-8B/70B and MoE expert shapes at M = 1..8192, every config the B200 heuristics pick
    has a (tile_m, tile_k) that a case of :data:`CASES` runs."""
    covered = {tiling for _, tiling in CASES}
    picked = set()
    shapes = [
        (4096, 4096),
        (4096, 14336),
        (14336, 4096),
        (8192, 28672),
        (28672, 8192),
        (4096, 1536),
        (1536, 4096),
        (7168, 2048),
        (2048, 7168),
        (2048, 768),
        (768, 2048),
        (576, 1536),
        (10944, 7392),
    ]
    for k, n in shapes:
        for m in (1, 2, 4, 5, 8, 16, 17, 25, 32, 48, 64, 100, 128, 200, 256, 2048, 8192):
            for group in (16, 32, 64, 128, 256, k):
                c = heuristic_config(m, -(-n // 64) * 64, k, group)
                picked.add((c.tile_m, c.tile_k, c.slices))
    assert picked <= covered, f"configs picked but never interpreted: {sorted(picked - covered)}"


@pytest.mark.no_kernel
def test_prefill_m_tiles_leave_the_busiest_sm_the_fewest_rows():
    """Past 128 rows the M tile is 256, 192 or 128 rows, whichever gives the busiest SM fewer MMA rows
    (waves x tile_m), ties to the wider: Llama-3-8B's k/v projection (N = 1024) at M = 2048 takes 128-row
    tiles (128 CTAs in one wave, not 64 of 256), its q/o projection (N = 4096) 256-row ones (2 waves of 256
    rows against 4 of 128), a 1536-column one 192-row ones; 128-row tiles step 128 deep where K allows,
    wider ones 64."""
    sms = 148
    picks = ((1024, 4096, (128, 128), 128), (4096, 4096, (256, 64), 256), (14336, 4096, (128, 128), 1792))
    for n, k, tiling, ctas in (*picks, (1536, 2048, (192, 64), 132)):  # 11 x 12 CTAs of 192 rows: one wave
        c = heuristic_config(2048, n, k, 128, sms)
        assert ((c.tile_m, c.tile_k), c.ctas(2048, n)) == (tiling, ctas), n
        for tile_m in (128, 192, 256):  # the pick is never beaten by another tile on waves x tile_m
            m_tiles = -(-2048 // tile_m)
            other = -(-m_tiles * (n // 128) // sms) * tile_m
            assert -(-ctas // sms) * c.tile_m <= other
    assert heuristic_config(2048, 1024, 4032, 128, sms).tile_k == 64  # K_pad not a multiple of 128
    # 129..256 rows: two 128-row tiles rather than one of 256 while the CTAs stay in one wave.
    assert heuristic_config(200, 4096, 4096, 128, sms).tile_m == 128
    assert heuristic_config(200, 4096 * 8, 4096, 128, sms).tile_m == 256  # 256 -> 512 CTAs: 2 -> 4 waves


@pytest.mark.no_kernel
@pytest.mark.parametrize(
    "make,match",
    [
        (lambda qw, x: (x.astype(jnp.float32), qw), "x has dtype float32"),
        (lambda qw, x: (x[:, :64], qw), "x has K=64 but the weight has K=128"),
        (lambda qw, x: (x, relayout(qw, "nk_int4")), "layout 'nk_int4'"),
        (lambda qw, x: (x[None], qw), "x2d must be 2-D"),
    ],
)
def test_refuses_what_the_hopper_kernel_refuses(make, match):
    rng = np.random.default_rng(0)
    qw = exact_weight(rng, 128, 128, 64, True)
    x = activations(rng, 2, 128, exact=True)
    args = make(qw, x)
    with pytest.raises((NotImplementedError, ValueError), match=match):
        blackwell_matmul(*args)
    if match != "x2d must be 2-D":  # the same reason, word for word, from the Hopper kernel
        with pytest.raises((NotImplementedError, ValueError), match=match):
            mg.mosaic_gpu_matmul(*args)


@pytest.mark.no_kernel
def test_config_rules_are_named():
    with pytest.raises(ValueError, match="tile_m=24 must be one of"):
        BlackwellConfig(tile_m=24)
    with pytest.raises(ValueError, match="max_concurrent_steps=1 must be >= 2"):
        BlackwellConfig(max_concurrent_steps=1)
    rng = np.random.default_rng(0)
    qw = exact_weight(rng, 192, 128, 64, True)
    with pytest.raises(ValueError, match=r"K_pad=192 must be a multiple of slices x tile_k = 1 x 128"):
        plan(1, qw, config=BlackwellConfig(tile_k=128))
    with pytest.raises(ValueError, match=r"group=128 must divide a K slice \(K_pad / slices = 64\)"):
        plan(1, exact_weight(rng, 256, 128, 128, True), config=BlackwellConfig(tile_k=64, slices=4))
    with pytest.raises(ValueError, match="M=9 rows need 3 M tiles; K slices"):
        plan(9, exact_weight(rng, 256, 128, 64, True), config=BlackwellConfig(tile_k=64, slices=4))
    with pytest.raises(ValueError, match="bytes of SMEM"):
        plan(1, exact_weight(rng, 512, 128, 64, True), config=BlackwellConfig(128, 256, 256, 6))


@pytest.mark.no_kernel
def test_interpret_names_its_gpus():
    with pytest.raises(ValueError, match=r"interpret\(gpu='a100'\).*'b200'"):
        with interpret(gpu="a100"):
            pass


@pytest.mark.no_kernel
def test_b200_spec():
    from nybble.kernels.gpu import get_gpu, spec_for_device_kind

    b200 = get_gpu("b200")
    assert (b200.sms, b200.compute_capability, b200.tmem_columns) == (148, "10.0", 512)
    assert b200.tmem_bytes_per_sm == 128 * b200.tmem_columns * 4  # 128 lanes of 32-bit columns
    assert spec_for_device_kind("NVIDIA B200") is b200
    # The decode budget of issue 45: ~57 weights per SM-cycle at 8 TB/s and 0.5 byte a weight.
    assert 55 < b200.hbm_bytes_per_s / 0.5 / (b200.sms * b200.clock_hz) < 58
