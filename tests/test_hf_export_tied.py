"""nybble's compressed-tensors export of a model with tied embeddings, as transformers loads it.

The reference (``tests/fixtures/quant/ct_tied_export/``, written by ``tools/make_tied_export_fixture.py``):
transformers 5.25 + compressed-tensors 0.20.1 loaded nybble's export of the tiny tied Llama in ``float/``
(a plain ``from_pretrained``, compressed linears and all) and ran it on ``prompt.npy``. Before the export
named ``lm_head`` in ``ignore`` (as llm-compressor does), transformers could not load it at all ("Linear
has no attribute `weight`"). The test writes the export again and compares nybble's logits of it with
transformers'; torch is never imported."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from nybble import models
from nybble.models.definitions.layers import QLinear

ROOT = Path(__file__).resolve().parent.parent
D = ROOT / "tests" / "fixtures" / "quant" / "ct_tied_export"


def _export_tied():
    spec = importlib.util.spec_from_file_location("make_tied", ROOT / "tools" / "make_tied_export_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.export_tied


def test_tied_export_names_lm_head_and_matches_transformers(tmp_path):
    out = _export_tied()(D / "float", tmp_path / "export")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"]  # tied: no tensor of its own, still named, as llm-compressor does
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    model = models.from_pretrained(out, dtype=jnp.float32)
    assert model.lm_head is None  # read back tied
    assert sum(isinstance(m, QLinear) for _, m in nnx.iter_modules(model)) == 14
    got = np.asarray(model(jnp.asarray(np.load(D / "prompt.npy"))))
    want = np.load(D / "transformers_logits.npy")
    assert got.shape == want.shape == (1, 12, 256)
    # Both dequantize (q * s) in float32 from the same int4 codes and scales: float32 rounding apart.
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    # The float model is far from it: the comparison sees the int4 weights.
    float_logits = np.asarray(
        models.from_pretrained(D / "float", dtype=jnp.float32)(np.load(D / "prompt.npy"))
    )
    assert np.linalg.norm(float_logits - want) / np.linalg.norm(want) > 1e-3
