"""A mixture-of-experts SwiGLU block in Flax NNX: Mixtral, Qwen3-MoE, shared experts (Qwen2-MoE, DeepSeek).

    moe = MoE(MoEConfig(hidden_size=64, intermediate_size=32, num_experts=4, top_k=2), rngs=nnx.Rngs(0))
    y = moe(x)                                     # x (..., hidden) -> (..., hidden)
    nybble.models.quantize(moe)                    # expert stacks -> stacked int4 (QExperts), in place

Module paths (what ``QuantRule`` and ``ShardRule`` patterns see): ``router`` (a float :class:`Router`,
``weight`` (experts, hidden) as Hugging Face stores it; never quantized), ``experts.{gate,up,down}_proj``
(:class:`Experts` stacks, (experts, in, out) float kernels; :class:`QExperts` once quantized), and when
configured ``shared_expert.{gate,up,down}_proj`` (plain ``nnx.Linear`` s) and ``shared_expert_gate`` (hidden,
1).

The forward pass, dropless and with static shapes under ``jit``: the router's logits in float32, softmax over
the experts, the top k per token (renormalized to sum 1 when ``norm_topk_prob``: Mixtral always, Qwen3-MoE per
its config), the T * k (token, expert) pairs sorted by expert (a stable sort, so each expert's rows keep token
order), ``ragged_matmul`` (int4) or, for float stacks, ``lax.ragged_dot`` (a decode step's few rows: each
row's own expert gathered, or a window of rows an expert, :func:`windowed_experts`) for gate/up and for down,
then the rows put back in token order and summed with their router weights (a decode step's one token,
``MoE.normed`` and ``MoE.deferred``: routed without a sort, :func:`route_ranked`). Shared experts are added to
every token, scaled by ``sigmoid(shared_expert_gate(x))`` when that gate exists (Qwen2-MoE).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nybble.kernels.backends import Implementation
from nybble.kernels.triton import backend as triton_backend
from nybble.kernels.triton import moe_routing as routing_kernel
from nybble.kernels.triton import moe_routing_tokens as tokens_routing_kernel
from nybble.models.definitions.decode_attention import no_gpu_target
from nybble.models.definitions.fuse import FusedExpertsGateUp, FusedParts
from nybble.models.definitions.layers import QuantizedParam, projections
from nybble.ops import ragged_matmul
from nybble.quant.qformat import QuantFormat
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.rtn import quantize
from nybble.quant.stacked import check_stacked
from nybble.sharding.experts import ExpertShardedWeight


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sizes and routing of one MoE block.

    Attributes:
      hidden_size: the model width (each expert's input and output).
      intermediate_size: each routed expert's SwiGLU width (``moe_intermediate_size`` in Qwen configs).
      num_experts: routed experts.
      top_k: experts per token (``num_experts_per_tok``).
      norm_topk_prob: renormalize the top-k router probabilities to sum 1 (Mixtral: True).
      shared_intermediate_size: width of the shared expert added to every token (None: none).
      shared_expert_gate: scale the shared expert by ``sigmoid(x @ w_gate)`` (Qwen2-MoE).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"MoEConfig: top_k = {self.top_k} must be in [1, num_experts = {self.num_experts}]"
            )
        if self.shared_expert_gate and self.shared_intermediate_size is None:
            raise ValueError("MoEConfig: shared_expert_gate needs a shared expert (shared_intermediate_size)")


def route(logits: jax.Array, top_k: int, *, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Router weights (T, k) float32 and experts (T, k) int32 from logits (T, E): softmax, then top k.

    Softmax over all experts in float32, then the k largest probabilities (ties: the lower expert index),
    renormalized to sum 1 when ``norm_topk_prob``: the weights are ``scores / totals`` of
    :func:`route_scores`.
    """
    scores, totals, experts = route_scores(logits, top_k, norm_topk_prob=norm_topk_prob)
    return scores / totals, experts


def route_scores(
    logits: jax.Array, top_k: int, *, norm_topk_prob: bool, logit_scale: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`route`'s weights unnormalized: scores (T, k) and totals (T, 1) float32 (weights = scores /
    totals), experts (T, k) int32. Renormalized, the weights are the softmax of the k largest logits (the
    softmax is increasing, and its normalizer cancels): scores exp(top - top[0]) (the first of the top k is
    the largest), totals their sum; the full softmax would be a launch of its own in a decode step, and so
    would the k scores' softmax, where the MoE block divides its weighted sum by the totals instead (one
    fusion). Otherwise the top k of the softmax, totals 1. The same experts (up to ties the float32
    softmax rounds together) and weights up to float32 rounding. ``logit_scale`` (T, 1) > 0, renormalized
    only: the logits times it, applied after the top k, which it does not reorder (``MoE.deferred``).
    """
    logits = logits.astype(jnp.float32)
    if norm_topk_prob:
        top, experts = jax.lax.top_k(logits, top_k)
        diff = top - top[..., :1]
        scores = jnp.exp(diff if logit_scale is None else diff * logit_scale)
        # k terms summed as adds: XLA fuses them into the consumer, where a reduction is a launch of its own
        totals = functools.reduce(operator.add, [scores[..., i : i + 1] for i in range(top_k)])
        return scores, totals, experts.astype(jnp.int32)
    if logit_scale is not None:
        raise ValueError("route_scores: logit_scale needs norm_topk_prob=True (a softmax over all logits)")
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    return weights, jnp.ones_like(weights[..., :1]), experts.astype(jnp.int32)


class RankedRoutes(NamedTuple):
    """One token's routing by ranks (:func:`route_ranked`), each field (E,): ``group_sizes`` int32 (1 for
    the k chosen experts, else 0), ``slots`` int32 (a chosen expert's row among the k, the rows in expert
    order), ``scores`` float32 (a chosen expert's weight times ``totals``, 0 for the others) and ``totals``
    float32 (the chosen scores' sum, in every entry)."""

    group_sizes: jax.Array
    slots: jax.Array
    scores: jax.Array
    totals: jax.Array


def route_ranked(logits: jax.Array, top_k: int, logit_scale: jax.Array | float = 1.0) -> RankedRoutes:
    """:func:`route_scores` (renormalized) of one token's float32 logits (E,) without a sort: expert e is
    chosen when fewer than k experts rank above it, in the order ``lax.top_k`` sorts by (IEEE total order:
    +0 above -0, NaN above +inf; equal bits: the lower index first), so the same k experts, always k. Its
    score exp((l_e - max l) x scale) is :func:`route_scores`' for the same expert. In XLA this is two
    launches of reductions over the experts, each output (E,): the ranks and the largest logit, then the
    group sizes, slots, scores and total (where top_k's sort is two launches, and sorting its k experts by
    expert a third). ``logit_scale`` > 0 multiplies the logits after the choice (``MoE.deferred``)."""
    e = logits.shape[0]
    logits = logits.astype(jnp.float32)
    # the float's bits as an int32 in the floats' total order (XLA's top_k comparator): negative floats'
    # magnitude bits flipped, so more negative is lower and -0 (all ones) sits just below +0
    bits = jax.lax.bitcast_convert_type(logits, jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    ids = jnp.arange(e, dtype=jnp.int32)
    lower_id = ids[None, :] < ids[:, None]  # (e, j): j < e
    above = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & lower_id)
    ranks = jnp.sum(above, axis=1, dtype=jnp.int32)
    # The largest logit once per expert, (E,) like the ranks, so one launch with them: max(l_j, l_e) over
    # j. (A max over j broadcast to (E,) is a reduction of another shape: a launch of its own.)
    top = jnp.max(jnp.maximum(logits[None, :], logits[:, None]), axis=1)
    chosen = ranks < top_k
    exp = jnp.exp((logits - top) * logit_scale)
    # Every sum below is over j for each e, so all four are one launch. The total and the chosen scores
    # take e where its value is the same for every e (ranks >= 0, the diagonal): a sum XLA could see as one
    # number would be a reduction of another shape, a launch of its own.
    slots = jnp.sum(lower_id & chosen[None, :], axis=1, dtype=jnp.int32)
    diagonal = ids[None, :] == ids[:, None]
    group_sizes = jnp.sum(diagonal & chosen[None, :], axis=1, dtype=jnp.int32)
    totals = jnp.sum(jnp.where(chosen[None, :] & (ranks[:, None] >= 0), exp[None, :], 0.0), axis=1)
    scores = jnp.sum(jnp.where(diagonal & chosen[None, :], exp[None, :], 0.0), axis=1)
    return RankedRoutes(group_sizes, slots, scores, totals)


class Router(nnx.Module):
    """The MoE router: ``router(x)`` = x @ weight^T, the logits (..., experts) in x's dtype (accumulated in
    float32, as ``nnx.Linear`` computes them); ``weight`` (experts, hidden), float, never quantized.

    The weight is (experts, hidden), Hugging Face's layout, not ``nnx.Linear``'s (hidden, experts): a decode
    step's one-token product this small is a multiply and a reduction over hidden in XLA:GPU, one launch
    where hidden is the minor axis (a row reduction), two over (hidden, experts), the products written and
    read back (3x the weight's bytes; Qwen3-30B-A3B on an H200, jax 0.11.2 and 0.12).
    """

    def __init__(self, hidden: int, num_experts: int, *, rngs: nnx.Rngs, dtype: Any = jnp.float32) -> None:
        init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)
        self.weight = nnx.Param(init(rngs.params(), (num_experts, hidden), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.logits(x).astype(x.dtype)

    def logits(self, x: jax.Array) -> jax.Array:
        """The logits in float32, unrounded."""
        return jnp.einsum(
            "...h,eh->...e", x, self.weight[...].astype(x.dtype), preferred_element_type=jnp.float32
        )


# Up to this many (token, expert) pairs (decode: 64 tokens of a top-8 model), sort_by_expert ranks them by
# comparing every pair with every other: a few reductions XLA fuses, where argsort, the inverse's scatter and
# bincount's scatter-add are launches of their own (Qwen3-30B-A3B's decode step on an H200: 5 launches
# fewer a layer at batch 1, 3 at batch 64; the (pairs, pairs) comparisons are 0.26M at 512).
COMPARE_SORT_PAIRS = 512


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For (T, k) expert choices: ``order`` (T*k,) (the pairs sorted by expert, stably), ``inverse`` (its
    inverse permutation) and ``group_sizes`` (E,) int32."""
    flat = experts.reshape(-1)
    pairs = flat.shape[0]
    if pairs <= COMPARE_SORT_PAIRS:
        pos = jnp.arange(pairs, dtype=jnp.int32)
        lower, same = flat[None, :] < flat[:, None], flat[None, :] == flat[:, None]
        # pair i's place: the pairs of a lower expert, and of the same expert earlier in token order (stable)
        before = lower | (same & (pos[None, :] < pos[:, None]))  # (pairs, pairs)
        experts_ids = jnp.arange(num_experts, dtype=flat.dtype)
        members = flat[None, :] == experts_ids[:, None]  # (E, pairs)
        if pairs < num_experts:
            # Sibling sums of one shape are one launch in XLA, of two shapes two. (Not one sum over both
            # stacked: the group sizes would be a slice of it, which XLA wraps, with the grouped kernel that
            # reads them, into a fusion of its own.)
            before = jnp.pad(before, ((0, num_experts - pairs), (0, 0)))
        inverse = jnp.sum(before, axis=1, dtype=jnp.int32)[:pairs]
        group_sizes = jnp.sum(members, axis=1, dtype=jnp.int32)
        order = jnp.sum(jnp.where(inverse[None, :] == pos[:, None], pos[None, :], 0), axis=1, dtype=jnp.int32)
        return order, inverse, group_sizes
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, inverse, group_sizes


# Up to this many tokens a decode step's MoE block runs MoE.normed: the router's product a reduction over
# hidden (reading its weight once a token, from L2 past the first), the norm's sum of squares beside it in
# one launch. Past it XLA's GEMM after the norm launches less. Qwen3-30B-A3B's step on an H200 (jax 0.12,
# 2026-12-07): 1 launch a layer fewer at 2, 8 and 16 tokens, 2 at 32, 1 more at 64.
NORMED_MAX_TOKENS = 32


class Experts(nnx.Module):
    """A stack of float linears, one per expert: ``kernel`` (experts, in, out); multiplies sorted rows."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
    ) -> None:
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.kernel = nnx.Param(init(rngs.params(), (num_experts, in_features, out_features), dtype))
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features

    def __call__(self, x: jax.Array, group_sizes: jax.Array, max_group: int | None = None) -> jax.Array:
        """x (rows, in) sorted by expert -> (rows, out) in x's dtype, f32 accumulation: ``lax.ragged_dot``;
        with fewer rows than experts (decode: Qwen3-30B-A3B's 8 rows a token, 128 experts), each row times
        its own expert's matrix, gathered (XLA's GPU compile fuses the gather into the product, reading the
        rows' matrices only, where ``lax.ragged_dot`` reads every expert's); with ``max_group`` (a bound on
        every group size: the tokens of a top-k routing, which picks an expert once a token) up to
        :data:`WINDOW_MAX_GROUP`, a window of that many rows an expert (:func:`windowed_experts`)."""
        w = self.kernel[...].astype(x.dtype)
        rows = x.shape[0]
        if rows < self.num_experts:
            with jax.named_scope("expert_gather"):
                # the expert of each sorted row, from the group sizes
                expert = jnp.repeat(jnp.arange(self.num_experts), group_sizes, total_repeat_length=rows)
                mats = w[expert]  # (rows, in, out)
            y = jnp.einsum("ri,rio->ro", x, mats, preferred_element_type=jnp.float32)
            return y.astype(x.dtype)
        if max_group is not None and max_group <= WINDOW_MAX_GROUP:
            return windowed_experts(x, w, group_sizes, max_group)
        return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


# A decode step's float experts with at least as many rows as experts: XLA's GPU ragged_dot expands the rows
# over every expert and writes that (Qwen3-30B-A3B at batch 64, 512 rows of 2048 over 128 experts: 268 MB a
# layer, 66% of the step's HBM limit on an H200), so a window of ``max_group`` rows an expert is multiplied
# instead: experts x max_group rows, each weight read once and used max_group times, bytes-bound while
# 2 max_group flops a 2-byte weight stay under the tensor rate over HBM's (H200 ~206 rows, B200 ~280).
WINDOW_MAX_GROUP = 64


def windowed_experts(x: jax.Array, w: jax.Array, group_sizes: jax.Array, max_group: int) -> jax.Array:
    """``lax.ragged_dot(x, w, group_sizes)`` in x's dtype (f32 accumulation) for rows x (rows, in) sorted
    by expert whose groups hold at most ``max_group`` rows each: expert e multiplies the window of
    ``max_group`` rows from its group's first (rows past its group, another expert's or clamped to the
    last, are computed and never read), one batched product (experts, max_group, in) x (experts, in, out);
    each row is read back from its expert's window."""
    rows, experts = x.shape[0], w.shape[0]
    with jax.named_scope("expert_windows"):
        starts = jnp.cumsum(group_sizes) - group_sizes  # each expert's first row
        offsets = jnp.arange(max_group, dtype=starts.dtype)
        windows = x[jnp.minimum(starts[:, None] + offsets[None, :], rows - 1)]  # (experts, max_group, in)
        # rounded to x's dtype before the rows are read back: the GEMM writes half the bytes of f32
        y = jnp.einsum("eci,eio->eco", windows, w, preferred_element_type=jnp.float32).astype(x.dtype)
        expert = jnp.repeat(jnp.arange(experts), group_sizes, total_repeat_length=rows)  # each row's expert
        return y[expert, jnp.arange(rows) - starts[expert]]


class QExperts(nnx.Module):
    """An int4 :class:`Experts`: a stacked ``QuantizedWeight`` multiplied through ``nybble.ragged_matmul``.

    Attributes:
      qweight: ``QuantizedParam`` holding the stacked weight (or, once sharded, a
        ``nybble.sharding.ExpertShardedWeight``).
      implementation: passed to ``nybble.ragged_matmul``.
    """

    def __init__(self, qweight: Any, *, implementation: Implementation | None = None) -> None:
        if isinstance(qweight, ExpertShardedWeight):
            self.num_experts = qweight.num_experts
        else:
            self.num_experts = check_stacked(qweight, "QExperts")
        self.in_features, self.out_features = qweight.shape
        self.qweight = QuantizedParam(qweight)
        self.implementation = implementation

    @classmethod
    def from_experts(
        cls,
        experts: Experts,
        format: QuantFormat | None = None,
        *,
        qweight: QuantizedWeight | None = None,
        implementation: Implementation | None = None,
        clip_search: bool = False,
        **fields: Any,
    ) -> QExperts:
        """An :class:`Experts` stack rounded to nearest, each expert on its own, in ``format`` (or its
        fields as keywords, as ``nybble.quantize``); or wraps the given stacked ``qweight``."""
        if qweight is None:
            qweight = quantize(experts.kernel[...], format, clip_search=clip_search, **fields)
        return cls(qweight, implementation=implementation)

    @property
    def weight(self) -> Any:
        return self.qweight.get_value()

    def __call__(self, x: jax.Array, group_sizes: jax.Array, max_group: int | None = None) -> jax.Array:
        """x (rows, in) sorted by expert -> (rows, out) through ``nybble.ragged_matmul``; ``max_group`` (a
        bound on the group sizes, :class:`Experts`' window) is not needed: the grouped kernels read each
        expert's own rows."""
        return ragged_matmul(x, self.qweight.get_value(), group_sizes, implementation=self.implementation)


class ExpertMLP(FusedParts, nnx.Module):
    """The routed experts' SwiGLU, ``down(silu(gate(x)) * up(x))``, over rows sorted by expert."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32) -> None:
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Experts(e, h, i, rngs=rngs, dtype=dtype)
        self.up_proj = Experts(e, h, i, rngs=rngs, dtype=dtype)
        self.down_proj = Experts(e, i, h, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array, group_sizes: jax.Array, max_group: int | None = None) -> jax.Array:
        """x (rows, hidden) sorted by expert -> (rows, hidden); ``max_group``: a bound on every group size
        (a top-k routing's tokens), which float stacks use (:class:`Experts`)."""
        fused = vars(self).get("gate_up_proj")  # models.definitions.fuse: one grouped launch for both
        if isinstance(fused, FusedExpertsGateUp):  # int4: the SiLU product in the grouped kernel too
            return self.down_proj(fused.swiglu(x, group_sizes), group_sizes)
        if fused is not None:
            gate, up = fused(x, group_sizes, max_group)
        else:
            gate, up = self.gate_proj(x, group_sizes, max_group), self.up_proj(x, group_sizes, max_group)
        return self.down_proj(jax.nn.silu(gate) * up, group_sizes, max_group)


class SharedMLP(FusedParts, nnx.Module):
    """A dense SwiGLU added to every token (a shared expert)."""

    def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs, dtype: Any = jnp.float32) -> None:
        def linear(din: int, dout: int) -> nnx.Linear:
            return nnx.Linear(din, dout, use_bias=False, param_dtype=dtype, dtype=dtype, rngs=rngs)

        self.gate_proj = linear(hidden, intermediate)
        self.up_proj = linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = projections(self, "gate_up_proj", ("gate_proj", "up_proj"), x)
        return self.down_proj(jax.nn.silu(gate) * up)


class MoE(nnx.Module):
    """A dropless top-k mixture of SwiGLU experts (see the module docstring); ``moe(x)`` keeps x's shape."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32) -> None:
        self.config = cfg
        self.decode_routing = "xla"  # one decode token's routing: "xla" | "triton" (set_decode_routing)
        self.router = Router(cfg.hidden_size, cfg.num_experts, rngs=rngs, dtype=dtype)
        self.experts = ExpertMLP(cfg, rngs=rngs, dtype=dtype)
        self.shared_expert = (
            None
            if cfg.shared_intermediate_size is None
            else SharedMLP(cfg.hidden_size, cfg.shared_intermediate_size, rngs=rngs, dtype=dtype)
        )
        self.shared_expert_gate = (
            nnx.Linear(cfg.hidden_size, 1, use_bias=False, param_dtype=dtype, dtype=dtype, rngs=rngs)
            if cfg.shared_expert_gate
            else None
        )

    def routing(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Router weights (T, k) float32 and experts (T, k) int32 for tokens x (T, hidden)."""
        cfg = self.config
        return route(self.router(x), cfg.top_k, norm_topk_prob=cfg.norm_topk_prob)

    def routing_scores(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """:meth:`routing`'s weights unnormalized (:func:`route_scores`): scores, totals and experts."""
        cfg = self.config
        return route_scores(self.router(x), cfg.top_k, norm_topk_prob=cfg.norm_topk_prob)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (..., hidden) -> (..., hidden) in x's dtype."""
        cfg = self.config
        shape = x.shape
        xt = x.reshape(-1, cfg.hidden_size)
        scores, totals, experts = self.routing_scores(xt)
        out = self._routed(xt, scores, totals, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(xt).astype(jnp.float32)
            if self.shared_expert_gate is not None:
                shared = shared * jax.nn.sigmoid(self.shared_expert_gate(xt).astype(jnp.float32))
            out = out + shared
        return out.astype(x.dtype).reshape(shape)

    @property
    def defers_norm(self) -> bool:
        """Whether :meth:`deferred` applies: renormalized top-k weights and no shared expert."""
        return self.config.norm_topk_prob and self.shared_expert is None

    def deferred(self, h: jax.Array, row_scale: jax.Array) -> jax.Array:
        """``self(h * row_scale)`` for rows whose norm's scale is not yet applied (``RMSNorm.deferred``: h
        (..., hidden), row_scale (..., 1) float32), when :attr:`defers_norm`. For a one-token decode step:
        the router multiplies h, and the scale (> 0, one number a token) multiplies its float32 logits after
        the top k, which it does not reorder; so the norm's sum of squares and the router's product, both
        reductions over hidden in XLA, need not wait for each other, and no launch applies the scale before
        the router (one launch fewer a layer). The logits are not rounded to x's dtype as ``router(x)``
        rounds them: the same experts up to logits that rounding would tie."""
        if not self.defers_norm:
            raise ValueError("MoE.deferred needs norm_topk_prob=True and no shared expert (see defers_norm)")
        ht = h.reshape(-1, self.config.hidden_size)
        scale = row_scale.reshape(-1, 1).astype(jnp.float32)
        return self._scaled(ht, scale, self.router.logits(ht)).reshape(h.shape)

    def normed(self, x: jax.Array, norm: Any, parts: tuple[jax.Array, ...] | None = None) -> jax.Array:
        """``self(norm(x))`` for an RMSNorm ``norm`` (``weight`` (hidden,), ``eps``), when
        :attr:`defers_norm`: :meth:`deferred` with the norm's sum of squares in the router's launch. A
        decode step's two reductions over hidden, the logits (T, experts) and the sum of squares (T,), are
        two launches in XLA (sibling reductions fuse only where their outputs have one shape); here the sum
        of squares is taken once per expert, (T, experts) like the logits, so XLA runs both in one launch,
        reading x and the router's weight once (the weight only shapes the squares: XLA would turn a sum of
        squares broadcast over the experts back into one sum, a launch of its own). The numbers of
        ``deferred(*norm.deferred(x))``: the same products and sums, in float32. ``parts`` (optional): the
        arrays x is the sum of, each x's shape (the residual stream and the attention's output), which the
        routing kernel (:func:`set_decode_routing`) adds itself (XLA does not write their sum)."""
        if not self.defers_norm:
            raise ValueError("MoE.normed needs norm_topk_prob=True and no shared expert (see defers_norm)")
        hidden = self.config.hidden_size
        xt = x.reshape(-1, hidden)
        xf = xt.astype(jnp.float32)
        with jax.named_scope("norm"):
            ht = (xf * norm.weight[...].astype(jnp.float32)).astype(x.dtype)
        w = self.router.weight[...].astype(x.dtype).astype(jnp.float32)
        logits = jnp.sum(ht.astype(jnp.float32)[:, None, :] * w, axis=-1)
        # x * x where the weight is a number (every entry of a working router; a NaN one makes its logit
        # NaN anyway): what keeps XLA from reducing the squares once and broadcasting the sum
        squares = jnp.where(jnp.isnan(w), 0.0, xf[:, None, :] * xf[:, None, :])
        sums = jnp.sum(squares, axis=-1)  # (T, experts): every column holds the same sum
        if xt.shape[0] == 1 and self.decode_routing == "triton":
            sizes, slot_scores, score_total, rows = route_one_on_kernel(
                logits[0],
                [p.reshape(hidden) for p in (parts or (x,))],
                norm.weight[...],
                sums[0],
                self.config.top_k,
                norm.eps,
            )
            y = self.experts(rows, sizes).astype(jnp.float32)  # (k, hidden): slot s, the s-th chosen expert
            # k adds, not a reduction over the experts: XLA fuses them into the launch that reads the sum
            # (the next norm's), where a reduction is a launch of its own
            out = functools.reduce(operator.add, [y[s : s + 1] * slot_scores[s] for s in range(y.shape[0])])
            return (out / score_total[0]).astype(x.dtype).reshape(x.shape)
        if 1 < xt.shape[0] <= tokens_routing_kernel.MAX_TOKENS and self.decode_routing == "triton":
            sizes, slots, scores, totals, rows = route_tokens_on_kernel(
                logits,
                [p.reshape(-1, hidden) for p in (parts or (x,))],
                norm.weight[...],
                sums,
                self.config.top_k,
                norm.eps,
            )
            # (T k, hidden), sorted by expert: token t's j-th at slots[t, j]; an expert's group <= T rows
            y = self.experts(rows, sizes, xt.shape[0])
            out = jnp.einsum("tkh,tk->th", y[slots].astype(jnp.float32), scores) / totals[:, None]
            return out.astype(x.dtype).reshape(x.shape)
        with jax.named_scope("norm"):
            scale = jax.lax.rsqrt(sums[:, :1] / hidden + norm.eps)
        return self._scaled(ht, scale, logits).reshape(x.shape)

    def _scaled(self, ht: jax.Array, scale: jax.Array, logits: jax.Array) -> jax.Array:
        """The block's output (T, hidden) in ht's dtype for rows ``ht`` whose norm's ``scale`` (T, 1)
        float32 is not yet applied, and the router's float32 ``logits`` of ht. One token (a batch-1 decode
        step) is routed by ranks (:func:`route_ranked`, :meth:`_routed_one`): besides the experts' kernels, 4
        launches from the logits to the next norm's sum of squares, where the top k (two), the sort, the
        rows' gather, the weighted sum and the sum of squares took 6."""
        cfg = self.config
        xt = (ht.astype(jnp.float32) * scale).astype(ht.dtype)
        if xt.shape[0] == 1:
            return self._routed_one(xt, route_ranked(logits[0], cfg.top_k, scale[0, 0])).astype(ht.dtype)
        scores, totals, experts = route_scores(logits, cfg.top_k, norm_topk_prob=True, logit_scale=scale)
        return self._routed(xt, scores, totals, experts).astype(ht.dtype)

    def _routed_one(self, xt: jax.Array, routes: RankedRoutes) -> jax.Array:
        """:meth:`_routed` of one token xt (1, hidden) routed by :func:`route_ranked`: its k rows (x k
        times, the experts' rows in expert order) through the experts; each expert's row, its slot's,
        weighted by its score and summed over the experts (float32), over the total.
        One launch: a reduction over the experts, where the k weights in slot order would be a reduction
        of their own (over the experts, of the slots)."""
        k = self.config.top_k
        y = self.experts(jnp.broadcast_to(xt, (k, xt.shape[1])), routes.group_sizes)  # (k, hidden)
        # (E, hidden): each expert's row, its slot's; an unchosen expert's slot is a chosen one's, times 0
        # (a select instead would keep XLA from fusing the gather into the sum: a launch more)
        rows = y[jnp.minimum(routes.slots, k - 1)].astype(jnp.float32)
        return (jnp.sum(rows * routes.scores[:, None], axis=0) / routes.totals[0])[None]

    def _routed(self, xt: jax.Array, scores: jax.Array, totals: jax.Array, experts: jax.Array) -> jax.Array:
        """The routed experts' weighted sum (T, hidden) float32 of tokens xt (T, hidden), for
        :func:`route_scores`' scores, totals and experts."""
        cfg = self.config
        order, inverse, group_sizes = sort_by_expert(experts, cfg.num_experts)
        rows = xt[order // cfg.top_k]  # (T*k, hidden), sorted by expert
        # a token picks an expert once: no group holds more rows than there are tokens
        y = self.experts(rows, group_sizes, xt.shape[0])[inverse]
        y = y.reshape(xt.shape[0], cfg.top_k, cfg.hidden_size)
        # Each expert's output is rounded to x's dtype, then weighted and summed in float32 (the weights'
        # normalization after the sum: one fusion with it).
        return jnp.einsum("tkh,tk->th", y.astype(jnp.float32), scores) / totals


DECODE_ROUTING = ("xla", "triton")


def route_one_on_kernel(
    logits: jax.Array,
    parts: list[jax.Array],
    norm_weight: jax.Array,
    sums_of_squares: jax.Array,
    top_k: int,
    eps: float,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One token's routing on nybble's Triton kernel (``nybble.kernels.triton.moe_routing``, one launch):
    from the router's f32 logits (E,) of the unscaled normed row, the residual row x (hidden,) as the parts
    it sums, the norm's weight and x's f32 sum of squares (in entry 0 of ``sums_of_squares``): the group
    sizes (E,), the chosen experts' scores in slot order (k,), their total (1,) and the k normalized rows
    (k, hidden) in x's dtype. Arguments are checked here (a clear error, never one from inside Pallas)."""
    if (why := routing_kernel.unsupported(logits, parts[0], top_k) or no_gpu_target()) is not None:
        raise NotImplementedError(f"MoE decode routing 'triton': {why}; or set_decode_routing(model, 'xla')")
    hidden = parts[0].shape[-1]
    cfg = routing_kernel.choose_config(hidden, top_k, eps)
    return routing_kernel.route_one(
        logits, parts, norm_weight, sums_of_squares, cfg, interpret=triton_backend.is_interpret_active()
    )


def route_tokens_on_kernel(
    logits: jax.Array,
    parts: list[jax.Array],
    norm_weight: jax.Array,
    sums_of_squares: jax.Array,
    top_k: int,
    eps: float,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """2 to 16 tokens' routing on nybble's Triton kernel (``nybble.kernels.triton.moe_routing_tokens``,
    one launch): from the router's f32 logits (T, E) of the unscaled normed rows, the residual rows x (T,
    hidden) as the parts they sum, the norm's weight and each row's f32 sum of squares (column 0 of
    ``sums_of_squares`` (T, n)): the group sizes (E,), each token's chosen experts' rows among the sorted
    ones (T, k) and scores (T, k), their totals (T,), and the T k normalized rows sorted by expert (T k,
    hidden) in x's dtype. Arguments are checked here (a clear error, never one from inside Pallas)."""
    why = tokens_routing_kernel.unsupported(logits, parts[0], top_k) or no_gpu_target()
    if why is not None:
        raise NotImplementedError(f"MoE decode routing 'triton': {why}; or set_decode_routing(model, 'xla')")
    tokens, experts = logits.shape
    cfg = tokens_routing_kernel.choose_config(parts[0].shape[-1], top_k, eps, tokens, experts)
    return tokens_routing_kernel.route_tokens(
        logits, parts, norm_weight, sums_of_squares, cfg, interpret=triton_backend.is_interpret_active()
    )


def set_decode_routing(model: nnx.Module, implementation: str) -> nnx.Module:
    """Every MoE block of ``model`` routes a decode step's tokens (batch 1 to 16, ``MoE.normed``) with
    ``implementation``: "xla" (the default: at batch 1 two launches of reductions over the experts, from 2
    tokens the top k, the sort's reductions and the rows' gather) or "triton" (nybble's one-launch
    Pallas-on-Triton kernels, ``nybble.kernels.triton.moe_routing`` for one token and
    ``moe_routing_tokens`` for 2 to 16, on NVIDIA GPUs of
    compute capability 8.0 or newer, or on a CPU inside ``nybble.kernels.triton.backend.interpret()``) for
    the blocks it can route (``MoE.defers_norm``: renormalized top k, no shared expert; a model with none is
    refused). The same experts and weights. In place; returns the model."""
    if implementation not in DECODE_ROUTING:
        raise ValueError(
            f"decode routing: unknown implementation {implementation!r}; choose one of {DECODE_ROUTING}"
        )
    blocks = [m for _, m in nnx.iter_modules(model) if isinstance(m, MoE)]
    if not blocks:
        raise ValueError(f"set_decode_routing: {type(model).__name__} has no nybble MoE block")
    if implementation == "triton" and not any(block.defers_norm for block in blocks):
        cfg = blocks[0].config
        raise ValueError(
            "set_decode_routing: the routing kernel routes renormalized top-k blocks with no shared expert "
            f"(Qwen3-MoE, Mixtral: MoE.defers_norm), and none of this model's is (norm_topk_prob="
            f"{cfg.norm_topk_prob}, shared expert: {cfg.shared_intermediate_size is not None}); keep 'xla'"
        )
    for block in blocks:
        block.decode_routing = implementation
    return model


def expert_stacks(model: nnx.Module) -> list[tuple[str, Any, str, Experts | QExperts]]:
    """Every :class:`Experts` / :class:`QExperts` of ``model``: (dotted path, parent, attribute, module)."""
    modules = {tuple(p): m for p, m in nnx.iter_modules(model)}
    out = []
    for p, m in modules.items():
        if p and isinstance(m, Experts | QExperts):
            out.append((".".join(str(k) for k in p), modules[p[:-1]], p[-1], m))
    return out


def num_weights(experts: Experts | QExperts) -> int:
    """Weights of the whole stack (experts * in * out): what a rule's ``min_size`` compares."""
    return int(np.prod((experts.num_experts, experts.in_features, experts.out_features)))


__all__ = [
    "DECODE_ROUTING",
    "NORMED_MAX_TOKENS",
    "WINDOW_MAX_GROUP",
    "ExpertMLP",
    "Experts",
    "MoE",
    "MoEConfig",
    "QExperts",
    "RankedRoutes",
    "Router",
    "SharedMLP",
    "expert_stacks",
    "num_weights",
    "route",
    "route_one_on_kernel",
    "route_ranked",
    "route_scores",
    "route_tokens_on_kernel",
    "set_decode_routing",
    "sort_by_expert",
    "windowed_experts",
]
