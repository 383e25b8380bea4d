"""Writes tests/fixtures/quant/ct_tied_export/: transformers' logits for nybble's compressed-tensors export
of a tiny Llama with tied embeddings (the reference of ``tests/test_hf_export_tied.py``).

Three steps, two environments (nybble's tests never import torch; this script never imports nybble in
the torch steps, nor torch in the nybble step). Make the torch environment outside the repository::

    python3 -m venv ~/hfenv && ~/hfenv/bin/pip install torch transformers compressed-tensors safetensors

then, from the repository root::

    ~/hfenv/bin/python tools/make_tied_export_fixture.py float     # the float checkpoint (seeded)
    PYTHONPATH=. .venv/bin/python tools/make_tied_export_fixture.py export  # nybble: RTN, save_pretrained
    ~/hfenv/bin/python tools/make_tied_export_fixture.py logits    # transformers loads nybble's export

Written to ``tests/fixtures/quant/ct_tied_export/``: ``float/`` (config.json with
``tie_word_embeddings: true``, model.safetensors: what transformers' ``save_pretrained`` writes for a
random 2-layer Llama, hidden 64, vocab 256), ``prompt.npy`` (int32 (1, 12)), ``transformers_logits.npy``
(float32 (1, 12, 256): the export loaded by a plain ``AutoModelForCausalLM.from_pretrained`` in float32,
compressed linears and all, what a user gets, run on the prompt) and ``versions.json``. The export itself
is not kept: the test writes it again (``export_tied``) and compares nybble's logits of it with
transformers'. Before nybble wrote ``ignore: ["lm_head"]``, transformers could not load such an export
("Linear has no attribute `weight`": it wrapped the tied lm_head as a compressed Linear and the tie
broke). The export is symmetric: transformers 5.25 with compressed-tensors 0.20.1 loads asymmetric
pack-quantized directories only with ``CompressedTensorsConfig(dequantize=True)`` (its compressed Linear
expects unpacked zero points and refuses the packed ones, llm-compressor's too).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SEED = 20261204
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "quant" / "ct_tied_export"
EXPORT = OUT / "export"  # written by the export step, read by the logits step, then removed


def export_tied(float_dir: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """nybble's part: the float directory read, RTN g32 symmetric, written as compressed-tensors (what
    ``tests/test_hf_export_tied.py`` repeats)."""
    import jax.numpy as jnp

    from nybble import models

    model = models.from_pretrained(float_dir, dtype=jnp.float32)
    models.quantize(model, models.RTN(group_size=32), progress=False)
    return models.save_pretrained(model, out, format="compressed-tensors", source=float_dir, overwrite=True)


def write_float() -> None:
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(OUT / "float")
    prompt = np.random.default_rng(SEED).integers(0, 256, size=(1, 12)).astype(np.int32)
    np.save(OUT / "prompt.npy", prompt)


def write_logits() -> None:
    import shutil
    from importlib.metadata import version

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(EXPORT, dtype=torch.float32).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied
    prompt = torch.from_numpy(np.load(OUT / "prompt.npy").astype(np.int64))
    with torch.no_grad():
        logits = loaded(prompt).logits.float().numpy()
    np.save(OUT / "transformers_logits.npy", logits)
    versions = {p: version(p) for p in ("torch", "transformers", "compressed-tensors")}
    (OUT / "versions.json").write_text(json.dumps(versions, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(EXPORT)


if __name__ == "__main__":
    step = sys.argv[1] if len(sys.argv) > 1 else ""
    if step == "float":
        write_float()
    elif step == "export":
        export_tied(OUT / "float", EXPORT)
    elif step == "logits":
        write_logits()
    else:
        sys.exit("usage: make_tied_export_fixture.py float | export | logits (see the module docstring)")
