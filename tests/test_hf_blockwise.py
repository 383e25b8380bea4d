"""GPTQ and AutoRound over a checkpoint directory, decoder block by decoder block (issue 35).

Reference: the same method run on the whole model loaded in memory (``from_pretrained`` then
``nybble.models.quantize``); the block-by-block output, read back with the format's reader, must hold the
same codes and scales bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from nybble.__main__ import main
from nybble.models import from_pretrained, quantize
from nybble.models.io.hf.blockwise import quantize_directory_calibrated
from nybble.models.io.hf.files import CheckpointDir
from nybble.quant.formats.hf_scheme import scheme_from_config
from tests.hf_tiny import CFG, write_float_dir


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    return write_float_dir(tmp_path_factory.mktemp("hf"))


def test_blockwise_gptq_equals_gptq_of_the_loaded_model(float_dir, tmp_path):
    """GPTQ block by block from the files gives the codes and scales of GPTQ on the whole loaded model."""
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 16))
    report = quantize_directory_calibrated(
        float_dir, tmp_path / "gptq", calibration=ids, method="gptq", group_size=32, progress=False
    )
    assert len(report.quantized) == 14
    model = from_pretrained(float_dir, dtype=jnp.float32)
    quantize(model, method="gptq", calibration=ids, group_size=32, progress=False)
    got = CheckpointDir(tmp_path / "gptq")
    scheme = scheme_from_config(got.config["quantization_config"])
    for i in range(CFG.num_layers):
        for hf, mine in (
            ("self_attn.k_proj", model.layers[i].attn.k_proj),
            ("mlp.down_proj", model.layers[i].mlp.down_proj),
        ):
            ref = mine.weight
            k, n = ref.shape
            qw = scheme.read_linear(f"model.layers.{i}.{hf}", got.get, in_features=k, out_features=n)
            assert np.array_equal(np.asarray(qw.logical_codes()), np.asarray(ref.logical_codes())), (i, hf)
            assert np.asarray(qw.scales).tobytes() == np.asarray(ref.scales).tobytes(), (i, hf)
    src = CheckpointDir(float_dir)
    for name in ("model.norm.weight", "lm_head.weight", "model.layers.1.post_attention_layernorm.weight"):
        assert got.get(name).tobytes() == src.get(name).tobytes()


def test_blockwise_autoround_equals_autoround_of_the_loaded_model(float_dir, tmp_path):
    """AutoRound block by block gives what AutoRound of the loaded model gives with target='own' (the
    float block on the quantized inputs: the hidden states a block-by-block pass has)."""
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 16))
    options = dict(method="autoround", group_size=32, steps=4, chunk=4)
    quantize_directory_calibrated(float_dir, tmp_path / "ar", calibration=ids, progress=False, **options)
    model = from_pretrained(float_dir, dtype=jnp.float32)
    quantize(model, calibration=ids, target="own", progress=False, **options)
    got = CheckpointDir(tmp_path / "ar")
    scheme = scheme_from_config(got.config["quantization_config"])
    for i in range(CFG.num_layers):
        ref = model.layers[i].mlp.up_proj.weight
        qw = scheme.read_linear(f"model.layers.{i}.mlp.up_proj", got.get, in_features=64, out_features=128)
        assert np.array_equal(np.asarray(qw.logical_codes()), np.asarray(ref.logical_codes())), i
        assert np.asarray(qw.scales).tobytes() == np.asarray(ref.scales).tobytes(), i


def test_cli_gptq_on_a_directory_goes_block_by_block(float_dir, tmp_path, capsys, monkeypatch):
    from nybble.models.io.hf import blockwise

    seen = {}
    real = blockwise.quantize_directory_calibrated

    def spy(*args, **kw):
        seen.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(blockwise, "quantize_directory_calibrated", spy)
    out = tmp_path / "g"
    argv = ["quantize", "--model", str(float_dir), "--method", "gptq", "--calib-tokens", "256"]
    assert main([*argv, "--format", "gptq", "--group-size", "32", "--output", str(out), "--no-progress"]) == 0
    assert seen["method"] == "gptq" and len(seen["calibration"]) == 256
    got = CheckpointDir(out)
    assert got.config["quantization_config"]["quant_method"] == "gptq"
    assert sum(n.endswith(".qweight") for n in got.names()) == 14 and "lm_head.weight" in got
    (tmp_path / "notok").mkdir()
    for f in float_dir.iterdir():
        if f.name != "tokenizer.json":
            (tmp_path / "notok" / f.name).write_bytes(f.read_bytes())
    assert main([*argv, "--model", str(tmp_path / "notok"), "--output", str(tmp_path / "x")]) == 2
    assert "needs the model's tokenizer" in capsys.readouterr().err
