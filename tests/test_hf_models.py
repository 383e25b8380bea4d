"""Hugging Face checkpoint directories in: config.json mapping, from_pretrained, load_tokenizer.

The references are transformers' own float32 logits for tiny random checkpoints it wrote itself, committed
under tests/fixtures/hf/ by tools/make_hf_fixtures.py (torch is never imported here).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from nybble import models
from nybble.models.io.hf import names
from nybble.models.io.hf.config import ConfigError, decoder_config_from_hf, hf_config_for, read_config
from nybble.models.io.hf.files import CheckpointError

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CHECKPOINTS = ["llama", "llama3", "llama32_rope_parameters", "mistral", "qwen2", "qwen3"]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def loaded() -> dict[str, models.Llama]:
    return {name: models.from_pretrained(FIXTURES / name, dtype=jnp.float32) for name in CHECKPOINTS}


def _ref(name: str) -> tuple[np.ndarray, np.ndarray]:
    d = FIXTURES / name
    return np.load(d / "prompt_ids.npy"), np.load(d / "transformers_logits.npy")


# ----------------------------------------------------------------------------- logits vs transformers


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_match_transformers(loaded, name):
    ids, want = _ref(name)
    got = loaded[name](jnp.asarray(ids)[None])
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert rel_err(got, want) < 1e-3
    # elementwise too, relative to the logits' scale
    assert float(np.max(np.abs(np.asarray(got) - want))) < 1e-3 * float(np.max(np.abs(want)))


def test_configs_read_as_written(loaded):
    c = {n: m.config for n, m in loaded.items()}
    assert c["llama"].rope_scaling is None and not c["llama"].tie_embeddings and c["llama"].head_dim == 16
    assert (
        c["llama3"].rope_scaling is not None
        and c["llama3"].rope_scaling.original_max_position_embeddings == 8
    )
    assert c["llama3"].rope_theta == 500000.0
    assert c["llama32_rope_parameters"].rope_scaling == c["llama3"].rope_scaling
    assert c["llama32_rope_parameters"].tie_embeddings and loaded["llama32_rope_parameters"].lm_head is None
    assert c["llama32_rope_parameters"].head_dim == 32
    assert c["mistral"].sliding_window == 6
    assert c["qwen2"].qkv_bias and loaded["qwen2"].layers[0].attn.q_proj.bias is not None
    assert c["qwen3"].qk_norm and c["qwen3"].head_dim == 32 and c["qwen3"].tie_embeddings
    # the spellings really differ on disk
    assert "rope_scaling" in read_config(FIXTURES / "llama3")
    assert "rope_parameters" in read_config(FIXTURES / "llama32_rope_parameters")


def test_sharded_fixture_is_sharded():
    d = FIXTURES / "llama3"
    assert (d / "model.safetensors.index.json").is_file() and not (d / "model.safetensors").exists()
    assert len(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1


@pytest.mark.parametrize("name", ["mistral", "qwen3", "llama3"])
def test_kv_cache_decode_equals_full_forward(loaded, name):
    model = loaded[name]
    ids, _ = _ref(name)
    ids = jnp.asarray(ids)[None]
    full = np.asarray(model(ids))
    start = 5
    logits, cache = model.prefill(ids[:, :start], max_len=ids.shape[1])
    steps = [np.asarray(logits)]
    for pos in range(start, ids.shape[1]):
        step, cache = model.decode_step(ids[:, pos], cache, pos)
        steps.append(np.asarray(step))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=0, atol=2e-5 * np.abs(full).max())


def test_bf16_default_dtype_close():
    ids, want = _ref("qwen2")
    model = models.from_pretrained(FIXTURES / "qwen2")  # dtype=bfloat16 by default
    assert model.embed.embedding.dtype == jnp.bfloat16
    got = model(jnp.asarray(ids)[None])
    assert got.dtype == jnp.float32 and rel_err(got, want) < 5e-2


def test_mesh_places_the_model(loaded):
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    model = models.from_pretrained(FIXTURES / "qwen2", dtype=jnp.float32, mesh=mesh)
    ids, want = _ref("qwen2")
    assert model.layers[0].attn.q_proj.kernel[...].sharding.mesh == mesh
    assert rel_err(model(jnp.asarray(ids)[None]), want) < 1e-3


# ------------------------------------------------------------------------------------------ tokenizer


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_tokenizer_matches_transformers_ids(name):
    tok = models.load_tokenizer(FIXTURES / name)
    ids, _ = _ref(name)
    manifest = json.loads((FIXTURES / "MANIFEST.json").read_text())
    assert tok.encode(manifest["prompt"]).ids[: len(ids)] == ids.tolist()


def test_missing_tokenizer_model_loads(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "qwen3", d)
    (d / "tokenizer.json").unlink()
    model = models.from_pretrained(d, dtype=jnp.float32)
    ids, want = _ref("qwen3")
    assert rel_err(model(jnp.asarray(ids)[None]), want) < 1e-3
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json.*tokenizer_config\.json.*model loads"):
        models.load_tokenizer(d)


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("where", ["meta-llama/Llama-3.2-1B", "https://huggingface.co/Qwen/Qwen3-0.6B"])
def test_hub_id_or_url_says_download_first(where):
    with pytest.raises(ValueError, match="download it first"):
        models.from_pretrained(where)
    with pytest.raises(ValueError, match="download it first"):
        models.load_tokenizer(where)


BASE = read_config(FIXTURES / "llama")


def _with(**changes):
    cfg = copy.deepcopy(BASE)
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


_DROP = object()
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}

CONFIG_ERRORS = [
    (dict(model_type="gemma2"), r"model_type = 'gemma2' is not supported; supported: llama, mistral"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope_scaling\.rope_type = 'yarn'"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope_scaling\.rope_type = 'dynamic'"),
    (
        dict(
            rope_theta=_DROP,
            rope_scaling=_DROP,
            rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
        ),
        r"rope_parameters\.rope_type = 'linear'",
    ),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), r"lacks low_freq_factor, high_freq_factor"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}), r"rope_theta = 10000.0 disagrees"),
    (
        dict(rope_scaling=dict(LLAMA3), rope_parameters={"rope_type": "default"}),
        r"rope_scaling\.rope_type = 'llama3' disagrees with rope_parameters\.rope_type = 'default'",
    ),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor = 0.5"),
    (dict(hidden_act="gelu_pytorch_tanh"), r"hidden_act = 'gelu_pytorch_tanh' is not supported"),
    (dict(attention_bias=True), r"attention_bias = True is not supported for llama"),
    (dict(mlp_bias=True), r"mlp_bias = True"),
    (dict(sliding_window=4096), r"sliding_window = 4096 is not part of the llama architecture"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8), r"use_sliding_window = True"),
    (
        dict(model_type="mistral", layer_types=["full_attention", "sliding_attention"], sliding_window=4),
        r"layer_types mixes",
    ),
    (dict(model_type="qwen3", attention_bias=True), r"attention_bias = True is not supported for qwen3"),
    (dict(final_logit_softcapping=30.0), r"final_logit_softcapping = 30.0"),
    (
        dict(num_key_value_heads=3),
        r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
    ),
    (dict(hidden_size=_DROP), r"hidden_size is missing"),
    (dict(vocab_size=-1), r"vocab_size = -1, expected a positive integer"),
]


@pytest.mark.parametrize(("changes", "message"), CONFIG_ERRORS, ids=[m for _, m in CONFIG_ERRORS])
def test_config_errors_name_key_and_value(changes, message):
    with pytest.raises(ConfigError, match=message):
        decoder_config_from_hf(_with(**changes))


def test_config_defaults_and_spellings():
    base = decoder_config_from_hf(BASE)
    v5 = decoder_config_from_hf(
        _with(
            rope_theta=_DROP,
            rope_scaling=_DROP,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    )
    assert v5 == base
    s4 = decoder_config_from_hf(_with(rope_theta=5e5, rope_scaling=dict(LLAMA3)))
    s5 = decoder_config_from_hf(
        _with(rope_theta=_DROP, rope_scaling=_DROP, rope_parameters=dict(LLAMA3, rope_theta=5e5))
    )
    assert s4 == s5 and s4.rope_scaling is not None and s4.rope_theta == 5e5
    # transformers 4.3x's "type" key
    old = dict(LLAMA3)
    old["type"] = old.pop("rope_type")
    assert decoder_config_from_hf(_with(rope_theta=5e5, rope_scaling=old)) == s4
    assert decoder_config_from_hf(_with(num_key_value_heads=_DROP)).num_kv_heads == base.num_heads
    # neutral values of numbers-changing keys are accepted
    assert decoder_config_from_hf(_with(mlp_bias=False, attention_bias=False, pretraining_tp=1)) == base
    # Mistral without a window, Qwen2 with its window switched off
    assert decoder_config_from_hf(_with(model_type="mistral", sliding_window=None)).sliding_window is None
    q2 = decoder_config_from_hf(_with(model_type="qwen2", use_sliding_window=False, sliding_window=32))
    assert q2.qkv_bias and q2.sliding_window is None


def _copy(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    return d


def test_weights_that_disagree_with_config(tmp_path):
    d = _copy(tmp_path, "llama")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=128)))
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[96, 64\], "
        r"but config\.json implies \[128, 64\]",
    ):
        models.from_pretrained(d)
    # an architecture the weights do not have: qwen2 expects q/k/v biases
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="qwen2")))
    with pytest.raises(
        CheckpointError,
        match=r"tensor\(s\) that config\.json's architecture needs are missing.*"
        r"self_attn\.k_proj\.bias",
    ):
        models.from_pretrained(d)
    # tensors the decoder has no place for
    d2 = _copy(tmp_path, "qwen2")
    cfg2 = json.loads((d2 / "config.json").read_text())
    (d2 / "config.json").write_text(json.dumps(dict(cfg2, model_type="llama")))
    with pytest.raises(CheckpointError, match=r"the llama decoder has no place for.*proj\.bias"):
        models.from_pretrained(d2)


def test_no_config_json(tmp_path):
    d = _copy(tmp_path, "llama")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        models.from_pretrained(d)


# ----------------------------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_names_round_trip(loaded, name):
    cfg = loaded[name].config
    expected = names.expected_shapes(cfg)
    on_disk = (
        set(json.loads((FIXTURES / name / "model.safetensors.index.json").read_text())["weight_map"])
        if (FIXTURES / name / "model.safetensors.index.json").is_file()
        else None
    )
    if on_disk is not None:
        assert on_disk == set(expected)
    for hf in expected:
        path, param = names.module_path_for(hf)
        assert names.hf_name_for(path, param) == hf
        assert names.hf_module_for(path) == hf.rsplit(".", 1)[0]
    linears = names.hf_linear_modules(cfg)
    assert len(linears) == 7 * cfg.num_layers + (0 if cfg.tie_embeddings else 1)
    assert all(f"{m}.weight" in expected for m in linears)
    assert names.module_path_for("model.layers.0.self_attn.q_proj.weight_packed") is None
    assert names.is_ignored("model.layers.1.self_attn.rotary_emb.inv_freq")
    w = np.arange(6, dtype=np.float32).reshape(2, 3)  # torch (out=2, in=3)
    assert (
        names.to_nybble("kernel", w).shape == (3, 2)
        and names.to_hf("kernel", names.to_nybble("kernel", w)).tolist() == w.tolist()
    )


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_hf_config_for_inverts_the_mapping(loaded, name):
    cfg = loaded[name].config
    written = hf_config_for(cfg)
    assert written["model_type"] == read_config(FIXTURES / name)["model_type"]
    assert decoder_config_from_hf(written) == cfg


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_float_tensors_written_as_transformers_wrote_them(loaded, name):
    """names.float_hf_tensors of the loaded model gives back transformers' own tensors, bit for bit."""
    from nybble.models.io.hf.files import CheckpointDir

    ckpt = CheckpointDir(FIXTURES / name)
    written = dict(names.float_hf_tensors(loaded[name]))
    assert set(written) == set(ckpt.names())
    for hf_name, array in written.items():
        want = ckpt.get(hf_name).astype(np.float32)  # bf16 -> f32 is exact
        assert array.shape == want.shape and np.array_equal(array, want), hf_name


def test_mesh_of_four_devices_places_tensors_as_read():
    """A 2x2 mesh of CPU devices in a subprocess (tests/multidevice/hf_mesh_4dev.py)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env["PYTHONPATH"] = os.pathsep.join(
        [str(repo), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    )
    script = repo / "tests" / "multidevice" / "hf_mesh_4dev.py"
    run = subprocess.run(
        [sys.executable, str(script), "qwen2", "llama3"], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for name, r in result.items():
        assert r["rel"] < 1e-3, (name, r)
        assert r["q_spec"] == [None, "model"] and r["q_shard"] == [64, 32], (name, r)
        assert r["o_spec"] == ["model", None], (name, r)


def test_non_float_weight_in_float_checkpoint(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy(tmp_path, "llama")
    t = load_file(str(d / "model.safetensors"))
    t["model.norm.weight"] = np.ones(t["model.norm.weight"].shape, np.int32)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is I32 \[64\].*float weights"):
        models.from_pretrained(d)
