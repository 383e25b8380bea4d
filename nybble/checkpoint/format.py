"""The nybble checkpoint format's constants and names: dtypes, leaf paths, the checksum, the refusal."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FORMAT_NAME = "nybble"
FORMAT_VERSION = 1
MAX_HEADER = 100 * 2**20

DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
}
DTYPE_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def refuse(path: Path, why: str) -> ValueError:
    """The one error for a file that is not an intact checkpoint this version reads."""
    return ValueError(f"nybble.load: refusing {path}: {why}")


def path_tokens(path: tuple[Any, ...]) -> list[list[Any]]:
    """A jax key path as the format's ``[kind, key]`` tokens (``"d"`` dict key, ``"l"`` list index)."""
    out: list[list[Any]] = []
    for p in path:
        if isinstance(p, jax.tree_util.DictKey):
            key = p.key
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise TypeError(f"nybble.save: dict keys must be str or int, got {key!r}")
            out.append(["d", key])
        elif isinstance(p, jax.tree_util.SequenceKey):
            out.append(["l", p.idx])
        else:
            raise TypeError(
                f"nybble.save supports nested dicts and lists of arrays; unsupported pytree node at "
                f"{jax.tree_util.keystr(path)} ({type(p).__name__})"
            )
    return out


def path_name(tokens: list[list[Any]]) -> str:
    """The dotted name of a leaf (``"layers.0.attn.q_proj.qweight"``), ``"root"`` for a lone leaf."""
    return ".".join(str(k) for _, k in tokens) or "root"


def digest_seed(meta: dict[str, Any]) -> str:
    """What the checksum covers before the tensors: the tree, and the ``info`` when the file has one."""
    return meta["tree"] + meta.get("info", "")


def digest(seed: str, tensors: Iterable[tuple[str, str, list[int], Iterator[bytes | memoryview]]]) -> str:
    """sha256 over ``seed``, then each tensor's name, dtype name, shape and bytes (given in chunks)."""
    h = hashlib.sha256(seed.encode())
    for name, dtype, shape, chunks in tensors:
        h.update(f"|{name}|{dtype}|{list(shape)}|".encode())
        for chunk in chunks:
            h.update(chunk)
    return h.hexdigest()


def as_array(a: np.ndarray) -> Any:
    """A loaded tensor as a jax array; 64-bit ones stay numpy (jax without x64 would narrow them)."""
    return a.copy() if a.dtype.itemsize == 8 else jnp.asarray(a)


def build_tree(entries: list[tuple[list[list[Any]], Any]]) -> Any:
    """The pytree of ``(tokens, leaf)`` entries: nested dicts, lists where the tokens say ``"l"``."""
    if len(entries) == 1 and not entries[0][0]:
        return entries[0][1]
    root: dict[Any, Any] = {}
    kinds: dict[int, str] = {}
    for tokens, leaf in entries:
        node = root
        for i, (kind, key) in enumerate(tokens):
            kinds[id(node)] = kind
            if i == len(tokens) - 1:
                node[key] = leaf
            else:
                node = node.setdefault(key, {})

    def convert(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        kind = kinds.get(id(node), "d")
        items = {k: convert(v) for k, v in node.items()}
        if kind == "l":
            return [items[i] for i in sorted(items)]
        return items

    return convert(root)
