"""from_pretrained of quantized directories: each linear straight into a QLinear, no float round trip.

The GPTQ directories are packed here from the format's definition (qweight (K/8, N) with 8 codes along K,
qzeros (groups, N/8) along N holding zero - 1 in v1, fp16 scales (groups, N), g_idx (K,)) with chosen
integer codes, independently of nybble's reader; the reference is the float model holding exactly
``(u - z[g_idx]) * s[g_idx]``. Activation order with groups scattered over the input rows exercises
``QLinear.input_perm``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import nybble
from nybble import models
from nybble.models.definitions.layers import QLinear
from nybble.models.io.hf import names
from nybble.models.io.hf.files import CheckpointDir, CheckpointError

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
GROUP = 32


def _pack_along(values: np.ndarray, axis: int) -> np.ndarray:
    """8 4-bit values per int32 along ``axis``, value i at bits 4i (GPTQ's order)."""
    v = np.moveaxis(values.astype(np.uint32) & 0xF, axis, 0)
    v = v.reshape(v.shape[0] // 8, 8, *v.shape[1:])
    words = np.zeros(v.shape[:1] + v.shape[2:], np.uint32)
    for i in range(8):
        words |= v[:, i] << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), 0, axis))  # safetensors writes raw memory


def _gptq_dir(tmp_path: Path, *, desc_act: bool, sym: bool, fmt: str, seed: int = 0):
    """A GPTQ copy of the tiny llama fixture: (quantized dir, {HF linear: float W (in, out)})."""
    src = FIXTURES / "llama"
    ckpt = CheckpointDir(src)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    dense: dict[str, np.ndarray] = {}
    linears = {f"{m}.weight" for m in names.hf_linear_modules(models.from_pretrained(src).config)} - {
        "lm_head.weight"
    }
    for name in ckpt.names():
        w = ckpt.get(name)
        if name not in linears:
            tensors[name] = w
            continue
        module = name[: -len(".weight")]
        n, k = w.shape
        groups = k // GROUP
        u = rng.integers(0, 16, size=(k, n))
        z = np.full((groups, n), 8) if sym else rng.integers(1, 16, size=(groups, n))
        s = rng.uniform(0.005, 0.03, size=(groups, n)).astype(np.float16)
        if desc_act:  # every group's rows scattered over K (as GPTQ's activation order leaves them)
            g_idx = (rng.permutation(k) // GROUP).astype(np.int32)
        else:
            g_idx = (np.arange(k) // GROUP).astype(np.int32)
        dense[module] = (u - z[g_idx]) * s[g_idx].astype(np.float32)  # exact in float32
        stored_z = z - 1 if fmt == "gptq" else z
        tensors[f"{module}.qweight"] = _pack_along(u, 0)
        tensors[f"{module}.qzeros"] = _pack_along(stored_z, 1)
        tensors[f"{module}.scales"] = s
        tensors[f"{module}.g_idx"] = g_idx
    out = tmp_path / f"gptq_{fmt}_{'act' if desc_act else 'natural'}_{'sym' if sym else 'asym'}"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": fmt,
    }
    (out / "config.json").write_text(json.dumps(cfg))
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    return out, dense


def _float_reference(dense: dict[str, np.ndarray]) -> models.Llama:
    model = models.from_pretrained(FIXTURES / "llama", dtype=jnp.float32)
    for module, w in dense.items():
        path = names.module_path_for_module(module)
        node = model
        for part in path.split("."):
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        node.kernel.set_value(jnp.asarray(w))
    return model


@pytest.mark.parametrize(
    ("desc_act", "sym", "fmt"), [(True, False, "gptq"), (False, True, "gptq_v2"), (True, True, "gptq")]
)
def test_gptq_directory_loads_into_qlinear(tmp_path, desc_act, sym, fmt):
    d, dense = _gptq_dir(tmp_path, desc_act=desc_act, sym=sym, fmt=fmt)
    model = models.from_pretrained(d, dtype=jnp.float32)
    q = model.layers[0].attn.q_proj
    assert isinstance(q, QLinear) and model.lm_head is not None and not isinstance(model.lm_head, QLinear)
    assert (q.input_perm is not None) == desc_act
    # exact weights: the layer reproduces the chosen (u - z) * s on every input
    for module, w in dense.items():
        path = names.module_path_for_module(module)
        node = model
        for part in path.split("."):
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        eye = jnp.eye(w.shape[0], dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(node(eye)), w, err_msg=module)
    ids = jnp.asarray(np.load(FIXTURES / "llama" / "prompt_ids.npy"))[None]
    want = np.asarray(_float_reference(dense)(ids))
    got = np.asarray(model(ids))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    # the KV-cache path goes through the same QLinear layers
    _, cache = model.prefill(ids[:, :8], max_len=ids.shape[1])
    step, _ = model.decode_step(ids[:, 8], cache, 8)
    np.testing.assert_allclose(np.asarray(step[:, 0]), got[:, 8], atol=1e-4 * np.abs(got).max())


def test_act_order_layers_are_not_written_back(tmp_path):
    d, _ = _gptq_dir(tmp_path, desc_act=True, sym=True, fmt="gptq")
    model = models.from_pretrained(d, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.[qkvo]_proj multiplies permuted inputs"):
        models.save_pretrained(model, tmp_path / "out", format="gptq")
    assert not (tmp_path / "out").exists()


def test_quantized_directory_bf16_and_quantize_nothing_twice(tmp_path):
    d, _ = _gptq_dir(tmp_path, desc_act=False, sym=True, fmt="gptq_v2")
    model = models.from_pretrained(d)  # bf16
    assert model.embed.embedding.dtype == jnp.bfloat16
    assert jnp.isfinite(model(jnp.arange(8)[None])).all()
    qw = model.layers[1].mlp.down_proj.weight
    assert qw.shape == (96, 64) and qw.group_size == GROUP


def test_input_perm_is_exact():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    qw = nybble.quantize(jnp.asarray(w), group_size=32)
    perm = rng.permutation(64)
    x = jax.random.normal(jax.random.key(0), (3, 64), jnp.float32)
    got = QLinear(qw, input_perm=perm)(x)
    want = np.asarray(x)[:, perm] @ np.asarray(nybble.dequantize(qw, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"input_perm shape \(63,\) != \(64,\)"):
        QLinear(qw, input_perm=perm[:63])


def test_quantized_tensors_missing(tmp_path):
    d, _ = _gptq_dir(tmp_path, desc_act=False, sym=True, fmt="gptq_v2")
    from safetensors.numpy import load_file

    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.scales"]
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"quantized layer 'model\.layers\.1\.mlp\.up_proj' lacks "):
        models.from_pretrained(d)


def test_unsupported_quantization_config(tmp_path):
    d, _ = _gptq_dir(tmp_path, desc_act=False, sym=True, fmt="gptq_v2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bits"):
        models.from_pretrained(d)


QUANT_FIXTURES = Path(__file__).parent / "fixtures" / "quant"


@pytest.mark.parametrize("name", ["ct_tiny_sym_g128", "ct_tiny_asym_g32"])
def test_compressed_tensors_directory_vs_transformers(name):
    """llm-compressor's W4A16 directories (packed by compressed-tensors' ModelCompressor, hf-quant's
    fixtures) against transformers' logits after loading them with CompressedTensorsConfig(dequantize=True).

    transformers dequantizes into the checkpoint dtype (bf16), nybble keeps the exact ``(q - z) * s``: so
    the int4 model is within bf16's rounding of transformers' logits, and the same model with its weights
    rounded to bf16 as transformers rounds them is within 1e-3.
    """
    from flax import nnx

    d = QUANT_FIXTURES / name
    ids = jnp.asarray(np.load(d / "prompt.npy")).reshape(1, -1)
    want = np.load(d / "logits.npy")
    model = models.from_pretrained(d, dtype=jnp.float32)
    quantized = [(p, m) for p, m in nnx.iter_modules(model) if isinstance(m, QLinear)]
    assert len(quantized) == 7 * model.config.num_layers  # lm_head is in the ignore list
    got = np.asarray(model(ids))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    ref_w = np.load(d / "transformers_weights.npz")
    for p, m in quantized:
        hf = names.hf_module_for(".".join(str(k) for k in p)) + ".weight"
        w = np.asarray(nybble.dequantize(m.weight, jnp.bfloat16).astype(jnp.float32))
        if hf in ref_w:  # bit-exact against transformers' own dequantization
            np.testing.assert_array_equal(w, ref_w[hf].T, err_msg=hf)
        lin = nnx.Linear(*w.shape, use_bias=False, rngs=nnx.Rngs(0))
        lin.kernel.set_value(jnp.asarray(w))
        parent = model
        for k in p[:-1]:
            parent = parent[k] if isinstance(k, int) else getattr(parent, k)
        setattr(parent, p[-1], lin)
    rounded = np.asarray(model(ids))
    assert np.linalg.norm(rounded - want) / np.linalg.norm(want) < 1e-3
