"""GPTQ (Frantar et al., 2022): int4 weights that minimize the layer's output error on calibration data.

The algorithm; importing checkpoints other tools made with it is ``nybble.quant.formats.gptq_format``.

For a layer ``y = x @ w`` with ``w`` of shape (K, N) and calibration inputs ``X`` (n, K), GPTQ quantizes
the rows of ``w`` (the input features) one at a time and, after each, spreads that row's rounding error
over the rows not yet quantized so that ``X @ w`` moves as little as possible. With the Hessian
``H = 2 X^T X / n`` of the squared output error and ``U`` the upper Cholesky factor of ``H^-1``
(``H^-1 = U^T U``), quantizing row k with error ``e = (w_k - dequant(q_k)) / U[k, k]`` updates
``w_j -= U[k, j] e`` for every later row j. This is the paper's Algorithm 1:

* blocked: rows are processed in blocks of ``block_size``; inside a block the updates are applied row by
  row to the block only, the rest of the matrix receives them as one (K - k) x B x N matmul per block
  ("lazy batch updates");
* group parameters (scale and offset of a group of ``group_size`` rows) are computed when quantization
  reaches the group, from the weights as updated so far. Blocks are a multiple of the group size
  (``block_size`` is raised to ``group_size`` if smaller), so a group's rows are all fully updated then;
* the rounding itself is nybble's (``nybble.quantize``'s scale rule, the scale dtype's rounding, signed
  codes, asymmetric offsets), so the result is an ordinary ``QuantizedWeight`` every kernel runs and the
  error fed back is the error of the values the kernels will actually multiply with.

Act-order (``act_order=True``) quantizes rows in order of decreasing Hessian diagonal (the most
"important" inputs first, while the most rows remain to absorb their error). Checkpoints made that way
usually carry a ``g_idx`` that scatters groups over K and need a gather (or a permuted input) at run
time. nybble instead uses **static groups**: every group's scale and offset are computed up front from
the original weights in natural order, so row k keeps group k // G whatever order it is quantized in,
and the result is a plain natural-order ``QuantizedWeight`` (no permutation, no gather on K). This is
AutoGPTQ's ``desc_act=True, static_groups=True``. Per-column quantization (``group_size=None``) likewise
fixes its one scale per column up front, as in the reference implementation.

After the codes are chosen, ``refit_scales=True`` (the default) re-solves each group's scale and offset by
least squares on the same objective (``nybble.quant.refit``); ``refit_scales=False`` is the paper's result.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from nybble.packing import (
    group_rows,
    num_groups,
    pad_to,
    padded_weight_dims,
    round_up,
)
from nybble.quant.lapack_threads import one_blas_thread, ready
from nybble.quant.qformat import FormatFields, QuantFormat, with_fields
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.refit import damped_hessian, integer_zero_scales, least_squares_params
from nybble.quant.rtn import check_weight, group_params, round_to_codes
from nybble.quant.stacked import check_stacked_float, stack_weights

__all__ = ["HessianAccumulator", "gptq", "hessian_from_inputs"]


class HessianAccumulator:
    """Accumulates ``H = 2 X^T X / n`` over batches of inputs, in float32, without storing them.

    ``acc.add(x)`` takes any (..., K) array (all leading axes are samples); ``acc.hessian`` is the
    result. Memory: one (K, K) float32 matrix.
    """

    def __init__(self, k: int):
        self.k = int(k)
        self.xtx = jnp.zeros((self.k, self.k), jnp.float32)
        self.count = 0

    def add(self, x: Any) -> None:
        x = jnp.asarray(x)
        if x.shape[-1] != self.k:
            raise ValueError(f"HessianAccumulator: expected inputs (..., {self.k}), got {tuple(x.shape)}")
        x2 = x.reshape(-1, self.k)
        self.xtx = self.xtx + _xtx(x2)
        self.count += x2.shape[0]

    @property
    def hessian(self) -> jax.Array:
        if self.count == 0:
            raise ValueError("HessianAccumulator: no inputs were added")
        return self.xtx * (2.0 / self.count)


@jax.jit
def _xtx(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return jnp.matmul(x.T, x, precision=jax.lax.Precision.HIGHEST)


def hessian_from_inputs(x: Any | Iterable[Any]) -> jax.Array:
    """``2 X^T X / n`` (K, K) float32 from calibration inputs (..., K) or an iterable of such batches."""
    if hasattr(x, "shape"):
        x = [x]
    acc: HessianAccumulator | None = None
    for batch in x:
        if acc is None:
            acc = HessianAccumulator(np.shape(batch)[-1])
        acc.add(batch)
    if acc is None:
        raise ValueError("hessian_from_inputs: no inputs given")
    return acc.hessian


def gptq(
    w: Any,
    hessian: Any = None,
    *,
    inputs: Any = None,
    format: QuantFormat | None = None,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool | None = None,
    clip_search: bool = False,
    refit_scales: bool = True,
    **fields: Unpack[FormatFields],
) -> QuantizedWeight:
    """GPTQ-quantizes a float weight (K, N) = (in_features, out_features) to a ``QuantizedWeight``.

    Args:
      w: float weight, the layout of a Flax ``kernel`` (``y = x @ w``); or a stack of expert weights
        (E, K, N), which gives a stacked weight (``nybble.quant.stacked``), each expert quantized on its
        own Hessian: then ``hessian`` is (E, K, K) or ``inputs`` a sequence of E arrays (the tokens routed
        to each expert).
      hessian: (K, K) ``2 X^T X / n`` of the layer's inputs (see :func:`hessian_from_inputs`), or
      inputs: the calibration inputs (..., K) themselves (exactly one of the two).
      format: the stored format (a :class:`nybble.QuantFormat`), or its fields as keywords
        (``group_size``, ``symmetric``, ``scale_dtype``, ``layout``, ``zero_point``), as in
        ``nybble.quantize``. With ``zero_point="integer"`` (asymmetric groups with an integer zero point,
        as the reference GPTQ and every GPTQ checkpoint) the refit keeps each group's zero and re-solves
        its scale only (offsets stay ``(8 - z) * s``, float32, exact).
      damp: dampening, as a fraction of the mean Hessian diagonal added to the diagonal.
      block_size: rows per lazy-update block (raised to ``group_size`` when smaller).
      act_order: quantize rows by decreasing Hessian diagonal (implies static groups, see module doc).
      static_groups: compute every group's parameters up front from the original weights (default:
        ``act_order``). ``act_order=True`` with ``static_groups=False`` is refused: it would need a
        permutation of K at run time.
      clip_search: choose each group's range shrink (``nybble.quant.rtn.CLIP_GRID``) by least squared
        weight error, as the reference implementation's ``mse`` option does.
      refit_scales: once the codes are chosen, re-solve every group's scale (and offset) by least squares
        on the layer's output error (``nybble.quant.refit``): never worse on the calibration data, and
        clearly better on SmolLM2-135M (README). ``False`` gives the paper's algorithm exactly.

    Inputs with a zero Hessian diagonal ("dead" inputs, never non-zero in the calibration data) get
    weight 0 before quantization, as in the reference implementation. Runs under ``jax.jit`` (the
    algorithm is one jitted function per shape); all arithmetic is float32.
    """
    fmt = with_fields(format, dict(fields), "gptq")
    options = dict(
        format=fmt,
        damp=damp,
        block_size=block_size,
        act_order=act_order,
        static_groups=static_groups,
        clip_search=clip_search,
        refit_scales=refit_scales,
    )
    if getattr(w, "ndim", None) == 3:  # a stack of experts: each on its own Hessian (its routed tokens)
        return _gptq_stacked(w, hessian, inputs, **options)
    check_weight(w, "gptq")
    group_size, symmetric, integer = fmt.group_size, fmt.symmetric, fmt.integer_zero
    if (hessian is None) == (inputs is None):
        raise ValueError("gptq: pass exactly one of hessian= (K, K) or inputs= (..., K)")
    k, n = w.shape
    h = hessian_from_inputs(inputs) if hessian is None else jnp.asarray(hessian, jnp.float32)
    if h.shape != (k, k):
        raise ValueError(f"gptq: Hessian must be ({k}, {k}) for a weight of shape {(k, n)}, got {h.shape}")
    if not (isinstance(block_size, int) and block_size > 0):
        raise ValueError(f"gptq: block_size must be a positive int, got {block_size!r}")
    if not 0 <= damp:
        raise ValueError(f"gptq: damp must be >= 0, got {damp}")
    if static_groups is None:
        static_groups = act_order
    if act_order and not static_groups:
        raise ValueError(
            "gptq: act_order=True needs static_groups=True (the default): dynamic groups under act-order "
            "scatter each group over K and would need a permutation of the input at run time"
        )
    k_pad, n_pad = padded_weight_dims(k, n)
    block = block_size if group_size is None else max(block_size, group_size)
    if group_size is not None and block % group_size:
        raise ValueError(f"gptq: block_size {block_size} must be a multiple of group_size {group_size}")
    with one_blas_thread():  # the factorizations run in LAPACK on the CPU: see nybble.quant.lapack_threads
        codes, scales, offsets, ok = ready(
            _gptq_core(
                jnp.asarray(w, jnp.float32),
                h,
                k=k,
                k_pad=k_pad,
                n_pad=n_pad,
                k_loop=round_up(k_pad, block),
                fmt=fmt,
                damp=float(damp),
                block=block,
                act_order=act_order,
                static_groups=static_groups or group_size is None,
                clip_search=bool(clip_search),
            )
        )
        if not isinstance(ok, jax.core.Tracer) and not bool(ok):
            raise ValueError(
                f"gptq: the damped Hessian of this ({k}, {n}) layer is not positive definite in float32 "
                f"(damp={damp}); raise damp (e.g. 0.1) or use more calibration data"
            )
        if refit_scales:  # dead inputs hold weight 0 and code 0, as in the core
            target = jnp.where((jnp.diag(h) == 0)[:, None], 0.0, jnp.asarray(w, jnp.float32))
            if integer:  # the zeros stay, the scales are re-solved (nybble.quant.refit)
                scales, offsets = ready(integer_zero_scales(
                    codes, target, damped_hessian(h, float(damp)), scales, offsets,
                    group_size=group_size, scale_dtype=fmt.dtype,
                ))  # fmt: skip
            else:
                scales, offsets = ready(least_squares_params(
                    codes, target, damped_hessian(h, float(damp)), scales, offsets,
                    group_size=group_size, symmetric=symmetric, scale_dtype=fmt.dtype,
                ))  # fmt: skip
    return QuantizedWeight.from_codes(
        codes, scales, offsets, shape=(k, n), group_size=group_size, layout=fmt.layout
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "k", "k_pad", "n_pad", "k_loop", "fmt", "damp", "block", "act_order", "static_groups",
        "clip_search",
    ),
)  # fmt: skip
def _gptq_core(w, h, *, k, k_pad, n_pad, k_loop, fmt, damp, block, act_order, static_groups,
               clip_search):  # fmt: skip
    """Returns (codes int8 (K_pad, N_pad) in natural row order, scales, offsets or None, ok).

    ``ok`` is False when a Cholesky factorization failed (non-finite factor).
    """
    group_size, symmetric, scale_dtype = fmt.group_size, fmt.symmetric, fmt.dtype
    g, ng = group_rows(k_pad, group_size), num_groups(k_pad, group_size)
    groups_loop = -(-k_loop // g)
    real = jnp.arange(k_loop) < k
    # Dead inputs (zero Hessian diagonal) get weight 0 and H_kk = 1; rows padded up to a whole number
    # of blocks get the same: zero weight, an identity Hessian row, no coupling, code 0.
    diag = jnp.diag(h)
    dead = diag == 0
    alive = jnp.pad(~dead, (0, k_loop - k))
    w = jnp.where(alive[:, None], pad_to(w, (k_loop, n_pad)), 0.0)
    h = pad_to(damped_hessian(h, damp), (k_loop, k_loop)) + jnp.diag(jnp.where(real, 0.0, 1.0))

    if static_groups:  # parameters from the original weights, natural order: row k keeps group k // G
        wg = pad_to(w, (groups_loop * g, n_pad)).reshape(groups_loop, g, n_pad)
        vg = (jnp.arange(groups_loop * g) < k).reshape(groups_loop, g, 1)
        st_scales, st_offsets = group_params(wg, vg, fmt, clip_search=clip_search)
        st_s = st_scales.astype(jnp.float32)
        st_b = jnp.zeros_like(st_s) if st_offsets is None else st_offsets.astype(jnp.float32)

    if act_order:  # largest diagonal first; padded rows last
        perm = jnp.argsort(-jnp.where(real, jnp.diag(h), -jnp.inf), stable=True)
        w, h = w[perm], h[perm][:, perm]
    else:
        perm = jnp.arange(k_loop)

    # U: upper Cholesky factor of H^-1 (H^-1 = U^T U); row k of U carries row k's error forward.
    low = jnp.linalg.cholesky(h)
    hinv = jax.scipy.linalg.cho_solve((low, True), jnp.eye(k_loop, dtype=jnp.float32))
    u = jnp.linalg.cholesky(hinv).T
    ok = jnp.all(jnp.isfinite(u))

    def quantize_block(b: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        """Rows [b * block, (b + 1) * block): one row at a time inside, then one lazy batch update."""
        w, codes, dyn_s, dyn_b = carry
        k0 = b * block
        u_rows = jax.lax.dynamic_slice_in_dim(u, k0, block)  # (block, k_loop)
        u1 = jax.lax.dynamic_slice_in_dim(u_rows, k0, block, axis=1)
        zeros = jnp.zeros((block, n_pad), jnp.float32)
        blk = (jax.lax.dynamic_slice_in_dim(w, k0, block), zeros, zeros)
        if static_groups:
            rows = jax.lax.dynamic_slice_in_dim(perm, k0, block) // g
            blk = jax.lax.fori_loop(0, block, functools.partial(_row_step, u1, st_s[rows], st_b[rows]), blk)
        else:
            for start in range(0, block, g):  # a dynamic group: parameters from the updated rows
                valid = jax.lax.dynamic_slice_in_dim(real, k0 + start, g)[:, None]
                sc, of = group_params(blk[0][start : start + g], valid, fmt, clip_search=clip_search)
                j = (k0 + start) // g
                dyn_s = dyn_s.at[j].set(sc)
                s_rows = jnp.broadcast_to(sc.astype(jnp.float32), (block, n_pad))
                b_rows = jnp.zeros_like(s_rows)
                if of is not None:
                    dyn_b = dyn_b.at[j].set(of)
                    b_rows = jnp.broadcast_to(of.astype(jnp.float32), s_rows.shape)
                step = functools.partial(_row_step, u1, s_rows, b_rows)
                blk = jax.lax.fori_loop(start, start + g, step, blk)
        _, q1, e1 = blk
        codes = jax.lax.dynamic_update_slice_in_dim(codes, q1, k0, 0)
        # Lazy batch update of every later row; U's columns up to the block's end are masked to zero, so
        # the rows already quantized receive exactly 0.
        u_later = jnp.where(jnp.arange(k_loop) >= k0 + block, u_rows, 0.0)
        w = w - jnp.matmul(u_later.T, e1, precision=jax.lax.Precision.HIGHEST)
        return w, codes, dyn_s, dyn_b

    no_params = jnp.zeros((groups_loop, n_pad), scale_dtype)
    # Integer zero points keep their offsets in float32 (exact), so the carry does too.
    no_offsets = jnp.zeros((groups_loop, n_pad), jnp.float32 if fmt.integer_zero else scale_dtype)
    carry = (w, jnp.zeros((k_loop, n_pad), jnp.float32), no_params, no_offsets)
    _, codes, dyn_scales, dyn_offsets = jax.lax.fori_loop(0, k_loop // block, quantize_block, carry)

    codes = jnp.zeros_like(codes).at[perm].set(codes)  # back to natural row order
    codes = jnp.where(real[:, None], codes, 0)[:k_pad].astype(jnp.int8)
    if static_groups:
        scales, offsets = st_scales, st_offsets
    else:
        scales, offsets = dyn_scales, None if symmetric else dyn_offsets
    # Groups wholly past K hold zero scales and offsets, as in nybble.quantize.
    return codes, scales[:ng], None if offsets is None else offsets[:ng], ok


def _row_step(u1, s_rows, b_rows, i, carry):
    """Quantize row i of the block and push its error onto the block's later rows."""
    w1, q1, e1 = carry
    row = w1[i]
    q, dq = round_to_codes(row, s_rows[i], b_rows[i])
    err = (row - dq) / u1[i, i]
    later = jnp.where(jnp.arange(u1.shape[0]) > i, u1[i], 0.0)
    w1 = w1 - later[:, None] * err[None, :]
    return w1, q1.at[i].set(q), e1.at[i].set(err)


def _gptq_stacked(w: Any, hessian: Any, inputs: Any, **options: Any) -> QuantizedWeight:
    """``gptq`` of each expert of an (E, K, N) stack on its own Hessian, stacked (nybble.quant.stacked)."""
    check_stacked_float(w, "gptq")
    e, k, _ = w.shape
    if (hessian is None) == (inputs is None):
        raise ValueError("gptq: pass exactly one of hessian= (E, K, K) or inputs= (E arrays of (..., K))")
    if hessian is not None and tuple(np.shape(hessian)) != (e, k, k):
        raise ValueError(
            f"gptq: an expert stack of shape {tuple(w.shape)} needs one Hessian per expert, (E, K, K) = "
            f"{(e, k, k)}, got {tuple(np.shape(hessian))}"
        )
    if inputs is not None and len(inputs) != e:
        raise ValueError(f"gptq: an expert stack of {e} experts needs {e} input arrays, got {len(inputs)}")
    per_expert = []
    for i in range(e):
        h, x = (hessian[i], None) if hessian is not None else (None, inputs[i])
        per_expert.append(gptq(w[i], h, inputs=x, **options))
    return stack_weights(per_expert)
