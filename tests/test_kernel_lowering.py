"""Lowering the Mosaic GPU W4A16 kernel for CUDA on a CPU: the hardware rules interpret mode cannot check.

``jax.jit(f).trace(*ShapeDtypeStructs).lower(lowering_platforms=("cuda",))`` runs Mosaic GPU's layout
inference, its SMEM budget and TMA alignment checks, with no data and no GPU, so production shapes cost
nothing. Every config the heuristics can pick at the shapes of real models is lowered here (once per
distinct config x kernel structure; those the X-ray gate of tests/test_xray.py compiles, which lowers them
first, are not lowered twice), plus the error paths on a CPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble.kernels.mosaic_gpu as mg
from bench.xray.cases import gate_cases, is_twin, kernel_key
from bench.xray.heuristic_cases import heuristic_cases
from nybble.kernels.mosaic_gpu import split_k
from nybble.kernels.mosaic_gpu.config import (
    SMEM_BUDGET_BYTES,
    TuningConfig,
    fits_smem,
    folds_bias,
    smem_bytes,
    split_k_shares,
    splits_k,
    stores_any_rows,
    wgmma_k,
)
from nybble.kernels.mosaic_gpu.heuristics import heuristic_config
from nybble.packing import padded_weight_dims
from nybble.quant import QuantizedWeight, quantize, relayout
from tests import kernel_faults as faults

NUM_SMS = 132
# (K, N) of Llama-3-8B, Llama-3-70B, SmolLM2-135M projections, and an odd pair (K = 10944, N = 7392).
WEIGHT_SHAPES = [
    (4096, 4096),
    (4096, 14336),
    (14336, 4096),
    (8192, 28672),
    (28672, 8192),
    (576, 1536),
    (1536, 576),
    (10944, 7392),
]
BATCHES = [1, 16, 128, 4096]
GROUPS = [128, 16, 32, 64, 256, None]


def _abstract_weight(
    k, n, group, symmetric, scale_dtype=jnp.bfloat16, layout="wgmma_int4"
) -> QuantizedWeight:
    """What nybble.quantize returns for a (K, N) weight, as ShapeDtypeStructs: lowering needs no data."""
    quant = lambda w: quantize(
        w, group_size=group, symmetric=symmetric, scale_dtype=scale_dtype, layout=layout
    )
    return jax.eval_shape(quant, jax.ShapeDtypeStruct((k, n), jnp.float32))


def _lower(m, qw, x_dtype=jnp.bfloat16, config=None):
    fn = lambda x, qw: mg.mosaic_gpu_matmul(x, qw, config=config, num_sms=NUM_SMS)
    x = jax.ShapeDtypeStruct((m, qw.shape[0]), x_dtype)
    return jax.jit(fn).trace(x, qw).lower(lowering_platforms=("cuda",))


_ALL_CASES = heuristic_cases(WEIGHT_SHAPES, BATCHES, GROUPS, NUM_SMS)
# The kernels tests/test_xray.py's gate compiles down to SASS (which lowers them for CUDA first) are not
# lowered a second time here.
_GATE = gate_cases(NUM_SMS)
_GATE_KEYS = {kernel_key(case, NUM_SMS) for case in _GATE}
# Except where the gate does not run: `make test-jax-cuda12` (jax 0.12; the gate's baseline is the pinned
# end's toolchain) sets NYBBLE_LOWER_GATE_KERNELS=1 and lowers them here.
_GATE_LOWERED_HERE = {
    kernel_key(c, NUM_SMS): (c.m, c.k, c.n, c.group_size, c.symmetric)
    for c in (_GATE if os.environ.get("NYBBLE_LOWER_GATE_KERNELS") == "1" else ())
}
# A (config, structure) picked for both symmetric and asymmetric groups is lowered asymmetric only, as the
# gate compiles it: the same kernel plus the offsets' operand, loads and adds (the symmetric kernel has no
# code the asymmetric one lacks), except where the symmetric kernel folds the bias into WGMMA
# (bench.xray.cases.is_twin). Mosaic's checks of the offsets then run on it, and half the lowerings go.
_ASYMMETRIC = {key[:2] for key in _ALL_CASES if not key[2]}
_CASES = {
    key: case
    for key, case in _ALL_CASES.items()
    if key not in _GATE_KEYS and not is_twin(key, _ASYMMETRIC)
}


def _fold_class(key) -> tuple[bool, bool] | None:
    """What the bias fold's code depends on besides the asymmetric twin's: with or without a producer,
    with or without K slices (the fold sets the constant tile's value and which accumulator its WGMMA
    adds to, the same for any tile sizes or slots). None for a kernel that does not fold."""
    config, _, symmetric = key
    if not (symmetric and folds_bias(config, has_offsets=False)):
        return None
    return config.producer, config.slices > 1


# Symmetric kernels that fold the bias are lowered once per fold class: their asymmetric twins are lowered
# (or compiled) at every config, the fold's code once in each setting it meets.
_FOLD_CLASSES: dict[tuple[bool, bool], object] = {}
# (One whose asymmetric twin is neither lowered nor compiled is lowered itself: the rest of its code.)
for _key in list(_CASES):
    _class = _fold_class(_key)
    _twin_covered = (_key[0], _key[1], False) in set(_CASES) | _GATE_KEYS
    if _class is not None and _FOLD_CLASSES.setdefault(_class, _key) != _key and _twin_covered:
        del _CASES[_key]


def test_lowering_and_the_xray_gate_share_every_kernel():
    """The X-ray gate's kernel keys are this module's (config, structure, symmetric), so the kernels skipped
    here are ones the gate compiles (Llama-3 shapes at g128 asymmetric are in both), or symmetric twins of
    asymmetric kernels lowered here or compiled there."""
    skipped = set(_ALL_CASES) - set(_CASES)
    lowered_or_compiled = set(_CASES) | _GATE_KEYS
    for key in skipped:
        # A symmetric kernel: its asymmetric twin is lowered or compiled (and, if it folds the bias, its
        # fold class is lowered).
        assert key in _GATE_KEYS or (key[2] and (key[0], key[1], False) in lowered_or_compiled), key
    # Symmetric kernels that fold the bias are code of their own: each is lowered or compiled itself.
    folded = {key for key in _ALL_CASES if _fold_class(key) is not None}
    assert {_fold_class(key) for key in folded} == {_fold_class(key) for key in folded & set(_CASES)}
    assert len(_FOLD_CLASSES) >= 3  # with and without a producer, with and without K slices
    assert len(skipped & _GATE_KEYS) >= 15
    assert any(not key[2] and key[1] == 128 for key in skipped)
    # Every (config, structure) the heuristics pick is lowered or compiled at least once.
    assert {key[:2] for key in _ALL_CASES} == {key[:2] for key in lowered_or_compiled & set(_ALL_CASES)}


def test_heuristics_cover_every_code_path():
    configs = {key[0] for key in _ALL_CASES}
    assert any(c.slices == 8 for c in configs) and any(1 < c.slices < 8 for c in configs)
    assert any(c.slices == 1 and c.compute_wgs == 1 for c in configs)
    assert any(c.compute_wgs == 2 for c in configs) and any(c.split_k > 1 for c in configs)
    assert {c.scales_on for c in configs} == {"accumulators", "weights"}
    assert {c.tile_k for c in configs} >= {128, 256} and {c.tiles for c in configs} >= {1, 2}


_LOWERED = [*_CASES.values(), *_GATE_LOWERED_HERE.values()]


@pytest.mark.sweep
@pytest.mark.parametrize(
    "m, k, n, group, symmetric",
    _LOWERED,
    ids=[f"M{m}-K{k}-N{n}-g{g}-{'sym' if s else 'asym'}" for m, k, n, g, s in _LOWERED],
)
def test_lower_every_heuristic_config(m, k, n, group, symmetric):
    text = _lower(m, _abstract_weight(k, n, group, symmetric)).as_text()
    assert "mosaic_gpu" in text


# Configs the heuristics do not pick at these shapes but autotuning or a caller might: both variants
# with small and large tiles, split-K, K slices, the minimum pipeline depth, narrow bands.
_EXPLICIT = [
    TuningConfig(tiles=1, tile_m=64, tile_k=64, max_concurrent_steps=2, split_k=8),
    TuningConfig(tiles=4, tile_m=64, tile_k=128, max_concurrent_steps=3, grid_tile_m=1),
    TuningConfig(tiles=1, tile_m=16, tile_k=128, max_concurrent_steps=3, split_k=2, compute_wgs=2),
    TuningConfig(tiles=2, tile_m=32, tile_k=64, max_concurrent_steps=6, split_k=4, compute_wgs=2),
    TuningConfig(tiles=1, tile_m=128, tile_k=128, max_concurrent_steps=4, compute_wgs=2, grid_tile_m=3),
    TuningConfig(tiles=4, tile_m=1, tile_k=256, slices=8, max_concurrent_steps=4, scales_on="accumulators"),
    TuningConfig(tiles=2, tile_m=32, tile_k=128, max_concurrent_steps=7, split_k=4),
]


@pytest.mark.parametrize("config", _EXPLICIT, ids=str)
@pytest.mark.parametrize("group, symmetric", [(32, False), (256, True)])
def test_lower_explicit_configs(config, group, symmetric):
    if group % 64:  # groups of 32: exact weights, no K slices
        config = dataclasses.replace(config, scales_on="weights")
        if config.slices > 1:
            config = dataclasses.replace(config, slices=1, tile_m=8)
    m = 1 if config.slices > 1 else 300
    _lower(m, _abstract_weight(8192, 4096, group, symmetric), config=config)


@pytest.mark.parametrize("compute_wgs", [1, 2])
def test_lower_one_step_per_split(compute_wgs):
    config = TuningConfig(
        tiles=1, tile_m=16, tile_k=64, max_concurrent_steps=3, split_k=2, compute_wgs=compute_wgs
    )
    _lower(4, _abstract_weight(128, 128, 32, True), config=config)


@pytest.mark.parametrize("m", [1, 4096])
def test_lower_float16_activations_float32_scales(m):
    _lower(m, _abstract_weight(4096, 4096, 128, False, jnp.float32), x_dtype=jnp.float16)


def test_decode_fills_the_gpu_in_one_launch():
    """M = 1 on Llama-3-8B's layers: K slices give every SM a CTA, no split-K."""
    for k, n in ((4096, 4096), (14336, 4096), (4096, 14336)):
        k_pad, n_pad = padded_weight_dims(k, n, 128)
        config = heuristic_config(1, n_pad, k_pad, 128, NUM_SMS)
        ctas = n_pad // config.cta_rows
        assert config.slices == 8 and config.split_k == 1 and ctas >= NUM_SMS


def test_split_k_is_one_launch():
    """Llama-3-8B kv and down at M = 64: the heuristics split K (the output tiles alone leave SMs idle), and
    the lowered call is the one Mosaic GPU kernel with its split_k CTAs in one cluster: no f32 partials, no
    reduction or slice after it (the X-ray counts the same on the compiled module)."""
    for k, n in ((4096, 1024), (14336, 4096)):
        qw = _abstract_weight(k, n, 128, True)
        config = mg.plan(64, qw, num_sms=NUM_SMS).config
        assert config.split_k > 1, config
        text = _lower(64, qw).as_text()
        assert text.count("mosaic_gpu") >= 1
        calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
        assert len(calls) == 1, calls
        assert "stablehlo.reduce" not in text and "f32" not in calls[0].split("->")[-1]


def test_split_k_shares():
    """Each CTA of the cluster sums and stores whole 8-row slabs of y: tile_m / split_k rows of every A
    tile, or, where that would be fewer than 8, 8 rows of fewer A tiles; every slab exactly once."""
    rows = [split_k.slab_rows(*a) for a in ((64, 8), (128, 4), (16, 1), (16, 2), (16, 4, 2))]
    assert rows == [8, 32, 16, 8, 8]
    assert split_k_shares(128, 4, 2) == [(32, q, 0, 2) for q in range(4)]  # rows 32q.. of both A tiles
    # tile_m = 16, 4 CTAs, 2 A tiles: CTA q stores rows 8 (q // 2).. of A tile q % 2.
    assert split_k_shares(16, 4, 2) == [(8, 0, 0, 1), (8, 0, 1, 1), (8, 1, 0, 1), (8, 1, 1, 1)]
    for tile_m, parts, tiles in itertools.product((8, 16, 32, 64, 128), (2, 4, 8), (1, 2, 4)):
        if not splits_k(tile_m, parts, tiles):
            assert tiles * tile_m // 8 < parts
            continue
        covered = [
            (r * rows + i, t) for rows, r, t0, count in split_k_shares(tile_m, parts, tiles)
            for t in range(t0, t0 + count) for i in range(rows)
        ]  # fmt: skip
        assert sorted(covered) == sorted(itertools.product(range(tile_m), range(tiles)))
    for tile_m, parts, tiles, rule in (
        (8, 2, 1, "8-row slabs"),
        (16, 8, 2, "8-row slabs"),
        (32, 3, 1, "power of two"),
        (12, 2, 2, "multiple of 8"),
    ):
        with pytest.raises(ValueError, match=rule):
            split_k_shares(tile_m, parts, tiles)
    for bad in (dict(tile_m=8, split_k=2, tiles=1), dict(tile_m=16, split_k=8, tiles=2), dict(split_k=3)):
        with pytest.raises(ValueError, match=r"8-row slabs|power of two"):
            TuningConfig(**bad)


@pytest.mark.parametrize("m", [9, 13, 100])
def test_ragged_m_stores_y_rows_directly(m):
    """M that does not fill 8-row tiles: x gets zero rows (a pad), but the kernel stores y's M rows itself
    (staging.y_staging: one-row SMEM tiles), so no slice follows the kernel. K-sliced tiles keep the
    slice (their y tile is laid out by Mosaic)."""
    qw = _abstract_weight(4096, 14336, 128, True)
    config = mg.plan(m, qw, num_sms=NUM_SMS).config
    assert stores_any_rows(config), config
    text = _lower(m, qw).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and f"tensor<{m}x14336xbf16>" in calls[0].split("->")[-1], calls
    assert "stablehlo.pad" in text and "stablehlo.slice" not in text
    sliced = TuningConfig(
        tiles=1, tile_m=16, tile_k=256, slices=2, max_concurrent_steps=4, scales_on="accumulators"
    )
    assert not stores_any_rows(sliced)
    assert "stablehlo.slice" in _lower(9, qw, config=sliced).as_text()


@pytest.mark.parametrize("m", [128, 4096])
@pytest.mark.parametrize("n", [7392, 7400])
def test_lower_n_not_a_multiple_of_64(m, n):
    # The kernel keys above are lowered once, at the first shape that picks them; the y store's GMEM side
    # depends on N itself: N = 7392 (32 mod 64) and 7400 (8 mod 64) once failed inside Mosaic ("dimension 1
    # must have size smaller or a multiple of its tiling 64"). They now store into (M, N_pad) and slice.
    text = _lower(m, _abstract_weight(10944, n, 128, False)).as_text()
    assert "mosaic_gpu" in text


def test_prefill_does_not_split_k():
    k_pad, n_pad = padded_weight_dims(4096, 14336, 128)
    config = heuristic_config(4096, n_pad, k_pad, 128, NUM_SMS)
    assert config.split_k == 1 and config.tile_m == 256 and config.compute_wgs == 2


def test_over_budget_config_fails_to_lower():
    config = TuningConfig(tiles=4, tile_m=128, tile_k=256, max_concurrent_steps=8)
    assert smem_bytes(config, group=128, has_offsets=True) > SMEM_BUDGET_BYTES
    assert not fits_smem(config, group=128, has_offsets=True)
    with pytest.raises(Exception, match="shared memory"):
        _lower(128, _abstract_weight(4096, 4096, 128, False), config=config)


def test_smem_bytes_by_hand():
    """Stage buffers x slots + the constant tile + the epilogue, counted by hand for one config of each
    family; the budget's edge found by adding a slot."""
    decode = TuningConfig(
        tiles=2, tile_m=1, tile_k=256, slices=8, max_concurrent_steps=2, scales_on="accumulators"
    )
    # codes 2 A tiles x 64 x 256 / 2 B + x 8 x 256 x 2 B + scale and offset rows 8 slices x 2 rows x 16
    # CTA rows x 2 B x 2, two slots; the ones tile 64 x 128 x 2 B (one WGMMA call's K: a group of 128);
    # the slice sum's f32 accumulators 2 x 64 x 8 x 4 B and the y tile 1 x 16 x 2 B.
    assert smem_bytes(decode, group=128, has_offsets=True) == (16384 + 4096 + 1024) * 2 + 16384 + 4096 + 32
    # Groups of 64: the ones tile is one chunk wide, 64 x 64 x 2 B.
    assert smem_bytes(decode, group=64, has_offsets=True) == (16384 + 4096 + 2048) * 2 + 8192 + 4096 + 32
    prefill = TuningConfig(tiles=2, tile_m=128, tile_k=128, max_concurrent_steps=3, compute_wgs=2)
    # A CTA covers 256 rows of N: codes 4 A tiles x 64 x 128 / 2 B + x 128 x 128 x 2 B + 4 scale rows
    # (g32) x 256 x 4 B (f32 scales), 3 slots; the bf16 y tile 128 x 256 x 2 B. 225,280 B + 1 KiB slack
    # fit in 232,448 B; a 4th slot would not.
    used = smem_bytes(prefill, group=32, has_offsets=False, scale_bytes=4)
    assert used == (16384 + 32768 + 4096) * 3 + 65536 == 225280
    assert fits_smem(prefill, group=32, has_offsets=False, scale_bytes=4)
    four = dataclasses.replace(prefill, max_concurrent_steps=4)
    assert not fits_smem(four, group=32, has_offsets=False, scale_bytes=4)
    split = TuningConfig(tiles=1, tile_m=64, tile_k=256, max_concurrent_steps=2, split_k=8)
    # codes 64 x 256 / 2 B + x 64 x 256 x 2 B + 2 scale rows x 64 x 2 B, two slots; the f32 partial in
    # 8 slabs, 64 x 64 x 4 B; the bf16 y slab (8 x 64 x 2 B) reuses the slots' SMEM (split_k.py).
    assert smem_bytes(split, group=128, has_offsets=False) == (8192 + 32768 + 256) * 2 + 16384


def test_wgmma_call_widths():
    """One WGMMA call covers two 64-wide chunks where that pays in the X-ray (config.wgmma_k): never past a
    step, nor past a group on the accumulator route; one chunk in the warp-specialized kernel and for exact
    weights against a WGMMA N over 64."""
    acc = TuningConfig(tiles=1, tile_m=16, tile_k=256, slices=2, scales_on="accumulators")
    assert [wgmma_k(acc, g) for g in (64, 128, 256, 4096)] == [64, 128, 128, 128]
    assert wgmma_k(dataclasses.replace(acc, tile_k=64), 128) == 64
    exact = TuningConfig(tiles=1, tile_m=64, tile_k=256)
    assert [wgmma_k(exact, g) for g in (16, 32, 128)] == [128, 128, 128]  # groups within a call: fine
    assert wgmma_k(dataclasses.replace(exact, tile_m=128), 128) == 64
    assert wgmma_k(TuningConfig(tiles=1, tile_m=128, tile_k=128, compute_wgs=2), 128) == 64


def test_injected_bugs_are_off_unless_asked():
    """The deliberate bugs of tests/kernel_faults.py (the GPU tests' proof that they can fail) change the
    traced kernel when injected, and removing them restores it exactly: the kernel modules hold no trace
    of them. (The jaxpr: the lowered module's serialization differs from one lowering to the next.)"""
    config = TuningConfig(
        tiles=1, tile_m=16, tile_k=128, max_concurrent_steps=2, split_k=2, scales_on="accumulators"
    )
    qw = _abstract_weight(1024, 256, 128, False)
    x = jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16)
    trace = lambda: str(jax.make_jaxpr(lambda x, qw: mg.mosaic_gpu_matmul(x, qw, config=config))(x, qw))
    assert faults.injected() is None
    clean = trace()
    for bug in faults.BUGS:
        with faults.injecting(bug):
            assert faults.injected() == bug and trace() != clean, bug
        assert faults.injected() is None
    assert trace() == clean
    with pytest.raises(ValueError, match="last-n-tile-zero"):
        with faults.injecting("no-such-bug"):
            pass
    # A context variable: another context (thread, task) tracing while a bug is injected here traces
    # the kernel without it.
    import contextvars

    with faults.injecting("last-n-tile-zero"):
        assert contextvars.Context().run(trace) == clean


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tiles=3), "tiles=3"),
        (dict(tile_m=12), "tile_m=12"),
        (dict(tile_k=32), "tile_k=32"),
        (dict(slices=3), "slices=3"),
        (dict(tile_m=2, slices=2), "multiple of 8"),
        (dict(tile_m=8, slices=2, compute_wgs=2), "one-warpgroup"),
        (dict(max_concurrent_steps=0), "max_concurrent_steps=0"),
        (dict(split_k=0), "split_k=0"),
        (dict(split_k=9), "split_k=9"),
        (dict(tile_m=16, slices=2, split_k=2), "K slices or split-K"),
        (dict(tile_m=8, split_k=2, tiles=1), "8-row slabs"),
        (dict(tile_m=128, split_k=3), "power of two"),
        (dict(tile_m=128, split_k=2, compute_wgs=2), "slabs of at most 32 rows"),
        (dict(scales_on="x"), "scales_on"),
    ],
)
def test_config_validates_itself(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TuningConfig(**kwargs)


def test_config_that_does_not_divide_k_is_refused():
    config = TuningConfig(tiles=2, tile_m=16, tile_k=128, max_concurrent_steps=2, split_k=2)
    with pytest.raises(ValueError, match="split_k"):
        _lower(1, _abstract_weight(640, 4096, 128, True), config=config)


def test_accumulator_route_refuses_small_groups():
    config = TuningConfig(tiles=1, tile_m=8, tile_k=128, scales_on="accumulators")
    with pytest.raises(ValueError, match="multiple of 64"):
        _lower(1, _abstract_weight(1024, 1024, 32, True), config=config)


def test_one_launch_and_no_copy_of_x_at_decode():
    """The compiled call of a decode matmul is the kernel alone: x is read as it is (a reshape), y written
    as it is, so no padding, de-interleaving or split-K fusion runs beside the kernel."""
    text = _lower(1, _abstract_weight(4096, 4096, 128, True)).as_text()
    ops = {op for op in re.findall(r"= (stablehlo\.[a-z_]+)", text)}
    assert "stablehlo.custom_call" in ops
    assert not ops & {"stablehlo.pad", "stablehlo.transpose", "stablehlo.reduce", "stablehlo.slice"}, ops


def test_a_kernel_called_at_several_sites_is_lowered_once():
    """Three layers of two projections (two problems): each problem's Mosaic GPU module is in the lowered
    program once, a function each layer calls (``mosaic_gpu.lowered_once``), where every call site had
    lowered its own copy (a 3-layer decode step's compile took twice as long)."""
    up, down = _abstract_weight(576, 1536, 128, True), _abstract_weight(1536, 576, 128, True)

    def layers(x, up, down):
        for _ in range(3):
            x = mg.mosaic_gpu_matmul(mg.mosaic_gpu_matmul(x, up, num_sms=NUM_SMS), down, num_sms=NUM_SMS)
        return x

    x = jax.ShapeDtypeStruct((1, 576), jnp.bfloat16)
    text = jax.jit(layers).trace(x, up, down).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2
    calls = re.findall(r"\bcall @(\w+)\(", text)
    assert len(calls) == 6 and len(set(calls)) == 2, calls


def _small_weight() -> QuantizedWeight:
    return quantize(np.ones((256, 128), np.float32), group_size=128)


def test_cpu_outside_interpret_mode_raises_clearly():
    qw = _small_weight()
    x = jnp.ones((3, 256), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"Hopper GPU.*interpret\(\)"):
        mg.mosaic_gpu_matmul(x, qw)
    with pytest.raises(NotImplementedError, match="interpret"):
        jax.jit(mg.mosaic_gpu_matmul).trace(x, qw).lower()  # for the default (CPU) platform


def test_lower_under_vmap_and_grad():
    qw = _abstract_weight(1536, 576, 128, True)
    x = jax.ShapeDtypeStruct((2, 5, 1536), jnp.bfloat16)
    batched = jax.vmap(lambda x, qw: mg.mosaic_gpu_matmul(x, qw), in_axes=(0, None))
    jax.jit(batched).trace(x, qw).lower(lowering_platforms=("cuda",))
    loss = lambda x, qw: mg.mosaic_gpu_matmul(x, qw).astype(jnp.float32).sum()
    x2 = jax.ShapeDtypeStruct((5, 1536), jnp.bfloat16)
    jax.jit(jax.grad(loss)).trace(x2, qw).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda qw: (jnp.ones((2, 256), jnp.float32), qw), "float32"),
        (lambda qw: (jnp.ones((2, 128), jnp.bfloat16), qw), "K=128"),
        (lambda qw: (jnp.ones((2, 256), jnp.bfloat16), relayout(qw, "nk_int4")), "layout"),
    ],
    ids=["f32", "wrong-k", "layout"],
)
def test_is_supported_reasons(make, match):
    x, qw = make(_small_weight())
    reason = mg.is_supported(x, qw)
    assert reason is not None and match in reason
    with pytest.raises(NotImplementedError, match=match):
        mg.mosaic_gpu_matmul(x, qw)


def test_is_supported_accepts_a_normal_weight():
    assert mg.is_supported(jnp.ones((2, 256), jnp.bfloat16), _small_weight()) is None


def test_fast_layout_keys_are_jaxs_own():
    """The suite and the X-ray lower with bench.kernel_xray.layout_key installed (tests/conftest.py): each
    of its sort keys must be the string jax's own ``ValueSite.__str__`` gives, so the sort orders the same
    strings (comparing lowered modules cannot show it: a lowering's bytes, its kernel hash included, differ
    from run to run by themselves). Checked on the Hopper kernel's two scale routes (M = 1 accumulator with
    K slices, M = 128 exact), asymmetric, the grouped kernel and the Blackwell kernel. On a jax that no
    longer sorts by the key (0.12), nothing is replaced."""
    from jax.experimental.mosaic.gpu import layout_inference as li

    from bench.kernel_xray import layout_key
    from bench.xray.moe_cases import abstract_weight as abstract_stack
    from nybble.kernels.mosaic_gpu.blackwell import blackwell_matmul
    from nybble.kernels.mosaic_gpu.blackwell.target import target_arch
    from nybble.kernels.mosaic_gpu.grouped import grouped_matmul

    def lower_grouped():
        qw = abstract_stack(8, 2048, 768, 128, False)
        args = (jax.ShapeDtypeStruct((16, 2048), jnp.bfloat16), qw, jax.ShapeDtypeStruct((8,), jnp.int32))
        fn = lambda x, qw, sizes: grouped_matmul(x, qw, sizes, num_sms=NUM_SMS)
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))

    def lower_blackwell():
        qw = _abstract_weight(4096, 4096, 128, False, layout=None)
        x = jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16)
        with target_arch(10, 0):
            return jax.jit(blackwell_matmul).trace(x, qw).lower(lowering_platforms=("cuda",))

    lowerings = [
        lambda: _lower(1, _abstract_weight(4096, 4096, 128, False)),
        lambda: _lower(128, _abstract_weight(1536, 576, 32, False)),
        lower_grouped,
        lower_blackwell,
    ]
    if not layout_key.sorts_by_key():  # jax 0.12: no sort by the key, nothing replaced
        assert not layout_key.install(check=True)
        assert li.ValueSite.__str__.__module__ == li.__name__  # jax's own
        return
    assert layout_key.install(check=True), "jax's ValueSite.__str__ is not the one layout_key knows"
    try:
        before = layout_key.keys_checked()
        for lower in lowerings:  # every key compared with jax's own as it is made (AssertionError if not)
            assert "mosaic_gpu" in lower().as_text()
        assert layout_key.keys_checked() - before > 100  # layout inference ran, key by key
    finally:
        layout_key.install()
