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

import json
import re
from collections.abc import Container, Sequence
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
from nybble.quant.formats.hf_base import (
    Getter,
    HFScheme,
    HFWriter,
    _check_bits,
    _check_int32,
    _finish,
    _get,
    _get_optional,
    _logical,
    _unsupported,
    integer_zeros,
    pack_int32,
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




def _gptq_tensors(p: str, get: Getter, k: int, n: int, group_size: int | None, *, awq: bool) -> tuple:
    """The checked qweight, qzeros, scales of one GPTQ-style (or AWQ) layer."""
    groups = 1 if group_size is None else -(-k // group_size)
    qweight = _get(get, f"{p}.qweight")
    qzeros = _get(get, f"{p}.qzeros")
    scales = _get(get, f"{p}.scales")
    _check_int32(qweight, f"{p}.qweight")
    _check_int32(qzeros, f"{p}.qzeros")
    check_dtype(scales, f"{p}.scales", "f", "float16")
    if awq:
        check_shape(qweight, f"{p}.qweight", (k, n // 8), "(in, out / 8) int32, AWQ packs along N")
    else:
        check_shape(qweight, f"{p}.qweight", (k // 8, n), "(in / 8, out) int32, GPTQ packs along K")
    check_shape(qzeros, f"{p}.qzeros", (groups, n // 8), "(ceil(in / group_size), out / 8) int32")
    check_shape(scales, f"{p}.scales", (groups, n), "(ceil(in / group_size), out)")
    if k % 8 or n % 8:
        raise ValueError(
            f"{p}: in_features={k} and out_features={n} must be multiples of 8 to pack 8 codes a word"
        )
    return qweight, qzeros, scales


def _group_size(value: Any, where: str) -> int | None:
    if value in (-1, None, 0):
        return None
    if not isinstance(value, int) or value <= 0:
        raise _unsupported(f"{where}={value!r}")
    return value


class GPTQScheme(HFScheme):
    """GPTQ directories (``quant_method: gptq``) and AutoRound's GPTQ-packed exports."""

    quant_method = "gptq"

    def __init__(self, config: dict, *, zero_convention: str | None = None) -> None:
        super().__init__(config)
        _check_bits(config.get("bits", 4), "bits")
        fmt = config.get("checkpoint_format", config.get("format", "gptq"))
        if zero_convention is None:
            if fmt not in ("gptq", "gptq_v2"):
                raise _unsupported(f"gptq checkpoint_format={fmt!r}")
            zero_convention = "v1" if fmt == "gptq" else "v2"
        self.zero_convention = zero_convention
        if config.get("dynamic"):  # GPTQModel's per-module overrides ({"-:regex": {}, "+:regex": {...}})
            raise _unsupported(f"gptq dynamic={json.dumps(config['dynamic'])} (per-module overrides)")
        self.group_size = _group_size(config.get("group_size", 128), "group_size")
        self.sym = bool(config.get("sym", True))
        self.desc_act = bool(config.get("desc_act", False))
        self.lm_head = bool(config.get("lm_head", False))
        blocks = config.get("modules_in_block_to_quantize")
        # A list of lists of in-block names ("self_attn.q_proj"); None quantizes every linear of a block.
        self.in_block = (
            None if not blocks else [m for sub in blocks for m in ([sub] if isinstance(sub, str) else sub)]
        )
        self.not_convert = list(config.get("modules_to_not_convert") or [])
        # AutoGPTQ, optimum and GPTQModel always save g_idx; auto-round's GPTQ packers only with act-order.
        self.writes_g_idx = True

    def is_quantized(self, module_name: str) -> bool:
        if module_name == "lm_head" or module_name.endswith(".lm_head"):
            return self.lm_head
        if any(module_name == m or module_name.endswith("." + m) for m in self.not_convert):
            return False
        if self.in_block is not None:
            return any(module_name.endswith("." + m) for m in self.in_block)
        return True

    def _required(self, module_name: str) -> list[str]:
        names = [f"{module_name}.{t}" for t in ("qweight", "qzeros", "scales")]
        return names + ([f"{module_name}.g_idx"] if self.desc_act else [])

    def optional_tensor_names(self, module_name: str) -> list[str]:
        return [f"{module_name}.g_idx"]

    def _usual(self, name: str) -> bool:
        return self.writes_g_idx

    def read_linear_with_perm(
        self, module_name: str, get: Getter, *, in_features: int, out_features: int
    ) -> tuple[QuantizedWeight, np.ndarray | None]:
        p, k, n = module_name, int(in_features), int(out_features)
        qweight, qzeros, scales = _gptq_tensors(p, get, k, n, self.group_size, awq=False)
        u = unpack_words(qweight, axis=0)
        zeros = _resolve_zeros(unpack_words(qzeros, axis=1), self.zero_convention, p)
        g_idx = _get_optional(get, f"{p}.g_idx")
        if g_idx is not None:
            check_dtype(g_idx, f"{p}.g_idx", "iu", "int32")
            check_shape(g_idx, f"{p}.g_idx", (k,), "(in_features,)")
            g_idx = g_idx.astype(np.int64)
        elif self.desc_act:
            raise ValueError(f"{p}.g_idx: missing, and desc_act=True needs it (the group of each input row)")
        return _finish(u, zeros, scales, self.group_size, g_idx, symmetric=True if self.sym else None, name=p)


class GPTQWriter(HFWriter):
    """GPTQ ``checkpoint_format: gptq`` (v1: stored zero - 1), what transformers and vLLM load:
    ``qweight`` int32 (K / 8, N), ``qzeros`` int32 (groups, N / 8), ``scales`` float16 (groups, N),
    ``g_idx`` int32 (K,) = k // G. One group size and one ``sym`` for the whole model."""

    format = "gptq"

    def __init__(self, *, scale_dtype: Any = np.float16) -> None:
        super().__init__(scale_dtype=scale_dtype)

    def write_linear(self, module_name: str, qw: QuantizedWeight) -> dict[str, np.ndarray]:
        k, n = qw.shape
        p = module_name
        if k % 8 or n % 8:
            raise ValueError(
                f"{p}: GPTQ packs 8 codes per int32 along in_features and zeros along out_features; "
                f"(in, out) = ({k}, {n}) must both be multiples of 8 (write format='compressed-tensors')"
            )
        # One group size for the model; a one-group layer (K <= G) fits any G >= K.
        g_new = qw.group_size
        for name, (_, g_old) in self.layers.items():
            k_old = self.in_features[name]
            clash = (g_new is not None and g_old is not None and g_new != g_old) or (
                (g_new is None and g_old is not None and k > g_old)
                or (g_old is None and g_new is not None and k_old > g_new)
            )
            if clash:
                raise ValueError(
                    f"{p}: group_size {g_new} (K={k}) differs from the {g_old} of {name} (K={k_old}); a GPTQ "
                    "config has one group_size (format='compressed-tensors' has config groups)"
                )
        q, s, o = _logical(qw, module_name)
        groups = 1 if qw.group_size is None else -(-k // qw.group_size)
        s, o = s[:groups], None if o is None else o[:groups]
        z = integer_zeros(p, s, o)
        if (z == 0).any():
            g, c = (int(i) for i in np.argwhere(z == 0)[0])
            raise ValueError(
                f"{p}: zero point 0 at (group, n) = ({g}, {c}): GPTQ v1 stores zero - 1, and -1 does not fit "
                "the 4-bit field (vLLM's kernels would read zero 16); write format='compressed-tensors'"
            )
        self.layers[p] = (bool(qw.symmetric), qw.group_size)
        self.in_features[p] = k
        return {
            f"{p}.qweight": pack_int32(q.astype(np.int16) + 8, axis=0),
            f"{p}.qzeros": pack_int32(z - 1, axis=1),
            f"{p}.scales": self._scales(p, qw, s),
            f"{p}.g_idx": natural_group_index(k, qw.group_size).astype(np.int32),
        }

    def quantization_config(self, ignore: Sequence[str]) -> dict:
        sizes = {g for _, g in self.layers.values() if g is not None}
        g = sizes.pop() if sizes else None
        sym = all(sym for sym, _ in self.layers.values())
        config = {
            "quant_method": "gptq", "bits": 4, "group_size": -1 if g is None else g, "desc_act": False,
            "sym": sym, "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True,
            "damp_percent": 0.01, "lm_head": any(_is_lm_head(m) for m in self.layers),
        }  # fmt: skip
        in_block = _in_block_modules(self.layers, [m for m in ignore if not _is_lm_head(m)])
        if in_block is not None:
            config["modules_in_block_to_quantize"] = [in_block]
        return config


def _is_lm_head(name: str) -> bool:
    return name == "lm_head" or name.endswith(".lm_head")


_BLOCK = re.compile(r"^(.*\.layers\.\d+)\.(.+)$")


def _in_block_modules(written: Container[str], ignored: Sequence[str]) -> list[str] | None:
    """GPTQ's ``modules_in_block_to_quantize`` (in-block names, the same in every block) for float linears
    inside the blocks; None when there are none. A config cannot leave one block's layer in float and
    quantize it in another: that is refused, naming the layer."""
    if not ignored:
        return None
    float_names = set()
    for m in ignored:
        match = _BLOCK.match(m)
        if match is None:
            raise ValueError(
                f"{m}: a GPTQ config can leave in float only lm_head or in-block linears "
                "(model.layers.N.<name>); write format='compressed-tensors' (its ignore list names any layer)"
            )
        float_names.add(match.group(2))
    quantized = set()
    for m in written:  # type: ignore[attr-defined]
        match = _BLOCK.match(m)
        if match is None:
            continue
        if match.group(2) in float_names:
            raise ValueError(
                f"{m}: quantized, while {match.group(2)} of another block is left in float; a GPTQ config "
                "names in-block layers for every block alike (modules_in_block_to_quantize): write "
                "format='compressed-tensors'"
            )
        quantized.add(match.group(2))
    return sorted(quantized)
