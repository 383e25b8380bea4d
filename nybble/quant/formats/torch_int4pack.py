"""Export a ``QuantizedWeight`` to torch's tinygemm format (``torch.ops.aten._weight_int4pack_mm``).

Written in numpy from the source of pytorch's ``aten/src/ATen/native/cuda/int4mm.cu`` (the kernel
``matrix_to_m16n8k16_Bint4_layout`` behind ``_convert_weight_to_int4pack_cuda`` with a uint8 [n][k / 2]
input, torch >= 2.5, and ``BLayout_TC_int4::load`` that reads it back); torch is not needed.

Input of ``_convert_weight_to_int4pack`` (:func:`to_torch_uint8_codes`): uint8 [N, K / 2], byte (n, b)
holds unsigned code u = q + 8 of row k = 2 b in its HIGH nibble and of row 2 b + 1 in its LOW nibble.

Output (:func:`to_torch_int4pack`, innerKTiles = 8): int32 [N / 8, K / 128, 32, 4]. Entry
[nt, ko, t, j] serves lane t of the m16n8k16 MMA for column n = 8 nt + t // 4 and the two 16-deep
k-tiles starting at k0 = 128 ko + 32 j. With c = 2 (t % 4), its 8 nibbles (bits [4 i, 4 i + 4)) are::

    i:   0       1           2            3            4          5            6            7
    k:   k0+c    k0+c+8      k0+c+16      k0+c+24      k0+c+1     k0+c+9       k0+c+17      k0+c+25

i.e. the low 16 bits hold the even k of the lane's four B-fragment pairs and the high 16 bits the odd
ones, so one ``lop3`` with mask 0x000f000f and magic 0x4300 makes a bf16x2 pair (k, k + 1) per shift.
The kernel dequantizes ``(u - 8) * scale + zero`` in bf16 with ``scale_and_zero`` bf16 [K / g, N, 2]:
exactly nybble's ``q * scale + offset``, so the pair is (scales, offsets or 0).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from nybble.quant.qweight import QuantizedWeight

TORCH_GROUP_SIZES = (32, 64, 128, 256)
INNER_K_TILES = 8  # 8 k-tiles of 16 per int32x4: the 16-byte load tinygemm's fastest path uses
K_MULTIPLE = INNER_K_TILES * 16


class TorchCodes(NamedTuple):
    """``codes``: uint8 [N_pad, K_pad / 2], the input of ``torch._convert_weight_to_int4pack``."""

    codes: np.ndarray
    scale_and_zero: np.ndarray  # bfloat16 (ml_dtypes) [K_pad / group_size, N_pad, 2]
    group_size: int  # the qGroupSize to pass to torch


class TorchInt4Pack(NamedTuple):
    """``packed``: int32 [N_pad / 8, K_pad / 128, 32, 4], ``_convert_weight_to_int4pack(codes, 8)``."""

    packed: np.ndarray
    scale_and_zero: np.ndarray  # bfloat16 (ml_dtypes) [K_pad / group_size, N_pad, 2]
    group_size: int


def _unsigned_codes_nk(qw: QuantizedWeight, dtype: type) -> np.ndarray:
    """Unsigned codes u = q + 8 as (N_pad, K_pad), 0..15."""
    return (np.asarray(qw.logical_codes()).astype(np.int16) + 8).astype(dtype).T


def _torch_group_size(qw: QuantizedWeight) -> int:
    """tinygemm's qGroupSize for this weight: its own group, or 128-row sub-groups of a larger one."""
    k_pad, _ = qw.padded_shape
    g = qw.group
    if g < TORCH_GROUP_SIZES[0]:
        raise ValueError(
            f"torch tinygemm supports group sizes {TORCH_GROUP_SIZES}, this weight has g{g}; "
            "requantize with group_size >= 32"
        )
    if g in TORCH_GROUP_SIZES and k_pad % g == 0:
        return g
    # Larger (or partial-last) groups: repeat each scale row over 128-row sub-groups, which all lie
    # inside one nybble group because g is a power of two >= 128 (or the whole of K).
    _check_k(qw, K_MULTIPLE, f"group g{g} re-expressed as 128-row tinygemm groups")
    return K_MULTIPLE


def _scale_and_zero(qw: QuantizedWeight, group_size: int) -> np.ndarray:
    import ml_dtypes

    k_pad = qw.padded_shape[0]
    rows = np.arange(k_pad // group_size) * group_size // qw.group  # nybble group of each torch group
    scales = np.asarray(qw.scales, np.float32)[rows]
    zeros = np.zeros_like(scales) if qw.offsets is None else np.asarray(qw.offsets, np.float32)[rows]
    return np.stack([scales, zeros], axis=-1).astype(ml_dtypes.bfloat16)


def _check_k(qw: QuantizedWeight, multiple: int, why: str) -> None:
    k_pad, _ = qw.padded_shape
    if k_pad % multiple:
        raise ValueError(
            f"torch tinygemm ({why}) needs K to be a multiple of {multiple}; this weight has K_pad={k_pad} "
            f"(K={qw.shape[0]}). Zero-pad the float weight to K={-(-k_pad // multiple) * multiple} rows "
            f"(and x to as many columns) and requantize"
        )


def _check(qw: QuantizedWeight) -> None:
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"expected a QuantizedWeight, got {type(qw).__name__}")


def to_torch_uint8_codes(qw: QuantizedWeight) -> TorchCodes:
    """The uint8 [N_pad, K_pad / 2] input of ``torch._convert_weight_to_int4pack`` and its scales.

    Byte (n, b) = (u[2b, n] << 4) | u[2b + 1, n] with u = q + 8 (gpt-fast / torchao packing: even k
    in the HIGH nibble). ``scale_and_zero`` is bf16 [K_pad / g, N_pad, 2] = (scale, offset): exact when
    the weight's scale dtype is bfloat16, rounded to bf16 otherwise. The product of the torch op has
    N_pad columns; slice ``[:, :N]``. Needs K_pad to be a multiple of the tinygemm group (convert with
    innerKTiles 2 or 4 when K_pad is not a multiple of 128).
    """
    _check(qw)
    group_size = _torch_group_size(qw)
    u = _unsigned_codes_nk(qw, np.uint8)
    codes = (u[:, 0::2] << 4) | u[:, 1::2]
    return TorchCodes(codes.astype(np.uint8), _scale_and_zero(qw, group_size), group_size)


def to_torch_int4pack(qw: QuantizedWeight) -> TorchInt4Pack:
    """The int32 [N_pad / 8, K_pad / 128, 32, 4] tensor ``_convert_weight_to_int4pack(codes, 8)`` returns.

    Pass ``packed``, ``group_size`` and ``scale_and_zero`` (as torch bf16 tensors on the GPU) to
    ``torch.ops.aten._weight_int4pack_mm(x_bf16, packed, group_size, scale_and_zero)``. Needs K_pad
    to be a multiple of 128 and a group size of at least 32 (larger or per-column groups are
    re-expressed at g128 by repeating scale rows, exactly).
    """
    _check(qw)
    _check_k(qw, K_MULTIPLE, f"innerKTiles={INNER_K_TILES}")
    group_size = _torch_group_size(qw)
    k_pad, n_pad = qw.padded_shape
    u = _unsigned_codes_nk(qw, np.uint32)
    # Split n = 8 nt + tr and k = 128 ko + 32 j + 16 tile + 8 half + 2 tq + e, where the lane is
    # t = 4 tr + tq, j picks the int32 of the lane's int4 (16-byte) vector, tile the k-tile of the pair,
    # half the +8 rows of the fragment and e the even/odd k of a bf16x2 pair.
    v = u.reshape(n_pad // 8, 8, k_pad // 128, 4, 2, 2, 4, 2)
    # -> (nt, ko, tr, tq, j, e, tile, half): nibble index i = 4 e + 2 tile + half.
    v = v.transpose(0, 2, 1, 6, 3, 7, 4, 5).reshape(n_pad // 8, k_pad // 128, 32, 4, 8)
    words = np.bitwise_or.reduce(v << (np.arange(8, dtype=np.uint32) * 4), axis=-1)
    return TorchInt4Pack(words.view(np.int32), _scale_and_zero(qw, group_size), group_size)
