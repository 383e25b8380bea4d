"""Hugging Face directories through the command line and save_pretrained (issue 35, output side).

References: the streamed output is read back with the formats' own readers (``hf_scheme``) and compared
bit for bit with ``nybble.quantize`` of the same float weights read independently from the input files;
passed-through tensors byte for byte; from_pretrained of what save_pretrained wrote gives the in-memory
model's logits exactly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import nybble
from nybble.__main__ import main
from nybble.models import from_pretrained, quantize, save_pretrained
from nybble.models.definitions.llama import Llama
from nybble.models.io.hf.config import decoder_config_from_hf
from nybble.models.io.hf.files import INDEX_NAME, CheckpointDir, read_header
from nybble.models.io.hf.stream import quantize_directory
from nybble.quant.formats.hf_scheme import scheme_from_config
from tests.hf_tiny import CFG, write_float_dir


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    return write_float_dir(tmp_path_factory.mktemp("hf"))


def _linears(ckpt: CheckpointDir) -> list[str]:
    return [n[: -len(".weight")] for n in ckpt.names() if n.endswith("_proj.weight")]


def test_the_float_directory_is_sharded_and_loads(float_dir):
    files = sorted(os.listdir(float_dir))
    assert INDEX_NAME in files and "tokenizer.json" in files and "generation_config.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 2
    ckpt = CheckpointDir(float_dir)
    assert decoder_config_from_hf(ckpt.config) == CFG
    assert all(ckpt.dtype(n) == ml_dtypes.bfloat16 for n in ckpt.names())


@pytest.mark.parametrize(
    ("fmt", "scale_dtype", "symmetric"),
    [
        ("compressed-tensors", "bfloat16", True),
        ("compressed-tensors", "bfloat16", False),
        ("gptq", "float16", True),
        ("gptq", "float16", False),
    ],
)
def test_streamed_quantize_equals_nybble_quantize_bit_for_bit(
    float_dir, tmp_path, capsys, fmt, scale_dtype, symmetric
):
    out = tmp_path / "int4"
    argv = ["quantize", "--model", str(float_dir), "--format", fmt, "--group-size", "32"]
    argv += ["--output", str(out), "--max-shard-size", "12KB", "--no-progress"]
    argv += ["--symmetric"] if symmetric else ["--asymmetric"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "linear layers quantized" in captured.err and "GB/s" in captured.err
    src, got = CheckpointDir(float_dir), CheckpointDir(out)
    assert (out / "tokenizer.json").read_bytes() == (float_dir / "tokenizer.json").read_bytes()
    assert (out / "generation_config.json").is_file()
    qc = got.config["quantization_config"]
    assert qc["quant_method"] == fmt and got.config["model_type"] == "llama"
    assert (
        qc["config_groups"]["group_0"]["weights"]["symmetric"] if fmt != "gptq" else qc["sym"]
    ) is symmetric
    scheme = scheme_from_config(qc)
    linears = _linears(src)
    assert len(linears) == 7 * CFG.num_layers  # lm_head stays float
    assert not scheme.is_quantized("lm_head")
    for module in linears:
        w = src.get(f"{module}.weight")  # torch (out, in) bf16
        options = {} if symmetric else {"symmetric": False, "zero_point": "integer"}
        ref = nybble.quantize(
            np.asarray(w, np.float32).T, group_size=32, scale_dtype=getattr(jnp, scale_dtype), **options
        )
        qw = scheme.read_linear(module, got.get, in_features=w.shape[1], out_features=w.shape[0])
        assert qw.shape == ref.shape == (w.shape[1], w.shape[0])
        assert np.array_equal(np.asarray(qw.logical_codes()), np.asarray(ref.logical_codes())), module
        assert np.asarray(qw.scales).dtype == np.asarray(ref.scales).dtype
        assert np.asarray(qw.scales).tobytes() == np.asarray(ref.scales).tobytes(), module
        if not symmetric:
            assert np.asarray(qw.offsets).tobytes() == np.asarray(ref.offsets).tobytes(), module
        assert f"{module}.weight" not in got
    passed = [n for n in src.names() if n[: -len(".weight")] not in linears]
    assert "lm_head.weight" in passed and "model.embed_tokens.weight" in passed
    for name in passed:
        assert got.get(name).tobytes() == src.get(name).tobytes() and got.dtype(name) == src.dtype(name)
    # shard cap: every shard's tensor bytes under 12 KB unless it holds one tensor alone
    for f in got.shard_files:
        tensors, _ = read_header(f)
        assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= 12_000


def test_streamed_nybble_format_keeps_float_offsets(float_dir, tmp_path):
    report = quantize_directory(
        float_dir, tmp_path / "nb", format="nybble", group_size=32, symmetric=False, progress=False
    )
    assert len(report.quantized) == 14 and report.bytes_read == CheckpointDir(float_dir).total_bytes
    got = CheckpointDir(tmp_path / "nb")
    scheme = scheme_from_config(got.config["quantization_config"])
    w = CheckpointDir(float_dir).get("model.layers.1.mlp.down_proj.weight")
    ref = nybble.quantize(np.asarray(w, np.float32).T, group_size=32, symmetric=False)
    qw = scheme.read_linear("model.layers.1.mlp.down_proj", got.get, in_features=128, out_features=64)
    assert np.array_equal(np.asarray(qw.logical_codes()), np.asarray(ref.logical_codes()))
    assert np.asarray(qw.offsets).tobytes() == np.asarray(ref.offsets).tobytes()


def test_an_existing_output_is_refused_unless_overwrite(float_dir, tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    argv = ["quantize", "--model", str(float_dir), "--output", str(out), "--no-progress"]
    assert main(argv) == 2
    assert "already exists" in capsys.readouterr().err and os.listdir(out) == ["mine.txt"]
    assert main([*argv, "--overwrite"]) == 0
    assert "mine.txt" not in os.listdir(out) and "config.json" in os.listdir(out)


def test_a_failure_midway_leaves_nothing(float_dir, tmp_path, monkeypatch):
    from nybble.models.io.hf import stream

    calls = []

    def failing(w, module):
        calls.append(module)
        if len(calls) == 9:
            raise RuntimeError("injected failure at the 9th layer")
        return nybble.quantize(w, group_size=32)

    out = tmp_path / "never"
    with pytest.raises(RuntimeError, match="injected"):
        stream.quantize_directory(float_dir, out, max_shard_size="4KB", quantize_fn=failing, progress=False)
    assert len(calls) == 9
    assert not out.exists() and os.listdir(tmp_path) == []


def test_bad_inputs_are_clear_errors(float_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a hub id: argparse's error, exit status 2
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--model", "meta-llama/Llama-3.2-1B", "--output", "x"])
    assert exc.value.code == 2 and "download it first" in capsys.readouterr().err
    # no config.json
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in float_dir.iterdir():
        if f.name != "config.json":
            (broken / f.name).write_bytes(f.read_bytes())
    assert main(["quantize", "--model", str(broken), "--output", str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err
    # shapes that disagree with config.json
    config = json.loads((float_dir / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    assert main(["quantize", "--model", str(broken), "--output", str(tmp_path / "o")]) == 2
    assert "config.json implies" in capsys.readouterr().err
    # an already quantized directory
    (broken / "config.json").write_text(
        json.dumps({**config, "quantization_config": {"quant_method": "gptq"}})
    )
    assert main(["quantize", "--model", str(broken), "--output", str(tmp_path / "o")]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_generate_and_eval_take_a_directory(float_dir, tmp_path, capsys):
    assert main(["generate", "--model", str(float_dir), "--prompt", "the king", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("the king")
    q = tmp_path / "q"
    assert quantize_directory(float_dir, q, group_size=32, progress=False).quantized
    argv = ["eval", "--model", str(q), "--tokens", "16", "--window", "16", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"int4 ({q})" in out and "float" not in out.split("\n", 1)[1]
    # no tokenizer: the model loads, generate says what is missing
    (q / "tokenizer.json").unlink()
    assert main(["generate", "--model", str(q), "--prompt", "the king"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer.json" in err and "generate" in err
    assert from_pretrained(q) is not None


def test_save_pretrained_round_trips_float_and_quantized(tmp_path):
    model = Llama(CFG, rngs=nnx.Rngs(1), dtype=jnp.float32)
    ids = jnp.arange(10)[None] % CFG.vocab_size
    save_pretrained(model, tmp_path / "f32")
    assert np.array_equal(np.asarray(from_pretrained(tmp_path / "f32", dtype=jnp.float32)(ids)), model(ids))
    with pytest.raises(ValueError, match="has none; quantize it first"):
        save_pretrained(model, tmp_path / "x", format="compressed-tensors")
    asym = nnx.clone(model)
    quantize(model, group_size=32, progress=False)
    quantize(asym, group_size=32, symmetric=False, progress=False)  # float offsets: nybble's format only
    with pytest.raises(ValueError, match="int4 layers"):
        save_pretrained(model, tmp_path / "x")
    with pytest.raises(ValueError, match="integer zero point"):
        save_pretrained(asym, tmp_path / "x", format="compressed-tensors")
    for fmt, m in (("compressed-tensors", model), ("gptq", model), ("nybble", model), ("nybble-asym", asym)):
        save_pretrained(m, tmp_path / fmt, format=fmt.removesuffix("-asym"))
        back = from_pretrained(tmp_path / fmt, dtype=jnp.float32)
        assert back.layers[0].mlp.up_proj.weight.shape == (64, 128)
        assert back.layers[0].mlp.up_proj.weight.symmetric is (m is model)
        np.testing.assert_allclose(np.asarray(back(ids)), np.asarray(m(ids)), rtol=0, atol=1e-5)
    assert (
        not (tmp_path / "x").exists() and sorted(p.name for p in tmp_path.iterdir() if p.name[0] == ".") == []
    )


def test_the_benchmark_checkpoints_are_the_llamas_they_claim():
    """bench.checkpoints' synthetic directories: the tensors names.py expects, at ~0.5B and ~2B."""
    from bench.checkpoints import SIZES, llama_config, tensor_shapes
    from nybble.models.io.hf.names import expected_shapes

    counts = {}
    for size, layers in SIZES.items():
        config = llama_config(layers)
        shapes = dict(tensor_shapes(config))
        assert shapes == expected_shapes(decoder_config_from_hf(config))
        counts[size] = sum(int(np.prod(s)) for s in shapes.values())
    assert 0.45e9 < counts["0.5B"] < 0.55e9 and 1.9e9 < counts["2B"] < 2.1e9


def test_a_named_model_quantized_to_a_directory(tmp_path, capsys):
    """`--model tiny-random --format compressed-tensors --asymmetric`: integer zeros, read back exactly."""
    from nybble.models.evaluate.zoo import tiny_random

    out = tmp_path / "ct"
    argv = ["quantize", "--model", "tiny-random", "--format", "compressed-tensors", "--asymmetric"]
    assert main([*argv, "--group-size", "64", "--output", str(out), "--no-progress"]) == 0
    ref, _ = tiny_random()
    quantize(ref, group_size=64, symmetric=False, zero_point="integer", progress=False)
    back = from_pretrained(out, dtype=jnp.float32)
    ids = jnp.arange(12)[None]
    np.testing.assert_allclose(np.asarray(back(ids)), np.asarray(ref(ids)), rtol=0, atol=1e-5)
    assert back.layers[1].mlp.down_proj.weight.symmetric is False
