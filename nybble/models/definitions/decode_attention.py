"""Attention of one new token per sequence over its KV cache, written for few launches in a decode step.

    out = attend_one(q, k_cache, v_cache, position, window)   # q (b, kv_heads, groups, d)

Two implementations (``DECODE_ATTENTION``), chosen per model with :func:`set_decode_attention`:
``"xla"`` (the default, below) and ``"triton"``, nybble's Pallas-on-Triton kernel
(``nybble.kernels.triton.decode_attention``: the cache write, the attention and the merge of its splits
in one launch), on NVIDIA GPUs of compute capability 8.0 or newer, or on a CPU inside
``nybble.kernels.triton.backend.interpret()``. The kernel is not the default because it has not yet run
on a GPU (none was lent since it was written): ``make gpu-check`` tests it against this XLA path.

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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nybble.kernels.triton import backend as triton_backend
from nybble.kernels.triton import decode_attention as kernel

_LOWEST = float(jnp.finfo(jnp.float32).min)


class DeferredNorm(NamedTuple):
    """An RMSNorm's per-row scale, not yet computed (``llama.RMSNorm.deferred_sum``):
    ``rsqrt(sum_of_squares / dim + eps)``. ``rows``: the norm's input (..., dim), for a consumer that sums
    their squares itself (the Triton decode attention kernel: then XLA's reduction has no reader and is
    never launched)."""

    sum_of_squares: jax.Array  # (..., 1) float32
    dim: int
    eps: float
    rows: jax.Array | None = None

    def scale(self) -> jax.Array:
        """The scale (as ``RMSNorm.deferred`` computes it: the mean is the sum over ``dim``)."""
        with jax.named_scope("norm"):
            return jax.lax.rsqrt(self.sum_of_squares / self.dim + self.eps)


def split_counters(x: jax.Array) -> jax.Array:
    """Zeros of x's shape in int32, computed from x so that XLA writes them in the launch that writes x
    (the Triton decode attention kernel's split counters: no launch of their own): x * 0 is 0 for a number,
    NaN for inf or NaN, and converts to 0 either way."""
    return (x.astype(jnp.float32) * 0).astype(jnp.int32)


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


DECODE_ATTENTION = ("xla", "triton")


def check_decode_attention(implementation: Any) -> None:
    """Refuses a name that is not one of :data:`DECODE_ATTENTION`."""
    if implementation not in DECODE_ATTENTION:
        raise ValueError(
            f"decode attention: unknown implementation {implementation!r}; choose one of {DECODE_ATTENTION}"
        )


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


def no_gpu_target() -> str | None:
    """Why this trace cannot lower the Triton kernel: no NVIDIA GPU here and none named by the current mesh
    (a deviceless compile sets one: ``jax.set_mesh`` or ``jax.sharding.use_abstract_mesh``), and no
    interpret mode; None when it can."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if triton_backend.is_interpret_active() or (device is not None and device.platform == "gpu"):
        return None
    return triton_backend.not_here()


def write_and_attend_on_kernel(
    qkv: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    position: jax.Array,
    *,
    heads: int,
    window: int | None,
    inv_freq: np.ndarray,
    row_norm: DeferredNorm | None,
    norms: tuple[jax.Array, jax.Array, float, float] | None,
    counters_from: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decode step's attention on the Triton kernel, from the q/k/v projections' output qkv (b, 1,
    (heads + 2 kv_heads) d): the input norm's deferred row scale (:class:`DeferredNorm`: the kernel sums
    the squares of its ``rows`` where they are given and their width a multiple of 16) or None, the q/k
    norms (weights and eps) or None, the rotary embedding, the cache write and the attention in one launch;
    returns (out (b, 1, heads * d) in qkv's dtype, k_cache, v_cache). The splits are merged by the last of
    them, in the launch, where ``counters_from`` (the projection's input x: the launch that writes it
    writes their arrival counters, zeros of its shape) is given; else by a second launch. Arguments are
    checked here (a clear error, never one from inside Pallas); the machine at lowering, as for a forced
    ``nybble.matmul`` backend."""
    b, kv_heads, max_len, d = k_cache.shape
    rows = qkv.reshape(b, heads + 2 * kv_heads, d)
    eps = None if norms is None else (float(norms[2]), float(norms[3]))
    token = kernel.NewToken(heads, kv_heads, None if row_norm is None else (row_norm.dim, row_norm.eps), eps)
    if (why := kernel.unsupported(rows, k_cache, v_cache, token) or no_gpu_target()) is not None:
        raise NotImplementedError(f"decode attention 'triton': {why}; or set_decode_attention(model, 'xla')")
    cfg = kernel.choose_config(b, kv_heads, max_len, triton_backend.target_gpu().sms)
    with jax.named_scope("rope_factors"):  # the same for every layer: XLA computes them once a step
        rope = kernel.rope_factors(position, inv_freq)
    arrivals = None
    if counters_from is not None and cfg.splits > 1:
        # The splits' arrival counters, zeros written by the launch that writes the projection's input (no
        # launch of their own; an array of its shape, of which the kernel uses (b, kv_heads)), or made
        # where an earlier launch wrote them (split_counters, int32 already)
        arrivals = counters_from.reshape(b, -1)
        if arrivals.dtype != jnp.int32:
            arrivals = split_counters(arrivals)
    row_sums = row_inputs = None
    summable = row_norm is not None and kernel.row_chunk(row_norm.dim) >= kernel.MIN_ROWS
    if summable and row_norm.rows is not None:
        row_inputs = row_norm.rows.reshape(b, row_norm.dim)  # XLA's sum of squares then has no reader
    elif row_norm is not None:
        row_sums = row_norm.sum_of_squares.reshape(b)
    out, k_cache, v_cache = kernel.write_and_attend(
        rows, k_cache, v_cache, position, window, cfg, token, rope,
        row_sum_of_squares=row_sums, row_inputs=row_inputs,
        norm_weights=None if norms is None else norms[:2], arrivals=arrivals,
        out_dtype=qkv.dtype, interpret=triton_backend.is_interpret_active(),
    )  # fmt: skip
    return out.reshape(b, 1, heads * d), k_cache, v_cache


__all__: list[Any] = [
    "DECODE_ATTENTION",
    "DeferredNorm",
    "attend_one",
    "check_decode_attention",
    "split_counters",
    "visible_positions",
    "write_and_attend",
    "write_and_attend_on_kernel",
]
