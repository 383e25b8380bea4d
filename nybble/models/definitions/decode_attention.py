"""Attention of one new token per sequence over its KV cache, written for few launches in a decode step.

    out = attend_one(q, k_cache, v_cache, position, window)   # q (b, kv_heads, groups, d)

The cache already holds the new token's key and value at ``position`` (written first, in place when the
cache is donated), so the step reads keys and values once, as one sequence, with no second block for the
new token. Each part is a reduction XLA fuses with its elementwise neighbours: the scores (q . k, the scale
and the mask applied to the reduction's result), the softmax's maximum and sum as one variadic reduction
(the running maximum rescales the running sum, as in online softmax), and the probabilities times the
values as one batched GEMM. The numbers are those of
the two-einsum softmax up to float32 rounding order: products of bf16 inputs in float32, probabilities
rounded to the query's dtype before they weight the values, as the einsum path rounds them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

_LOWEST = float(jnp.finfo(jnp.float32).min)


def _softmax_stats(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]):
    """Combines two (maximum, sum of exp(score - maximum)) pairs: associative and commutative."""
    (m1, l1), (m2, l2) = a, b
    m = jnp.maximum(m1, m2)
    return m, l1 * jnp.exp(m1 - m) + l2 * jnp.exp(m2 - m)


def visible_positions(max_len: int, position: jax.Array, window: int | None) -> jax.Array:
    """(max_len,) True where a query at ``position`` sees a cached key: at or before it, and within
    ``window`` positions (itself included) when given."""
    pos = jnp.arange(max_len, dtype=jnp.int32)
    mask = pos <= position
    if window is not None:
        mask = mask & (position - pos < window)
    return mask


def attend_one(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, position: jax.Array, window: int | None
) -> jax.Array:
    """Softmax attention of q (b, kv_heads, groups, d) over the cache (b, kv_heads, max_len, d) up to
    ``position`` (included); float32 (b, kv_heads, groups, d)."""
    d = q.shape[-1]
    mask = visible_positions(k_cache.shape[2], position, window)  # (s,)
    qf = q.astype(jnp.float32)[:, :, :, None, :]  # (b, h, g, 1, d)
    scores = jnp.sum(qf * k_cache.astype(jnp.float32)[:, :, None], axis=-1) * (d**-0.5)  # (b, h, g, s)
    scores = jnp.where(mask, scores, _LOWEST)
    ones = jnp.broadcast_to(mask.astype(jnp.float32), scores.shape)
    top, total = jax.lax.reduce((scores, ones), (_LOWEST, 0.0), _softmax_stats, (3,))
    probs = (jnp.exp(scores - top[..., None]) / total[..., None]).astype(q.dtype)
    # a batched GEMM reads the values once, in the cache's layout (a reduction over s would transpose them)
    return jnp.einsum("bhgs,bhsd->bhgd", probs, v_cache.astype(q.dtype), preferred_element_type=jnp.float32)


def write_and_attend(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    position: jax.Array,
    window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes the new key and value (b, kv_heads, 1, d) into the caches at ``position``, then
    :func:`attend_one` of q (b, 1, heads, d); returns (out (b, 1, heads * d) float32, k_cache, v_cache)."""
    b, _, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    start = (jnp.int32(0), jnp.int32(0), position, jnp.int32(0))
    k_cache = jax.lax.dynamic_update_slice(k_cache, k_new.astype(k_cache.dtype), start)
    v_cache = jax.lax.dynamic_update_slice(v_cache, v_new.astype(v_cache.dtype), start)
    qg = q.reshape(b, kv_heads, heads // kv_heads, d)
    out = attend_one(qg, k_cache, v_cache, position, window)
    return out.reshape(b, 1, heads * d), k_cache, v_cache


__all__: list[Any] = ["attend_one", "visible_positions", "write_and_attend"]
