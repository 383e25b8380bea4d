"""What every Hugging Face quantized-linear format shares (``nybble.quant.formats.hf_scheme`` picks the
format): the reader and writer bases, tensor access with clear errors, 4-bit packing, and the exact
conversion of unsigned codes and integer zeros to a ``QuantizedWeight``."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from nybble.quant.formats._common import (
    build_weight,
    check_dtype,
    checked_group_size,
    natural_group_index,
    regroup_natural,
)
from nybble.quant.qweight import QuantizedWeight

SUPPORTED = (
    "compressed-tensors 'pack-quantized' (4-bit int weights only: symmetric or asymmetric, strategy "
    "'group' or 'channel', actorder, no activation quantization); "
    "gptq (bits 4, checkpoint_format 'gptq' or 'gptq_v2', desc_act, sym); "
    "awq (bits 4, version 'gemm'); "
    "auto-round (bits 4, data_type int, packing_format auto_round, auto_round:auto_gptq, auto_round:gptq, "
    "auto_round:gptqmodel, auto_round:auto_awq); "
    "nybble (nybble's own codes)"
)
WRITE_FORMATS = ("compressed-tensors", "gptq", "nybble")

Getter = Callable[[str], Any]


def _unsupported(what: str) -> ValueError:
    return ValueError(f"quantization_config: {what} is not supported. nybble reads: {SUPPORTED}")


def _get(get: Getter, name: str) -> np.ndarray:
    """One tensor through the caller's getter; a missing tensor is an error that names it."""
    try:
        value = get(name)
    except KeyError:
        value = None
    if value is None:
        raise ValueError(f"{name}: missing from the checkpoint (the quantization_config says it is there)")
    return np.asarray(value)


def _get_optional(get: Getter, name: str) -> np.ndarray | None:
    try:
        value = get(name)
    except KeyError:
        return None
    return None if value is None else np.asarray(value)


def _check_int32(x: np.ndarray, name: str) -> None:
    check_dtype(x, name, "iu", "int32")
    if x.dtype.itemsize != 4:
        raise ValueError(f"{name}: expected dtype int32, got {x.dtype.name}")


def _check_bits(bits: Any, where: str) -> None:
    if bits != 4:
        raise _unsupported(f"{where}={bits!r} (only 4-bit weights)")


class HFScheme:
    """How one directory stores its quantized linears (built by :func:`scheme_from_config`).

    Module names are Hugging Face module paths (``model.layers.0.self_attn.q_proj``); every method is
    asked only about linear modules.
    """

    quant_method: str = ""

    def __init__(self, config: dict) -> None:
        self.config = config

    def is_quantized(self, module_name: str) -> bool:
        """Whether this linear is stored quantized (else it is a float ``.weight``)."""
        raise NotImplementedError

    def tensor_names(self, module_name: str, available: Container[str] | None = None) -> list[str]:
        """The tensors this linear's quantized form is stored as (all must be present).

        A format's optional tensors (:meth:`optional_tensor_names`, e.g. a GPTQ ``g_idx`` that only some
        exporters write) are included when ``available`` (the checkpoint's tensor names) holds them, or,
        without ``available``, when the format's usual writer always writes them.
        """
        names = self._required(module_name)
        for name in self.optional_tensor_names(module_name):
            if name not in names and (name in available if available is not None else self._usual(name)):
                names.append(name)
        return names

    def optional_tensor_names(self, module_name: str) -> list[str]:
        """Tensors this linear may also have (read when present): the rest of the checkpoint's tensors
        under this module are not the format's."""
        return []

    def _required(self, module_name: str) -> list[str]:
        raise NotImplementedError

    def _usual(self, name: str) -> bool:
        """Whether an optional tensor is written by the format's usual exporter (assumed when unknown)."""
        return False

    def read_linear(
        self, module_name: str, get: Getter, *, in_features: int, out_features: int
    ) -> QuantizedWeight:
        """This linear as a (K=in, N=out) QuantizedWeight, exact. ``get(name)`` returns one tensor (a
        numpy array; KeyError or None when absent). Raises ValueError naming the tensor, its expected and
        found shape/dtype; and for an activation-order layer that needs an input permutation (use
        :meth:`read_linear_with_perm`)."""
        qw, perm = self.read_linear_with_perm(
            module_name, get, in_features=in_features, out_features=out_features
        )
        if perm is not None:
            raise ValueError(
                f"{module_name}: activation-order layer whose groups are scattered over K finer than 16 rows "
                "(g_idx): it is exact only with its input permuted. Read it with "
                "scheme.read_linear_with_perm(...) -> (weight, perm) and compute x[..., perm] @ weight"
            )
        return qw

    def read_linear_with_perm(
        self, module_name: str, get: Getter, *, in_features: int, out_features: int
    ) -> tuple[QuantizedWeight, np.ndarray | None]:
        """``(weight, perm)``: perm None, or int32 (K,) with ``x @ W == x[..., perm] @ weight`` exactly."""
        raise NotImplementedError


def _finish(
    u: np.ndarray,
    zeros: np.ndarray,
    scales: np.ndarray,
    group_size: int | None,
    g_idx: np.ndarray | None,
    *,
    symmetric: bool | None,
    name: str,
) -> tuple[QuantizedWeight, np.ndarray | None]:
    """Unsigned codes (K, N), unsigned zeros and scales (groups, N), g_idx or None -> exact weight, perm."""
    k = u.shape[0]
    group_size = checked_group_size(k, scales.shape[0], group_size, f"{name} scales")
    perm = None
    if g_idx is not None:
        groups = scales.shape[0]
        if g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= groups:
            raise ValueError(
                f"{name}: g_idx values must lie in [0, {groups}) (one of the {groups} scale rows), got "
                f"[{int(g_idx.min())}, {int(g_idx.max())}]"
            )
        regrouped = regroup_natural(g_idx, k, group_size)
        if regrouped is not None:
            group_size, rows = regrouped
            zeros, scales = zeros[rows], scales[rows]
        else:
            # Rows sorted by group (stable): each group becomes a contiguous run in natural order.
            perm = np.argsort(g_idx, kind="stable").astype(np.int32)
            sorted_idx = g_idx[perm]
            counts = np.bincount(g_idx, minlength=scales.shape[0])
            if group_size is None or not np.array_equal(sorted_idx, natural_group_index(k, group_size)):
                raise ValueError(
                    f"{name}: g_idx groups must hold G={group_size} rows each (the last may be short) "
                    f"to be made contiguous; rows per group found: {counts.tolist()}"
                )
            u = u[perm]
    if symmetric and not np.all(zeros == 8):
        bad = tuple(int(i) for i in np.argwhere(zeros != 8)[0])
        raise ValueError(
            f"{name}: the config says symmetric but zero point at (group, n) = {bad} is "
            f"{int(zeros[bad]) - 8} (signed), not 0"
        )
    qw = build_weight(u, zeros, scales, group_size, symmetric=symmetric, offset_dtype=np.float32, name=name)
    return qw, perm


def pack_int32(values: np.ndarray, axis: int) -> np.ndarray:
    """Unsigned 4-bit values (0..15) -> int32 words, 8 along ``axis`` (element i at bits 4i), the axis
    zero-padded to a multiple of 8: compressed-tensors' ``pack_to_int32`` and GPTQ's packing."""
    v = np.moveaxis(np.asarray(values).astype(np.uint32), axis, -1)
    pad = -v.shape[-1] % 8
    if pad:
        v = np.concatenate([v, np.zeros((*v.shape[:-1], pad), np.uint32)], axis=-1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    words = np.bitwise_or.reduce(v << (np.arange(8, dtype=np.uint32) * 4), axis=-1)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


class HFWriter:
    """Writes nybble weights as one format's tensors (:func:`writer_for`); collects what the
    ``quantization_config`` must say while layers are written."""

    format: str = ""

    def __init__(self, *, scale_dtype: Any = None) -> None:
        self.scale_dtype = None if scale_dtype is None else np.dtype(scale_dtype)
        self.layers: dict[str, tuple[bool, int | None]] = {}  # name -> (symmetric, group_size)
        self.in_features: dict[str, int] = {}

    def write_linear(self, module_name: str, qw: QuantizedWeight) -> dict[str, np.ndarray]:
        """The tensors (name -> numpy array) of this linear; raises naming the layer if the format cannot
        hold ``qw`` exactly."""
        raise NotImplementedError

    def quantization_config(self, ignore: Sequence[str]) -> dict:
        """config.json's ``quantization_config`` for the layers written so far; ``ignore`` names the
        linears left in float (e.g. ``["lm_head"]``)."""
        raise NotImplementedError

    # Shared checks -----------------------------------------------------------------------------------

    def _scales(self, name: str, qw: QuantizedWeight, s: np.ndarray) -> np.ndarray:
        """Scales cast to the format's dtype, refusing a cast that changes a value."""
        target = self.scale_dtype or np.dtype(qw.scales.dtype)
        out = s.astype(target)
        if not np.array_equal(out.astype(np.float32), s.astype(np.float32)):
            bad = tuple(int(i) for i in np.argwhere(out.astype(np.float32) != s.astype(np.float32))[0])
            raise ValueError(
                f"{name}: scale {float(s[bad])!r} at (group, n) = {bad} is not exactly representable in "
                f"{target.name} (the weight's scales are {np.dtype(qw.scales.dtype).name}); requantize with "
                f"scale_dtype={target.name} or write with scale_dtype={np.dtype(qw.scales.dtype).name}"
            )
        return out


def _logical(qw: QuantizedWeight, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Signed codes (K, N) int8, scales and offsets (groups, N) float32 (offsets None when symmetric)."""
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"{name}: expected a nybble QuantizedWeight, got {type(qw).__name__}")
    if qw.scales.ndim != 2:
        raise ValueError(
            f"{name}: a stacked weight (scales {tuple(qw.scales.shape)}, e.g. MoE experts) is one linear "
            "per leading index: write each as its own module"
        )
    k, n = qw.shape
    q = np.asarray(qw.logical_codes())[:k, :n]
    s = np.asarray(qw.scales.astype(jnp.float32))[:, :n]
    o = None if qw.offsets is None else np.asarray(qw.offsets.astype(jnp.float32))[:, :n]
    return q, s, o


def integer_zeros(name: str, s: np.ndarray, o: np.ndarray | None) -> np.ndarray:
    """The unsigned integer zero z (0..15) of each group with ``offset == (8 - z) * scale`` exactly;
    raises naming the layer and the first group whose offset is no such multiple (a float zero point,
    as nybble's default asymmetric quantization makes: quantize with ``zero_point="integer"``)."""
    if o is None:
        return np.full(s.shape, 8, np.int64)
    s64, o64 = s.astype(np.float64), o.astype(np.float64)
    safe = np.where(s64 == 0, 1.0, s64)
    z = 8.0 - np.round(o64 / safe)
    z = np.where(s64 == 0, 8.0, z)
    ok = ((8.0 - z) * s64 == o64) & (z >= 0) & (z <= 15)
    if not ok.all():
        g, c = (int(i) for i in np.argwhere(~ok)[0])
        zf = 8.0 - o64[g, c] / safe[g, c] if s64[g, c] else float("nan")
        raise ValueError(
            f"{name}: offset {float(o64[g, c])!r} at (group, n) = ({g}, {c}) is not (8 - z) * scale for an "
            f"integer zero point z in 0..15 (scale {float(s64[g, c])!r}, z would be {float(zf)!r}): this "
            "format stores integer zero points. Quantize with zero_point='integer' (or symmetric), or "
            "write format='nybble'"
        )
    return z.astype(np.int64)
