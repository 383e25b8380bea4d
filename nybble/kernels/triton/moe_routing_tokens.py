"""A few decode tokens' MoE routing in one launch on Pallas' Triton backend (2 to 16 tokens: batch 2..16 of
a decode step): from the router's logits to what the grouped expert kernels and the weighted sum read.

    sizes, slots, scores, totals, rows = route_tokens(logits, parts, norm_weight, sums_of_squares, cfg)

The experts and scores of ``nybble.models.definitions.moe.route_scores`` (renormalized, the logits scaled
by each token's RMSNorm scale after the choice) and the rows ``MoE._routed`` gives the experts, sorted by
expert (stably: by token within an expert), as ``sort_by_expert`` sorts them. XLA takes five launches for
them at Qwen3-30B-A3B's batch 8 (the top k, two thunks; the ranks' reductions, two; the rows' gather); this
kernel takes one (the one-token kernel beside it, ``moe_routing``, serves batch 1).

Inputs: the router's f32 ``logits`` (T, E) of the tokens' rows before their RMSNorm's scale; the residual
stream's rows x (T, hidden) as their ``parts`` (x's and the attention's output, added here as XLA adds
them: XLA writes their sum nowhere); the norm's ``norm_weight`` (hidden,); the router launch's f32
``sums_of_squares`` (T, n), each token's in column 0 (``MoE.normed`` takes it once per expert).
Outputs: ``sizes`` (E,) int32 (the grouped kernels' group sizes), ``slots`` (T, k) int32 (the row of each
token's j-th chosen expert, its experts in expert order), ``scores`` (T, k) f32 (their exp((l - max l) x
scale)), ``totals`` (T,) f32 (each token's sum of them) and ``rows`` (T k, hidden) in x's dtype, sorted by
expert: row ``slots[t, j]`` is token t's normalized row.

Grid (hidden / block,): every program routes every token (a few hundred instructions: no program waits for
another's routing), then writes its ``block`` columns of each token's k rows; program 0 also writes the
routing. A token's top k without a sort or an (E, E) comparison: its k-th largest key found bit by bit
(32 steps, each counting the keys at or above a candidate: T x E compares a step), then the keys above it
and, of those equal to it, the lowest indices (``lax.top_k``'s order: keys are the logits' bits in the
floats' total order, ties to the lower index). Slots: the tokens' choices of the experts below, plus the
earlier tokens' of the same expert (prefix sums over experts and over tokens).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from nybble.kernels.triton import pallas as triton_pallas
from nybble.kernels.triton.moe_routing import (
    _keys,
    _pow2,
    experts_and_rows_unsupported,
    normed_row,
    widest_block,
)

MAX_TOKENS = 16  # every program routes them all: T x E compares a step of the k-th key's search
_SIGN = -(2**31)  # int32's sign bit: XOR maps the signed keys' order to their bits' unsigned order


@dataclasses.dataclass(frozen=True)
class TokensRoutingConfig:
    """``top_k`` experts a token; the RMSNorm's ``eps``; ``block`` columns of the rows a program writes."""

    top_k: int
    eps: float
    block: int
    num_warps: int = 4


def unsupported(logits: Any, x: Any, top_k: int) -> str | None:
    """Why the kernel cannot route these tokens' logits (T, E) and rows x (T, hidden) (a part of them), or
    None."""
    tokens, experts = (int(n) for n in np.shape(logits))
    if not 2 <= tokens <= MAX_TOKENS:
        return f"the MoE tokens' routing kernel routes 2 to {MAX_TOKENS} tokens, got {tokens}"
    return experts_and_rows_unsupported(experts, x, top_k)


# (tokens, experts) entries a thread of 4 warps holds up to: past them 8 warps (16 tokens of 256 experts: 4
# warps spilled, 253 registers, sm_90, 2026-12-07)
ENTRIES_PER_4_WARPS = 1024


def choose_config(hidden: int, top_k: int, eps: float, tokens: int, experts: int) -> TokensRoutingConfig:
    """Blocks of ``moe_routing.widest_block(hidden)`` columns; 8 warps where the (tokens, experts) tables
    (tokens padded to a power of two) pass ``ENTRIES_PER_4_WARPS``."""
    warps = 4 if _pow2(tokens) * experts <= ENTRIES_PER_4_WARPS else 8
    return TokensRoutingConfig(top_k=top_k, eps=float(eps), block=widest_block(hidden), num_warps=warps)


def _exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _chosen(key: jax.Array, k: int) -> jax.Array:
    """(T, E) bool: each token's k largest keys (T, E) in ``lax.top_k``'s order (ties to the lower index).
    The k-th largest key, bit by bit from the top of its unsigned form (key ^ sign bit): the largest
    threshold with at least k keys at or above it."""
    threshold = jnp.zeros(key.shape[:1], jnp.int32)  # unsigned form, as int32 bits
    for bit in range(31, -1, -1):
        candidate = threshold | jnp.int32(_SIGN if bit == 31 else 1 << bit)
        at_or_above = jnp.sum((key >= (candidate ^ _SIGN)[:, None]).astype(jnp.int32), axis=1)
        threshold = jnp.where(at_or_above >= k, candidate, threshold)
    kth = (threshold ^ _SIGN)[:, None]  # the k-th largest key, signed
    above = key > kth
    equal = (key == kth).astype(jnp.int32)
    room = k - jnp.sum(above.astype(jnp.int32), axis=1, keepdims=True)  # >= 1: kth is one of the top k
    return above | ((equal == 1) & (_exclusive_cumsum(equal, 1) < room))


def _kernel(*refs, cfg: TokensRoutingConfig, parts: int, tokens: int):
    logits_ref, *part_refs, w_ref, ss_ref = refs[: parts + 3]
    sizes_ref, slots_ref, scores_ref, totals_ref, rows_ref = refs[parts + 3 :]
    c = pl.program_id(0)
    k, padded = cfg.top_k, _pow2(tokens)
    dim = w_ref.shape[0]
    # Triton's shapes are powers of two: rows past the tokens re-read the last token and are masked out
    token_ids = jax.lax.broadcasted_iota(jnp.int32, (padded,), 0)
    kept = jnp.minimum(token_ids, tokens - 1)
    valid = (token_ids < tokens)[:, None]
    logits = logits_ref[kept, :]  # (T, E) f32
    scale = jax.lax.rsqrt(ss_ref[kept, 0] / dim + cfg.eps)  # (T,): RMSNorm.deferred_sum's row scales
    # Every per-token value of a padded row equals the last token's, so their stores agree
    chosen = _chosen(_keys(logits), k)
    chosen_ints = chosen.astype(jnp.int32)
    counted = jnp.where(valid, chosen_ints, 0)  # the padded rows' choices counted nowhere
    sizes = jnp.sum(counted, axis=0)  # (E,)
    # (t, e)'s row: the choices of lower experts, then the earlier tokens' of e (sort_by_expert's order);
    # a padded row's earlier tokens are the last token's and itself: itself taken off
    earlier = _exclusive_cumsum(counted, 0)
    earlier = jnp.where(valid, earlier, earlier - chosen_ints)
    slot = _exclusive_cumsum(sizes, 0)[None, :] + earlier  # (T, E)
    order = _exclusive_cumsum(chosen_ints, 1)  # (t, e): e is token t's order-th chosen expert
    top = jnp.max(logits, axis=1, keepdims=True)
    score = jnp.where(chosen, jnp.exp((logits - top) * scale[:, None]), 0.0)
    choice_ids = jax.lax.broadcasted_iota(jnp.int32, (_pow2(k),), 0)
    kept_choices = jnp.minimum(choice_ids, k - 1)  # choices past k: the k-th again, the same values
    # (T, k): token t's j-th chosen expert's row and score, as k sums over the experts
    picks = [chosen & (order == j) for j in range(k)]
    token_slots = [jnp.sum(jnp.where(p, slot, 0), axis=1) for p in picks]  # k of (T,)

    @pl.when(c == 0)
    def _write_routing():
        sizes_ref[...] = sizes
        for j in range(k):
            slots_ref[kept, j] = token_slots[j]
            scores_ref[kept, j] = jnp.sum(jnp.where(picks[j], score, 0.0), axis=1)
        totals_ref[kept] = jnp.sum(score, axis=1)

    # MoE.normed's rows: x rounded to its dtype, the norm's weight applied and rounded, then the row scale
    cols = pl.ds(pl.multiple_of(c * cfg.block, cfg.block), cfg.block)
    dtype = rows_ref.dtype
    weight = w_ref[cols].astype(jnp.float32)
    token_of = jax.lax.broadcasted_iota(jnp.int32, (padded, _pow2(k)), 0)
    choice_of = jax.lax.broadcasted_iota(jnp.int32, (padded, _pow2(k)), 1)
    # (T, k) of the rows, each entry token t's j-th: the k sums above placed by choice
    table = functools.reduce(
        jnp.add, [jnp.where(choice_of == j, token_slots[j][:, None], 0) for j in range(k)]
    )
    for t in range(tokens):
        x = functools.reduce(jnp.add, [ref[t, cols].astype(jnp.float32) for ref in part_refs])
        row = normed_row(x, weight, jax.lax.rsqrt(ss_ref[t, 0] / dim + cfg.eps), dtype)
        # token t's k rows (its choices past k store the k-th's row again)
        rows_t = jnp.sum(jnp.where((token_of == t) & (choice_of == kept_choices[None, :]), table, 0), axis=0)
        rows_ref[rows_t, cols] = jnp.broadcast_to(row[None, :], (_pow2(k), cfg.block))


def route_tokens(
    logits: jax.Array,
    parts: Sequence[jax.Array],
    norm_weight: jax.Array,
    sums_of_squares: jax.Array,
    cfg: TokensRoutingConfig,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The kernel (see the module): (sizes, slots, scores, totals, rows in the first part's dtype). The rows
    x are the sum of ``parts`` (each (T, hidden)); ``sums_of_squares`` (T, n >= 1) f32, each token's in
    column 0. Arguments are checked by :func:`unsupported`."""
    tokens, e = logits.shape
    hidden = parts[0].shape[-1]
    dtype = parts[0].dtype
    if hidden % cfg.block:
        raise ValueError(f"{cfg}: block must divide hidden ({hidden})")
    out_shape = (
        jax.ShapeDtypeStruct((e,), jnp.int32),
        jax.ShapeDtypeStruct((tokens, cfg.top_k), jnp.int32),
        jax.ShapeDtypeStruct((tokens, cfg.top_k), jnp.float32),
        jax.ShapeDtypeStruct((tokens,), jnp.float32),
        jax.ShapeDtypeStruct((tokens * cfg.top_k, hidden), dtype),
    )
    sums = jnp.asarray(sums_of_squares, jnp.float32)
    return triton_pallas.pallas_call(
        functools.partial(_kernel, cfg=cfg, parts=len(parts), tokens=tokens),
        out_shape=out_shape,
        grid=(hidden // cfg.block,),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="nybble_moe_routing_tokens",
    )(
        logits.astype(jnp.float32),
        *(part.reshape(tokens, hidden) for part in parts),
        norm_weight.reshape(hidden),
        sums.reshape(tokens, -1),
    )


def reference(logits, x, norm_weight, sums_of_squares, top_k: int, eps: float):
    """float64 numpy of rows x (T, hidden) and their sums of squares (T,): (sizes, slots, scores, totals,
    rows) with no rounding; each token's k experts of the largest logits (ties to the lower index), in
    expert order, their scores exp((l - max l) x scale); the rows sorted by expert, then by token."""
    logits = np.asarray(logits, np.float64)
    tokens, e = logits.shape
    x = np.asarray(x, np.float64)
    scale = 1.0 / np.sqrt(np.asarray(sums_of_squares, np.float64) / x.shape[1] + eps)
    experts = [sorted(sorted(range(e), key=lambda j, t=t: (-logits[t, j], j))[:top_k]) for t in range(tokens)]
    pairs = sorted((ex, t, j) for t in range(tokens) for j, ex in enumerate(experts[t]))
    slots = np.zeros((tokens, top_k), np.int32)
    for row, (_, t, j) in enumerate(pairs):
        slots[t, j] = row
    sizes = np.bincount([ex for ex, _, _ in pairs], minlength=e).astype(np.int32)
    scores = np.stack([np.exp((logits[t, experts[t]] - logits[t].max()) * scale[t]) for t in range(tokens)])
    normed = x * np.asarray(norm_weight, np.float64) * scale[:, None]
    rows = np.stack([normed[t] for _, t, _ in pairs])
    return sizes, slots, scores, scores.sum(1), rows


__all__ = ["MAX_TOKENS", "TokensRoutingConfig", "choose_config", "reference", "route_tokens", "unsupported"]
