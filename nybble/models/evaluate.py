"""Perplexity over a token stream and greedy decoding, jitted with fixed shapes (few recompiles)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _split(model: nnx.Module) -> tuple[Any, Any]:
    if not isinstance(model, nnx.Module):
        raise TypeError(f"expected a flax.nnx.Module language model, got {type(model).__name__}")
    return nnx.split(model)


@functools.partial(jax.jit, static_argnums=0)
def _nll_sum(graphdef: Any, state: Any, inputs: jax.Array, targets: jax.Array, mask: jax.Array):
    model = nnx.merge(graphdef, state)
    logits = model(inputs).astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((logz - target_logit) * mask), jnp.sum(mask)


def negative_log_likelihood(
    model: nnx.Module, token_ids: Sequence[int] | np.ndarray, *, window: int = 256, batch: int = 4
) -> tuple[float, int]:
    """Summed next-token negative log-likelihood (nats) and the number of tokens scored.

    The stream is cut into consecutive windows of ``window`` scored tokens; each window sees the token
    before it as its first input, so every token but the first is scored once, with up to ``window``
    tokens of context. Windows run ``batch`` at a time with one fixed shape (the last batch is masked),
    so the model compiles once.
    """
    ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
    if ids.size < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {ids.size}")
    if window < 1 or batch < 1:
        raise ValueError(f"window and batch must be >= 1, got window={window}, batch={batch}")
    n_windows = -(-(ids.size - 1) // window)
    batch = min(batch, n_windows)  # short streams: no padded windows
    n_batches = -(-n_windows // batch)
    total = n_batches * batch * window + 1
    padded = np.zeros(total, np.int32)
    padded[: ids.size] = ids
    valid = np.zeros(total, np.float32)
    valid[1 : ids.size] = 1.0
    starts = np.arange(n_batches * batch) * window
    idx = starts[:, None] + np.arange(window)[None, :]
    inputs, targets, mask = padded[idx], padded[idx + 1], valid[idx + 1]
    graphdef, state = _split(model)
    nll, count = 0.0, 0.0
    for b in range(n_batches):
        sl = slice(b * batch, (b + 1) * batch)
        s, c = _nll_sum(graphdef, state, inputs[sl], targets[sl], mask[sl])
        nll += float(s)
        count += float(c)
    return nll, int(count)


def perplexity(
    model: nnx.Module, token_ids: Sequence[int] | np.ndarray, *, window: int = 256, batch: int = 4
) -> float:
    """Perplexity ``exp(mean NLL)`` of a causal LM (``model(ids)`` -> logits) over a token stream.

    See :func:`negative_log_likelihood` for the windowing; ``window`` bounds the context per token.
    """
    nll, count = negative_log_likelihood(model, token_ids, window=window, batch=batch)
    return math.exp(nll / count)


@functools.partial(jax.jit, static_argnums=0)
def _greedy(graphdef: Any, state: Any, ids: jax.Array, start: jax.Array, stop: jax.Array, eos: jax.Array):
    model = nnx.merge(graphdef, state)

    def cond(carry):
        i, _, done = carry
        return (i < stop) & ~done

    def body(carry):
        i, ids, _ = carry
        hidden = model.hidden_states(ids)
        last = jax.lax.dynamic_slice_in_dim(hidden, i - 1, 1, axis=1)
        nxt = jnp.argmax(model.logits(last)[0, 0]).astype(ids.dtype)
        return i + 1, ids.at[0, i].set(nxt), nxt == eos

    i, ids, _ = jax.lax.while_loop(cond, body, (start, ids, jnp.asarray(False)))
    return ids, i


def generate(
    model: nnx.Module,
    prompt: str | Sequence[int] | np.ndarray,
    max_new_tokens: int = 32,
    *,
    tokenizer: Any = None,
    eos_id: int | None = None,
    bucket: int = 64,
) -> Any:
    """Greedy decoding without a KV cache: one full forward pass per new token, all inside one jit.

    Args:
      model: ``model.hidden_states(ids)`` and ``model.logits(hidden)`` (``nybble.models.llama.Llama``).
      prompt: text (needs ``tokenizer``) or token ids.
      max_new_tokens: tokens to add at most; decoding stops early at ``eos_id``.
      tokenizer: a ``tokenizers.Tokenizer`` (``encode(text).ids``, ``decode(ids)``).
      eos_id: stop token; None: the tokenizer's ``<|endoftext|>``/``<|im_end|>`` if present, else none.
      bucket: sequences are padded to a multiple of this, so similar lengths share one compilation.

    Returns the continuation only: text if ``prompt`` is text, else a numpy array of token ids.
    """
    as_text = isinstance(prompt, str)
    if as_text:
        if tokenizer is None:
            raise ValueError("generate: a text prompt needs tokenizer=...")
        ids = tokenizer.encode(prompt).ids
    else:
        ids = [int(i) for i in np.asarray(prompt).reshape(-1)]
    if not ids:
        raise ValueError("generate: empty prompt")
    if eos_id is None and tokenizer is not None:
        for name in ("<|endoftext|>", "<|im_end|>"):
            if (tid := tokenizer.token_to_id(name)) is not None:
                eos_id = tid
                break
    length = len(ids) + max_new_tokens
    padded_len = -(-length // bucket) * bucket
    buf = np.zeros((1, padded_len), np.int32)
    buf[0, : len(ids)] = ids
    graphdef, state = _split(model)
    out, end = _greedy(
        graphdef,
        state,
        jnp.asarray(buf),
        jnp.asarray(len(ids), jnp.int32),
        jnp.asarray(length, jnp.int32),
        jnp.asarray(-1 if eos_id is None else eos_id, jnp.int32),
    )
    new = np.asarray(out)[0, len(ids) : int(end)]
    if as_text:
        return tokenizer.decode(new.tolist())
    return new


__all__ = ["generate", "negative_log_likelihood", "perplexity"]
