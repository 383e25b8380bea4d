"""The XLA path of ``nybble.ragged_matmul``: a loop over the experts with rows, one expert in float at a time.

Rows of x are sorted by expert: expert e owns rows [start_e, start_e + size_e). The active experts (size > 0)
are gathered into at most ``min(experts, rows)`` slots (no more experts than rows can have any), and a
``while`` loop runs once per active expert: it slices that expert's codes, scales and offsets out of the stack
(a dynamic index: only its bytes are read), dequantizes them to one (N_pad, K_pad) array in x's dtype (the
dense XLA path's ``dequantized_operand``), and multiplies its rows in windows of ``window`` rows (a second
loop, ``ceil(size_e / window)`` trips; a window's rows past the expert's end keep what the output held). So at
decode only the experts with rows are read and dequantized, and no (experts, K, N) float array exists: the
compiled program holds one expert's float weight (the test reads the buffers of the compiled HLO).

The loops have dynamic trip counts (XLA ``while``): the path is differentiable forward-mode only
(``jax.grad`` through it raises; the float MoE path, ``lax.ragged_dot``, is differentiable).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nybble.kernels.ops.matmul.xla import codes_kn, dequantized_operand
from nybble.packing import pad_to
from nybble.quant.qweight import QuantizedWeight, scale_codes

# Bounds of the row window: at least one 8-row sublane tile, at most 128 rows (a GEMM tall enough that XLA
# runs it at full rate; a window's unused rows cost compute only).
MIN_WINDOW, MAX_WINDOW = 8, 128


def row_window(rows: int, experts: int) -> int:
    """Rows multiplied per step: the mean rows per expert rounded up to a power of two, within [8, 128]."""
    mean = max(1, -(-rows // experts))
    window = 1 << (mean - 1).bit_length()
    return max(MIN_WINDOW, min(MAX_WINDOW, window))


def group_bounds(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """(starts, sizes) of the groups in rows, each clamped: negative sizes count as 0, rows past ``rows``
    are dropped (what a traced, unchecked ``group_sizes`` gets)."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends - starts


def expert_weight(qw: QuantizedWeight, expert: jax.Array) -> QuantizedWeight:
    """Expert ``expert`` (may be traced) of a stacked weight: a dynamic index of each array."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, expert, 0, keepdims=False), qw)


def expert_operand(qw: QuantizedWeight, dtype: jnp.dtype, kn: bool) -> tuple[jax.Array, int]:
    """One expert's weight in ``dtype`` and the axis that holds K: (K_pad, N_pad) when ``kn`` (the CPU's
    orientation), else (N_pad, K_pad); the dense XLA path's two formulations."""
    if kn:
        return scale_codes(codes_kn(qw), qw, k_axis=0, dtype=dtype), 0
    return dequantized_operand(qw, dtype)


def xla_ragged_matmul(
    x: jax.Array, qw: QuantizedWeight, group_sizes: jax.Array, *, window: int | None = None
) -> jax.Array:
    """``ragged_dot(x, dequantize(qw), group_sizes)`` for x (rows, K), qw stacked (E, ...): (rows, N) in
    x's dtype, float32 accumulation, rows past the groups' sum zero. Arguments are checked by the caller."""
    run = functools.partial(_ragged_matmul, window=window)
    return jax.lax.platform_dependent(
        x, qw, group_sizes, cpu=functools.partial(run, kn=True), default=functools.partial(run, kn=False)
    )


def _ragged_matmul(
    x: jax.Array, qw: QuantizedWeight, group_sizes: jax.Array, *, window: int | None, kn: bool
) -> jax.Array:
    rows, _ = x.shape
    experts = qw.codes.shape[0]
    n = qw.shape[1]
    k_pad, n_pad = qw.padded_shape
    window = row_window(rows, experts) if window is None else window
    starts, sizes = group_bounds(group_sizes, rows)
    has_rows = sizes > 0
    active = jnp.nonzero(has_rows, size=min(experts, rows), fill_value=0)[0]
    # Padded by one window of zero rows so that every window's slice starts where asked (XLA clamps a
    # dynamic slice that would run past the end).
    x_pad = pad_to(x, (rows + window, k_pad))
    out = jnp.zeros((rows + window, n_pad), x.dtype)

    def one_expert(i: jax.Array, out: jax.Array) -> jax.Array:
        e = active[i]
        w, k_axis = expert_operand(expert_weight(qw, e), x.dtype, kn)  # this expert only
        start, size = starts[e], sizes[e]

        def one_window(c: jax.Array, out: jax.Array) -> jax.Array:
            r0 = start + c * window
            xw = jax.lax.dynamic_slice(x_pad, (r0, 0), (window, k_pad))
            yw = jax.lax.dot_general(
                xw, w, (((1,), (k_axis,)), ((), ())), preferred_element_type=jnp.float32
            ).astype(x.dtype)
            mine = (jnp.arange(window) < size - c * window)[:, None]
            held = jax.lax.dynamic_slice(out, (r0, 0), (window, n_pad))
            return jax.lax.dynamic_update_slice(out, jnp.where(mine, yw, held), (r0, 0))

        return jax.lax.fori_loop(0, (size + window - 1) // window, one_window, out)

    out = jax.lax.fori_loop(0, jnp.sum(has_rows, dtype=jnp.int32), one_expert, out)
    return out[:rows, :n]


__all__ = ["MAX_WINDOW", "MIN_WINDOW", "group_bounds", "row_window", "xla_ragged_matmul"]
