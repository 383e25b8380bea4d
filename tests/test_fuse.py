"""Fused projections (nybble.models.fuse_projections): q/k/v and gate/up as one layer give the unfused
numbers, generate keeps its greedy tokens (SmolLM2, the HF fixtures), and checkpoints stay per projection."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nybble.models import (
    QLinear,
    from_pretrained,
    fuse_projections,
    generate,
    load_model,
    quantize,
    save_model,
    unfuse_projections,
)
from nybble.models.definitions.fuse import FusedGateUp, FusedLinear, concat_columns, split_columns
from nybble.models.definitions.llama import Llama
from nybble.models.evaluate.zoo import TINY_CONFIG
from nybble.quant.rtn import quantize as quantize_weight

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
IDS = (np.arange(12) * 37 % 256)[None].astype(np.int32)


def tiny(kind: str, **changes) -> Llama:
    model = Llama(dataclasses.replace(TINY_CONFIG, **changes), rngs=nnx.Rngs(3), dtype=jnp.float32)
    if kind != "float":
        quantize(model, group_size=64, symmetric=kind == "int4-sym", progress=False, fuse_projections=False)
    return model


@pytest.mark.parametrize("symmetric", [True, False])
def test_concat_then_split_is_exact(symmetric):
    rng = np.random.default_rng(0)
    parts = [
        quantize_weight(rng.standard_normal((96, n), np.float32), group_size=32, symmetric=symmetric)
        for n in (40, 24, 72)
    ]  # N not multiples of 64: padding sits between the parts
    fused = concat_columns(parts)
    assert fused.shape == (96, 136)
    np.testing.assert_array_equal(
        np.asarray(fused.logical_codes())[:96, :136],
        np.concatenate([np.asarray(p.logical_codes())[:96, : p.shape[1]] for p in parts], axis=1),
    )
    for a, b in zip(split_columns(fused, (40, 24, 72)), parts, strict=True):
        np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
        np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
        if not symmetric:
            np.testing.assert_array_equal(np.asarray(a.offsets), np.asarray(b.offsets))
    with pytest.raises(ValueError, match="differ in K or format"):
        concat_columns([parts[0], quantize_weight(np.ones((96, 8), np.float32), group_size=64)])


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_gate_up_interleaved_and_split_back_exactly(symmetric):
    # An int4 MLP's gate/up fuse into a FusedGateUp: columns interleaved 8 by 8 (nybble.packing.gate_up),
    # each part split back bit for bit (codes, scales, offsets), and its output is (gate, up).
    model = tiny("int4-sym" if symmetric else "int4-asym")
    mlp = model.layers[1].mlp
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 128)), jnp.float32)
    want = (np.asarray(mlp.gate_proj(x)), np.asarray(mlp.up_proj(x)))
    fuse_projections(model)
    fused = mlp.gate_up_proj
    assert isinstance(fused, FusedGateUp) and fused.inner.weight.shape == (128, 512)
    codes = np.asarray(fused.inner.weight.logical_codes())[:128]
    np.testing.assert_array_equal(codes[:, 8:16], np.asarray(up.logical_codes())[:128, :8])
    np.testing.assert_array_equal(codes[:, 16:24], np.asarray(gate.logical_codes())[:128, 8:16])
    for got, part in zip(fused(x), want, strict=True):
        np.testing.assert_allclose(np.asarray(got), part, rtol=1e-5, atol=1e-5)
    for name, original in (("gate_proj", gate), ("up_proj", up)):
        split = getattr(mlp, name).weight  # FusedParts: the part split off
        for field in ("codes", "scales") + (() if symmetric else ("offsets",)):
            np.testing.assert_array_equal(
                np.asarray(getattr(split, field)), np.asarray(getattr(original, field))
            )
    # The MLP's output through the SwiGLU op (the XLA path here) is the unfused MLP's, to f32 rounding.
    ref = np.asarray(model.layers[1].mlp(x))
    unfuse_projections(model)
    np.testing.assert_allclose(np.asarray(model.layers[1].mlp(x)), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.up_proj.weight.codes), np.asarray(up.codes))


@pytest.mark.parametrize("kind", ["int4-sym", "float"])
def test_fused_logits_equal_unfused(kind):
    model = tiny(kind, qkv_bias=True)
    ref = np.asarray(model(IDS))
    assert fuse_projections(model) == 2 * TINY_CONFIG.num_layers
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    assert isinstance(attn.qkv_proj, FusedLinear) and "q_proj" not in vars(attn)
    assert isinstance(mlp.gate_up_proj, FusedLinear) and "up_proj" not in vars(mlp)
    assert fuse_projections(model) == 0  # fused already
    if kind != "float":
        assert isinstance(attn.qkv_proj.inner, QLinear) and attn.qkv_proj.inner.weight.shape == (128, 256)
    out = np.asarray(model(IDS))
    # One wider GEMM, float or int4 (same codes and scales): XLA's CPU dot may block the K sum differently
    # for a wider N, so the logits agree to f32 rounding (int4 rounding error is ~1e-2 here, 1000x more).
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert unfuse_projections(model) == 2 * TINY_CONFIG.num_layers
    np.testing.assert_array_equal(np.asarray(model(IDS)), ref) if kind != "float" else None


def test_generate_tokens_unchanged_and_saved_per_projection(tmp_path):
    model = tiny("int4-asym")
    before = generate(model, IDS[0], 8)
    quantized = tiny("float")
    quantize(quantized, group_size=64, symmetric=False, progress=False, fuse_projections=True)
    assert isinstance(quantized.layers[1].mlp.gate_up_proj, FusedLinear)
    np.testing.assert_array_equal(generate(quantized, IDS[0], 8), before)
    save_model(tmp_path / "m.safetensors", quantized)  # written one projection at a time
    template = tiny("int4-asym")
    loaded = load_model(tmp_path / "m.safetensors", template)
    assert isinstance(loaded.layers[0].attn.q_proj, QLinear)
    np.testing.assert_array_equal(generate(loaded, IDS[0], 8), before)


@pytest.mark.parametrize("name", ["llama3"])
def test_hf_fixture_greedy_tokens_unchanged(name):
    prompt = np.load(FIXTURES / name / "prompt_ids.npy").reshape(-1)[:8]
    plain = from_pretrained(FIXTURES / name, dtype=jnp.float32, fuse_projections=False)
    quantize(plain, group_size=32, progress=False, fuse_projections=False)
    assert "qkv_proj" not in vars(plain.layers[0].attn)
    fused = from_pretrained(FIXTURES / name, dtype=jnp.float32, fuse_projections=True)
    assert isinstance(fused.layers[0].attn.qkv_proj, FusedLinear)  # fused float, unfused, quantized, fused
    quantize(fused, group_size=32, progress=False, fuse_projections=True)
    assert isinstance(fused.layers[0].attn.qkv_proj.inner, QLinear)
    np.testing.assert_array_equal(generate(fused, prompt, 6), generate(plain, prompt, 6))


@pytest.mark.slow
def test_smollm2_greedy_tokens_unchanged():
    from nybble.models import smollm2

    model, tok = smollm2.load(jnp.float32)
    # Its first 8 of 30 layers (real weights, a quarter of the compile; every layer fuses alike)
    model.layers = nnx.List(list(model.layers)[:8])
    model.config = dataclasses.replace(model.config, num_layers=8)
    quantize(model, group_size=128, progress=False, fuse_projections=False)
    prompt = tok.encode("The capital of France is").ids
    before = generate(model, prompt, 4)
    assert fuse_projections(model) == 2 * model.config.num_layers
    np.testing.assert_array_equal(generate(model, prompt, 4), before)


def test_from_pretrained_fuses_on_request_and_refuses_a_mesh():
    assert "qkv_proj" not in vars(from_pretrained(FIXTURES / "llama3", dtype=jnp.float32).layers[0].attn)
    model = from_pretrained(FIXTURES / "llama3", dtype=jnp.float32, fuse_projections=True)
    assert isinstance(model.layers[0].attn.qkv_proj, FusedLinear)
    with pytest.raises(ValueError, match="cannot be combined with mesh"):
        from_pretrained(FIXTURES / "llama3", mesh=object(), fuse_projections=True)
