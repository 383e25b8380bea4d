"""bench.model_bench on the tiny random Llama: measurement, agreement, JSON schema, command line."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench import model_bench
from nybble.models import quantize
from nybble.models.evaluate.zoo import tiny_random


@pytest.fixture(scope="module")
def models():
    model, _ = tiny_random(jnp.float32)
    return model, quantize(nnx.clone(model), group_size=128, progress=False)


def test_measure_decode_counts_and_times(models):
    model, _ = models
    prompts = model_bench.make_prompts(range(1000), 2, 5)
    m = model_bench.measure_decode(model, prompts, 4, repeats=2)
    assert all(k in m for k in model_bench.MEASURE_KEYS)
    assert m["batch"] == 2 and m["prompt_len"] == 5 and m["decode_steps"] == 4 and m["finite"]
    assert np.asarray(m["tokens"]).shape == (2, 5)  # prefill's token + 4 decode steps
    assert m["decode"]["samples"] == 2 and m["decode"]["median_s"] > 0
    assert m["tokens_per_s"] == pytest.approx(2 * 4 / m["decode"]["median_s"])
    assert m["prefill_tokens_per_s"] == pytest.approx(2 * 5 / m["prefill"]["median_s"])
    # the greedy tokens are those of generate()
    from nybble.models import generate

    np.testing.assert_array_equal(m["tokens"], generate(model, prompts, 5))
    with pytest.raises(ValueError):
        model_bench.measure_decode(model, prompts[0], 4)


def test_agreement_and_prompts():
    assert model_bench.agreement([[1, 2, 3, 4]], [[1, 2, 0, 4]]) == (0.75, 0.5)
    assert model_bench.agreement([[1, 2], [3, 4]], [[1, 2], [0, 4]]) == (0.75, 0.5)
    p = model_bench.make_prompts([5, 6, 7], 2, 4)
    assert p.shape == (2, 4) and p.dtype == np.int32 and p.tolist() == [[5, 6, 7, 5], [6, 7, 5, 6]]
    with pytest.raises(ValueError):
        model_bench.agreement([[1]], [[1, 2]])


def test_compare_rows_and_schema(models):
    rows = model_bench.compare(*models, range(300), batches=(1, 3), prompt_len=6, new_tokens=3, repeats=1)
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert all(k in r for k in model_bench.ROW_KEYS)
        assert r["speedup"] == pytest.approx(r["int4"]["tokens_per_s"] / r["float"]["tokens_per_s"])
        assert 0 <= r["agreement"] <= 1 and r["finite"]
    result = {"schema": model_bench.SCHEMA, "machine": {}, "config": {}, "rows": rows, "checks_ok": True}
    result.update(notes=[], elapsed_s=1.0)
    assert model_bench.validate(result) == []
    broken = {k: v for k, v in rows[0].items() if k != "speedup"}
    assert "rows[0] lacks 'speedup'" in model_bench.validate({**result, "rows": [broken]})
    assert "missing top-level key 'rows'" in model_bench.validate({"schema": model_bench.SCHEMA})


def test_main_writes_json_and_markdown(tmp_path, capsys):
    args = ["--model", "tiny-random", "--batches", "1", "2", "--new-tokens", "2", "--prompt-len", "4"]
    assert model_bench.main([*args, "--repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "model_bench.json").read_text())
    assert model_bench.validate(result) == []
    assert result["config"]["dtype"] == "float32" and result["config"]["group_size"] == 128
    assert [r["batch"] for r in result["rows"]] == [1, 2] and result["checks_ok"]
    # q/k/v and gate/up fused (nybble.models.fuse_projections): qkv 128x256, o 128x128, gate_up 128x512, down
    assert set(result["config"]["int4_paths"]) == {"128x128", "128x256", "128x512", "256x128"}
    md = (tmp_path / "model_bench.md").read_text()
    assert "float tok/s" in md and "int4 tok/s" in md
    out = capsys.readouterr().out
    assert "speedup" in out and "float32" in out
    (tmp_path / "model_bench.md").unlink()
    assert model_bench.main([*args, "--repeats", "1", "--out", str(tmp_path), "--no-markdown"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_bench.json"]


def test_main_without_weights_writes_reason_and_exits_3(tmp_path, monkeypatch, capsys):
    from nybble.models.evaluate import zoo

    def missing(dtype):
        raise ImportError("SmolLM2 weights not found")

    monkeypatch.setitem(zoo.MODELS, "smollm2", missing)
    assert model_bench.main(["--out", str(tmp_path)]) == 3
    result = json.loads((tmp_path / "model_bench.json").read_text())
    assert result["rows"] == [] and not result["checks_ok"] and "weights not found" in result["skipped"]
    assert "cannot load smollm2" in capsys.readouterr().err


def test_llama3_8b_shapes_is_the_published_architecture():
    """The zoo's Llama-3-8B stand-in has the fields bench.decode reads from the published config.json."""
    from bench.decode.models import HF_CONFIGS
    from nybble.models.evaluate.zoo import LLAMA3_8B_CONFIG, MODELS
    from nybble.models.io.hf.config import decoder_config_from_hf

    assert decoder_config_from_hf(HF_CONFIGS["llama3-8b"]) == LLAMA3_8B_CONFIG
    assert "llama3-8b-shapes" in MODELS
