"""The quantized-linear part of Hugging Face checkpoint directories: read and write, exactly.

A directory's ``config.json`` ``quantization_config`` names how its linear layers are stored.
:func:`scheme_from_config` turns it into an :class:`HFScheme` that says which modules are quantized, which
tensors each one has, and reads one into a :class:`~nybble.quant.qweight.QuantizedWeight` (logical
(K, N) = (in_features, out_features), nybble's default layout) straight from the packed integers: no float
round trip. :func:`writer_for` is the other direction.

Formats read (``SUPPORTED``):

* compressed-tensors ``pack-quantized`` (llm-compressor W4A16, vLLM): 4-bit ``int`` weights, symmetric or
  asymmetric, ``group`` or ``channel`` strategy, ``ignore`` (exact names and ``re:`` regexes), ``targets``,
  ``actorder`` (``weight_g_idx``). Tensors per linear ``p`` (torch layout, N = out, K = in):
  ``p.weight_packed`` int32 (N, ceil(K / 8)) (8 codes along K, element i at bits 4i, stored q + 8),
  ``p.weight_scale`` (N, groups), ``p.weight_zero_point`` int32 (ceil(N / 8), groups) (asymmetric, packed
  along N, stored z + 8), ``p.weight_shape`` int64 [N, K], ``p.weight_g_idx`` int32 (K,) (actorder
  "group"). Weight ``(q - z) * s``.
* GPTQ (AutoGPTQ / optimum / GPTQModel): ``checkpoint_format`` "gptq" (v1: stored zero - 1) and
  "gptq_v2", ``desc_act`` (``g_idx``), ``sym``; see ``gptq_format``.
* AWQ ``version: gemm`` (interleaved nibble order); see ``awq_format``.
* AutoRound's own export (``quant_method: auto-round``, ``packing_format`` ``auto_round:auto_gptq`` /
  ``auto_round:gptq`` (GPTQ v1 tensors), ``auto_round`` / ``auto_round:gptqmodel`` (GPTQ tensors, zero
  stored as is) and ``auto_round:auto_awq`` (AWQ tensors)); its symmetric scales may be negative, which
  changes nothing here (no sign is assumed anywhere).
* nybble's own (``quant_method: nybble``): codes, scales and offsets exactly as a QuantizedWeight holds them.

Exactness. Every format stores unsigned codes u, an integer zero z and a scale s with weight
``(u - z) * s``; nybble stores signed codes ``q = u - 8`` and ``offset = (8 - z) * s``. Symmetric layers keep
their scale dtype. Asymmetric layers keep their scales' dtype and store the offsets in float32: for 16-bit
scales both ``q * s`` and ``(8 - z) * s`` are exact in float32, so ``nybble.dequantize(qw, float32)`` is
exactly the library's ``(q - z) * s`` (and the cast to the checkpoint dtype rounds that one exact value as
the library does). Every dequantization path (``nybble.dequantize``, the XLA matmul, the Mosaic kernel)
reads scales and offsets each in its own dtype, so the mixed pair needs no kernel rule (checked in GPU
interpret mode). Float32 scales: symmetric is exact too; asymmetric rounds twice (``q * s``, then
``+ offset``) where the library rounds once, within one float32 ulp.

Which tensors: :meth:`HFScheme.tensor_names` lists what a linear must have; tensors some exporters add
(a GPTQ ``g_idx``) are :meth:`HFScheme.optional_tensor_names`, included when ``available=`` (the
checkpoint's names) holds them.

Writers (:func:`writer_for`) refuse, naming the layer, what the format cannot hold exactly: float zero
points (quantize with ``zero_point="integer"``), scales the format's dtype cannot represent, GPTQ's zero 0
(v1 stores ``z - 1``), mixed group sizes or per-layer float exceptions a GPTQ config cannot state.
compressed-tensors output is byte-identical to its own compressor's for the same codes and scales.

Activation order (GPTQ ``desc_act``, compressed-tensors ``actorder: group``): row k of K uses group
``g_idx[k]``. Where runs of G' >= 16 consecutive rows share a group (G' a power of two), the weight is
regrouped exactly at group size G' in natural order (:func:`nybble.quant.formats._common.regroup_natural`).
Otherwise (the usual case: groups scattered row by row) the rows are sorted by group, which needs the
input permuted: :meth:`HFScheme.read_linear_with_perm` returns ``(weight, perm)`` with
``x @ W_checkpoint == x[..., perm] @ weight``, and :meth:`HFScheme.read_linear` refuses such a layer rather
than return a weight that needs a permutation its caller might not apply.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Container, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from nybble.packing import DEFAULT_LAYOUT, check_group_size, get_layout, num_groups, padded_weight_dims
from nybble.quant.formats._common import (
    build_weight,
    check_dtype,
    check_shape,
    checked_group_size,
    natural_group_index,
    regroup_natural,
    unpack_words,
)
from nybble.quant.formats.awq_format import unpack_awq
from nybble.quant.formats.gptq_format import _resolve_zeros
from nybble.quant.qweight import SCALE_DTYPES, QuantizedWeight, relayout

__all__ = [
    "SUPPORTED",
    "WRITE_FORMATS",
    "HFScheme",
    "HFWriter",
    "pack_int32",
    "scheme_from_config",
    "writer_for",
]

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


# ----------------------------------------------------------------------------------------------------
# compressed-tensors


_CT_UNSUPPORTED_FORMATS = {
    "marlin-24": "marlin-24 (2:4 sparse)",
    "sparse-24-bitmask": "2:4 sparse (sparse-24-bitmask)",
    "sparse-bitmask": "sparse-bitmask",
    "float-quantized": "float-quantized (fp8 weights)",
    "nvfp4-pack-quantized": "nvfp4-pack-quantized (fp4)",
    "mxfp4-pack-quantized": "mxfp4-pack-quantized (fp4)",
    "naive-quantized": "naive-quantized (unpacked int8 storage)",
    "int-quantized": "int-quantized (int8 storage)",
    "dense": "dense",
}


class _CTGroup:
    def __init__(self, name: str, group: dict, default_format: str | None) -> None:
        where = f"config_groups.{name}"
        fmt = group.get("format") or default_format
        if fmt != "pack-quantized":
            label = _CT_UNSUPPORTED_FORMATS.get(str(fmt), repr(fmt))
            raise _unsupported(f"compressed-tensors format {label} ({where})")
        for act in ("input_activations", "output_activations"):
            if group.get(act):
                raise _unsupported(f"{where}.{act}={json.dumps(group[act])} (activation quantization)")
        w = group.get("weights")
        if not isinstance(w, dict):
            raise _unsupported(f"{where}.weights={w!r} (no weight quantization)")
        _check_bits(w.get("num_bits"), f"{where}.weights.num_bits")
        if w.get("type", "int") != "int":
            raise _unsupported(f"{where}.weights.type={w.get('type')!r} (float-quantized weights)")
        if w.get("dynamic"):
            raise _unsupported(f"{where}.weights.dynamic={w.get('dynamic')!r}")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise _unsupported(f"{where}.weights.strategy={strategy!r} (only 'group' and 'channel')")
        self.strategy = strategy
        self.symmetric = bool(w.get("symmetric", True))
        self.actorder = w.get("actorder")
        if self.actorder not in (None, "group", "weight", "static"):
            raise _unsupported(f"{where}.weights.actorder={self.actorder!r}")
        if strategy == "group":
            g = w.get("group_size")
            if not isinstance(g, int) or g <= 0:
                raise _unsupported(f"{where}.weights.group_size={g!r} with strategy 'group'")
            self.group_size: int | None = g
        else:
            self.group_size = None
        targets = group.get("targets", [])
        self.targets = [targets] if isinstance(targets, str) else list(targets)


def _ct_match(name: str, target: str) -> int:
    """How a compressed-tensors target/ignore entry matches a linear's name: 3 exact, 2 regex, 1 by class
    (``Linear``; every module asked about is one), 0 none. Regexes use ``re.match`` (anchored at the start),
    as compressed-tensors does."""
    if target.startswith("re:"):
        return 2 if re.match(target[3:], name) else 0
    if target == name:
        return 3
    if target in ("Linear", "nn.Linear", "torch.nn.Linear"):
        return 1
    return 0


class CompressedTensorsScheme(HFScheme):
    """compressed-tensors ``pack-quantized`` (see the module docstring)."""

    quant_method = "compressed-tensors"

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise _unsupported(
                f"compressed-tensors quantization_status={status!r} (only 'compressed' directories carry "
                "packed weights)"
            )
        for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            if config.get(key):
                raise _unsupported(f"compressed-tensors {key}={json.dumps(config[key])}")
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise _unsupported("compressed-tensors without config_groups")
        self.groups = [_CTGroup(name, g, config.get("format")) for name, g in groups.items()]
        self.ignore = list(config.get("ignore") or [])

    def group_for(self, module_name: str) -> _CTGroup | None:
        """The config group of this linear: the most specific target match (exact > regex > class)."""
        if any(_ct_match(module_name, t) for t in self.ignore):
            return None
        best, best_rank = None, 0
        for g in self.groups:
            rank = max((_ct_match(module_name, t) for t in g.targets), default=0)
            if rank > best_rank:
                best, best_rank = g, rank
        return best

    def is_quantized(self, module_name: str) -> bool:
        return self.group_for(module_name) is not None

    def _required(self, module_name: str) -> list[str]:
        g = self._group(module_name)
        names = [f"{module_name}.{t}" for t in ("weight_packed", "weight_scale", "weight_shape")]
        if not g.symmetric:
            names.append(f"{module_name}.weight_zero_point")
        if g.actorder == "group":  # compressed-tensors < 0.20 wrote the group of every input column
            names.append(f"{module_name}.weight_g_idx")
        return names

    def optional_tensor_names(self, module_name: str) -> list[str]:
        return [f"{module_name}.weight_g_idx"]

    def _group(self, module_name: str) -> _CTGroup:
        g = self.group_for(module_name)
        if g is None:
            raise ValueError(
                f"{module_name}: not quantized by this quantization_config (ignored or untargeted)"
            )
        return g

    def read_linear_with_perm(
        self, module_name: str, get: Getter, *, in_features: int, out_features: int
    ) -> tuple[QuantizedWeight, np.ndarray | None]:
        g = self._group(module_name)
        p, k, n = module_name, int(in_features), int(out_features)
        packed = _get(get, f"{p}.weight_packed")
        _check_int32(packed, f"{p}.weight_packed")
        check_shape(packed, f"{p}.weight_packed", (n, -(-k // 8)), "(out, ceil(in / 8)) int32")
        shape = _get_optional(get, f"{p}.weight_shape")
        if shape is not None and [int(v) for v in shape.reshape(-1)] != [n, k]:
            raise ValueError(
                f"{p}.weight_shape: expected [{n}, {k}] (out_features, in_features), got "
                f"{shape.reshape(-1).tolist()}"
            )
        groups = 1 if g.group_size is None else -(-k // g.group_size)
        scale = _get(get, f"{p}.weight_scale")
        check_dtype(scale, f"{p}.weight_scale", "f", "a float (bfloat16/float16/float32)")
        check_shape(
            scale, f"{p}.weight_scale", (n, groups), f"(out, {'ceil(in / group_size)' if groups > 1 else 1})"
        )
        group_size = (
            None if g.group_size is None else checked_group_size(k, groups, g.group_size, f"{p}.weight_scale")
        )
        u = unpack_words(packed, axis=1)[:, :k].T  # (K, N) unsigned = q + 8
        if g.symmetric:
            zeros = np.full((groups, n), 8, np.uint8)
        else:
            zp = _get(get, f"{p}.weight_zero_point")
            _check_int32(zp, f"{p}.weight_zero_point")
            check_shape(zp, f"{p}.weight_zero_point", (-(-n // 8), groups), "(ceil(out / 8), groups) int32")
            zeros = unpack_words(zp, axis=0)[:n].T  # (groups, N) unsigned = z + 8
        g_idx = None
        if g.actorder == "group":
            g_idx = _get_optional(get, f"{p}.weight_g_idx")
        if g_idx is not None:
            check_dtype(g_idx, f"{p}.weight_g_idx", "iu", "int32")
            check_shape(g_idx, f"{p}.weight_g_idx", (k,), "(in_features,)")
            g_idx = g_idx.astype(np.int64)
        return _finish(u, zeros, scale.T, group_size, g_idx, symmetric=True if g.symmetric else None, name=p)


# ----------------------------------------------------------------------------------------------------
# GPTQ, AWQ, AutoRound


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


class AutoRoundScheme(HFScheme):
    """AutoRound's own export (``quant_method: auto-round``): GPTQ- or AWQ-packed tensors by
    ``packing_format``; per-layer ``extra_config`` may leave layers in float (bits >= 16)."""

    quant_method = "auto-round"

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        _check_bits(config.get("bits", 4), "bits")
        dtype = config.get("data_type", "int")
        if dtype != "int":
            raise _unsupported(f"auto-round data_type={dtype!r}")
        for key in ("act_bits",):
            if config.get(key, 16) < 16:
                raise _unsupported(f"auto-round {key}={config.get(key)!r} (activation quantization)")
        fmt = str(config.get("packing_format", "auto_round:auto_gptq"))
        inner = {**config, "checkpoint_format": "gptq"}
        if fmt in ("auto_round:auto_gptq", "auto_round:gptq", "auto_gptq"):
            self.inner: HFScheme = GPTQScheme(inner, zero_convention="v1")
            self.inner.writes_g_idx = False  # auto_round_extension's qlinear_torch_zp has no g_idx
        elif fmt in ("auto_round", "auto_round:gptqmodel", "auto_round:auto_round"):
            self.inner = GPTQScheme(inner, zero_convention="v2")
            self.inner.writes_g_idx = fmt == "auto_round:gptqmodel"  # qlinear_torch(g_idx=True)
        elif fmt in ("auto_round:auto_awq", "auto_round:awq", "auto_awq"):
            self.inner = AWQScheme(config, check_version=False)
        else:
            raise _unsupported(f"auto-round packing_format={fmt!r}")
        self.packing_format = fmt
        self.extra = dict(config.get("extra_config") or {})
        blocks = config.get("block_name_to_quantize")
        if isinstance(blocks, str):  # AutoRound writes "model.layers" or "a.layers,b.layers"
            blocks = [b.strip() for b in blocks.split(",") if b.strip()]
        self.blocks = None if not blocks else [b if isinstance(b, str) else b[0] for b in blocks]

    def is_quantized(self, module_name: str) -> bool:
        extra = self.extra.get(module_name, {})
        if "bits" in extra:
            if extra["bits"] >= 16:
                return False
            _check_bits(extra["bits"], f"extra_config[{module_name!r}].bits")
        if module_name == "lm_head" or module_name.endswith(".lm_head"):
            return bool(extra)
        if self.blocks is not None:
            return any(module_name.startswith(b.rstrip(".") + ".") for b in self.blocks)
        return True

    def tensor_names(self, module_name: str, available: Container[str] | None = None) -> list[str]:
        return self.inner.tensor_names(module_name, available)

    def optional_tensor_names(self, module_name: str) -> list[str]:
        return self.inner.optional_tensor_names(module_name)

    def read_linear_with_perm(
        self, module_name: str, get: Getter, *, in_features: int, out_features: int
    ) -> tuple[QuantizedWeight, np.ndarray | None]:
        extra = self.extra.get(module_name, {})
        if any(key in extra and extra[key] != self.config.get(key) for key in ("group_size", "sym")):
            raise ValueError(
                f"{module_name}: extra_config overrides {extra} (per-layer group size / sym) are not read yet"
            )
        return self.inner.read_linear_with_perm(
            module_name, get, in_features=in_features, out_features=out_features
        )


# ----------------------------------------------------------------------------------------------------
# nybble's own


class NybbleScheme(HFScheme):
    """``quant_method: nybble``: ``p.codes`` (the layout's packed codes), ``p.scales``, ``p.offsets``
    (asymmetric), ``p.quant_shape`` int64 [K, N, group_size or -1]; written by ``writer_for("nybble")``."""

    quant_method = "nybble"

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        _check_bits(config.get("bits", 4), "bits")
        self.layout = config.get("layout", DEFAULT_LAYOUT)
        get_layout(self.layout)
        self.ignore = list(config.get("ignore") or [])
        self.asymmetric = set(config.get("asymmetric") or [])

    def is_quantized(self, module_name: str) -> bool:
        return module_name not in self.ignore

    def _required(self, module_name: str) -> list[str]:
        names = [f"{module_name}.{t}" for t in ("codes", "scales", "quant_shape")]
        return names + ([f"{module_name}.offsets"] if module_name in self.asymmetric else [])

    def read_linear_with_perm(
        self, module_name: str, get: Getter, *, in_features: int, out_features: int
    ) -> tuple[QuantizedWeight, np.ndarray | None]:
        p, k, n = module_name, int(in_features), int(out_features)
        meta = _get(get, f"{p}.quant_shape").reshape(-1).tolist()
        if len(meta) != 3 or meta[:2] != [k, n]:
            raise ValueError(f"{p}.quant_shape: expected [{k}, {n}, group_size or -1], got {meta}")
        group_size = None if meta[2] == -1 else int(meta[2])
        check_group_size(group_size)
        k_pad, n_pad = padded_weight_dims(k, n)
        rows = (num_groups(k_pad, group_size), n_pad)
        scales = _get(get, f"{p}.scales")
        check_shape(scales, f"{p}.scales", rows, "(num_groups, N_pad)")
        offsets = _get(get, f"{p}.offsets") if p in self.asymmetric else None
        if offsets is not None:
            check_shape(offsets, f"{p}.offsets", rows, "(num_groups, N_pad)")
        codes = _get(get, f"{p}.codes")
        for a, what in ((scales, "scales"), (offsets, "offsets")):
            if a is not None and np.dtype(a.dtype).name not in SCALE_DTYPES:
                raise ValueError(f"{p}.{what}: expected one of {SCALE_DTYPES}, got {a.dtype.name}")
        try:
            qw = QuantizedWeight(
                codes=jnp.asarray(codes), scales=jnp.asarray(scales),
                offsets=None if offsets is None else jnp.asarray(offsets),
                shape=(k, n), group_size=group_size, symmetric=offsets is None, layout=self.layout,
            )  # fmt: skip
        except ValueError as e:
            raise ValueError(f"{p}.codes: {e}") from None
        if self.layout != DEFAULT_LAYOUT:
            qw = relayout(qw, DEFAULT_LAYOUT)
        return qw, None


def scheme_from_config(quantization_config: dict) -> HFScheme:
    """The :class:`HFScheme` of a config.json ``quantization_config``; an error listing what nybble
    reads (``SUPPORTED``) for anything else (other bit widths, fp8, nvfp4, marlin-24, 2:4 sparse, float
    or dynamic quantization, activation quantization, an unknown ``quant_method``)."""
    if not isinstance(quantization_config, dict):
        raise ValueError(f"quantization_config must be a dict, got {type(quantization_config).__name__}")
    method = str(quantization_config.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return CompressedTensorsScheme(quantization_config)
    if method == "gptq":
        return GPTQScheme(quantization_config)
    if method == "awq":
        return AWQScheme(quantization_config)
    if method in ("auto-round", "autoround", "intel/auto-round", "auto_round"):
        return AutoRoundScheme(quantization_config)
    if method == "nybble":
        return NybbleScheme(quantization_config)
    raise _unsupported(f"quant_method={quantization_config.get('quant_method')!r}")


# ----------------------------------------------------------------------------------------------------
# Writers


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


class CompressedTensorsWriter(HFWriter):
    """compressed-tensors ``pack-quantized``: the tensors its ``PackedQuantizationCompressor`` writes."""

    format = "compressed-tensors"

    def __init__(self, *, scale_dtype: Any = None, version: str | None = None) -> None:
        super().__init__(scale_dtype=scale_dtype)
        self.version = version

    def write_linear(self, module_name: str, qw: QuantizedWeight) -> dict[str, np.ndarray]:
        k, n = qw.shape
        q, s, o = _logical(qw, module_name)
        groups = 1 if qw.group_size is None else -(-k // qw.group_size)
        s, o = s[:groups], None if o is None else o[:groups]
        z = integer_zeros(module_name, s, o)
        p = module_name
        out = {
            f"{p}.weight_packed": pack_int32((q.astype(np.int16) + 8).T, axis=1),
            f"{p}.weight_scale": np.ascontiguousarray(self._scales(p, qw, s).T),
            f"{p}.weight_shape": np.array([n, k], np.int64),
        }
        if not qw.symmetric:
            out[f"{p}.weight_zero_point"] = pack_int32(z.T, axis=0)  # stored z_signed + 8 = unsigned z
        self.layers[p] = (bool(qw.symmetric), qw.group_size)
        self.in_features[p] = k
        return out

    def _described_as(self) -> dict[str, tuple[bool, int | None]]:
        """Each layer's (symmetric, group size) as the config states it: a one-group layer (K <= G, which
        nybble reads as per column) joins the most common group size G >= K of its kind, since a group of
        G >= K rows is one scale row either way (identical tensors)."""
        counts: dict[tuple[bool, int], int] = {}
        for sym, g in self.layers.values():
            if g is not None:
                counts[(sym, g)] = counts.get((sym, g), 0) + 1
        out = {}
        for name, (sym, g) in self.layers.items():
            if g is None:
                fits = [
                    (c, gg) for (ss, gg), c in counts.items() if ss == sym and gg >= self.in_features[name]
                ]
                g = max(fits)[1] if fits else None
            out[name] = (sym, g)
        return out

    def quantization_config(self, ignore: Sequence[str]) -> dict:
        kinds: dict[tuple[bool, int | None], list[str]] = {}
        for name, kind in self._described_as().items():
            kinds.setdefault(kind, []).append(name)
        groups = {}
        for i, ((sym, g), names) in enumerate(sorted(kinds.items(), key=lambda kv: -len(kv[1]))):
            groups[f"group_{i}"] = {
                "targets": ["Linear"] if len(kinds) == 1 else sorted(names),
                "weights": {
                    "num_bits": 4, "type": "int", "symmetric": sym,
                    "strategy": "channel" if g is None else "group", "group_size": g, "dynamic": False,
                },
                "input_activations": None, "output_activations": None, "format": "pack-quantized",
            }  # fmt: skip
        # As llm-compressor: every Linear left in float is named, and lm_head always unless it was written
        # in int4 (a tied lm_head has no tensor of its own, but transformers would wrap it as a compressed
        # Linear and break the tie: the load fails).
        ignore = sorted(set(ignore) | ({"lm_head"} - set(self.layers)))
        # The keys compressed-tensors 0.20's ModelCompressor.update_config writes.
        config = {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "config_groups": groups, "ignore": ignore,
            "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
            "global_compression_ratio": None, "moe_sparsity_config": None,
        }  # fmt: skip
        if self.version:
            config["version"] = self.version
        return config


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


class NybbleWriter(HFWriter):
    """nybble's own codes, scales and offsets, exactly as the QuantizedWeight holds them (any offsets)."""

    format = "nybble"

    def __init__(self, *, layout: str = DEFAULT_LAYOUT) -> None:
        super().__init__()
        get_layout(layout)
        self.layout = layout

    def write_linear(self, module_name: str, qw: QuantizedWeight) -> dict[str, np.ndarray]:
        qw = relayout(qw, self.layout)
        k, n = qw.shape
        p = module_name
        codes = np.asarray(qw.codes)
        if codes.dtype == np.dtype(jnp.int4):  # nk_int4 also accepts an int4 view: store its bytes
            codes = np.asarray(get_layout(self.layout).pack(qw.logical_codes()))
        out = {
            f"{p}.codes": codes,
            f"{p}.scales": np.asarray(qw.scales),
            f"{p}.quant_shape": np.array([k, n, -1 if qw.group_size is None else qw.group_size], np.int64),
        }
        if qw.offsets is not None:
            out[f"{p}.offsets"] = np.asarray(qw.offsets)
        self.layers[p] = (bool(qw.symmetric), qw.group_size)
        return out

    def quantization_config(self, ignore: Sequence[str]) -> dict:
        asym = sorted(name for name, (sym, _) in self.layers.items() if not sym)
        return {
            "quant_method": "nybble", "bits": 4, "layout": self.layout, "ignore": list(ignore),
            "asymmetric": asym,
        }  # fmt: skip


def writer_for(format: str, **options: Any) -> HFWriter:
    """A writer for ``format`` in ``WRITE_FORMATS``: "compressed-tensors" (options ``scale_dtype``: the
    model dtype, default each weight's own; ``version``), "gptq" (``scale_dtype``, default float16) or
    "nybble" (``layout``)."""
    writers = {"compressed-tensors": CompressedTensorsWriter, "gptq": GPTQWriter, "nybble": NybbleWriter}
    if format not in writers:
        raise ValueError(f"format={format!r}: nybble writes {WRITE_FORMATS}")
    return writers[format](**options)
