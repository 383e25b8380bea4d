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

# Tokens scored per window by default (README's perplexity table, `nybble eval`): each token sees at most
# this much context.
DEFAULT_WINDOW = 256


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
    model: nnx.Module, token_ids: Sequence[int] | np.ndarray, *, window: int = DEFAULT_WINDOW, batch: int = 4
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
    model: nnx.Module, token_ids: Sequence[int] | np.ndarray, *, window: int = DEFAULT_WINDOW, batch: int = 4
) -> float:
    """Perplexity ``exp(mean NLL)`` of a causal LM (``model(ids)`` -> logits) over a token stream.

    See :func:`negative_log_likelihood` for the windowing; ``window`` bounds the context per token.
    """
    nll, count = negative_log_likelihood(model, token_ids, window=window, batch=batch)
    return math.exp(nll / count)


@functools.partial(jax.jit, static_argnums=0)
def _greedy(graphdef: Any, state: Any, ids: jax.Array, start: jax.Array, stop: jax.Array, eos: jax.Array):
    """No cache: one full forward per new token; ``ids`` (batch, padded); rows done at ``eos`` repeat it."""
    model = nnx.merge(graphdef, state)

    def cond(carry):
        i, _, done = carry
        return (i < stop) & ~jnp.all(done)

    def body(carry):
        i, ids, done = carry
        hidden = model.hidden_states(ids)
        last = jax.lax.dynamic_slice_in_dim(hidden, i - 1, 1, axis=1)
        nxt = jnp.argmax(model.logits(last)[:, 0], axis=-1).astype(ids.dtype)
        nxt = jnp.where(done, eos, nxt)
        return i + 1, ids.at[:, i].set(nxt), done | (nxt == eos)

    done = jnp.zeros((ids.shape[0],), bool)
    i, ids, _ = jax.lax.while_loop(cond, body, (start, ids, done))
    return ids, i


@functools.partial(jax.jit, static_argnums=(0, 4))
def prefill_last(graphdef: Any, state: Any, ids: jax.Array, length: jax.Array, max_len: int):
    """Prompts ``ids`` (batch, padded_len) of true length ``length`` into a new ``max_len`` cache.

    Returns ``(logits, cache)``: float32 logits (batch, vocab) at position ``length - 1``. Positions from
    ``length`` on hold padding in the cache; decoding overwrites each before any query can see it.
    """
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(ids.shape[0], max_len)
    hidden, cache = model.hidden_states_cached(ids, cache, 0)
    last = jax.lax.dynamic_slice_in_dim(hidden, length - 1, 1, axis=1)
    return model.logits(last)[:, 0], cache


def decode_step(
    graphdef: Any, state: Any, token_ids: jax.Array, cache: Any, position: jax.Array
) -> tuple[jax.Array, Any]:
    """One greedy-decoding step of a split model: token ids (batch, 1) at ``position`` over ``cache``.

    Returns float32 logits (batch, 1, vocab) and the updated cache. The step :func:`generate` runs in its
    decoding loop, and the one ``python -m bench.decode`` compiles and counts.
    """
    return nnx.merge(graphdef, state).decode_step(token_ids, cache, position)


@functools.partial(jax.jit, static_argnums=(0, 6))
def decode_loop(
    graphdef: Any,
    state: Any,
    cache: Any,
    logits: jax.Array,
    length: jax.Array,
    n_new: jax.Array,
    out_len: int,
    eos: jax.Array,
):
    """Greedy decoding from a prefilled cache: ``logits`` (batch, vocab) give the first new token (at
    position ``length``); then one ``decode_step`` per further token, while fewer than ``n_new`` tokens
    are out and some row has not reached ``eos`` (finished rows repeat ``eos``).

    Returns ``(tokens, count)``: tokens (batch, out_len) of which the first ``count`` are generated;
    ``count - 1`` decode steps ran.
    """
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out = jnp.zeros((logits.shape[0], out_len), jnp.int32).at[:, 0].set(first)

    def cond(carry):
        j, _, _, done = carry
        return (j < n_new) & ~jnp.all(done)

    def body(carry):
        j, out, cache, done = carry
        prev = jax.lax.dynamic_slice_in_dim(out, j - 1, 1, axis=1)
        step_logits, cache = decode_step(graphdef, state, prev, cache, length + j - 1)
        nxt = jnp.argmax(step_logits[:, 0], axis=-1).astype(jnp.int32)
        nxt = jnp.where(done, eos, nxt)
        return j + 1, out.at[:, j].set(nxt), cache, done | (nxt == eos)

    j, out, _, _ = jax.lax.while_loop(cond, body, (jnp.asarray(1, jnp.int32), out, cache, first == eos))
    return out, j


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def generate(
    model: nnx.Module,
    prompt: str | Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
    max_new_tokens: int = 32,
    *,
    tokenizer: Any = None,
    eos_id: int | None = None,
    bucket: int = 64,
    use_cache: bool = True,
) -> Any:
    """Greedy decoding, all inside jit; with a KV cache (one prefill, then one token per step) by default.

    Args:
      model: a ``nybble.models.definitions.llama.Llama`` (``use_cache=False`` needs only
      ``model.hidden_states(ids)``
        and ``model.logits(hidden)``; the cache path needs ``init_cache``/``hidden_states_cached``).
      prompt: text (needs ``tokenizer``), token ids (length,), or a batch of equal-length prompts
        (batch, length) of token ids.
      max_new_tokens: tokens to add at most; decoding stops early once every row has produced ``eos_id``.
      tokenizer: a ``tokenizers.Tokenizer`` (``encode(text).ids``, ``decode(ids)``).
      eos_id: stop token; None: the tokenizer's ``<|endoftext|>``/``<|im_end|>`` if present, else none.
      bucket: prompt and cache lengths are padded to a multiple of this, so that similar lengths share
        one compilation.
      use_cache: True: KV-cache decoding; False: one full forward pass over the sequence per new token.

    Returns the continuation only: text if ``prompt`` is text, a numpy array (n,) of token ids for one
    prompt, or (batch, n) for a batch, where n is the number of steps run; a row that reached ``eos_id``
    before the others is padded with ``eos_id``. The eos token itself is kept.
    """
    as_text = isinstance(prompt, str)
    if as_text:
        if tokenizer is None:
            raise ValueError("generate: a text prompt needs tokenizer=...")
        ids = np.asarray([tokenizer.encode(prompt).ids], np.int32).reshape(1, -1)
        batched = False
    else:
        arr = np.asarray(prompt)
        batched = arr.ndim == 2
        if arr.ndim not in (1, 2):
            raise ValueError(f"generate: token ids must be (length,) or (batch, length), got {arr.shape}")
        if arr.size == 0:
            raise ValueError("generate: empty prompt")
        ids = arr.astype(np.int32).reshape(arr.shape[0] if batched else 1, -1)
    if ids.size == 0:
        raise ValueError("generate: empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if eos_id is None and tokenizer is not None:
        for name in ("<|endoftext|>", "<|im_end|>"):
            if (tid := tokenizer.token_to_id(name)) is not None:
                eos_id = tid
                break
    batch, n_prompt = ids.shape
    eos = jnp.asarray(-1 if eos_id is None else eos_id, jnp.int32)
    length = n_prompt + max_new_tokens
    graphdef, state = _split(model)
    if use_cache:
        padded = np.zeros((batch, _round_up(n_prompt, bucket)), np.int32)
        padded[:, :n_prompt] = ids
        n = jnp.asarray(n_prompt, jnp.int32)
        logits, cache = prefill_last(graphdef, state, jnp.asarray(padded), n, _round_up(length, bucket))
        out, count = decode_loop(
            graphdef,
            state,
            cache,
            logits,
            n,
            jnp.asarray(max_new_tokens, jnp.int32),
            _round_up(max_new_tokens, bucket),
            eos,
        )
        new = np.asarray(out)[:, : int(count)]
    else:
        buf = np.zeros((batch, _round_up(length, bucket)), np.int32)
        buf[:, :n_prompt] = ids
        out, end = _greedy(
            graphdef,
            state,
            jnp.asarray(buf),
            jnp.asarray(n_prompt, jnp.int32),
            jnp.asarray(length, jnp.int32),
            eos,
        )
        new = np.asarray(out)[:, n_prompt : int(end)]
    if as_text:
        return tokenizer.decode(new[0].tolist())
    return new if batched else new[0]


__all__ = ["decode_loop", "decode_step", "generate", "negative_log_likelihood", "perplexity", "prefill_last"]
