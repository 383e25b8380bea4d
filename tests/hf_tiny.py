"""A tiny bf16 Llama checkpoint directory (sharded, tokenizer and generation config) for the HF tests."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from nybble.models import save_pretrained
from nybble.models.definitions.llama import Llama, LlamaConfig

CFG = LlamaConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    tie_embeddings=False,
)
WORDS = ["<unk>", "the", "king", "queen", "of", "and", "to", "a", "my", "lord", "is", "in", "that", "you"]


def _tokenizer_json(path: Path) -> None:
    """A word-level tokenizer.json of the ``tokenizers`` library (unknown words -> <unk>), vocab <= 64."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def write_float_dir(root: Path) -> Path:
    """``root/float``: a tiny bf16 Llama directory in several shards, with tokenizer and generation config."""
    src = root / "src"
    src.mkdir()
    _tokenizer_json(src / "tokenizer.json")
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    model = Llama(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    save_pretrained(model, root / "float", max_shard_size="20KB", source=src)
    return root / "float"
