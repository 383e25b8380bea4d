"""Lowering the Mosaic GPU W4A16 kernel for CUDA on a CPU: the hardware rules interpret mode cannot check.

``jax.jit(f).trace(*ShapeDtypeStructs).lower(lowering_platforms=("cuda",))`` runs Mosaic GPU's layout
inference, its SMEM budget and TMA alignment checks, with no data and no GPU, so production shapes cost
nothing. Every config the heuristics can pick at the shapes of real models is lowered here (once per
distinct config x kernel structure), plus the error paths on a CPU.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble.kernels.mosaic_gpu as mg
from nybble.kernels.mosaic_gpu.config import (
    SMEM_BUDGET_BYTES,
    TuningConfig,
    fits_smem,
    heuristic_cases,
    heuristic_config,
    smem_bytes,
)
from nybble.packing import padded_weight_dims
from nybble.quant import QuantizedWeight, quantize

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


_CASES = heuristic_cases(WEIGHT_SHAPES, BATCHES, GROUPS, NUM_SMS)


def test_heuristics_cover_every_code_path():
    configs = {key[0] for key in _CASES}
    assert any(c.slices == 8 for c in configs) and any(1 < c.slices < 8 for c in configs)
    assert any(c.slices == 1 and c.compute_wgs == 1 for c in configs)
    assert any(c.compute_wgs == 2 for c in configs) and any(c.split_k > 1 for c in configs)
    assert {c.scales_on for c in configs} == {"accumulators", "weights"}
    assert {c.tile_k for c in configs} >= {128, 256} and {c.tiles for c in configs} >= {1, 2}


@pytest.mark.parametrize(
    "m, k, n, group, symmetric",
    list(_CASES.values()),
    ids=[f"M{m}-K{k}-N{n}-g{g}-{'sym' if s else 'asym'}" for m, k, n, g, s in _CASES.values()],
)
def test_lower_every_heuristic_config(m, k, n, group, symmetric):
    text = _lower(m, _abstract_weight(k, n, group, symmetric)).as_text()
    assert "mosaic_gpu" in text


# Configs the heuristics do not pick at these shapes but autotuning or a caller might: both variants
# with small and large tiles, split-K, K slices, the minimum pipeline depth, narrow bands.
_EXPLICIT = [
    TuningConfig(tiles=1, tile_m=8, tile_k=64, max_concurrent_steps=2, split_k=16),
    TuningConfig(tiles=4, tile_m=64, tile_k=128, max_concurrent_steps=3, grid_tile_m=1),
    TuningConfig(tiles=1, tile_m=16, tile_k=128, max_concurrent_steps=3, split_k=2, compute_wgs=2),
    TuningConfig(tiles=2, tile_m=8, tile_k=64, max_concurrent_steps=6, split_k=4, compute_wgs=2),
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
        tiles=1, tile_m=8, tile_k=64, max_concurrent_steps=3, split_k=2, compute_wgs=compute_wgs
    )
    _lower(4, _abstract_weight(128, 128, 32, True), config=config)


@pytest.mark.parametrize("m", [1, 4096])
def test_lower_float16_activations_float32_scales(m):
    _lower(m, _abstract_weight(4096, 4096, 128, False, jnp.float32), x_dtype=jnp.float16)


def test_decode_fills_the_gpu_in_one_launch():
    """M = 1 on Llama-3-8B's layers: K slices give every SM a CTA (two where SMEM allows), no split-K."""
    for k, n in ((4096, 4096), (14336, 4096), (4096, 14336)):
        k_pad, n_pad = padded_weight_dims(k, n, 128)
        config = heuristic_config(1, n_pad, k_pad, 128, NUM_SMS)
        ctas = n_pad // config.cta_rows
        assert config.slices == 8 and config.split_k == 1 and ctas >= NUM_SMS


def test_prefill_does_not_split_k():
    k_pad, n_pad = padded_weight_dims(4096, 14336, 128)
    config = heuristic_config(4096, n_pad, k_pad, 128, NUM_SMS)
    assert config.split_k == 1 and config.tile_m == 128 and config.compute_wgs == 2


def test_over_budget_config_fails_to_lower():
    config = TuningConfig(tiles=4, tile_m=128, tile_k=256, max_concurrent_steps=8)
    assert smem_bytes(config, group=128, has_offsets=True) > SMEM_BUDGET_BYTES
    assert not fits_smem(config, group=128, has_offsets=True)
    with pytest.raises(Exception, match="shared memory"):
        _lower(128, _abstract_weight(4096, 4096, 128, False), config=config)


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
        (dict(scales_on="x"), "scales_on"),
    ],
)
def test_config_validates_itself(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TuningConfig(**kwargs)


def test_config_that_does_not_divide_k_is_refused():
    config = TuningConfig(tiles=2, tile_m=8, tile_k=128, max_concurrent_steps=2, split_k=5)
    with pytest.raises(ValueError, match="split_k"):
        _lower(1, _abstract_weight(4096, 4096, 128, True), config=config)


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
        (lambda qw: (jnp.ones((2, 256), jnp.bfloat16), _with_layout(qw, "nk_int4")), "layout"),
    ],
    ids=["f32", "wrong-k", "layout"],
)
def test_is_supported_reasons(make, match):
    x, qw = make(_small_weight())
    reason = mg.is_supported(x, qw)
    assert reason is not None and match in reason
    with pytest.raises(NotImplementedError, match=match):
        mg.mosaic_gpu_matmul(x, qw)


def _with_layout(qw: QuantizedWeight, layout: str) -> QuantizedWeight:
    """The same codes under another registered layout name (a weight refuses an unregistered one)."""
    import dataclasses

    from nybble.packing import LAYOUTS, register_layout

    if layout not in LAYOUTS:
        register_layout(dataclasses.replace(LAYOUTS["nk_int4"], name=layout, description="a test layout"))
    return dataclasses.replace(qw, layout=layout)


def test_is_supported_accepts_a_normal_weight():
    assert mg.is_supported(jnp.ones((2, 256), jnp.bfloat16), _small_weight()) is None
