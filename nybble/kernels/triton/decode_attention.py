"""Decode attention in one launch on Pallas' Triton backend: from the qkv projection's output to the
attention's output, with the new token's key and value written into the KV cache on the way, each cached key
and value read once.

    out, k_cache, v_cache = write_and_attend(qkv, k_cache, v_cache, position, window, cfg, token, rope)

qkv (b, heads + 2 kv_heads, d): the new token's projections as the fused q/k/v layer writes them (query
heads, then keys, then values; a reshape of its (b, 1, N) output, no copy); caches (b, kv_heads, max_len,
d), bf16 or f16, updated in place (``input_output_aliases``: a donated cache is never copied); ``position``
is the new token's (a scalar). ``token`` (:class:`NewToken`) says what turns the projections into the query,
key and value, as the model's XLA path computes them, in its order and with its roundings to x's dtype: the
input norm's deferred row scale (``RMSNorm.deferred``: from each sequence's sum of squares, or from the norm's
input row, whose squares the kernel sums), Qwen3's per-head q/k norms, the rotary embedding
(``rope``: full-width cos and signed sin, so a rotated copy of each head, read with permuted columns, needs
no half-width slices, which Triton tensors do not have).

Grid (b, kv_heads, splits): program (i, h, s) computes the query heads of KV head h (its ``groups`` rows,
read with their row indices clamped, as 16 rows: tensor cores' smallest M) and the new key and value, then
reads the positions of split s (flash decoding) in blocks of ``block_s`` rows, from the sliding window's
first position to the one before ``position``: a short sequence reads only what it attends to. Per block it
- multiplies the (16, d) query block by the (block_s, d) keys as loaded (no register work between the load
  and the MMA, so Triton's pipeliner copies them straight to shared memory): (16, block_s) scores in f32;
- folds them into the running maximum, sum and (16, d) f32 output of online softmax; the probabilities,
  rounded to the cache's dtype, weight the values in a second MMA.
The program whose split holds ``position`` then folds in the new token from registers (its score a dot
product of d terms, its probability rounded as the MMA's are) and writes the new key and value rows; every
program writes its split's (maximum, sum, output) for its ``groups`` query heads. Given ``arrivals``
(int32 zeros, one counter per sequence and KV head), each program then counts itself in, and the last of
(i, h) merges the splits and writes the output projection's input in its dtype, in this launch:
- its state stores, every thread's, before a CTA barrier; then one thread's ``atom.add.acq_rel.gpu`` on
  the counter (Triton's scalar atomic, its old value shared through SMEM behind a second barrier): the
  release makes the stores visible at GPU scope to the program that acquires them with the last arrival;
- the last program reads the states with ``ld.volatile`` (no stale L1 line), after its acquire.
PTX of Llama-3-8B's step (sm_90a, ptxas 12.9, 2026-12-07) holds exactly this: ``bar.sync``,
``@p atom.global.gpu.acq_rel.add.u32``, ``bar.sync``, then the ``ld.volatile.global`` loads. Without
``arrivals`` a second launch (:func:`combine`, one program per sequence and KV head) merges them. With one
split (the grid already covers the SMs: batch 64) each program writes its output, no state, no merge.

Every row a program reads it owns: no split reads another's rows, and no program reads the new row from
memory (the loop stops before it), so the in-place write races with nothing.

jax 0.11.2 and 0.12 warn that Pallas' Triton backend is deprecated (to be removed in a later jax): this
kernel, like the portable int4 ones beside it, needs a port (Mosaic GPU on Hopper and Blackwell) before
nybble's jax range reaches that release.

SASS (ptxas 12.9, Llama-3-8B's shape, 2026-12-06): 325 instructions a 64-position block on sm_90 (32 HMMA,
28 LDSM), 123 registers on sm_80, no spills; with the new row swapped into each loaded block in registers,
the loop took 872 (128 selects, 133 shared-memory stores) and 255 registers. Summing the input norm's row
in the kernel (2026-12-07): 1,856 instructions in all on sm_90 (1,824 given the sum), 1,800 on sm_100
(1,768), 1,872 on sm_80 (1,816); the loop unchanged, no spills.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from nybble.kernels.triton import pallas as triton_pallas

DTYPES = ("bfloat16", "float16")  # the cache's and q's: the MMA's inputs
MIN_ROWS = 16  # an MMA's smallest M, N and K on Triton (mma.sync m16n8k16): the groups are padded to it
BLOCK_ROWS = (64, 32, 16)  # cache positions a block, largest first; one must divide max_len
MIN_BLOCKS_PER_SPLIT = 4  # a split reads at least 4 blocks: fewer make its (max, sum, out) write dominate
_LOWEST = float(np.finfo(np.float32).min)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """``block_s`` cache positions a block, ``splits`` programs along the cache per (sequence, KV head)."""

    block_s: int
    splits: int
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class NewToken:
    """The new token's rows in the qkv projection's output and what the model does to them before attention:
    ``row_norm`` (the input RMSNorm's (dim, eps), its per-row scale deferred past the projection: the
    kernel computes ``rsqrt(sum_of_squares / dim + eps)`` from each sequence's f32 sum of squares, an
    operand), ``norm_eps`` (Qwen3: the q and k per-head RMSNorms' eps; their weights are operands)."""

    heads: int
    kv_heads: int
    row_norm: tuple[int, float] | None = None
    norm_eps: tuple[float, float] | None = None

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


def state_rows(groups: int) -> int:
    """Rows of a split's written state: ``groups`` padded to a power of two (Triton's tensor shapes)."""
    return 1 << (groups - 1).bit_length()


def padded_groups(groups: int) -> int:
    """The query block's rows: ``groups`` padded to a power of two of at least 16."""
    return max(MIN_ROWS, state_rows(groups))


def unsupported(qkv: Any, k_cache: Any, v_cache: Any, token: NewToken) -> str | None:
    """Why the kernel cannot attend the new token of qkv (b, heads + 2 kv_heads, d) over these caches, or
    None."""
    from nybble.jax_range import outside_reason

    if (reason := outside_reason()) is not None:
        return reason
    dtype, v_dtype = np.dtype(k_cache.dtype).name, np.dtype(v_cache.dtype).name
    if dtype not in DTYPES or v_dtype != dtype:
        return f"the decode attention kernel reads bf16 or f16 caches of one dtype, got {dtype} and {v_dtype}"
    d, max_len = k_cache.shape[-1], k_cache.shape[2]
    if d < MIN_ROWS or d & (d - 1):
        return f"the decode attention kernel takes a head_dim that is a power of two >= 16, got {d}"
    if max_len % BLOCK_ROWS[-1]:
        return (
            f"the decode attention kernel reads the cache in blocks of 16 positions and this cache holds "
            f"{max_len}: make the cache a multiple of 16 positions (Llama.init_cache(batch, max_len))"
        )
    if token.groups > 128 or token.heads % token.kv_heads:
        return f"the decode attention kernel takes up to 128 query heads per KV head, got {token}"
    if qkv.shape[1:] != (token.heads + 2 * token.kv_heads, d) or k_cache.shape[1] != token.kv_heads:
        return f"qkv {tuple(qkv.shape)} and the caches {tuple(k_cache.shape)} do not match {token}"
    return None


def choose_config(batch: int, kv_heads: int, max_len: int, sms: int) -> AttentionConfig:
    """Blocks of 64 positions where they divide the cache; splits (a power of two dividing the blocks, each
    at least ``MIN_BLOCKS_PER_SPLIT`` blocks) until the grid covers every SM once."""
    block_s = next(b for b in BLOCK_ROWS if max_len % b == 0)
    blocks = max_len // block_s
    splits = 1
    while (
        batch * kv_heads * splits < sms
        and blocks % (2 * splits) == 0
        and blocks // (2 * splits) >= MIN_BLOCKS_PER_SPLIT
    ):
        splits *= 2
    return AttentionConfig(block_s=block_s, splits=splits)


def _round(x: jax.Array, dtype: Any) -> jax.Array:
    return x.astype(dtype).astype(jnp.float32)


def row_chunk(dim: int) -> int:
    """Columns of the norm's input row a step of :func:`_sum_of_squares` reads: the largest power of two
    dividing ``dim``, up to 1024 (Triton's tensors are powers of two; Llama-3's 4096: 4 steps)."""
    return min(1024, dim & -dim)


def _sum_of_squares(rows_ref, i):
    """Sequence i's f32 sum of squares of its norm input row (the residual stream, in its dtype), as
    ``RMSNorm.deferred_sum`` sums it (the order of the terms aside). Every program of the sequence sums it
    (8 KB of Llama-3's row, from L2 after the first): XLA's sum would be a launch, its reduction's result
    a fusion of no consumer."""
    chunk = row_chunk(rows_ref.shape[1])

    def step(j, total):
        x = rows_ref[i, pl.ds(pl.multiple_of(j * chunk, chunk), chunk)].astype(jnp.float32)
        return total + (x * x).sum()

    return jax.lax.fori_loop(0, rows_ref.shape[1] // chunk, step, jnp.zeros((), jnp.float32))


def _new_token(qkv_ref, rope_ref, scale_ref, qw_ref, kw_ref, i, h, *, token: NewToken, rows: int):
    """(q (rows, d), k (1, d), v (1, d)) of program (i, h) in qkv's dtype: the model's steps (see the
    module), each rounded to that dtype where the model rounds."""
    d, dtype = qkv_ref.shape[2], qkv_ref.dtype
    col = jax.lax.broadcasted_iota(jnp.int32, (d,), 0)
    rotated = (col + d // 2) % d  # rotate-half: column j reads j + d/2 (first half) or j - d/2 (second)
    cos, sin = rope_ref[pl.ds(0, 1), :], rope_ref[pl.ds(1, 1), :]  # (1, d): [cos, cos] and [-sin, sin]
    scale = None
    if token.row_norm is not None:  # RMSNorm.deferred_sum's scale, as DeferredNorm.scale computes it
        dim, eps = token.row_norm
        total = scale_ref[i] if len(scale_ref.shape) == 1 else _sum_of_squares(scale_ref, i)
        scale = jax.lax.rsqrt(total / dim + eps)

    def head(row_ids, weight_ref, eps):
        x = qkv_ref[i, row_ids, :].astype(jnp.float32)
        x_rot = qkv_ref[i, row_ids[:, None], rotated[None, :]].astype(jnp.float32)
        if scale is not None:  # llama.scaled
            x, x_rot = _round(x * scale, dtype), _round(x_rot * scale, dtype)
        if weight_ref is not None:  # llama.norm_heads_together: each head over its own d values
            inv = jax.lax.rsqrt((x * x).sum(axis=1, keepdims=True) / d + eps)
            weight = weight_ref[...].astype(jnp.float32)
            x = _round(x * inv * weight[None, :], dtype)
            x_rot = _round(x_rot * inv * weight_ref[rotated].astype(jnp.float32)[None, :], dtype)
        return (x * cos + x_rot * sin).astype(dtype)  # llama.rope: x1 cos - x2 sin | x2 cos + x1 sin

    eps_q, eps_k = token.norm_eps or (0.0, 0.0)
    r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    q = head(h * token.groups + jnp.minimum(r, token.groups - 1), qw_ref, eps_q)  # rows past groups: reread
    k = head(token.heads + h + jnp.zeros((1,), jnp.int32), kw_ref, eps_k)
    v = qkv_ref[i, pl.ds(token.heads + token.kv_heads + h, 1), :]
    if scale is not None:
        v = (v.astype(jnp.float32) * scale).astype(dtype)
    return q, k, v


def _kernel(
    *refs,
    cfg: AttentionConfig,
    token: NewToken,
    window: int | None,
    scale: float,
    merge: str,
    interpret: bool,
):
    pos_ref, qkv_ref, rope_ref, *rest = refs
    scale_ref = rest.pop(0) if token.row_norm else None
    qw_ref, kw_ref = (rest.pop(0), rest.pop(0)) if token.norm_eps else (None, None)
    if merge == "arrivals":  # the arrivals' input ref (aliased to the output ref, which the kernel uses)
        kc_ref, vc_ref, _, m_ref, l_ref, o_ref, kc_out, vc_out, y_ref, arrivals = rest
    elif merge == "single":
        kc_ref, vc_ref, kc_out, vc_out, y_ref = rest
    else:
        kc_ref, vc_ref, m_ref, l_ref, o_ref, kc_out, vc_out = rest
    i, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bs = cfg.block_s
    per_split = kc_ref.shape[2] // bs // cfg.splits
    first = s * per_split * bs  # this split's first cache position
    pos = pos_ref[()]
    lowest = pos - window + 1 if window is not None else 0  # the first position the query sees
    rows = padded_groups(token.groups)
    q, k_new, v_new = _new_token(qkv_ref, rope_ref, scale_ref, qw_ref, kw_ref, i, h, token=token, rows=rows)
    cache_dtype = kc_ref.dtype
    q, k_new, v_new = q.astype(cache_dtype), k_new.astype(cache_dtype), v_new.astype(cache_dtype)

    def body(j, carry):
        out, top, total = carry
        start = pl.multiple_of(first + j * bs, bs)
        position = start + jax.lax.broadcasted_iota(jnp.int32, (bs,), 0)
        # the cached positions before the new token's (its own row in the cache is stale until written)
        seen = ((position < pos) & (position >= lowest))[None, :]
        scores = plgpu.dot(q, kc_ref[i, h, pl.ds(start, bs), :], trans_b=True) * scale  # (rows, bs) f32
        scores = jnp.where(seen, scores, _LOWEST)
        new_top = jnp.maximum(top, scores.max(axis=1))
        rescale = jnp.exp(top - new_top)
        probs = jnp.where(seen, jnp.exp(scores - new_top[:, None]), 0.0)
        values = vc_ref[i, h, pl.ds(start, bs), :]
        out = out * rescale[:, None] + plgpu.dot(probs.astype(values.dtype), values)
        return out, new_top, total * rescale + probs.sum(axis=1)

    # the blocks of this split that hold positions lowest .. pos - 1 (none: an empty state)
    j_lo = jnp.clip(jax.lax.div(jnp.maximum(lowest - first, 0), bs), 0, per_split)
    j_hi = jnp.clip(jax.lax.div(jnp.maximum(pos - first + bs - 1, 0), bs), 0, per_split)
    init = (
        jnp.zeros((rows, q.shape[1]), jnp.float32),
        jnp.full((rows,), _LOWEST, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    out, top, total = jax.lax.fori_loop(j_lo, j_hi, body, init)
    # The new token, from registers, in the split that holds its position: one more step of online softmax
    # (its probability rounded to the cache's dtype, as the MMA's are)
    owner = (pos >= first) & (pos < first + per_split * bs)
    fresh = (q.astype(jnp.float32) * k_new.astype(jnp.float32)).sum(axis=1) * scale
    fresh = jnp.where(owner, fresh, _LOWEST)
    new_top = jnp.maximum(top, fresh)
    rescale = jnp.exp(top - new_top)
    prob = jnp.where(owner, jnp.exp(fresh - new_top), 0.0)
    weighted = prob.astype(v_new.dtype).astype(jnp.float32)[:, None] * v_new.astype(jnp.float32)
    out, top, total = out * rescale[:, None] + weighted, new_top, total * rescale + prob
    # The state's first state_rows(groups) rows only (4 of 16 for Llama-3's 4 query heads a KV head): rows
    # past them store into the last, with the same values (every padded row is the last head again)
    kept = jnp.minimum(jax.lax.broadcasted_iota(jnp.int32, (rows,), 0), state_rows(token.groups) - 1)
    if merge == "single":  # one split: its state is the whole softmax (_merged's weight is exp(0) = 1)
        y_ref[i, h, kept, :] = (out / total[:, None]).astype(y_ref.dtype)
    else:
        o_ref[i, h, s, kept, :] = out
        m_ref[i, h, s, kept] = top
        l_ref[i, h, s, kept] = total

    @pl.when(owner)
    def _write_new_row():
        kc_out[i, h, pl.ds(pos, 1), :] = k_new  # kc_out aliases kc_ref's buffer
        vc_out[i, h, pl.ds(pos, 1), :] = v_new

    if merge == "arrivals":
        # The last split of (i, h) to arrive merges them all. Every thread's state stores come before the
        # arrival (a CTA barrier: Triton issues a scalar atomic from one thread); the arrival releases them
        # at GPU scope, and the last program's acquires the others' (an acq_rel atomic, Triton's default).
        if not interpret:  # interpret mode runs the programs one after another
            plgpu.debug_barrier()
        arrived = plgpu.atomic_add(arrivals, (i, h), jnp.ones((), jnp.int32))

        @pl.when(arrived == cfg.splits - 1)
        def _merge():
            # the other programs' states: volatile loads (ld.volatile, relaxed at system scope in PTX's
            # memory model: never a stale L1 line; jax's ".cg" cache modifier does not lower)
            top = plgpu.load(m_ref.at[i, h], volatile=True)
            total = plgpu.load(l_ref.at[i, h], volatile=True)
            out = plgpu.load(o_ref.at[i, h], volatile=True)
            y_ref[i, h] = _merged(top, total, out).astype(y_ref.dtype)


def _merged(top: jax.Array, total: jax.Array, out: jax.Array) -> jax.Array:
    """The splits' online-softmax states, top and total (splits, rows) and out (splits, rows, d), merged:
    (rows, d) float32."""
    best = top.max(axis=0)
    weight = jnp.exp(top - best[None, :])  # 0 for a split that saw no position (its maximum: f32's lowest)
    norm = (total * weight).sum(axis=0)
    return (out * weight[:, :, None]).sum(axis=0) / norm[:, None]


def _combine_kernel(m_ref, l_ref, o_ref, y_ref):
    i, h = pl.program_id(0), pl.program_id(1)
    y_ref[i, h] = _merged(m_ref[i, h], l_ref[i, h], o_ref[i, h]).astype(y_ref.dtype)


def combine(top: jax.Array, total: jax.Array, out: jax.Array, groups: int, dtype: Any, *, interpret: bool):
    """Merges the splits' online-softmax states, top and total (b, h, splits, rows) and out (..., rows, d),
    into (b, h, groups, d) of ``dtype``: one launch, which writes the output projection's input itself (a
    power-of-two ``groups``; others write the next power of two of rows, then XLA slices)."""
    b, h, _, rows, d = out.shape
    y = triton_pallas.pallas_call(
        _combine_kernel,
        out_shape=jax.ShapeDtypeStruct((b, h, rows, d), dtype),
        grid=(b, h),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="nybble_decode_attention_combine",
    )(top, total, out)
    return y if rows == groups else y[:, :, :groups]


def rope_factors(position: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """(2, d) f32 of the rotary embedding at ``position``: ``[cos, cos]`` and ``[-sin, sin]`` of
    ``position * inv_freq`` (as ``llama.rope`` computes its angles); one array, so one fusion."""
    angles = jnp.asarray(position).astype(jnp.float32) * jnp.asarray(inv_freq)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return jnp.stack([jnp.concatenate([cos, cos]), jnp.concatenate([-sin, sin])])


def write_and_attend(
    qkv: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    position: jax.Array,
    window: int | None,
    cfg: AttentionConfig,
    token: NewToken,
    rope: jax.Array,
    *,
    row_sum_of_squares: jax.Array | None = None,
    row_inputs: jax.Array | None = None,
    norm_weights: tuple[jax.Array, jax.Array] | None = None,
    arrivals: jax.Array | None = None,
    out_dtype: Any = jnp.float32,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel (see module): (out (b, kv_heads, groups, d) of ``out_dtype``, k_cache, v_cache).
    ``rope``: :func:`rope_factors`; where ``token.row_norm``, ``row_sum_of_squares`` (b,) f32 or the rows
    the norm normalizes, ``row_inputs`` (b, dim) (the kernel sums their squares; ``row_chunk(dim)`` >= 16);
    ``norm_weights`` (the q and k norms', (d,) each) where ``token.norm_eps``. ``arrivals``: (b, n >=
    kv_heads) int32 zeros, the splits' arrival counters (column h: KV head h's): the last split of each
    merges them in this launch (else :func:`combine`, a second launch). With one split (``cfg.splits``)
    each program writes its output itself, counters or not. Arguments are checked by :func:`unsupported`."""
    b, kv_heads, max_len, d = k_cache.shape
    if max_len % (cfg.block_s * cfg.splits):
        raise ValueError(f"{cfg}: block_s x splits must divide the cache's {max_len} positions")
    row_operands = (row_sum_of_squares is not None) + (row_inputs is not None)
    if row_operands != (token.row_norm is not None) or (norm_weights is None) != (token.norm_eps is None):
        raise ValueError(
            f"{token}: one of row_sum_of_squares and row_inputs, and norm_weights, are given exactly where "
            "it says so"
        )
    operands = [jnp.asarray(position, jnp.int32).reshape(()), qkv, rope]
    if row_sum_of_squares is not None:
        operands.append(jnp.asarray(row_sum_of_squares, jnp.float32).reshape(b))
    if row_inputs is not None:
        dim = token.row_norm[0]
        if row_inputs.shape != (b, dim) or row_chunk(dim) < MIN_ROWS:
            raise ValueError(
                f"row_inputs must be ({b}, {dim}) with {dim} a multiple of 16, got {tuple(row_inputs.shape)}"
            )
        operands.append(row_inputs)
    if norm_weights is not None:
        operands.extend(norm_weights)
    caches = len(operands)
    rows = state_rows(token.groups)
    state = (b, kv_heads, cfg.splits, rows)
    if arrivals is not None and (
        arrivals.ndim != 2
        or arrivals.shape[0] != b
        or arrivals.shape[1] < kv_heads
        or arrivals.dtype != jnp.int32
    ):
        raise ValueError(
            f"arrivals must be int32 zeros of shape ({b}, n >= {kv_heads}), got {arrivals.dtype} "
            f"{arrivals.shape}"
        )
    merge = "single" if cfg.splits == 1 else "combine" if arrivals is None else "arrivals"
    # Results: the splits' states (not with one split: the program writes its output), the caches (aliased),
    # the output (merged in the launch), the counters (aliased); the kernel unpacks them in this order.
    states = [] if merge == "single" else [
        jax.ShapeDtypeStruct(state, jnp.float32),
        jax.ShapeDtypeStruct(state, jnp.float32),
        jax.ShapeDtypeStruct((*state, d), jnp.float32),
    ]  # fmt: skip
    out_shape = [
        *states,
        jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
    ]
    aliases = {caches: len(states), caches + 1: len(states) + 1}
    extra = []
    if merge != "combine":
        out_shape.append(jax.ShapeDtypeStruct((b, kv_heads, rows, d), out_dtype))
    if merge == "arrivals":
        aliases[caches + 2] = len(out_shape)
        out_shape.append(jax.ShapeDtypeStruct(arrivals.shape, jnp.int32))
        extra = [arrivals]
    results = triton_pallas.pallas_call(
        functools.partial(
            _kernel, cfg=cfg, token=token, window=window, scale=d**-0.5, merge=merge, interpret=interpret
        ),
        out_shape=tuple(out_shape),
        grid=(b, kv_heads, cfg.splits),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="nybble_decode_attention",
    )(*operands, k_cache, v_cache, *extra)
    k_cache, v_cache = results[len(states) : len(states) + 2]
    if merge == "combine":
        return combine(*results[:3], token.groups, out_dtype, interpret=interpret), k_cache, v_cache
    y = results[len(states) + 2]
    return (y if rows == token.groups else y[:, :, : token.groups]), k_cache, v_cache


def reference(
    qkv,
    k_cache,
    v_cache,
    position: int,
    window: int | None,
    token: NewToken,
    inv_freq,
    row_sum_of_squares=None,
    norm_weights=None,
    row_inputs=None,
):
    """float64 numpy, no rounding: the new token's q, k, v from qkv (row scale, q/k norms, rotary
    embedding; the row scale from ``row_sum_of_squares`` or from ``row_inputs``' rows), the caches with the
    new rows written, then softmax(q k^T / sqrt(d)) v over the positions ``position - window + 1 ..
    position``; (out (b, kv_heads, groups, d), k_cache, v_cache)."""
    x = np.array(qkv, np.float64)
    if row_inputs is not None:
        row_sum_of_squares = np.square(np.asarray(row_inputs, np.float64)).sum(-1)
    if row_sum_of_squares is not None:
        dim, eps = token.row_norm
        x = x / np.sqrt(np.asarray(row_sum_of_squares, np.float64).reshape(-1, 1, 1) / dim + eps)
    hq, hk = token.heads, token.kv_heads
    q, k, v = x[:, :hq], x[:, hq : hq + hk], x[:, hq + hk :]
    if norm_weights is not None:
        (wq, wk), (eq, ek) = norm_weights, token.norm_eps
        q = q / np.sqrt((q * q).mean(-1, keepdims=True) + eq) * np.asarray(wq, np.float64)
        k = k / np.sqrt((k * k).mean(-1, keepdims=True) + ek) * np.asarray(wk, np.float64)
    angles = position * np.asarray(inv_freq, np.float64)
    cos, sin = np.cos(angles), np.sin(angles)

    def rope(y):
        y1, y2 = np.split(y, 2, axis=-1)
        return np.concatenate([y1 * cos - y2 * sin, y2 * cos + y1 * sin], axis=-1)

    q, k = rope(q), rope(k)
    kc, vc = np.array(k_cache, np.float64), np.array(v_cache, np.float64)
    kc[:, :, position], vc[:, :, position] = k, v
    lo = 0 if window is None else max(0, position - window + 1)
    qg = q.reshape(q.shape[0], hk, token.groups, -1)
    scores = np.einsum("bhgd,bhsd->bhgs", qg, kc[:, :, lo : position + 1]) / np.sqrt(qg.shape[-1])
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhgs,bhsd->bhgd", probs, vc[:, :, lo : position + 1]), kc, vc


__all__ = [
    "AttentionConfig",
    "NewToken",
    "choose_config",
    "combine",
    "padded_groups",
    "reference",
    "rope_factors",
    "row_chunk",
    "state_rows",
    "unsupported",
    "write_and_attend",
]
