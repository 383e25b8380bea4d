"""Fused projections: q/k/v as one linear, gate/up as one, so a decode step launches one kernel for each.

    nybble.models.fuse_projections(model)      # in place: attn.qkv_proj, mlp.gate_up_proj
    nybble.models.unfuse_projections(model)    # back to q/k/v_proj, gate/up_proj (exact)

MoE expert stacks fuse too (``experts.gate_up_proj``: a :class:`FusedExperts`, each expert's gate and up
side by side, one grouped launch; int4 ones a :class:`FusedExpertsGateUp`, interleaved as below, whose
grouped kernel computes the SiLU product too). Projections that read the same input are concatenated along N
into one weight: a ``QuantizedWeight`` of N = N_q + N_k + N_v (its codes and scales the parts' own, column
for column: exact), or one float kernel. The fused layer's output is split back, so the numbers are those of
the separate layers: bit for bit on nybble's kernels and XLA alike where every output column is computed
alone (a GEMM's columns do not interact). Checkpoints stay per projection: ``save_model`` and
``save_pretrained`` write the parts.

An int4 MLP's gate and up (one width, no bias) fuse into a :class:`FusedGateUp`: their columns interleaved
in blocks of 8 (``nybble.packing.gate_up``), so that nybble's kernels compute ``silu(gate) * up`` in their
epilogue at decode (``FusedGateUp.swiglu``): the MLP's elementwise launch goes too.

Fused: every ``Attention`` whose q/k/v (and ``MLP`` whose gate/up) are all ``QLinear`` of one format, or
all float ``nnx.Linear`` of one dtype; others (sharded weights, activation-order layers, mixed kinds) are
left as they are. Module paths then read ``layers.{i}.attn.qkv_proj.inner`` and
``layers.{i}.mlp.gate_up_proj.inner``; ``attn.q_proj`` still reads (:class:`FusedParts`: the part split
off, a copy). ``nybble.models.quantize`` and ``from_pretrained`` fuse by default (``fuse_projections``);
``shard`` splits them back first (its rules place q/k/v and gate/up one by one).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nybble.kernels.ops.ragged_swiglu_matmul import ragged_swiglu_matmul
from nybble.kernels.ops.swiglu_matmul import swiglu_matmul
from nybble.models.definitions.layers import QLinear
from nybble.packing.gate_up import concatenated_order, gate_up_order, interleavable, split_gate_up
from nybble.quant.qweight import QuantizedWeight

FUSIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class FusedLinear(nnx.Module):
    """Linears of one input as one: ``inner`` (a ``QLinear`` or ``nnx.Linear``) of N = sum(sizes);
    ``fused(x)`` returns the parts' outputs, a tuple in the order of ``names``."""

    def __init__(self, inner: QLinear | nnx.Linear, names: Sequence[str], sizes: Sequence[int]) -> None:
        self.inner = inner
        self.names = tuple(names)
        self.sizes = tuple(int(s) for s in sizes)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, ...]:
        y = self.inner(x)
        return tuple(jnp.split(y, np.cumsum(self.sizes[:-1]).tolist(), axis=-1))

    def part(self, name: str) -> QLinear | nnx.Linear:
        """The projection ``name`` split off (a new layer holding copies of its columns)."""
        return self.parts()[self.names.index(name)]

    def parts(self) -> list[Any]:
        """Every projection split off, in the order of ``names`` (new layers holding copies)."""
        return _split(self.inner, self.sizes)


class FusedGateUp(FusedLinear):
    """An int4 SwiGLU MLP's gate and up as one ``QLinear`` whose columns interleave them in blocks of 8
    (``nybble.packing.gate_up``), so that :meth:`swiglu` runs ``silu(gate) * up`` in the Hopper kernel's
    epilogue (one launch, ``nybble.kernels.swiglu_matmul``). ``fused(x)`` still returns ``(gate, up)``."""

    def __call__(self, x: jax.Array) -> tuple[jax.Array, ...]:
        return split_gate_up(self.inner(x))

    def swiglu(self, x: jax.Array, norm: Any = None) -> jax.Array:
        """``silu(r gate(x)) * (r up(x))``; ``norm`` None (r = 1) or a deferred RMSNorm scale, an object with
        ``sum_of_squares`` (..., 1) float32, ``dim`` and ``eps`` (r = rsqrt(sum_of_squares / dim + eps))."""
        inner = self.inner
        if norm is None:
            return swiglu_matmul(x, inner.weight, implementation=inner.implementation)
        return swiglu_matmul(
            x,
            inner.weight,
            sum_of_squares=norm.sum_of_squares,
            norm=(norm.dim, norm.eps),
            implementation=inner.implementation,
        )

    def parts(self) -> list[Any]:
        concatenated = permute_columns(self.inner.weight, concatenated_order(self.sizes[0]))
        return _split(QLinear(concatenated, implementation=self.inner.implementation), self.sizes)


class FusedExperts(FusedLinear):
    """Expert stacks of one input as one (MoE gate/up): ``inner`` (``QExperts`` or ``Experts``) of
    N = sum(sizes) per expert; ``fused(x, group_sizes)`` returns the parts' outputs."""

    def __call__(  # type: ignore[override]
        self, x: jax.Array, group_sizes: jax.Array, max_group: int | None = None
    ) -> tuple[jax.Array, ...]:
        y = self.inner(x, group_sizes, max_group)
        return tuple(jnp.split(y, np.cumsum(self.sizes[:-1]).tolist(), axis=-1))


class FusedExpertsGateUp(FusedExperts):
    """A MoE's int4 expert stacks gate and up as one ``QExperts`` whose columns, expert by expert,
    interleave them in blocks of 8 (``nybble.packing.gate_up``), so that :meth:`swiglu` runs
    ``silu(gate) * up`` in the grouped kernel's epilogue (one launch,
    ``nybble.kernels.ragged_swiglu_matmul``).
    ``fused(x, group_sizes)`` still returns ``(gate, up)``."""

    def __call__(  # type: ignore[override]
        self, x: jax.Array, group_sizes: jax.Array, max_group: int | None = None
    ) -> tuple[jax.Array, ...]:
        return split_gate_up(self.inner(x, group_sizes))

    def swiglu(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """``silu(gate) * up`` of x's rows, sorted by expert (``group_sizes``)."""
        inner = self.inner
        return ragged_swiglu_matmul(x, inner.weight, group_sizes, implementation=inner.implementation)

    def parts(self) -> list[Any]:
        order = concatenated_order(self.sizes[0])
        concatenated = jax.vmap(lambda qw: permute_columns(qw, order))(self.inner.weight)
        return _split(type(self.inner)(concatenated, implementation=self.inner.implementation), self.sizes)


class FusedParts:
    """For modules whose projections may be fused: ``attn.q_proj`` (any part's old name) still reads,
    giving the part split off the fused layer (a copy: to change a part, ``unfuse_projections`` first)."""

    def __getattr__(self, name: str) -> Any:
        for fused_name, names in FUSIONS.items():
            fused = vars(self).get(fused_name)
            if name in names and isinstance(fused, FusedLinear) and name in fused.names:
                return fused.part(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def concat_columns(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """One ``QuantizedWeight`` holding ``weights`` side by side along N (same K and format): exact."""
    first = weights[0]
    fmt = lambda w: (w.shape[0], w.group_size, w.symmetric, w.layout, np.dtype(w.scales.dtype))
    if any(fmt(w) != fmt(first) for w in weights):
        raise ValueError(
            "concat_columns: weights differ in K or format (K, group, symmetric, layout, scale dtype): "
            f"{[fmt(w) for w in weights]}; only weights of one input and one format can be fused"
        )
    cols = lambda a, w: a[:, : w.shape[1]]
    codes = jnp.concatenate([cols(w.logical_codes(), w) for w in weights], axis=1)
    scales = jnp.concatenate([cols(w.scales, w) for w in weights], axis=1)
    offsets = None if first.symmetric else jnp.concatenate([cols(w.offsets, w) for w in weights], axis=1)
    n = sum(w.shape[1] for w in weights)
    return QuantizedWeight.from_codes(
        codes, scales, offsets, shape=(first.shape[0], n), group_size=first.group_size, layout=first.layout
    )


def permute_columns(qw: QuantizedWeight, order: Any) -> QuantizedWeight:
    """``qw`` with column j taken from column ``order[j]`` (codes, scales and offsets alike): exact."""
    order = jnp.asarray(order)
    n = qw.shape[1]
    codes = qw.logical_codes()[:, :n][:, order]
    scales = qw.scales[:, :n][:, order]
    offsets = None if qw.symmetric else qw.offsets[:, :n][:, order]
    return QuantizedWeight.from_codes(
        codes, scales, offsets, shape=qw.shape, group_size=qw.group_size, layout=qw.layout
    )


def _gate_up_interleavable(parts: list[Any]) -> bool:
    """Int4 gate and up of one width in whole blocks: linears with no bias (the epilogue adds none), or
    expert stacks."""
    int4 = all(type(p) is QLinear and p.bias is None for p in parts) or all(
        type(p).__name__ == "QExperts" for p in parts
    )
    return int4 and parts[0].out_features == parts[1].out_features and interleavable(parts[0].out_features)


def split_columns(qw: QuantizedWeight, sizes: Sequence[int]) -> list[QuantizedWeight]:
    """The inverse of :func:`concat_columns`: ``qw``'s columns cut into weights of N = ``sizes``."""
    if sum(sizes) != qw.shape[1]:
        raise ValueError(f"split_columns: sizes {tuple(sizes)} do not add up to N = {qw.shape[1]}")
    codes = qw.logical_codes()
    out, start = [], 0
    for n in sizes:
        part = slice(start, start + n)
        offsets = None if qw.symmetric else qw.offsets[:, part]
        out.append(
            QuantizedWeight.from_codes(
                codes[: qw.shape[0], part],
                qw.scales[:, part],
                offsets,
                shape=(qw.shape[0], n),
                group_size=qw.group_size,
                layout=qw.layout,
            )
        )
        start += n
    return out


def _fusable(parts: list[Any]) -> bool:
    if all(type(p) is QLinear for p in parts):
        ws = [p.weight for p in parts]
        return (
            all(isinstance(w, QuantizedWeight) and np.ndim(w.codes) == 2 for w in ws)
            and all(p.input_perm is None for p in parts)
            and len({(p.implementation, p.bias is None) for p in parts}) == 1
            and len({(w.shape[0], w.group_size, w.symmetric, w.layout, np.dtype(w.scales.dtype)) for w in ws})
            == 1
        )
    if all(type(p) is nnx.Linear for p in parts):
        keys = {(p.in_features, p.dtype, p.param_dtype, p.bias is None, p.precision) for p in parts}
        return len(keys) == 1
    # expert stacks by class name: models.definitions.moe imports this module (FusedParts)
    if all(type(p).__name__ == "QExperts" for p in parts):
        ws = [p.weight for p in parts]
        return all(isinstance(w, QuantizedWeight) and np.ndim(w.codes) == 3 for w in ws) and (
            len({(p.implementation, p.num_experts) for p in parts}) == 1
            and len({(w.shape[0], w.group_size, w.symmetric, w.layout, np.dtype(w.scales.dtype)) for w in ws})
            == 1
        )
    if all(type(p).__name__ == "Experts" for p in parts):
        return len({(p.num_experts, p.in_features, p.kernel[...].dtype) for p in parts}) == 1
    return False


def _fuse(parts: list[Any]) -> Any:
    kind = type(parts[0])
    if kind.__name__ == "QExperts":  # per expert, as concat_columns does for one weight
        qw = jax.vmap(concat_columns)([p.weight for p in parts])
        return kind(qw, implementation=parts[0].implementation)
    if kind.__name__ == "Experts":
        return _experts(kind, jnp.concatenate([p.kernel[...] for p in parts], axis=2))
    if isinstance(parts[0], QLinear):
        bias = None if parts[0].bias is None else jnp.concatenate([p.bias[...] for p in parts])
        qw = concat_columns([p.weight for p in parts])
        return QLinear(qw, bias, implementation=parts[0].implementation)
    first = parts[0]
    n = sum(p.out_features for p in parts)
    fused = nnx.eval_shape(
        lambda: nnx.Linear(
            first.in_features,
            n,
            use_bias=first.bias is not None,
            dtype=first.dtype,
            param_dtype=first.param_dtype,
            precision=first.precision,
            rngs=nnx.Rngs(0),
        )
    )
    fused.kernel = nnx.Param(jnp.concatenate([p.kernel[...] for p in parts], axis=1))
    if first.bias is not None:
        fused.bias = nnx.Param(jnp.concatenate([p.bias[...] for p in parts]))
    return fused


def _experts(kind: Any, kernel: jax.Array) -> Any:
    e, k, n = kernel.shape
    out = nnx.eval_shape(lambda: kind(e, k, n, rngs=nnx.Rngs(0), dtype=kernel.dtype))
    out.kernel = nnx.Param(kernel)
    return out


def _split(inner: Any, sizes: Sequence[int]) -> list[Any]:
    offsets = np.cumsum([0, *sizes])
    kind = type(inner)
    if kind.__name__ == "QExperts":
        stacks = jax.vmap(lambda w: split_columns(w, sizes))(inner.weight)
        return [kind(w, implementation=inner.implementation) for w in stacks]
    if kind.__name__ == "Experts":
        return [_experts(kind, inner.kernel[...][:, :, a:b]) for a, b in itertools.pairwise(offsets)]
    if isinstance(inner, QLinear):
        weights = split_columns(inner.weight, sizes)
        bias = (
            [None] * len(sizes)
            if inner.bias is None
            else [inner.bias[...][a:b] for a, b in itertools.pairwise(offsets)]
        )
        return [
            QLinear(w, b, implementation=inner.implementation) for w, b in zip(weights, bias, strict=True)
        ]
    out = []
    for a, b in itertools.pairwise(offsets):
        part = nnx.eval_shape(
            lambda n=int(b - a): nnx.Linear(
                inner.in_features,
                n,
                use_bias=inner.bias is not None,
                dtype=inner.dtype,
                param_dtype=inner.param_dtype,
                precision=inner.precision,
                rngs=nnx.Rngs(0),
            )
        )
        part.kernel = nnx.Param(inner.kernel[...][:, a:b])
        if inner.bias is not None:
            part.bias = nnx.Param(inner.bias[...][a:b])
        out.append(part)
    return out


def fuse_projections(model: nnx.Module) -> int:
    """Fuses q/k/v and gate/up of every layer of ``model`` that allows it, in place; returns how many
    fused layers were made (see the module docstring)."""
    count = 0
    for _, module in list(nnx.iter_modules(model)):
        for fused_name, names in FUSIONS.items():
            if isinstance(vars(module).get(fused_name), FusedLinear):
                continue  # fused already
            parts = [vars(module).get(n) for n in names]
            if any(p is None for p in parts) or not _fusable(parts):
                continue
            sizes = [p.out_features for p in parts]
            kind = FusedExperts if type(parts[0]).__name__ in ("Experts", "QExperts") else FusedLinear
            inner = _fuse(parts)
            if fused_name == "gate_up_proj" and _gate_up_interleavable(parts):
                order = gate_up_order(sizes[0])
                if kind is FusedExperts:  # each expert's columns, as concat_columns joined them
                    kind = FusedExpertsGateUp
                    weight = jax.vmap(lambda qw, order=order: permute_columns(qw, order))(inner.weight)
                    inner = type(inner)(weight, implementation=inner.implementation)
                else:
                    kind = FusedGateUp
                    inner = QLinear(permute_columns(inner.weight, order), implementation=inner.implementation)
            setattr(module, fused_name, kind(inner, names, sizes))
            for n in names:
                delattr(module, n)
            count += 1
    return count


def unfuse_projections(model: nnx.Module) -> int:
    """Splits every :class:`FusedLinear` of ``model`` back into its parts, in place (exact); returns how
    many were split."""
    count = 0
    for _, module in list(nnx.iter_modules(model)):
        for fused_name in FUSIONS:
            fused = getattr(module, fused_name, None)
            if not isinstance(fused, FusedLinear):
                continue
            for name, part in zip(fused.names, fused.parts(), strict=True):
                setattr(module, name, part)
            delattr(module, fused_name)
            count += 1
    return count


def has_fused(model: nnx.Module) -> bool:
    """Whether ``model`` holds a :class:`FusedLinear`."""
    return any(isinstance(m, FusedLinear) for _, m in nnx.iter_modules(model))


def unfused_copy(model: nnx.Module) -> nnx.Module:
    """``model`` itself when nothing is fused, else a copy with every projection split back (arrays of
    the other layers shared, not copied): what the checkpoint writers save."""
    if not has_fused(model):
        return model
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    unfuse_projections(copy)
    return copy


__all__ = [
    "FusedExperts",
    "FusedExpertsGateUp",
    "FusedGateUp",
    "FusedLinear",
    "FusedParts",
    "concat_columns",
    "fuse_projections",
    "has_fused",
    "permute_columns",
    "split_columns",
    "unfuse_projections",
    "unfused_copy",
]
