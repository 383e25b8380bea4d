"""One decode token's MoE routing in one launch on Pallas' Triton backend: from the router's logits to what
the grouped expert kernels and the weighted sum read.

    sizes, slot_scores, total, rows = route_one(logits, parts, norm_weight, sums_of_squares, cfg)

The experts and scores of ``nybble.models.definitions.moe.route_ranked`` and the rows ``MoE.normed`` gives
the experts. XLA takes two launches for them (reductions over the experts: the ranks, then everything that
reads every expert's rank) and a third for the weighted sum of the experts' rows (a reduction over the
experts of their slots' rows); this kernel takes one, and gives the scores in slot order, so the weighted
sum is k adds XLA fuses into the next norm's launch.

Inputs: the router's f32 ``logits`` (E,) of the token's row before its RMSNorm's per-row scale
(``MoE.normed``: the scale multiplies the logits after the choice); the residual stream's row x (hidden,)
as its ``parts``, x's and the attention's output, added here as XLA adds them (in f32, rounded to x's
dtype): XLA writes their sum nowhere (it adds them again in each launch that reads it), and an operand of
this launch would be a launch of its own; the norm's ``norm_weight`` (hidden,); and the router launch's f32
``sums_of_squares`` (n,), x's sum of squares in entry 0 (``MoE.normed`` takes it once per expert).
Outputs: ``sizes`` (E,) int32 (1 for the k chosen experts, the grouped kernels' group sizes),
``slot_scores`` (k,) f32 (the chosen experts' exp((l_e - max l) x scale), in expert order: slot s holds
the s-th chosen expert's, whose row is the grouped kernels' row s), ``total`` (1,) f32 (their sum), and
``rows`` (k, hidden) in x's dtype: the normalized row k times, the grouped kernels' x.

Grid (hidden / block,): program 0 ranks the E experts (E x E comparisons, 32 columns at a time in
registers: 16K for 128 experts), takes each chosen expert's slot as a prefix sum and writes the routing;
program c writes the columns c x block .. (c + 1) x block of the k rows (each program computes the row
scale itself: none waits for another).
Expert e is chosen when fewer than k experts rank above it in ``lax.top_k``'s order: keys are the logits'
bits in the floats' total order (a negative float's magnitude bits flipped), ties to the lower index.
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

X_DTYPES = ("bfloat16", "float16", "float32")
MAX_EXPERTS = 256  # program 0 ranks them all: E^2 comparisons
RANK_COLUMNS = 32  # experts compared with all E at once: (E, 32) in registers
BLOCK_COLUMNS = (256, 128, 64)  # the rows' columns a program writes, largest first; one must divide hidden


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """``top_k`` experts a token; the RMSNorm's ``eps`` (its dim is the rows' width); ``block`` columns of
    the rows a program writes."""

    top_k: int
    eps: float
    block: int
    num_warps: int = 4


def unsupported(logits: Any, x: Any, top_k: int) -> str | None:
    """Why the kernel cannot route one token of these logits (E,) and row x (hidden,) (a part of it), or
    None."""
    return experts_and_rows_unsupported(int(np.shape(logits)[-1]), x, top_k)


def experts_and_rows_unsupported(experts: int, x: Any, top_k: int) -> str | None:
    """Why neither routing kernel (one token's, or ``moe_routing_tokens``) routes ``experts`` experts' top
    ``top_k`` and writes rows like x (a part of them), or None: the rules both kernels share."""
    from nybble.jax_range import outside_reason

    if (reason := outside_reason()) is not None:
        return reason
    e = experts
    if e & (e - 1) or not 2 <= e <= MAX_EXPERTS:
        return f"the MoE routing kernel takes a power-of-two number of experts up to {MAX_EXPERTS}, got {e}"
    if not 1 <= top_k <= e:
        return f"the MoE routing kernel takes 1 <= top_k <= experts ({e}), got {top_k}"
    hidden = int(np.shape(x)[-1])
    if hidden % BLOCK_COLUMNS[-1]:
        return (
            f"the MoE routing kernel writes rows of a multiple of {BLOCK_COLUMNS[-1]} columns, got {hidden}"
        )
    if (name := np.dtype(x.dtype).name) not in X_DTYPES:
        return f"the MoE routing kernel takes x of dtype {X_DTYPES}, got {name}"
    return None


def widest_block(hidden: int) -> int:
    """The widest block of :data:`BLOCK_COLUMNS` that divides ``hidden`` (the columns a program writes)."""
    return next(b for b in BLOCK_COLUMNS if hidden % b == 0)


def choose_config(hidden: int, top_k: int, eps: float) -> RoutingConfig:
    """The widest block of :data:`BLOCK_COLUMNS` that divides ``hidden``."""
    return RoutingConfig(top_k=top_k, eps=float(eps), block=widest_block(hidden))


def _round(x: jax.Array, dtype: Any) -> jax.Array:
    return x.astype(dtype).astype(jnp.float32)


def normed_row(x: jax.Array, weight: jax.Array, scale: Any, dtype: Any) -> jax.Array:
    """``MoE.normed``'s row of the f32 sum x of the residual stream's parts: x rounded to ``dtype``, the
    norm's f32 ``weight`` applied and rounded, then the row ``scale``, rounded (both kernels' rows)."""
    return (_round(_round(x, dtype) * weight, dtype) * scale).astype(dtype)


def _keys(logits: jax.Array) -> jax.Array:
    """The logits' f32 bits as int32 in the floats' total order (XLA's top_k comparator): a negative
    float's magnitude bits flipped, so more negative is lower and -0 (all ones) sits just below +0."""
    bits = jax.lax.bitcast_convert_type(logits, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _ranks(key: jax.Array, ids: jax.Array, logits_ref: Any, columns: int) -> jax.Array:
    """(n,) int32: how many of the E experts rank above each of ``key`` (n,) (experts ``ids``), in
    ``lax.top_k``'s order (larger key, or an equal key and a lower index): the (n, E) comparison taken
    ``columns`` experts at a time, so it stays in registers (256 x 256 at once spilled)."""
    ranks = jnp.zeros(key.shape, jnp.int32)
    for j0 in range(0, logits_ref.shape[0], columns):
        other = _keys(logits_ref[pl.ds(j0, columns)])[None, :]
        other_ids = (j0 + jax.lax.broadcasted_iota(jnp.int32, (columns,), 0))[None, :]
        above = (other > key[:, None]) | ((other == key[:, None]) & (other_ids < ids[:, None]))
        ranks += jnp.sum(above.astype(jnp.int32), axis=1)
    return ranks


def _kernel(*refs, cfg: RoutingConfig, parts: int):
    logits_ref, *part_refs, w_ref, ss_ref = refs[: parts + 3]
    sizes_ref, slot_scores_ref, total_ref, rows_ref = refs[parts + 3 :]
    c = pl.program_id(0)
    k = cfg.top_k
    scale = jax.lax.rsqrt(ss_ref[0] / w_ref.shape[0] + cfg.eps)  # RMSNorm.deferred_sum's row scale

    @pl.when(c == 0)
    def _write_routing():
        logits = logits_ref[...]  # (E,) f32
        e = logits.shape[0]
        columns = min(e, RANK_COLUMNS)
        ids = jax.lax.broadcasted_iota(jnp.int32, (e,), 0)
        chosen = _ranks(_keys(logits), ids, logits_ref, columns) < k  # fewer than k rank above
        scores = jnp.where(chosen, jnp.exp((logits - jnp.max(logits)) * scale), 0.0)
        # each expert's slot: the chosen experts below it (an exclusive prefix sum: Triton's scan)
        chosen_ints = chosen.astype(jnp.int32)
        slots = jnp.cumsum(chosen_ints) - chosen_ints
        sizes_ref[...] = chosen_ints
        # slot s's score: the chosen expert with s chosen below it. Triton's shapes are powers of two: the
        # rows past k recompute slot k - 1 and store into it the same value
        kept = jnp.minimum(jax.lax.broadcasted_iota(jnp.int32, (_pow2(k),), 0), k - 1)
        in_slot = chosen[None, :] & (slots[None, :] == kept[:, None])  # (slot, e)
        slot_scores_ref[kept] = jnp.sum(jnp.where(in_slot, scores[None, :], 0.0), axis=1)
        total_ref[...] = jnp.zeros((1,), jnp.float32) + jnp.sum(scores)

    # MoE.normed's rows: x rounded to its dtype, the norm's weight applied and rounded, then the row scale
    cols = pl.ds(pl.multiple_of(c * cfg.block, cfg.block), cfg.block)
    dtype = rows_ref.dtype
    x = functools.reduce(jnp.add, [ref[cols].astype(jnp.float32) for ref in part_refs])
    row = normed_row(x, w_ref[cols].astype(jnp.float32), scale, dtype)
    for r in range(k):
        rows_ref[r, cols] = row


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def route_one(
    logits: jax.Array,
    parts: Sequence[jax.Array],
    norm_weight: jax.Array,
    sums_of_squares: jax.Array,
    cfg: RoutingConfig,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The kernel (see the module): (sizes, slot_scores, total, rows in the first part's dtype). The row x
    is the sum of ``parts`` (each (hidden,)); ``sums_of_squares`` (n >= 1,) f32, x's in entry 0. Arguments
    are checked by :func:`unsupported`."""
    e, hidden = logits.shape[-1], parts[0].shape[-1]
    dtype = parts[0].dtype
    if hidden % cfg.block:
        raise ValueError(f"{cfg}: block must divide hidden ({hidden})")
    out_shape = (
        jax.ShapeDtypeStruct((e,), jnp.int32),
        jax.ShapeDtypeStruct((cfg.top_k,), jnp.float32),
        jax.ShapeDtypeStruct((1,), jnp.float32),
        jax.ShapeDtypeStruct((cfg.top_k, hidden), dtype),
    )
    return triton_pallas.pallas_call(
        functools.partial(_kernel, cfg=cfg, parts=len(parts)),
        out_shape=out_shape,
        grid=(hidden // cfg.block,),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="nybble_moe_routing",
    )(
        logits.reshape(e).astype(jnp.float32),
        *(part.reshape(hidden) for part in parts),
        norm_weight.reshape(hidden),
        jnp.asarray(sums_of_squares, jnp.float32).reshape(-1),
    )


def reference(logits, x, norm_weight, sum_of_squares, top_k: int, dim: int, eps: float):
    """float64 numpy of the row x (hidden,) and its sum of squares: (sizes, slot_scores, total, rows) with no
    rounding; the k experts of the largest logits (ties to the lower index), their scores
    exp((l - max l) x scale) in expert order."""
    logits = np.asarray(logits, np.float64)
    scale = 1.0 / np.sqrt(float(sum_of_squares) / dim + eps)
    order = sorted(range(logits.shape[0]), key=lambda j: (-logits[j], j))
    experts = sorted(order[:top_k])
    sizes = np.zeros(logits.shape[0], np.int32)
    sizes[experts] = 1
    slot_scores = np.exp((logits[experts] - logits.max()) * scale)
    row = np.asarray(x, np.float64) * np.asarray(norm_weight, np.float64) * scale
    return sizes, slot_scores, np.array([slot_scores.sum()]), np.broadcast_to(row, (top_k, row.shape[0]))


__all__ = ["RoutingConfig", "choose_config", "reference", "route_one", "unsupported"]
