"""Stacked ``QuantizedWeight`` s: one weight per expert of a mixture of experts, arrays stacked on axis 0.

A stacked weight is the per-expert ``QuantizedWeight`` s' arrays stacked on a new leading axis: codes
(E, *stored), scales and offsets (E, num_groups, N_pad), the same packing and geometry per expert, and the
same static metadata (``shape`` stays the per-expert (K, N)). ``nybble.quantize(w)`` of a float (E, K, N)
stack returns one (each expert quantized on its own, exactly as ``nybble.quantize(w[e])`` would), and
``nybble.dequantize`` of one gives (E, K, N). ``nybble.ragged_matmul`` multiplies with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nybble.packing import default_layout
from nybble.quant.qweight import QuantizedWeight, relayout


def num_experts(qw: QuantizedWeight) -> int | None:
    """The expert count of a stacked weight (its codes' leading axis), or None for a plain (K, N) weight.

    Only one leading axis is a stack of experts; more are refused (``check_stacked``).
    """
    extra = np.ndim(qw.codes) - 2  # every layout stores 2-D codes (the int4 view of nk_int4 too)
    return None if extra <= 0 else int(qw.codes.shape[0])


def check_stacked(qw: Any, what: str) -> int:
    """The expert count of ``qw``, which must be a stacked ``QuantizedWeight`` (E, ...), else an error."""
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(
            f"{what}: the weight must be a stacked nybble.QuantizedWeight (from nybble.quantize of an "
            f"(experts, K, N) float array), got {type(qw).__name__}"
        )
    if np.ndim(qw.codes) != 3:
        got = "a plain (K, N) weight" if np.ndim(qw.codes) == 2 else f"codes of shape {tuple(qw.codes.shape)}"
        raise ValueError(
            f"{what}: expected a stacked weight with one leading expert axis (codes (experts, ...)), got "
            f"{got}; quantize the experts' (experts, K, N) float stack with nybble.quantize (or stack "
            f"per-expert weights with nybble.quant.stack_weights), or use nybble.matmul for a dense weight"
        )
    return int(qw.codes.shape[0])


def stack_weights(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Stacks per-expert ``QuantizedWeight`` s of one shape, group size, symmetry and layout on axis 0."""
    weights = list(weights)
    if not weights:
        raise ValueError("stack_weights: no weights to stack")
    first = weights[0]
    for i, w in enumerate(weights):
        if not isinstance(w, QuantizedWeight):
            raise TypeError(f"stack_weights: weight {i} is a {type(w).__name__}, not a QuantizedWeight")
        meta = (w.shape, w.group_size, w.symmetric, w.layout, w.dtype, w.codes.dtype)
        ref = (first.shape, first.group_size, first.symmetric, first.layout, first.dtype, first.codes.dtype)
        if meta != ref:
            raise ValueError(
                f"stack_weights: weight {i} has (shape, group_size, symmetric, layout, scale dtype, codes "
                f"dtype) {meta}, weight 0 has {ref}: every expert of a stack must match"
            )
        if num_experts(w) is not None:
            raise ValueError(f"stack_weights: weight {i} is already stacked ({w!r})")
    return jax.tree.map(lambda *a: jnp.stack(a), *weights)


def unstack_weight(qw: QuantizedWeight, expert: int) -> QuantizedWeight:
    """Expert ``expert`` of a stacked weight, as a plain (K, N) ``QuantizedWeight``."""
    e = check_stacked(qw, "unstack_weight")
    if not 0 <= expert < e:
        raise IndexError(f"unstack_weight: expert {expert} is not in [0, {e})")
    return jax.tree.map(lambda a: a[expert], qw)


def relayout_any(qw: QuantizedWeight, layout: str) -> QuantizedWeight:
    """``nybble.quant.relayout`` of a plain or a stacked weight (each expert repacked; exact)."""
    if qw.layout == layout:
        return qw
    if num_experts(qw) is None:
        return relayout(qw, layout)
    return jax.vmap(lambda one: relayout(one, layout))(qw)


def in_default_layout(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` (plain or stacked) stored in this machine's layout, ``nybble.packing.default_layout()``: what
    loaders return, so that the kernel of the local GPU reads it as it lies (converted once, at load)."""
    return relayout_any(qw, default_layout())


def check_stacked_float(w: Any, what: str = "quantize") -> None:
    """A float (E, K, N) stack; NaN/Inf reported with count and first (expert, k, n) when concrete."""
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{what}: expected a floating-point weight, got dtype {np.dtype(w.dtype).name}")
    if 0 in w.shape:
        raise ValueError(f"{what}: the expert stack has shape {tuple(w.shape)}; every axis must be nonzero")
    if isinstance(w, jax.core.Tracer):
        return
    finite = np.isfinite(np.asarray(w, dtype=np.float32))
    if not finite.all():
        bad = np.argwhere(~finite)
        first = tuple(int(i) for i in bad[0])
        raise ValueError(
            f"{what}: expert stack of shape {tuple(w.shape)} has {len(bad)} NaN/Inf value(s); first at "
            f"(expert, k, n) = {first}. Fix the checkpoint before quantizing."
        )


def quantize_stacked(quantize_one: Callable[..., QuantizedWeight], w: Any, **options: Any) -> QuantizedWeight:
    """``quantize_one(w[e], **options)`` for every expert e of a float (E, K, N) stack, stacked on axis 0.

    One vmapped XLA program (the experts are independent): the same codes and scales as quantizing each
    expert alone.
    """
    check_stacked_float(w)
    return jax.vmap(lambda we: quantize_one(we, **options))(jnp.asarray(w))


__all__ = [
    "check_stacked",
    "num_experts",
    "quantize_stacked",
    "stack_weights",
    "unstack_weight",
]
