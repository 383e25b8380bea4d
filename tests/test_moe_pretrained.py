"""Mixtral and Qwen3-MoE through from_pretrained: transformers' logits (tests/fixtures/moe, made by
tools/make_moe_fixtures.py), int4 quantize -> generate on XLA and on the kernels in interpret mode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble import models
from nybble.models.definitions.moe import MoE, QExperts, Router
from nybble.models.io.hf.config import ConfigError, decoder_config_from_hf, hf_config_for, read_config
from nybble.models.io.hf.files import CheckpointError
from nybble.models.io.hf.pretrained import from_pretrained
from nybble.quant.stacked import num_experts

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "moe"


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "mixtral_fused"])
def test_float_logits_match_transformers(name):
    ref_dir = FIXTURES / name.removesuffix("_fused")
    model = from_pretrained(FIXTURES / name, dtype=jnp.float32)
    ids = np.load(ref_dir / "prompt_ids.npy")
    ref = np.load(ref_dir / "transformers_logits.npy")
    assert _rel(model(ids[None]), ref) < 1e-3
    cfg = model.config
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    if name == "qwen3_moe":  # mlp_only_layers: [0]; norm_topk_prob false
        assert kinds == ["MLP", "MoE"] and cfg.moe.norm_topk_prob is False
    else:
        assert kinds == ["MoE", "MoE"] and cfg.moe.norm_topk_prob is True
    assert decoder_config_from_hf(hf_config_for(cfg)) == cfg


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_int4_generate_same_tokens_on_xla_and_kernels(name):
    d = FIXTURES / name
    model = from_pretrained(d, dtype=jnp.bfloat16)
    model, report = models.quantize(model, group_size=32, progress=False, return_report=True)
    moe_layers = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    for moe in moe_layers:
        for stack in (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj):
            assert isinstance(stack, QExperts) and num_experts(stack.weight) == 4
        assert isinstance(moe.router, Router)  # float, never quantized
    assert any(r.path.endswith("mlp.router") and not r.quantized for r in report.layers)
    ids = np.load(d / "prompt_ids.npy")[:8]
    xla = models.generate(model, ids, max_new_tokens=4, eos_id=None, bucket=16)
    assert len(xla) == 4
    if name == "qwen3_moe":  # dense and MoE layers; interpreting the kernels costs ~40 s of one core
        with nybble.kernels.interpret():
            kernels = models.generate(model, ids, max_new_tokens=4, eos_id=None, bucket=16)
        np.testing.assert_array_equal(kernels, xla)
    # The int4 model still follows the float one: the same first token as transformers' logits argmax.
    ref = np.load(d / "transformers_logits.npy")[0, 7]
    assert xla[0] == int(np.argmax(ref))


def test_config_refusals(tmp_path):
    base = read_config(FIXTURES / "qwen3_moe")
    for bad, match in (
        ({"num_experts_per_tok": 5}, "num_experts_per_tok = 5 > the 4 experts"),
        ({"num_experts": 8}, "num_local_experts and num_experts disagree"),
        ({"mlp_only_layers": [7]}, r"mlp_only_layers = \[7\]"),
        ({"shared_expert_intermediate_size": 16}, "shared_expert_intermediate_size = 16"),
    ):
        with pytest.raises(ConfigError, match=match):
            decoder_config_from_hf({**base, **bad})
    mixtral = read_config(FIXTURES / "mixtral")
    with pytest.raises(ConfigError, match=r"router_jitter_noise = 0\.1"):
        decoder_config_from_hf({**mixtral, "router_jitter_noise": 0.1})
    cfg = decoder_config_from_hf({**base, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert cfg.moe_layers == (1,)  # (i + 1) % 2 == 0


def test_missing_expert_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "mixtral"
    shutil.copytree(FIXTURES / "mixtral", d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight"):
        from_pretrained(d, dtype=jnp.float32)
    manifest = json.loads((FIXTURES / "MANIFEST.json").read_text())
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in manifest["tensors"]["mixtral"]


def test_compressed_tensors_experts_load_as_stacked_int4():
    # Experts packed by compressed-tensors itself (W4A16 pack-quantized, sym g32), the rest float: each
    # stack becomes one QExperts read straight from the packed tensors; logits as transformers' with the
    # library's own dequantization of the experts.
    d = FIXTURES / "qwen3_moe_ct_experts"
    model = from_pretrained(d, dtype=jnp.float32)
    moe = model.layers[1].mlp
    for stack in (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj):
        assert isinstance(stack, QExperts) and num_experts(stack.weight) == 4
        assert stack.weight.symmetric and stack.weight.dtype == np.dtype(jnp.bfloat16)
    assert moe.experts.gate_proj.weight.group_size == 32  # down_proj's K = 32 is one group: per column
    assert isinstance(moe.router, Router) and type(model.layers[0].mlp).__name__ == "MLP"
    ids = np.load(d / "prompt_ids.npy")
    assert _rel(model(ids[None]), np.load(d / "transformers_logits.npy")) < 1e-4


@pytest.mark.parametrize("fmt", [None, "compressed-tensors"])
def test_save_pretrained_round_trip(tmp_path, fmt):
    from nybble.models.io.hf.save import save_pretrained

    d = FIXTURES / "qwen3_moe"
    model = from_pretrained(d, dtype=jnp.float32)
    if fmt is not None:
        models.quantize(model, group_size=32, progress=False)
    ids = np.load(d / "prompt_ids.npy")[None]
    out = save_pretrained(model, tmp_path / "out", format=fmt, source=d)
    names = (
        set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
        if (out / "model.safetensors.index.json").is_file()
        else None
    )
    back = from_pretrained(out, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(back(ids)), np.asarray(model(ids)))
    moe = back.layers[1].mlp
    if fmt is None:
        assert isinstance(moe.experts.gate_proj, type(model.layers[1].mlp.experts.gate_proj))
    else:  # written expert by expert under the Hub names, read back into the same stacks
        assert isinstance(moe.experts.gate_proj, QExperts) and isinstance(moe.router, Router)
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert "model.layers.1.mlp.gate" in qc["ignore"]
    del names


def test_streamed_quantize_of_an_moe_directory(tmp_path):
    # The streaming quantizer (nybble quantize --model DIR) takes every expert's linear, keeps the router
    # float; from_pretrained reads the experts back as stacks equal to nybble.quantize of each expert.
    from nybble.models.io.hf.stream import quantize_directory

    d = FIXTURES / "qwen3_moe"
    out = tmp_path / "int4"
    quantize_directory(d, out, group_size=32, progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.gate" in qc["ignore"]
    model = from_pretrained(out, dtype=jnp.float32)
    float_model = from_pretrained(d, dtype=jnp.float32)
    stack = model.layers[1].mlp.experts.up_proj
    assert isinstance(stack, QExperts)
    w = float_model.layers[1].mlp.experts.up_proj.kernel[...]
    np.testing.assert_array_equal(
        np.asarray(nybble.dequantize(stack.weight)),
        np.asarray(nybble.dequantize(nybble.quantize(w, group_size=32, scale_dtype=stack.weight.dtype))),
    )
