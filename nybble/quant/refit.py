"""Least-squares group parameters for fixed int4 codes: the exact minimum of a layer's output error.

Once a weight's codes ``q`` are fixed (by GPTQ or round to nearest), its dequantized value is linear in the
group parameters: in column n, row k of group j is ``q[k, n] * s[j, n]`` (asymmetric: ``+ o[j, n]``). The
output error on calibration inputs X, ``|X (w - w_hat)|^2``, is then a quadratic form in each column's
parameters under ``H = 2 X^T X / n``, columns independent of each other:

    column n:  minimize (w_n - B_n p_n)^T H (w_n - B_n p_n)   over p_n = (s[:, n], o[:, n])

where the columns of ``B_n`` are the basis vectors ``q[:, n]`` restricted to one group (and, asymmetric,
the group's indicator). The minimum is one small solve per column: ``(B^T H B) p = B^T H w``, a (G, G)
system (2G asymmetric) for G groups. GPTQ chooses codes against scales fixed up front (from the
weights' ranges); re-solving the scales for the codes it chose can only lower the objective GPTQ
minimizes, at the cost of about one (K, K) x (K, N) matmul.

The Gram matrix ``B^T H B`` is built one group of columns at a time (``H[:, group j] @ q[group j]``), so
memory stays at a few (K, N) arrays plus the (N, G, G) systems.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nybble.packing import group_rows, pad_to
from nybble.quant.lapack_threads import one_blas_thread, ready
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.rtn import integer_zero_factor

__all__ = ["damped_hessian", "integer_zero_scales", "least_squares_params", "refit_group_params"]

_HI = jax.lax.Precision.HIGHEST


def damped_hessian(h: jax.Array, damp: float) -> jax.Array:
    """``H + damp * mean(diag H) * I`` with dead inputs (zero diagonal) given a unit diagonal, as GPTQ."""
    diag = jnp.diag(h)
    dead = diag == 0
    return h + jnp.diag(jnp.where(dead, 1.0, 0.0) + damp * jnp.mean(jnp.where(dead, 1.0, diag)))


@functools.partial(jax.jit, static_argnames=("group_size", "symmetric", "scale_dtype"))
def least_squares_params(
    codes: jax.Array,
    w: jax.Array,
    h: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    *,
    group_size: int | None,
    symmetric: bool,
    scale_dtype: Any,
) -> tuple[jax.Array, jax.Array | None]:
    """Scales (and offsets) minimizing ``(w - w_hat)^T h (w - w_hat)`` per column for fixed ``codes``.

    Args:
      codes: (K_pad, N_pad) int8 codes in natural row order.
      w: (K, N) float32 target weight.
      h: (K, K) positive definite (damped) Hessian.
      scales, offsets: the current parameters (ceil(K_pad / G), N_pad); a parameter no data constrains
        (a group whose codes are all 0 in that column, padding) keeps its current value.
    Returns (scales, offsets or None) in ``scale_dtype``.
    """
    k_pad, n_pad = codes.shape
    ng = scales.shape[0]
    g = group_rows(k_pad, group_size)
    rows = ng * g  # whole groups; rows past K hold code 0 and no Hessian coupling
    q = pad_to(codes.astype(jnp.float32), (rows, n_pad))
    w = pad_to(w.astype(jnp.float32), (rows, n_pad))
    h = pad_to(h.astype(jnp.float32), (rows, rows))

    def group_sums(v: jax.Array) -> jax.Array:  # (rows, ...) -> (ng, ...): sum over each group's rows
        return v.reshape(ng, g, *v.shape[1:]).sum(1)

    def gram_against_group(j: jax.Array) -> list[jax.Array]:
        """Inner products <basis(g1), H basis(j)> for every group g1, each (ng, N_pad)."""
        h_j = jax.lax.dynamic_slice_in_dim(h, j * g, g, axis=1)  # H's columns of group j
        hq = jnp.matmul(h_j, jax.lax.dynamic_slice_in_dim(q, j * g, g), precision=_HI)  # H @ scale basis j
        out = [group_sums(q * hq)]
        if not symmetric:
            h1 = h_j.sum(1, keepdims=True)  # H @ offset basis j (the group's indicator)
            out += [group_sums(hq), group_sums(q * h1), jnp.broadcast_to(group_sums(h1), (ng, n_pad))]
        return out

    # Each block is (j, g1, N); as matrices per column: A[n, g1, j].
    blocks = [b.transpose(2, 1, 0) for b in jax.lax.map(gram_against_group, jnp.arange(ng))]
    hw = jnp.matmul(h, w, precision=_HI)
    rhs = [group_sums(q * hw)]
    current = [scales.astype(jnp.float32)]
    if symmetric:
        gram = blocks[0]
    else:  # parameters ordered (scales, offsets): [[ss, so], [os, oo]]
        ss, os_, so, oo = blocks
        gram = jnp.concatenate([jnp.concatenate([ss, so], 2), jnp.concatenate([os_, oo], 2)], 1)
        rhs.append(group_sums(hw))
        current.append(offsets.astype(jnp.float32))
    rhs = jnp.concatenate(rhs).T  # (N, P)
    current = jnp.concatenate(current).T
    # A ridge far below the data's scale, pulling towards the current parameters: it decides only the
    # parameters the data leaves free (all-zero codes, padding), where the Gram matrix is singular.
    ridge = 1e-6 * jnp.trace(gram, axis1=1, axis2=2) / gram.shape[-1] + 1e-30
    eye = jnp.eye(gram.shape[-1], dtype=jnp.float32)
    sol = jnp.linalg.solve(gram + ridge[:, None, None] * eye, (rhs + ridge[:, None] * current)[..., None])
    sol = sol[..., 0].T.astype(scale_dtype)
    return sol[:ng], None if symmetric else sol[ng:]


def integer_zero_scales(
    codes: jax.Array, w: jax.Array, h: jax.Array, scales: jax.Array, offsets: jax.Array, *,
    group_size: int | None, scale_dtype: Any,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """:func:`least_squares_params` keeping each group's integer zero z (``offsets == (8 - z) * s``).

    ``w = q * s + (8 - z) * s = (q + 8 - z) * s`` is linear in s alone: a scale-only (symmetric) fit of
    the codes shifted by each group's ``8 - z``. Returns the new scales (``scale_dtype``) and offsets
    ``(8 - z) * s`` in float32 (exact), so the weight keeps its integer zero points.
    """
    zf = integer_zero_factor(scales, offsets)
    k_pad = codes.shape[0]
    shifted = codes.astype(jnp.float32) + jnp.repeat(zf, group_rows(k_pad, group_size), axis=0)[:k_pad]
    new, _ = least_squares_params(
        shifted.astype(jnp.int8), w, h, scales, None,
        group_size=group_size, symmetric=True, scale_dtype=scale_dtype,
    )  # fmt: skip
    return new, zf * new.astype(jnp.float32)


def refit_group_params(
    qweight: QuantizedWeight, w: Any, hessian: Any, *, damp: float = 0.01, zero_point: str = "float"
) -> QuantizedWeight:
    """``qweight`` with the same codes and its scales/offsets re-solved by least squares (module doc).

    Args:
      qweight: the quantized weight (any method) whose codes are kept.
      w: the float weight (K, N) it approximates.
      hessian: (K, K) ``2 X^T X / n`` of the layer's calibration inputs (see
        ``nybble.quant.hessian_from_inputs``).
      damp: dampening, a fraction of the mean Hessian diagonal added to the diagonal (as GPTQ's).
      zero_point: "integer" keeps an asymmetric weight's integer zero points and re-solves its scales
        only (:func:`integer_zero_scales`); "float" re-solves scales and offsets freely.

    The result has the scale dtype, group size and layout of ``qweight``; on the calibration inputs its
    output error is never larger than ``qweight``'s beyond the scale dtype's rounding.
    """
    k, n = qweight.shape
    if np.shape(w) != (k, n):
        raise ValueError(f"refit_group_params: w must have the weight's shape {(k, n)}, got {np.shape(w)}")
    if np.shape(hessian) != (k, k):
        raise ValueError(f"refit_group_params: hessian must be ({k}, {k}), got {np.shape(hessian)}")
    if not damp >= 0:
        raise ValueError(f"refit_group_params: damp must be >= 0, got {damp}")
    h = damped_hessian(jnp.asarray(hessian, jnp.float32), float(damp))
    if zero_point == "integer" and not qweight.symmetric:
        with one_blas_thread():
            scales, offsets = ready(
                integer_zero_scales(
                    qweight.logical_codes(), jnp.asarray(w, jnp.float32), h, qweight.scales, qweight.offsets,
                    group_size=qweight.group_size, scale_dtype=qweight.dtype,
                )
            )  # fmt: skip
        return dataclasses.replace(qweight, scales=scales, offsets=offsets)
    with one_blas_thread():  # the batched solve runs in LAPACK on the CPU: nybble.quant.lapack_threads
        scales, offsets = ready(
            least_squares_params(
                qweight.logical_codes(),
                jnp.asarray(w, jnp.float32),
                h,
                qweight.scales,
                qweight.offsets,
                group_size=qweight.group_size,
                symmetric=qweight.symmetric,
                scale_dtype=qweight.dtype,
            )
        )
    return dataclasses.replace(qweight, scales=scales, offsets=offsets)
