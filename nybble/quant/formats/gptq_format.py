"""Import GPTQ checkpoints (AutoGPTQ, optimum, GPTQModel): exact, act-order included.

The checkpoint format only; the GPTQ algorithm itself is ``nybble.quant.gptq``.

The tensors of one 4-bit layer with K inputs, N outputs and group size G (PyTorch ``Linear`` naming, so
K = in_features), as AutoGPTQ's ``QuantLinear`` stores them:

* ``qweight`` int32 [K / 8, N]: packed along K. Word (r, n) holds rows k = 8 r .. 8 r + 7 of column n,
  row 8 r + i in bits [4 i, 4 i + 4). Codes are unsigned, 0..15.
* ``qzeros`` int32 [ceil(K / G), N / 8]: packed along N the same way, word (g, c) holds the zero points of
  columns 8 c + i in nibble i.
* ``scales`` float16 [ceil(K / G), N].
* ``g_idx`` int32 [K] (optional): the group of each row of K; ``k // G`` unless quantized with act-order
  (``desc_act=True``), where rows were quantized in a permuted order and groups are scattered over K.

Dequantization (AutoGPTQ ``qlinear_cuda_old``, exllama, GPTQModel torch kernel alike), in float16::

    w[k, n] = scales[g_idx[k], n] * (qweight_nibble[k, n] - zero[g_idx[k], n])

Zero convention: "v1" (AutoGPTQ, optimum, GPTQModel's default ``checkpoint_format="gptq"``, nearly every
checkpoint on the Hub) stores ``zero - 1``, and dequantization uses ``(stored + 1) & 15``: a symmetric
checkpoint stores 7 (``qzeros == 0x77777777``). "v2" (GPTQModel ``checkpoint_format="gptq_v2"``) stores
the zero itself (8 for symmetric). ``"auto"`` decides from the zeros when they are all 7 or all 8.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from nybble.quant.formats._common import (
    as_array,
    build_weight,
    check_dtype,
    check_shape,
    checked_group_size,
    natural_group_index,
    read_layer,
    unpack_words,
)
from nybble.quant.qweight import QuantizedWeight

ZeroConvention = Literal["auto", "v1", "v2"]


def from_gptq(qweight: Any, qzeros: Any, scales: Any, g_idx: Any = None, **options: Any) -> QuantizedWeight:
    """One GPTQ layer -> ``QuantizedWeight`` of shape (K, N), bit-exact (see the module docstring).

    ``nybble.dequantize(qw, jnp.float16)`` equals the source's float16 dequantization bit for bit, and
    ``nybble.dequantize(qw, jnp.float32)`` is its exact real value ``s * (q - z)``. Symmetric layers keep
    float16 scales (4.125 bits/weight at g128); asymmetric ones store float32 scales and offsets, the
    cheapest dtype in which ``(8 - z) * s`` is exact (``scale_dtype=`` overrides, then inexactly).

    Arguments and options (``bits``, ``sym``, ``zero_convention``, ``group_size``, ``scale_dtype``,
    ``name``) as :func:`from_gptq_act_order`.

    Raises:
      ValueError: malformed tensors (named, with expected and actual shape/dtype), bits != 4, or an
        act-order ``g_idx``: import those with :func:`from_gptq_act_order`.
    """
    qw, perm = from_gptq_act_order(qweight, qzeros, scales, g_idx, **options)
    if perm is not None:
        name = options.get("name", "gptq")
        raise ValueError(
            f"{name}.g_idx: act-order checkpoint (g_idx != arange(K) // G): its rows of K are grouped "
            "out of order. Use nybble.quant.from_gptq_act_order, which returns (weight, perm) "
            "with the rows permuted so groups are contiguous; then y = x[..., perm] @ weight."
        )
    return qw


def from_gptq_act_order(
    qweight: Any,
    qzeros: Any,
    scales: Any,
    g_idx: Any = None,
    *,
    bits: int = 4,
    sym: bool | None = None,
    zero_convention: ZeroConvention = "auto",
    group_size: int | None = None,
    scale_dtype: Any = None,
    name: str = "gptq",
) -> tuple[QuantizedWeight, np.ndarray | None]:
    """One GPTQ layer, act-order included, exactly: returns ``(weight, perm)``.

    With act-order, row k of K belongs to group ``g_idx[k]`` and the groups are scattered. nybble's
    kernels read groups as contiguous runs of G rows, so the rows are reordered by group (a stable sort:
    ``perm = argsort(g_idx)``). Row j of the returned weight is row ``perm[j]`` of the checkpoint, hence

        x @ W_checkpoint == x[..., perm] @ W_returned        (exactly: the same products, re-summed)

    ``perm`` is None when ``g_idx`` is absent or already ``arange(K) // G`` (no gather needed). The
    caller applies ``x[..., perm]`` (or folds it into the previous layer's output columns).

    Args:
      qweight, qzeros, scales, g_idx: the layer's tensors (numpy, jax or anything ``np.asarray`` reads).
      bits: must be 4.
      sym: None decides from the zeros (all 8 -> symmetric); True insists (raises otherwise).
      zero_convention: "v1" (stored zero - 1), "v2" (stored zero) or "auto" (see module docstring).
      group_size: the checkpoint's group size, or None to infer it from the scale rows (-1: per column).
      scale_dtype: stored dtype override (inexact).
      name: used in error messages (the tensor prefix).
    """
    if zero_convention not in ("auto", "v1", "v2"):
        raise ValueError(f"zero_convention must be 'auto', 'v1' or 'v2', got {zero_convention!r}")
    qweight, qzeros, scales = read_layer(
        qweight, qzeros, scales, bits=bits, name=name,
        qweight_layout="[K / 8, N] (int32, 8 codes per word along K)",
    )  # fmt: skip
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    num_groups = scales.shape[0]
    check_shape(scales, f"{name}.scales", (num_groups, n), f"N={n} columns as qweight")
    if n % 8:
        raise ValueError(f"{name}.qweight: N={n} must be a multiple of 8 to pack qzeros along N")
    check_shape(qzeros, f"{name}.qzeros", (num_groups, n // 8), "[ceil(K / G), N / 8]")
    group_size = checked_group_size(k, num_groups, group_size, f"{name}.scales")

    u = unpack_words(qweight, axis=0)  # (K, N): row 8r + i from nibble i of word row r
    stored = unpack_words(qzeros, axis=1)  # (groups, N): column 8c + i from nibble i
    zeros = _resolve_zeros(stored, zero_convention, name)

    natural = natural_group_index(k, group_size)
    perm = None
    if g_idx is not None:
        g_idx = as_array(g_idx, f"{name}.g_idx")
        check_dtype(g_idx, f"{name}.g_idx", "iu", "int32")
        check_shape(g_idx, f"{name}.g_idx", (k,), "one group index per row of K")
        if g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= num_groups:
            raise ValueError(
                f"{name}.g_idx: group indices must lie in [0, {num_groups}), got "
                f"[{int(g_idx.min())}, {int(g_idx.max())}]"
            )
        if not np.array_equal(g_idx, natural):
            perm = np.argsort(g_idx, kind="stable").astype(np.int32)
            if not np.array_equal(g_idx[perm], natural):
                counts = np.bincount(g_idx, minlength=num_groups)
                raise ValueError(
                    f"{name}.g_idx: groups must hold exactly G={group_size} rows each (the last "
                    f"may be short) to be made contiguous; group sizes found: {counts.tolist()}"
                )
            u = u[perm]
    qw = build_weight(u, zeros, scales, group_size, symmetric=sym, scale_dtype=scale_dtype, name=name)
    return qw, perm


def _resolve_zeros(stored: np.ndarray, convention: ZeroConvention, name: str) -> np.ndarray:
    """Stored zero nibbles -> the zero points dequantization subtracts."""
    if convention == "auto":
        if np.all(stored == 7):
            convention = "v1"
        elif np.all(stored == 8):
            convention = "v2"
        else:
            raise ValueError(
                f"{name}.qzeros: cannot tell the zero convention of an asymmetric checkpoint; pass "
                "zero_convention='v1' (AutoGPTQ / optimum / GPTQModel checkpoint_format 'gptq': "
                "stored zero - 1) or 'v2' (GPTQModel checkpoint_format 'gptq_v2')"
            )
    if convention == "v1":
        # AutoGPTQ adds 1 and masks to 4 bits: a stored 15 (zero 0 written as -1) wraps to 0.
        return ((stored.astype(np.int32) + 1) & 0xF).astype(np.uint8)
    return stored
