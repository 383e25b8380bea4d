"""Read a whole GPTQ or AWQ safetensors checkpoint into a flat params dict of nybble weights.

Checkpoints written by other tools; nybble's own file format (``nybble.save`` / ``nybble.load``) is
``nybble.checkpoint``.

Quantized layers are the prefixes ``p`` with a ``p.qweight`` tensor; their ``p.qzeros``, ``p.scales``
(and for GPTQ ``p.g_idx``) are consumed, everything else (biases, norms, embeddings) is returned as a
numpy array under its own name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from nybble.extras import require
from nybble.quant.formats.awq_format import from_awq
from nybble.quant.formats.gptq_format import ZeroConvention, from_gptq_act_order
from nybble.quant.qweight import QuantizedWeight

PERM_SUFFIX = ".input_perm"


Source = str | os.PathLike | Mapping[str, Any] | Sequence[str | os.PathLike]


def _read(path_or_dict: Source) -> dict[str, np.ndarray]:
    """Tensors of a dict, a safetensors file, or several files (shards) merged."""
    if isinstance(path_or_dict, Mapping):
        return {str(k): np.asarray(v) for k, v in path_or_dict.items()}
    if isinstance(path_or_dict, Sequence) and not isinstance(path_or_dict, str):
        merged: dict[str, np.ndarray] = {}
        for shard in path_or_dict:
            tensors = _read(shard)
            if dup := sorted(set(merged) & set(tensors)):
                raise ValueError(f"tensor {dup[0]!r} appears in more than one shard (at {shard!r})")
            merged.update(tensors)
        return merged
    load_file = require("safetensors.numpy", "reading GPTQ/AWQ safetensors files").load_file
    path = os.fspath(path_or_dict)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint file at {path!r}")
    return load_file(path)


def _split(tensors: dict[str, np.ndarray], needed: tuple[str, ...], kind: str) -> list[str]:
    prefixes = sorted(name[: -len(".qweight")] for name in tensors if name.endswith(".qweight"))
    if not prefixes:
        raise ValueError(f"no '<prefix>.qweight' tensor found: not a {kind} checkpoint")
    for p in prefixes:
        for part in needed:
            if f"{p}.{part}" not in tensors:
                raise ValueError(
                    f"{p}.{part}: missing from the {kind} checkpoint (layer {p!r} has a qweight; "
                    f"{kind} layers need {', '.join(needed)})"
                )
    return prefixes


def load_gptq_checkpoint(
    path_or_dict: Source,
    *,
    zero_convention: ZeroConvention = "auto",
    sym: bool | None = None,
    group_size: int | None = None,
    act_order: Literal["permute", "error"] = "permute",
    scale_dtype: Any = None,
) -> dict[str, QuantizedWeight | np.ndarray]:
    """A GPTQ safetensors file (a list of shard files, or a dict of tensors) -> a flat params dict.

    Returns ``{prefix: QuantizedWeight}`` for every quantized layer plus ``{name: numpy array}`` for every
    other tensor.

    Each layer is imported exactly by :func:`nybble.quant.from_gptq_act_order`. An act-order
    layer (``g_idx`` not ``arange(K) // G``) has its rows of K reordered so groups are contiguous, and
    the permutation is returned as ``params[prefix + ".input_perm"]`` (int32 [K]): compute that layer as
    ``x[..., perm] @ W``. ``act_order="error"`` refuses such layers instead. Note that "auto" zero
    detection needs symmetric layers; AutoGPTQ / optimum checkpoints are ``zero_convention="v1"``.
    """
    if act_order not in ("permute", "error"):
        raise ValueError(f"act_order must be 'permute' or 'error', got {act_order!r}")
    tensors = _read(path_or_dict)
    prefixes = _split(tensors, ("qweight", "qzeros", "scales"), "GPTQ")
    params: dict[str, QuantizedWeight | np.ndarray] = {}
    for p in prefixes:
        qw, perm = from_gptq_act_order(
            tensors.pop(f"{p}.qweight"), tensors.pop(f"{p}.qzeros"), tensors.pop(f"{p}.scales"),
            tensors.pop(f"{p}.g_idx", None), sym=sym, zero_convention=zero_convention,
            group_size=group_size, scale_dtype=scale_dtype, name=p,
        )  # fmt: skip
        params[p] = qw
        if perm is not None:
            if act_order == "error":
                raise ValueError(
                    f"{p}.g_idx: act-order layer; pass act_order='permute' to import it with an "
                    f"input permutation (params[{p + PERM_SUFFIX!r}])"
                )
            params[p + PERM_SUFFIX] = perm
    params.update(tensors)
    return params


def load_awq_checkpoint(
    path_or_dict: Source,
    *,
    group_size: int | None = None,
    scale_dtype: Any = None,
) -> dict[str, QuantizedWeight | np.ndarray]:
    """An AWQ (GEMM) safetensors file (or dict) -> ``{prefix: QuantizedWeight, name: array}``, exact."""
    tensors = _read(path_or_dict)
    prefixes = _split(tensors, ("qweight", "qzeros", "scales"), "AWQ")
    params: dict[str, QuantizedWeight | np.ndarray] = {}
    for p in prefixes:
        params[p] = from_awq(
            tensors.pop(f"{p}.qweight"), tensors.pop(f"{p}.qzeros"), tensors.pop(f"{p}.scales"),
            group_size=group_size, scale_dtype=scale_dtype, name=p,
        )  # fmt: skip
    params.update(tensors)
    return params
