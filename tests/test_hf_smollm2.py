"""SmolLM2-135M: nybble's GGUF reader vs transformers' GGUF loader, and the same model as an HF directory.

transformers' reference (hidden states and a few logits) is committed in tests/fixtures/hf/smollm2_135m by
tools/make_hf_fixtures.py; the 535 MB float directory is not: the second test writes its own from the GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from nybble import models

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def rel_err(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def smollm2_gguf():
    return models.smollm2.load(jnp.float32)


def test_smollm2_gguf_matches_transformers(smollm2_gguf):
    """nybble's GGUF reader vs transformers' GGUF loader (its hidden states and logits, committed)."""
    model, tok = smollm2_gguf
    d = FIXTURES / "smollm2_135m"
    ids = np.load(d / "prompt_ids.npy")
    prompt = json.loads((FIXTURES / "MANIFEST.json").read_text())["prompt"]
    assert tok.encode(prompt).ids[: len(ids)] == ids.tolist()
    hidden = model.hidden_states(jnp.asarray(ids)[None])[0]
    assert rel_err(hidden, np.load(d / "final_hidden.npy")) < 1e-3
    logits = model.logits(hidden[jnp.asarray([0, len(ids) - 1])])
    assert rel_err(logits, np.load(d / "logits_at.npy")) < 1e-3


def test_smollm2_hf_directory_same_as_gguf(tmp_path, smollm2_gguf):
    """The GGUF model written as an HF directory by save_pretrained (float32, 3 shards) reads back as the
    same model: same config, tokenizer ids and perplexity."""
    model, tok = smollm2_gguf
    out = tmp_path / "smollm2"
    models.save_pretrained(model, out, max_shard_size="200MB", dtype=np.float32)  # float directory
    tok.save(str(out / "tokenizer.json"))
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(weight_map) == 30 * 9 + 2 and len(set(weight_map.values())) == 3  # tied: no lm_head
    again = models.from_pretrained(out, dtype=jnp.float32)
    assert again.config == model.config
    text = models.eval_text()[:600]
    ids = models.load_tokenizer(out).encode(text).ids[:97]
    assert ids == tok.encode(text).ids[:97]
    ppl_gguf = models.perplexity(model, ids, window=96, batch=1)
    ppl_hf = models.perplexity(again, ids, window=96, batch=1)
    assert 1 < ppl_gguf < 1000 and abs(ppl_hf - ppl_gguf) <= 1e-6 * ppl_gguf
