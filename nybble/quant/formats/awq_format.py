"""Import AWQ checkpoints (llm-awq, AutoAWQ ``GEMM`` version): exact.

The tensors of one 4-bit layer with K inputs, N outputs, group size G, as AutoAWQ's ``WQLinear_GEMM``
stores them:

* ``qweight`` int32 [K, N / 8]: packed along N. Word (k, c) holds columns 8 c .. 8 c + 7 of row k in the
  interleaved order [0, 2, 4, 6, 1, 3, 5, 7]: nibble i (bits [4 i, 4 i + 4)) is column 8 c + ORDER[i].
  (The interleave lets AWQ's CUDA kernel turn one word into 8 fp16 values with two LOP3 ``magic number``
  conversions, even columns from the low half-bytes and odd from the high.)
* ``qzeros`` int32 [K / G, N / 8]: the zero points, packed the same way (no off-by-one).
* ``scales`` float16 [K / G, N].

Dequantization (AutoAWQ ``dequantize_gemm``), in float16:
``w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``.
The GEMV / Marlin / exllama variants of AWQ use other layouts and are refused by the shape checks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nybble.quant.formats._common import (
    build_weight,
    check_shape,
    checked_group_size,
    read_layer,
    unpack_words,
)
from nybble.quant.formats.gptq_format import _gptq_tensors, _group_size
from nybble.quant.formats.hf_base import (
    Getter,
    HFScheme,
    _check_bits,
    _finish,
    _unsupported,
)
from nybble.quant.qweight import QuantizedWeight

# Nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8; AWQ_REVERSE_ORDER inverts it.
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
AWQ_REVERSE_ORDER = np.argsort(AWQ_ORDER)  # [0, 4, 1, 5, 2, 6, 3, 7]


def unpack_awq(words: np.ndarray) -> np.ndarray:
    """int32 [R, N / 8] in AWQ's interleaved order -> uint8 codes [R, N] in natural column order."""
    nibbles = unpack_words(words, axis=1)  # column 8c + i holds nibble i = true column 8c + ORDER[i]
    r, n = nibbles.shape
    return nibbles.reshape(r, n // 8, 8)[:, :, AWQ_REVERSE_ORDER].reshape(r, n)


def from_awq(
    qweight: Any,
    qzeros: Any,
    scales: Any,
    *,
    group_size: int | None = None,
    bits: int = 4,
    sym: bool | None = None,
    scale_dtype: Any = None,
    name: str = "awq",
) -> QuantizedWeight:
    """One AWQ GEMM layer -> ``QuantizedWeight`` of shape (K, N), bit-exact.

    ``nybble.dequantize(qw, jnp.float16)`` equals AutoAWQ's float16 dequantization bit for bit (float32:
    the exact real value). AWQ layers are asymmetric, stored with float32 scales and offsets (the
    cheapest exact choice, see ``nybble.quant.formats._common.build_weight``); a layer whose zeros are
    all 8 becomes symmetric with float16 scales. ``group_size`` None infers it from the scale rows.

    Raises:
      ValueError: malformed tensors (named, with expected and actual shape/dtype) or bits != 4.
    """
    qweight, qzeros, scales = read_layer(
        qweight, qzeros, scales, bits=bits, name=name,
        qweight_layout="[K, N / 8] (int32, 8 codes per word along N)",
    )  # fmt: skip
    k, n = qweight.shape[0], qweight.shape[1] * 8
    num_groups = scales.shape[0]
    check_shape(scales, f"{name}.scales", (num_groups, n), "N = 8 * qweight columns")
    check_shape(qzeros, f"{name}.qzeros", (num_groups, n // 8), "[K / G, N / 8]")
    group_size = checked_group_size(k, num_groups, group_size, f"{name}.scales")
    u = unpack_awq(qweight)
    zeros = unpack_awq(qzeros)
    return build_weight(u, zeros, scales, group_size, symmetric=sym, scale_dtype=scale_dtype, name=name)


class AWQScheme(HFScheme):
    """AWQ ``version: gemm`` (AutoAWQ / llm-awq) and AutoRound's AWQ-packed exports."""

    quant_method = "awq"

    def __init__(self, config: dict, *, check_version: bool = True) -> None:
        super().__init__(config)
        _check_bits(config.get("bits", config.get("w_bit", 4)), "bits")
        version = str(config.get("version", "gemm")).lower()
        if check_version and version != "gemm":
            raise _unsupported(f"awq version={config.get('version')!r} (only 'gemm')")
        self.group_size = _group_size(config.get("group_size", config.get("q_group_size", 128)), "group_size")
        self.not_convert = list(config.get("modules_to_not_convert") or [])

    def is_quantized(self, module_name: str) -> bool:
        if module_name == "lm_head" or module_name.endswith(".lm_head"):
            return False
        return not any(m in module_name.split(".") or module_name.endswith(m) for m in self.not_convert)

    def _required(self, module_name: str) -> list[str]:
        return [f"{module_name}.{t}" for t in ("qweight", "qzeros", "scales")]

    def read_linear_with_perm(
        self, module_name: str, get: Getter, *, in_features: int, out_features: int
    ) -> tuple[QuantizedWeight, np.ndarray | None]:
        p, k, n = module_name, int(in_features), int(out_features)
        qweight, qzeros, scales = _gptq_tensors(p, get, k, n, self.group_size, awq=True)
        return _finish(
            unpack_awq(qweight), unpack_awq(qzeros), scales, self.group_size, None, symmetric=None, name=p
        )
