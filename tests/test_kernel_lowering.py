"""Lowering the Mosaic GPU W4A16 kernel for CUDA on a CPU: the hardware rules interpret mode cannot check.

``jax.jit(f).trace(*ShapeDtypeStructs).lower(lowering_platforms=("cuda",))`` runs Mosaic GPU's layout
inference, its SMEM budget and TMA alignment checks, with no data and no GPU, so production shapes cost
nothing. Every config the heuristics can pick at the shapes of real models is lowered here (once per
distinct config x kernel structure), plus the error paths on a CPU.
"""

from __future__ import annotations

import dataclasses

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
    k, n, group, symmetric, scale_dtype=jnp.bfloat16, codes_dtype="uint8"
) -> QuantizedWeight:
    k_pad, n_pad = padded_weight_dims(k, n, group)
    num_groups = -(-k_pad // (k_pad if group is None else group))
    sds = jax.ShapeDtypeStruct
    codes = sds((n_pad, k_pad // 2), jnp.uint8) if codes_dtype == "uint8" else sds((n_pad, k_pad), jnp.int4)
    return QuantizedWeight(
        codes=codes,
        scales=sds((num_groups, n_pad), scale_dtype),
        offsets=None if symmetric else sds((num_groups, n_pad), scale_dtype),
        shape=(k, n),
        group_size=group,
        symmetric=symmetric,
    )


def _lower(m, qw, x_dtype=jnp.bfloat16, config=None):
    fn = lambda x, qw: mg.mosaic_gpu_matmul(x, qw, config=config, num_sms=NUM_SMS)
    x = jax.ShapeDtypeStruct((m, qw.shape[0]), x_dtype)
    return jax.jit(fn).trace(x, qw).lower(lowering_platforms=("cuda",))


# uint8 codes (the stored format) at every group size; int4-stored codes only change which code path
# decode takes, so two group structures cover them.
_CASES = heuristic_cases(WEIGHT_SHAPES, BATCHES, GROUPS, NUM_SMS, codes_dtypes=("uint8",))
for _key, _case in heuristic_cases(WEIGHT_SHAPES, BATCHES, [128, 32], NUM_SMS, ("int4",)).items():
    _CASES.setdefault(_key, _case)


def test_heuristics_cover_both_families():
    configs = {key[0] for key in _CASES}
    assert any(c.split_k > 1 for c in configs) and any(c.tile_m == 128 for c in configs)
    assert {c.tile_n for c in configs} == {64, 128} and {c.tile_k for c in configs} == {64, 128}
    assert any(c.compute_wgs == 2 for c in configs) and any(c.compute_wgs == 1 for c in configs)
    assert {c.codes_as for c in configs} == {"int4", "uint8"}


def test_heuristics_take_the_deepest_pipeline_that_fits():
    """Each pick has the most SMEM slots its shape allows: its cap (8 for decode, 4 for prefill, at most
    the K steps of a split), or one more slot would not fit. (That each pick fits at all is Mosaic's own
    SMEM check, run by lowering every pick in test_lower_every_heuristic_config.)"""
    for (config, _, symmetric), (m, k, n, group, _, _) in _CASES.items():
        k_pad, _ = padded_weight_dims(k, n, group)
        cap = max(2, min(8 if m <= 64 else 4, k_pad // config.tile_k // config.split_k))
        assert config.max_concurrent_steps <= cap, (config, m, k, n, group)
        if config.max_concurrent_steps < cap:
            deeper = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps + 1)
            assert not fits_smem(deeper, group=group or k_pad, has_offsets=not symmetric), (config, m, k, n)


def test_smem_bytes_by_hand():
    """Stage buffers x slots + the output tile, counted by hand for one config of each family."""
    decode = TuningConfig(tile_n=128, tile_m=8, tile_k=128, max_concurrent_steps=8, split_k=4)
    # codes 128 x 64 B + x 8 x 128 x 2 B + one scale row and one offset row of 128 x 2 B, 8 slots;
    # f32 split-K output tile 8 x 128 x 4 B.
    assert smem_bytes(decode, group=128, has_offsets=True) == (8192 + 2048 + 512) * 8 + 4096
    prefill = TuningConfig(tile_n=128, tile_m=128, tile_k=128, max_concurrent_steps=3, compute_wgs=2)
    # A CTA covers 256 columns: codes 256 x 64 B + x 128 x 128 x 2 B + 4 scale rows (g32) of 256 x 4 B
    # (f32 scales), 3 slots; bf16 output tile 128 x 256 x 2 B. 225,280 B + 1 KiB slack fit in 232,448 B;
    # a 4th slot would not.
    used = smem_bytes(prefill, group=32, has_offsets=False, scale_bytes=4)
    assert used == (16384 + 32768 + 4096) * 3 + 65536 == 225280
    assert fits_smem(prefill, group=32, has_offsets=False, scale_bytes=4)
    four = dataclasses.replace(prefill, max_concurrent_steps=4)
    assert not fits_smem(four, group=32, has_offsets=False, scale_bytes=4)


def test_heuristic_families():
    decode = heuristic_config(1, 256, 1024, 128)
    assert decode.split_k > 1 and decode.tile_m == 8 and decode.compute_wgs == 1
    assert decode.codes_as == "uint8"  # zero-copy weights
    assert heuristic_config(1, 256, 1024, 128, codes_dtype="int4").codes_as == "int4"
    prefill = heuristic_config(4096, 4096, 4096, 128)
    assert prefill.compute_wgs == 2 and prefill.codes_as == "int4"


@pytest.mark.parametrize(
    "m, k, n, group, symmetric, codes_dtype",
    list(_CASES.values()),
    ids=[f"M{m}-K{k}-N{n}-g{g}-{'sym' if s else 'asym'}-{c}" for m, k, n, g, s, c in _CASES.values()],
)
def test_lower_every_heuristic_config(m, k, n, group, symmetric, codes_dtype):
    text = _lower(m, _abstract_weight(k, n, group, symmetric, codes_dtype=codes_dtype)).as_text()
    assert "mosaic_gpu" in text


# Configs the heuristics do not pick at these shapes but autotuning or a caller might: both variants
# with small and large tiles, split-K, one-step pipelines' minimum depth, narrow bands.
_EXPLICIT = [
    TuningConfig(tile_n=64, tile_m=8, tile_k=64, max_concurrent_steps=2, split_k=16),
    TuningConfig(tile_n=128, tile_m=64, tile_k=128, max_concurrent_steps=5, grid_tile_m=1),
    TuningConfig(tile_n=64, tile_m=16, tile_k=128, max_concurrent_steps=3, split_k=2, compute_wgs=2),
    TuningConfig(tile_n=128, tile_m=8, tile_k=64, max_concurrent_steps=6, split_k=4, compute_wgs=2),
    TuningConfig(tile_n=64, tile_m=128, tile_k=128, max_concurrent_steps=4, compute_wgs=2, grid_tile_m=3),
    TuningConfig(tile_n=128, tile_m=128, tile_k=64, max_concurrent_steps=3, compute_wgs=2, codes_as="uint8"),
    TuningConfig(tile_n=128, tile_m=32, tile_k=128, max_concurrent_steps=7, split_k=4, codes_as="uint8"),
]


@pytest.mark.parametrize("config", _EXPLICIT, ids=str)
@pytest.mark.parametrize("group, symmetric", [(32, False), (256, True)])
def test_lower_explicit_configs(config, group, symmetric):
    _lower(300, _abstract_weight(8192, 4096, group, symmetric), config=config)


@pytest.mark.parametrize("compute_wgs", [1, 2])
def test_lower_one_step_per_split(compute_wgs):
    config = TuningConfig(
        tile_n=64, tile_m=8, tile_k=64, max_concurrent_steps=3, split_k=2, compute_wgs=compute_wgs
    )
    _lower(4, _abstract_weight(128, 128, 32, True), config=config)


@pytest.mark.parametrize("m", [1, 4096])
def test_lower_float16_activations_float32_scales(m):
    _lower(m, _abstract_weight(4096, 4096, 128, False, jnp.float32), x_dtype=jnp.float16)


def test_decode_fills_the_gpu():
    """M = 1 on Llama-3-8B's square layer: split-K brings the CTA count close to the SM count."""
    k_pad, n_pad = padded_weight_dims(4096, 4096, 128)
    config = heuristic_config(1, n_pad, k_pad, 128, NUM_SMS)
    ctas = n_pad // config.tile_n * config.split_k
    assert config.tile_m == 8 and config.split_k > 1 and 0.75 * NUM_SMS <= ctas <= NUM_SMS


def test_prefill_does_not_split_k():
    k_pad, n_pad = padded_weight_dims(4096, 14336, 128)
    config = heuristic_config(4096, n_pad, k_pad, 128, NUM_SMS)
    assert config.split_k == 1 and config.tile_m == 128 and config.tile_n == 128


def test_over_budget_config_is_pruned_and_fails_to_lower():
    config = TuningConfig(tile_n=128, tile_m=128, tile_k=128, max_concurrent_steps=8)
    assert smem_bytes(config, group=128, has_offsets=True) > SMEM_BUDGET_BYTES
    assert not fits_smem(config, group=128, has_offsets=True)
    with pytest.raises(Exception, match="shared memory"):
        _lower(128, _abstract_weight(4096, 4096, 128, False), config=config)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tile_n=96), "tile_n=96"),
        (dict(tile_m=12), "tile_m=12"),
        (dict(tile_k=32), "tile_k=32"),
        (dict(max_concurrent_steps=0), "max_concurrent_steps=0"),
        (dict(split_k=0), "split_k=0"),
    ],
)
def test_config_validates_itself(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TuningConfig(**kwargs)


def test_config_that_does_not_divide_k_is_refused():
    config = TuningConfig(tile_n=128, tile_m=8, tile_k=128, max_concurrent_steps=2, split_k=5)
    with pytest.raises(ValueError, match="split_k"):
        _lower(1, _abstract_weight(4096, 4096, 128, True), config=config)


def test_codes_copy_only_where_compute_bound():
    """XLA turns a uint8 -> int4 bitcast into a copy of the codes: decode reads uint8 codes as bytes (no
    bitcast), prefill takes the copy, int4-stored codes never need one."""
    qw = _abstract_weight(4096, 4096, 128, True)
    qw4 = _abstract_weight(4096, 4096, 128, True, codes_dtype="int4")
    assert mg.is_supported(jnp.ones((1, 4096), jnp.bfloat16), qw4) is None
    assert "bitcast_convert" not in _lower(1, qw).as_text()
    assert "bitcast_convert" in _lower(4096, qw).as_text()
    assert "bitcast_convert" not in _lower(1, qw4).as_text()
    assert "bitcast_convert" not in _lower(4096, qw4).as_text()


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
        (lambda qw: (jnp.ones((2, 256), jnp.bfloat16), _with_layout(qw, "kn_other")), "layout"),
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
    import dataclasses

    return dataclasses.replace(qw, layout=layout)


def test_is_supported_accepts_a_normal_weight():
    assert mg.is_supported(jnp.ones((2, 256), jnp.bfloat16), _small_weight()) is None
