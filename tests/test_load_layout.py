"""Loaders store int4 weights in the local GPU's layout, converted once at load, never per call.

``nybble.packing.default_layout()`` is ``planes_nk_int4`` (the Triton kernel's) on an NVIDIA GPU without a
nybble Mosaic GPU kernel and ``wgmma_int4`` on this CPU. The GPU is faked as in tests/test_api_traps.py (an
A100: ``nybble.device.gpu_device`` patched) while loading only; the forward passes then run the XLA
path on this CPU, which gives every layout the same bits, so a model loaded "on the A100" must give exactly
the logits of the one loaded here, and its weights exactly the codes and scales.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from nybble import device, models
from nybble.models.definitions.layers import QLinear
from nybble.models.definitions.moe import QExperts
from nybble.models.evaluate.zoo import load_named
from nybble.models.io.hf import names
from nybble.packing import default_layout
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.stacked import num_experts, unstack_weight
from tests.test_hf_quantized_models import _gptq_dir

MOE = Path(__file__).parent / "fixtures" / "moe" / "qwen3_moe_ct_experts"


class _A100:
    device_kind = "NVIDIA A100-SXM4-80GB"
    compute_capability = "8.0"


def _on_a100(monkeypatch, load):
    """``load()`` run while the local GPU reads as an A100; the fake is gone when it returns."""
    with monkeypatch.context() as m:
        m.setattr(device, "gpu_device", lambda: _A100())
        m.setattr(device, "hopper_device", lambda: None)
        assert default_layout() == "planes_nk_int4"
        return load()


def _int4_weights(model: nnx.Module) -> dict[tuple, QuantizedWeight]:
    return {p: m.weight for p, m in nnx.iter_modules(model) if isinstance(m, QLinear | QExperts)}


def _per_expert(qw: QuantizedWeight) -> list[QuantizedWeight]:
    e = num_experts(qw)
    return [qw] if e is None else [unstack_weight(qw, i) for i in range(e)]


def _assert_same_weights(here: nnx.Module, there: nnx.Module) -> None:
    """Every int4 weight of ``there`` in planes_nk_int4, of ``here`` in wgmma_int4: equal codes and scales."""
    a, b = _int4_weights(here), _int4_weights(there)
    assert a and a.keys() == b.keys()
    for path, qw in b.items():
        assert qw.layout == "planes_nk_int4" and a[path].layout == "wgmma_int4", path
        for one, ref in zip(_per_expert(qw), _per_expert(a[path]), strict=True):
            np.testing.assert_array_equal(np.asarray(one.logical_codes()), np.asarray(ref.logical_codes()))
            np.testing.assert_array_equal(np.asarray(one.scales), np.asarray(ref.scales))


def test_compressed_tensors_moe_loads_in_the_gpus_layout(monkeypatch):
    """Expert stacks (QExperts) read from compressed-tensors' packed ints, straight into planes_nk_int4."""
    here = models.from_pretrained(MOE, dtype=jnp.float32)
    there = _on_a100(monkeypatch, lambda: models.from_pretrained(MOE, dtype=jnp.float32))
    _assert_same_weights(here, there)
    assert any(isinstance(m, QExperts) for _, m in nnx.iter_modules(there))
    ids = jnp.asarray(np.load(MOE / "prompt_ids.npy"))[None]
    np.testing.assert_array_equal(np.asarray(there(ids)), np.asarray(here(ids)))


def test_gptq_and_nybble_directories_load_in_the_gpus_layout(monkeypatch, tmp_path):
    """GPTQ (dense QLinear layers) and nybble's own HF format, written in wgmma_int4 here."""
    d, dense = _gptq_dir(tmp_path, desc_act=False, sym=False, fmt="gptq_v2")
    here = models.from_pretrained(d, dtype=jnp.float32)
    there = _on_a100(monkeypatch, lambda: models.from_pretrained(d, dtype=jnp.float32))
    _assert_same_weights(here, there)
    for module, w in dense.items():  # the packed ints' (u - z) * s, exactly, through the loaded layer
        node = there
        for part in names.module_path_for_module(module).split("."):
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        np.testing.assert_array_equal(np.asarray(node(jnp.eye(w.shape[0], dtype=jnp.float32))), w)
    out = models.save_pretrained(here, tmp_path / "nybble", format="nybble", source=d)
    back = _on_a100(monkeypatch, lambda: models.from_pretrained(out, dtype=jnp.float32))
    _assert_same_weights(here, back)


def test_load_model_converts_a_saved_checkpoint_once(monkeypatch, tmp_path):
    """``models.load_model`` of a file saved in wgmma_int4: planes_nk_int4 on the A100, the same weights."""
    model = models.quantize(load_named("tiny-random", jnp.float32)[0], group_size=32, progress=False)
    path = models.save_model(tmp_path / "m.safetensors", model)
    fresh = _on_a100(monkeypatch, lambda: models.load_model(path, load_named("tiny-random", jnp.float32)[0]))
    _assert_same_weights(model, fresh)
