"""A small Llama in Flax NNX: RMSNorm, rotary embeddings, grouped-query causal attention, SwiGLU MLP.

Module paths (what ``QuantRule`` patterns see): ``embed``, ``layers.{i}.attn.{q,k,v,o}_proj``,
``layers.{i}.attn.{q,k}_norm`` (with ``qk_norm``), ``layers.{i}.mlp.{gate,up,down}_proj``,
``layers.{i}.{input,post}_norm``, ``norm``, ``lm_head`` (absent when the LM head is tied to the embedding).
Rotary embeddings use the Hugging Face ("rotate half") convention; GGUF checkpoints are un-permuted on load
(``nybble.models.gguf``).

One decoder for the Llama family: the switches of :class:`LlamaConfig` cover what Llama 2/3/3.1/3.2,
Mistral, Qwen2 and Qwen3 differ by (q/k/v biases, q/k RMSNorm over head_dim, head_dim, Llama 3 rope
scaling, a sliding attention window, the tied LM head). ``nybble.models.io.hf.config`` maps config.json to it.

KV-cache decoding: ``cache = model.init_cache(batch, max_len)``, then
``logits, cache = model.prefill(ids, cache)`` and ``logits, cache = model.decode_step(next_ids, cache, pos)``
one token at a time. The cache is a :class:`KVCache` pytree (per layer, keys and values of shape
(batch, kv_heads, max_len, head_dim): the layout the attention's dots read without a copy), so it passes
through ``jax.jit`` and ``lax`` loops as is; every row of a batch sits at the same position.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nybble.kernels.ops.residual_matmul import fuses as residual_fuses
from nybble.kernels.ops.residual_matmul import residual_matmul
from nybble.models.definitions.decode_attention import (
    DeferredNorm,
    check_decode_attention,
    split_counters,
    write_and_attend,
    write_and_attend_on_kernel,
)
from nybble.models.definitions.fuse import FusedGateUp, FusedParts
from nybble.models.definitions.layers import QLinear, projections
from nybble.models.definitions.moe import NORMED_MAX_TOKENS, MoE


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (config.json ``rope_type: "llama3"``).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, shorter than ``... / high_freq_factor`` kept, and those between interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"rope scaling: high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor})"
            )
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"rope scaling: factor ({self.factor}) and original_max_position_embeddings "
                f"({self.original_max_position_embeddings}) must be positive"
            )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama-family hyperparameters.

    The switches after ``tie_embeddings`` default to plain Llama: ``qkv_bias`` (biases on q/k/v_proj,
    Qwen2), ``qk_norm`` (RMSNorm over head_dim on queries and keys before the rotary embedding, Qwen3),
    ``rope_scaling`` (Llama 3.1's frequency scaling, or None), ``sliding_window`` (each query sees at most
    this many positions, itself included, Mistral; None: all).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): the routed experts of the MoE layers
    # (nybble.models.definitions.moe.MoEConfig), and which layers have them (None: every layer); the others
    # keep
    # the dense SwiGLU of intermediate_size.
    moe: Any = None
    moe_layers: tuple[int, ...] | None = None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the MoE block."""
        return self.moe is not None and (self.moe_layers is None or layer in self.moe_layers)

    def __post_init__(self) -> None:
        if self.moe is not None and self.moe.hidden_size != self.hidden_size:
            raise ValueError(f"moe.hidden_size ({self.moe.hidden_size}) != hidden_size ({self.hidden_size})")
        if self.moe_layers is not None:
            object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window ({self.sliding_window}) must be positive or None")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )


class KVCache(NamedTuple):
    """Keys and values of past positions, one array per layer, each (batch, kv_heads, max_len, head_dim).

    Keys are stored after the rotary embedding. A plain pytree: entries at or past the current position
    hold stale or zero values and are masked out by position, never read.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        """Positions the cache holds."""
        return int(self.k[0].shape[2])

    @property
    def batch(self) -> int:
        return int(self.k[0].shape[0])


class RMSNorm(nnx.Module):
    """``x / rms(x) * weight``, computed in float32, returned in ``x.dtype``."""

    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype: Any = jnp.float32) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        with jax.named_scope("norm"):  # scopes name the op families of a compiled step (bench.decode)
            xf = x.astype(jnp.float32)
            xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
            return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)

    def deferred_sum(self, x: jax.Array) -> tuple[jax.Array, DeferredNorm]:
        """``(x * weight, DeferredNorm)``: :meth:`deferred` with the scale not yet computed, for a consumer
        that computes it itself (the Triton decode attention kernel: the scale's rsqrt, a launch of its own
        after the reduction otherwise, since XLA fuses no elementwise op into a reduction's result)."""
        norm = self.deferred_given(x)
        with jax.named_scope("norm"):
            h = (x.astype(jnp.float32) * self.weight[...].astype(jnp.float32)).astype(x.dtype)
        return h, norm

    def deferred_given(self, x: jax.Array) -> DeferredNorm:
        """:meth:`deferred_sum`'s scale of x whose product ``x * weight`` was computed elsewhere (the
        previous layer's down projection, ``MLP.chained``): XLA computes the sum of squares only where a
        consumer reads it (the Triton attention kernel sums ``rows`` itself)."""
        with jax.named_scope("norm"):
            xf = x.astype(jnp.float32)
            return DeferredNorm(jnp.sum(xf * xf, axis=-1, keepdims=True), x.shape[-1], self.eps, x)

    def deferred(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(x * weight, 1 / rms(x))``: the norm with its per-row scale left for after a bias-free
        projection, ``norm(x) @ W == (x * weight) @ W * scale`` (the scale is one number per row, so it
        commutes with the matmul; the weight multiplies K and would not, folded into int4 weights). The
        product is computed with the sum of squares in one pass, so no launch applies the norm.
        ``scale`` is float32 (..., 1)."""
        h, norm = self.deferred_sum(x)
        return h, norm.scale()


def norm_heads_together(
    q_norm: RMSNorm, k_norm: RMSNorm, q: jax.Array, k: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(q_norm(q), k_norm(k))`` for q (b, t, heads, d) and k (b, t, kv_heads, d) with the sums of squares
    of every head of both in one reduction: one launch of a decode step where two norms were two. Each
    head's mean is over its own d values, and gets its own norm's eps, as each norm computes it."""
    with jax.named_scope("norm"):
        heads, kv_heads = q.shape[2], k.shape[2]
        both = jnp.concatenate([q.astype(jnp.float32), k.astype(jnp.float32)], axis=2)
        eps = np.asarray([q_norm.eps] * heads + [k_norm.eps] * kv_heads, np.float32)[:, None]
        inv = jax.lax.rsqrt(jnp.mean(both * both, axis=-1, keepdims=True) + eps)
        # The heads are normalized where they are read (the query's rotary fusion, the key's cache write):
        # normalized by the reduction itself, the key's rotary halves became two launches of their own.
        qn = q.astype(jnp.float32) * inv[:, :, :heads] * q_norm.weight[...].astype(jnp.float32)
        kn = k.astype(jnp.float32) * inv[:, :, heads:] * k_norm.weight[...].astype(jnp.float32)
        return qn.astype(q.dtype), kn.astype(k.dtype)


@functools.lru_cache(maxsize=64)
def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The (head_dim / 2,) float32 inverse frequencies, computed once per configuration (in float64).

    With ``scaling``, Llama 3.1's rule (transformers' ``_compute_llama3_parameters``).
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None:
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        span = scaling.high_freq_factor - scaling.low_freq_factor
        smooth = (old / wavelen - scaling.low_freq_factor) / span
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    out = inv_freq.astype(np.float32)
    out.setflags(write=False)  # shared by the cache
    return out


def rope(
    x: jax.Array, positions: jax.Array, theta: float = 10000.0, *, inv_freq: np.ndarray | None = None
) -> jax.Array:
    """Rotary position embedding, "rotate half" convention; x: (batch, length, heads, head_dim).

    ``inv_freq`` (head_dim / 2,) overrides the plain frequencies of ``theta`` (see
    :func:`rope_frequencies`).
    """
    half = x.shape[-1] // 2
    if inv_freq is None:
        inv_freq = rope_frequencies(x.shape[-1], float(theta))
    if inv_freq.shape != (half,):
        raise ValueError(f"rope: inv_freq shape {inv_freq.shape} != ({half},) for head_dim {x.shape[-1]}")
    with jax.named_scope("rope"):
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # (batch, length, half)
        cos = jnp.cos(angles)[:, :, None, :]
        sin = jnp.sin(angles)[:, :, None, :]
        xf = x.astype(jnp.float32)
        x1, x2 = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return out.astype(x.dtype)


def _linear(din: int, dout: int, rngs: nnx.Rngs, dtype: Any, *, bias: bool = False) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=bias, param_dtype=dtype, dtype=dtype, rngs=rngs)


def _window_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """(t, s) True where query position ``q_pos[i]`` may see key position ``k_pos[j]``: causal, and
    within ``window`` positions (itself included) when given."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if window is not None:
        mask = mask & (diff < window)
    return mask


class Attention(FusedParts, nnx.Module):
    """Grouped-query causal self-attention with rotary embeddings."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32) -> None:
        hd = cfg.head_dim
        assert hd is not None
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling
        self.sliding_window = cfg.sliding_window
        self.decode_attention = "xla"  # a decode step's attention: "xla" | "triton" (set_decode_attention)
        self.q_proj = _linear(cfg.hidden_size, cfg.num_heads * hd, rngs, dtype, bias=cfg.qkv_bias)
        self.k_proj = _linear(cfg.hidden_size, cfg.num_kv_heads * hd, rngs, dtype, bias=cfg.qkv_bias)
        self.v_proj = _linear(cfg.hidden_size, cfg.num_kv_heads * hd, rngs, dtype, bias=cfg.qkv_bias)
        self.o_proj = _linear(cfg.num_heads * hd, cfg.hidden_size, rngs, dtype)
        # Qwen3: RMSNorm over each head's head_dim features, before the rotary embedding.
        self.q_norm = RMSNorm(hd, eps=cfg.rms_eps, param_dtype=dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, eps=cfg.rms_eps, param_dtype=dtype) if cfg.qk_norm else None

    def _qkv(
        self, x: jax.Array, positions: jax.Array, row_scale: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        b, t, _ = x.shape
        q, k, v = projections(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"), x)
        if row_scale is not None:  # RMSNorm.deferred's scale, after the (bias-free) projections
            q, k, v = (scaled(y, row_scale) for y in (q, k, v))
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = norm_heads_together(self.q_norm, self.k_norm, q, k)
        inv_freq = rope_frequencies(self.head_dim, float(self.rope_theta), self.rope_scaling)
        return rope(q, positions, inv_freq=inv_freq), rope(k, positions, inv_freq=inv_freq), v

    def _attend(self, x: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        """Softmax attention of q (b, t, heads, d) over k, v (b, s, kv_heads, d); mask (t, s) is True where
        a query may see a key. Returns the output projection (b, t, hidden) in ``x.dtype``."""
        b, t = q.shape[:2]
        groups = self.num_heads // self.num_kv_heads
        with jax.named_scope("attention"):
            q = q.reshape(b, t, self.num_kv_heads, groups, self.head_dim)
            scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32)
            scores = scores * (self.head_dim**-0.5)
            scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
            probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
            out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v, preferred_element_type=jnp.float32)
            out = out.reshape(b, t, self.num_heads * self.head_dim).astype(x.dtype)
        return self.o_proj(out)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        t = x.shape[1]
        q, k, v = self._qkv(x, positions)
        pos = jnp.arange(t)
        return self._attend(x, q, k, v, _window_mask(pos, pos, self.sliding_window))

    def cached(
        self,
        x: jax.Array,
        position: jax.Array | int,
        k_cache: jax.Array,
        v_cache: jax.Array,
        row_scale: DeferredNorm | None = None,
        counters_from: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention of x (b, t, hidden) at positions ``position .. position + t - 1`` over the cache.

        Writes this chunk's keys and values into ``k_cache``/``v_cache`` (b, kv_heads, max_len, d) at
        ``position`` and attends causally to every cached position up to each query's own.
        Returns ``(output, k_cache, v_cache)``. ``row_scale``: the input norm's deferred scale
        (``RMSNorm.deferred_sum``), applied to q, k and v. ``counters_from``: an array of x's batch that an
        XLA launch writes (the Triton kernel's split counters are zeros of its shape, written in that
        launch: no launch of their own), or those zeros (``split_counters``); None: x.

        The cache is read once. One token (a decode step): written at ``position`` first, in place, then
        attended as one sequence (``decode_attention``: a few fused reductions, no GEMM). A chunk (a
        prefill): read before it is written, scores over the cached positions below ``position`` and over
        the chunk's own keys, one softmax over both, then the cache update in place (a donated cache is
        never copied).
        """
        b, t, _ = x.shape
        position = jnp.asarray(position, jnp.int32)
        if t == 1 and self.decode_attention == "triton":
            counters_from = x if counters_from is None else counters_from
            return self._decode_on_kernel(x, position, k_cache, v_cache, row_scale, counters_from)
        positions = jnp.broadcast_to(position + jnp.arange(t, dtype=jnp.int32), (b, t))
        q, k, v = self._qkv(x, positions, None if row_scale is None else row_scale.scale())
        if t == 1:  # a decode step: written first, then one read of the cache (decode_attention)
            with jax.named_scope("attention"):
                k_new, v_new = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
                out, k_cache, v_cache = write_and_attend(
                    q, k_new, v_new, k_cache, v_cache, position, self.sliding_window
                )
            return self.o_proj(out.astype(x.dtype)), k_cache, v_cache
        with jax.named_scope("attention"):
            # the chunk's keys and values as the cache holds them
            k_new = k.transpose(0, 2, 1, 3).astype(k_cache.dtype)  # (b, kv_heads, t, d), the cache's layout
            v_new = v.transpose(0, 2, 1, 3).astype(v_cache.dtype)
            q_pos, past = positions[0], jnp.arange(k_cache.shape[2])
            past_mask = _window_mask(q_pos, past, self.sliding_window) & (past < position)[None, :]
            new_mask = _window_mask(q_pos, q_pos, self.sliding_window)
            out = self._attend_split(q, (k_cache, k_new), (v_cache, v_new), (past_mask, new_mask), x.dtype)
            start = (jnp.int32(0), jnp.int32(0), position, jnp.int32(0))
            k_cache = jax.lax.dynamic_update_slice(k_cache, k_new, start)
            v_cache = jax.lax.dynamic_update_slice(v_cache, v_new, start)
        return self.o_proj(out), k_cache, v_cache

    def _decode_on_kernel(
        self,
        x: jax.Array,
        position: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        row_scale: DeferredNorm | None,
        counters_from: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """A decode step's attention on the Triton kernel (``set_decode_attention``): the projections' output
        as one array (the fused layer's own: XLA folds the concatenation of its slices away), then the row
        scale, q/k norms, rotary embedding, cache write and attention in the kernel."""
        qkv = jnp.concatenate(projections(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"), x), axis=-1)
        norms = None
        if self.q_norm is not None and self.k_norm is not None:
            norms = (self.q_norm.weight[...], self.k_norm.weight[...], self.q_norm.eps, self.k_norm.eps)
        with jax.named_scope("attention"):
            out, k_cache, v_cache = write_and_attend_on_kernel(
                qkv, k_cache, v_cache, position,
                heads=self.num_heads, window=self.sliding_window,
                inv_freq=rope_frequencies(self.head_dim, float(self.rope_theta), self.rope_scaling),
                row_norm=row_scale, norms=norms, counters_from=counters_from,
            )  # fmt: skip
        return self.o_proj(out), k_cache, v_cache

    def _attend_split(
        self,
        q: jax.Array,
        keys: tuple[jax.Array, ...],
        values: tuple[jax.Array, ...],
        masks: tuple[jax.Array, ...],
        dtype: Any,
    ) -> jax.Array:
        """Softmax attention of q (b, t, heads, d) over key/value blocks (b, kv_heads, s_i, d) as one
        sequence (one softmax over all blocks' scores), without concatenating them; (b, t, heads * d)."""
        b, t = q.shape[:2]
        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(b, t, self.num_kv_heads, groups, self.head_dim)
        scale = self.head_dim**-0.5
        scores = [
            jnp.where(
                mask,
                jnp.einsum("bqhgd,bhkd->bhgqk", q, k.astype(q.dtype), preferred_element_type=jnp.float32)
                * scale,
                jnp.finfo(jnp.float32).min,
            )
            for k, mask in zip(keys, masks, strict=True)
        ]
        top = jnp.max(jnp.stack([jnp.max(s, axis=-1) for s in scores]), axis=0)[..., None]
        exps = [jnp.exp(s - top) for s in scores]
        total = sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
        # (b, h, g, q, d), transposed after: jax 0.11.2's XLA:CPU runs no bf16 x bf16 = f32 dot whose result
        # puts q before the batch dims ("Unsupported element type for DotThunk"), eager bf16 prefills failed
        out = sum(
            jnp.einsum(
                "bhgqk,bhkd->bhgqd",
                (e / total).astype(q.dtype),
                v.astype(q.dtype),
                preferred_element_type=jnp.float32,
            )
            for e, v in zip(exps, values, strict=True)
        )
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, self.num_heads * self.head_dim).astype(dtype)


class MLP(FusedParts, nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32) -> None:
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, rngs, dtype)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, rngs, dtype)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, rngs, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.scaled(x, None)

    def scaled(self, x: jax.Array, row_scale: jax.Array | DeferredNorm | None) -> jax.Array:
        """The MLP of ``x`` whose rows still need ``row_scale``: a scale (``RMSNorm.deferred``), a
        :class:`DeferredNorm` (``RMSNorm.deferred_sum``), or None.

        Gate and up fused with their columns interleaved (int4: ``FusedGateUp``) take the norm and the SiLU
        product into their own op, ``nybble.kernels.swiglu_matmul``: one launch of the Hopper kernel at
        decode sizes, where the product was a launch of XLA's of its own."""
        fused = vars(self).get("gate_up_proj")
        if isinstance(fused, FusedGateUp) and not isinstance(row_scale, jax.Array):
            return self.down_proj(fused.swiglu(x, row_scale))
        if isinstance(row_scale, DeferredNorm):
            row_scale = row_scale.scale()
        gate, up = projections(self, "gate_up_proj", ("gate_proj", "up_proj"), x)
        if row_scale is not None:
            gate, up = scaled(gate, row_scale), scaled(up, row_scale)
        return self.down_proj(jax.nn.silu(gate) * up)


    def chained(
        self, x: jax.Array, row_scale: DeferredNorm | None, residual: jax.Array, next_norm: RMSNorm
    ) -> tuple[jax.Array, jax.Array] | None:
        """``(residual + mlp(x), that * next_norm.weight)`` where the down projection's kernel adds the
        residual and takes the next layer's norm product in its epilogue (``nybble.kernels.residual_matmul``:
        one launch of the Hopper kernel at decode sizes, where XLA launched the add and the product);
        None where it would not (a float or biased down projection, a backend without the epilogue), and
        the caller adds the residual itself."""
        fused, down = vars(self).get("gate_up_proj"), self.down_proj
        if not isinstance(fused, FusedGateUp) or isinstance(row_scale, jax.Array):
            return None
        if not isinstance(down, QLinear) or down.bias is not None or down.input_perm is not None:
            return None
        weight, implementation = down.weight, down.implementation
        a_shape = jax.ShapeDtypeStruct((*x.shape[:-1], weight.shape[0]), x.dtype)
        if residual.dtype != x.dtype or not residual_fuses(a_shape, weight, implementation=implementation):
            return None
        a = fused.swiglu(x, row_scale)
        return residual_matmul(a, weight, residual, next_norm.weight[...], implementation=implementation)


def scaled(y: jax.Array, row_scale: jax.Array) -> jax.Array:
    """``y * row_scale`` in float32, rounded to y's dtype (fused by XLA into y's consumers)."""
    return (y.astype(jnp.float32) * row_scale).astype(y.dtype)


def _bias_free(module: nnx.Module, fused: str, names: tuple[str, ...]) -> bool:
    """Whether ``module``'s projections ``names`` (or their fusion ``fused``) add no bias: a deferred norm
    scale must multiply before a bias is added."""
    layer = getattr(module, fused, None)
    parts = [getattr(layer, "inner", None)] if layer is not None else [getattr(module, n) for n in names]
    return all(p is not None and getattr(p, "bias", None) is None for p in parts)


class Chained(NamedTuple):
    """A layer's input-norm product computed by the layer before (``Block.cached_chain``): ``product`` = x *
    input_norm.weight, from the down projection's epilogue, and ``counters``, int32 zeros of x's shape that
    an XLA launch of that layer writes (with its residual stream past attention): the Triton attention
    kernel's split counters, which would take a launch of their own beside a kernel's output."""

    product: jax.Array
    counters: jax.Array


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32, layer: int = 0) -> None:
        self.input_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_eps, param_dtype=dtype)
        self.attn = Attention(cfg, rngs=rngs, dtype=dtype)
        self.post_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_eps, param_dtype=dtype)
        if cfg.is_moe_layer(layer):  # nybble.models.definitions.moe: router, experts (and shared experts)
            self.mlp: Any = MoE(cfg.moe, rngs=rngs, dtype=dtype)
        else:
            self.mlp = MLP(cfg, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.attn(self.input_norm(x), positions)
        return x + self.mlp(self.post_norm(x))

    def cached(
        self, x: jax.Array, position: jax.Array | int, k_cache: jax.Array, v_cache: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The block on a chunk at ``position`` with this layer's KV cache (see ``Attention.cached``).

        One token (a decode step): each norm's per-row scale is deferred past the bias-free projections
        that read it (``RMSNorm.deferred``), which saves the launch that would apply it."""
        return self.cached_chain(x, position, k_cache, v_cache)[:3]

    def defers_input_norm(self, x: jax.Array) -> bool:
        """Whether a decode step's input norm is deferred past q/k/v (one token, bias-free projections):
        then the previous layer may hand over its product (:meth:`cached_chain`'s ``normed``)."""
        return x.shape[1] == 1 and _bias_free(self.attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def cached_chain(
        self,
        x: jax.Array,
        position: jax.Array | int,
        k_cache: jax.Array,
        v_cache: jax.Array,
        *,
        normed: Chained | None = None,
        next_norm: RMSNorm | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array, Chained | None]:
        """:meth:`cached`, chained to its neighbours in a decode step: ``normed`` is this layer's input-norm
        product ``x * input_norm.weight`` if the previous layer computed it (:class:`Chained`), and with
        ``next_norm`` (the next layer's input norm) the down projection's kernel may compute the next one
        (``MLP.chained``); returns ``(x, k_cache, v_cache, the next layer's Chained or None)``."""
        if self.defers_input_norm(x):
            if normed is None:
                h, r = self.input_norm.deferred_sum(x)
                a, k_cache, v_cache = self.attn.cached(h, position, k_cache, v_cache, row_scale=r)
            else:
                r = self.input_norm.deferred_given(x)
                a, k_cache, v_cache = self.attn.cached(
                    normed.product, position, k_cache, v_cache, row_scale=r, counters_from=normed.counters
                )
        else:
            a, k_cache, v_cache = self.attn.cached(self.input_norm(x), position, k_cache, v_cache)
        parts = (x, a)  # MoE.normed's routing kernel adds them itself: XLA never writes their sum
        x = x + a
        if (
            x.shape[1] == 1
            and isinstance(self.mlp, MLP)
            and _bias_free(self.mlp, "gate_up_proj", ("gate_proj", "up_proj"))
        ):
            h, norm = self.post_norm.deferred_sum(x)
            if next_norm is not None and (chained := self.mlp.chained(h, norm, x, next_norm)) is not None:
                # x (the residual stream past attention) is written by XLA's add launch: see Chained
                return chained[0], k_cache, v_cache, Chained(chained[1], split_counters(x))
            return x + self.mlp.scaled(h, norm), k_cache, v_cache, None
        # MoE: up to NORMED_MAX_TOKENS tokens the router's product is a reduction that takes the norm's sum
        # of squares in its launch (MoE.normed); past them XLA's GEMM, which wants the normalized rows
        if (
            x.shape[1] == 1
            and x.shape[0] <= NORMED_MAX_TOKENS
            and isinstance(self.mlp, MoE)
            and self.mlp.defers_norm
        ):
            return x + self.mlp.normed(x, self.post_norm, parts), k_cache, v_cache, None
        return x + self.mlp(self.post_norm(x)), k_cache, v_cache, None


class Llama(nnx.Module):
    """A decoder-only Llama; ``model(token_ids)`` -> float32 logits (batch, length, vocab)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32) -> None:
        self.config = cfg
        self.dtype = dtype
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs, dtype=dtype, layer=i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_eps, param_dtype=dtype)
        self.lm_head = None if cfg.tie_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, rngs, dtype)

    def _embed(self, token_ids: jax.Array) -> jax.Array:
        with jax.named_scope("embedding"):
            return self.embed(token_ids).astype(self.dtype)

    def hidden_states(self, token_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """The final normalized hidden states (batch, length, hidden) in the model dtype."""
        token_ids = jnp.asarray(token_ids)
        if token_ids.ndim == 1:
            token_ids = token_ids[None]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(token_ids.shape[1]), token_ids.shape)
        x = self._embed(token_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """LM head (tied: the embedding transposed) on hidden states, float32 logits."""
        with jax.named_scope("lm_head"):
            if self.lm_head is None:
                emb = self.embed.embedding[...]
                return jnp.einsum(
                    "...d,vd->...v", hidden, emb.astype(hidden.dtype), preferred_element_type=jnp.float32
                )
            return self.lm_head(hidden).astype(jnp.float32)

    def __call__(self, token_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Token ids (batch, length) (or (length,)) -> logits (batch, length, vocab), float32."""
        return self.logits(self.hidden_states(token_ids, positions))

    # ------------------------------------------------------------------------------------- KV cache

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> KVCache:
        """A zero cache for ``batch`` sequences of up to ``max_len`` positions (dtype: the model's)."""
        cfg = self.config
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        dtype = self.dtype if dtype is None else dtype

        def zeros() -> tuple[jax.Array, ...]:
            return tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))

        return KVCache(k=zeros(), v=zeros())

    def hidden_states_cached(
        self, token_ids: jax.Array, cache: KVCache, position: jax.Array | int
    ) -> tuple[jax.Array, KVCache]:
        """Final normalized hidden states (batch, t, hidden) of ``token_ids`` (batch, t) placed at positions
        ``position .. position + t - 1`` (a scalar, the same for every row), attending to the cache;
        returns them with the cache updated at those positions."""
        token_ids = jnp.asarray(token_ids)
        if token_ids.ndim == 1:
            token_ids = token_ids[None]
        if token_ids.shape[0] != cache.batch:
            raise ValueError(f"token batch {token_ids.shape[0]} != cache batch {cache.batch}")
        x = self._embed(token_ids)
        ks, vs = [], []
        normed = None  # a layer's input-norm product, when the layer before computed it (Block.cached_chain)
        layers = list(self.layers)
        for i, (layer, k_cache, v_cache) in enumerate(zip(layers, cache.k, cache.v, strict=True)):
            following = layers[i + 1] if i + 1 < len(layers) else None
            next_norm = following.input_norm if following and following.defers_input_norm(x) else None
            with jax.named_scope(f"layer_{i}"):  # bench.decode repeats a middle layer's launches by it
                x, k_cache, v_cache, normed = layer.cached_chain(
                    x, position, k_cache, v_cache, normed=normed, next_norm=next_norm
                )
            ks.append(k_cache)
            vs.append(v_cache)
        return self.norm(x), KVCache(k=tuple(ks), v=tuple(vs))

    def prefill(
        self, token_ids: jax.Array, cache: KVCache | None = None, *, max_len: int | None = None
    ) -> tuple[jax.Array, KVCache]:
        """Runs a prompt (batch, length) from position 0 into a cache; returns float32 logits
        (batch, length, vocab) (as ``model(token_ids)``) and the cache. Without ``cache`` a new one of
        ``max_len`` positions (default: the prompt length) is made."""
        token_ids = jnp.asarray(token_ids)
        if token_ids.ndim == 1:
            token_ids = token_ids[None]
        if cache is None:
            cache = self.init_cache(token_ids.shape[0], max_len or token_ids.shape[1])
        if token_ids.shape[1] > cache.max_len:
            raise ValueError(f"prompt length {token_ids.shape[1]} > cache length {cache.max_len}")
        hidden, cache = self.hidden_states_cached(token_ids, cache, 0)
        return self.logits(hidden), cache

    def decode_step(
        self, token_ids: jax.Array, cache: KVCache, position: jax.Array | int
    ) -> tuple[jax.Array, KVCache]:
        """One new token per row, ``token_ids`` (batch, 1) (or (batch,)), at ``position`` (scalar, may be
        traced); returns float32 logits (batch, 1, vocab) and the updated cache. ``position`` must be
        below ``cache.max_len`` (not checked under jit: an overflowing write is clamped by XLA)."""
        token_ids = jnp.asarray(token_ids)
        if token_ids.ndim == 1:
            token_ids = token_ids[:, None]
        hidden, cache = self.hidden_states_cached(token_ids, cache, position)
        return self.logits(hidden), cache


def set_decode_attention(model: nnx.Module, implementation: str) -> nnx.Module:
    """Every attention layer of ``model`` attends a decode step's token with ``implementation``: "xla"
    (the default: XLA's fused reductions) or "triton" (nybble's one-launch Pallas-on-Triton kernel, see
    ``nybble.models.definitions.decode_attention``). In place; returns the model. Prefill is unchanged."""
    check_decode_attention(implementation)
    layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, Attention)]
    if not layers:
        raise ValueError(f"set_decode_attention: {type(model).__name__} has no nybble Attention layer")
    for layer in layers:
        layer.decode_attention = implementation
    return model


__all__ = [
    "MLP",
    "Attention",
    "Block",
    "DeferredNorm",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "RopeScaling",
    "rope",
    "rope_frequencies",
    "set_decode_attention",
]
