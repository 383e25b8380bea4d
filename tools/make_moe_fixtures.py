"""Writes tests/fixtures/moe/: tiny random Mixtral and Qwen3-MoE checkpoints and transformers' logits.

The independent reference of ``tests/test_moe_pretrained.py``. Run by hand in the torch environment of
tools/make_hf_fixtures.py (torch CPU, transformers 5.x, tokenizers), never nybble's own::

    /work/hfenv/bin/python tools/make_moe_fixtures.py

It does not import nybble. Re-running rewrites the fixtures (seeded). For each ``tests/fixtures/moe/<name>/``
(2 layers, hidden 64, 4 experts, top-2, vocab 320; norms and router random and large enough that routing is
decided by clear margins): what ``save_pretrained`` writes (config.json, model.safetensors,
generation_config.json, tokenizer files), ``prompt_ids.npy`` (int32 (16,)) and ``transformers_logits.npy``
(float32 (1, 16, vocab), the directory reloaded in float32 with eager attention). ``MANIFEST.json`` records
the library versions and the tensor names each checkpoint holds (transformers 5 writes the experts per
expert, as on the Hub, though it holds them fused in memory).

=================  ==============================================================================
``mixtral``        ``block_sparse_moe`` router + experts w1/w3/w2 in both layers, top-2 renormalized
``mixtral_fused``  the ``mixtral`` model's ``state_dict()`` as transformers 5 holds it in memory
                   (experts fused: ``mlp.experts.gate_up_proj`` (E, 2I, H), ``mlp.experts.down_proj``;
                   router ``mlp.gate``), with config.json only (its logits are ``mixtral``'s)
``qwen3_moe``      ``mlp_only_layers: [0]`` (layer 0 a dense SwiGLU of intermediate 96), layer 1 MoE with
                   ``moe_intermediate_size`` 32, ``norm_topk_prob: false``, q/k norms, head_dim 32
=================  ==============================================================================
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_hf_fixtures import PROMPT, PROMPT_LEN, TINY, build_tokenizer, logits_of, randomize, rel

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "moe"
ROPE = dict(rope_type="default", rope_theta=1000000.0)

CHECKPOINTS = {
    "mixtral": (
        "MixtralConfig",
        dict(
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            rope_parameters=ROPE,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            head_dim=32,
            tie_word_embeddings=False,
            rope_parameters=ROPE,
        ),
    ),
}


def randomize_routers(model: torch.nn.Module, seed: int) -> None:
    """Router weights N(0, 0.5): top-2 choices decided by clear margins, not float noise."""
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def make_checkpoint(name: str, tokenizer, seed: int) -> list[str]:
    cls_name, extra = CHECKPOINTS[name]
    config = getattr(transformers, cls_name)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    randomize(model, seed)
    randomize_routers(model, seed)
    model.eval()
    d = OUT / name
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    ids = tokenizer(PROMPT)["input_ids"][:PROMPT_LEN]
    assert len(ids) == PROMPT_LEN, len(ids)
    x = torch.tensor([ids])
    logits = logits_of(d, x)
    with torch.no_grad():
        same = model(x).logits.numpy()
    assert rel(logits, same) < 1e-5, (name, rel(logits, same))
    # Routing must matter: with the experts' outputs averaged (top-k = all experts) the logits move.
    moved = rel(logits_of(d, x, num_experts_per_tok=4), logits)
    assert moved > 1e-3, (name, "routing did not change the logits", moved)
    np.save(d / "prompt_ids.npy", np.asarray(ids, np.int32))
    np.save(d / "transformers_logits.npy", logits.astype(np.float32))
    if name == "mixtral":  # the same model under transformers 5's fused in-memory names
        fused = OUT / "mixtral_fused"
        shutil.rmtree(fused, ignore_errors=True)
        fused.mkdir()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state), sorted(state)[:8]
        save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
        shutil.copy(d / "config.json", fused / "config.json")
    with safe_open(d / "model.safetensors", "np") as f:
        names = sorted(f.keys())
    size = sum(p.stat().st_size for p in d.iterdir())
    experts = [n for n in names if "expert" in n][:3]
    print(f"{name}: {size / 1e3:.0f} KB, {len(names)} tensors, e.g. {experts}")
    return names


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    names = {name: make_checkpoint(name, tokenizer, seed) for seed, name in enumerate(CHECKPOINTS)}
    manifest = {
        "generator": "tools/make_moe_fixtures.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt": PROMPT,
        "tensors": names,
    }
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    main()
