"""compressed-tensors ``pack-quantized`` directories (llm-compressor W4A16, what vLLM serves): the reader
(:class:`CompressedTensorsScheme`) and the writer (:class:`CompressedTensorsWriter`). The format's tensors
are listed in ``nybble.quant.formats.hf_scheme``."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from nybble.quant.formats._common import (
    check_dtype,
    check_shape,
    checked_group_size,
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

__all__ = ["CompressedTensorsScheme", "CompressedTensorsWriter"]




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
