"""``nybble.save`` / ``nybble.load``: a params pytree with ``QuantizedWeight`` leaves in one safetensors file.

File layout: standard safetensors (8-byte little-endian header size, JSON header, tensor bytes), readable
by any safetensors reader. The header's ``__metadata__`` holds:

* ``format``: ``"nybble"``; ``format_version``: ``"1"``;
* ``tree``: JSON list, one entry per leaf in pytree order: ``path`` (list of ``[kind, key]``, kind
  ``"d"`` dict key, ``"l"`` list or tuple index), ``kind`` (``"array"`` or ``"quantized"``),
  the tensor name(s), and for quantized leaves ``layout``, ``group_size``, ``symmetric``, ``shape``;
* ``sha256``: hex digest over every tensor's name, dtype, shape and bytes, in header order.

Loading refuses (``ValueError``) a truncated or tampered file, a foreign or newer format version and an
unknown layout, so a damaged file never becomes a silently wrong model. Writes are atomic: a temporary
file in the target directory, fsync, then ``os.replace``; the file gets the mode the umask gives a new
file (0644 under the usual 022), as ``open`` would.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from nybble.packing import get_layout
from nybble.quant.qweight import QuantizedWeight

FORMAT_NAME = "nybble"
FORMAT_VERSION = 1
_MAX_HEADER = 100 * 2**20

_DTYPES: dict[str, Any] = {
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
_DTYPE_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


# ----------------------------------------------------------------------------------------------- paths


def _path_tokens(path: tuple[Any, ...]) -> list[list[Any]]:
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


def _path_name(tokens: list[list[Any]]) -> str:
    return ".".join(str(k) for _, k in tokens) or "root"


def _to_numpy(a: Any) -> np.ndarray:
    arr = np.asarray(jax.device_get(a))
    if arr.dtype not in _DTYPE_NAMES:
        raise TypeError(f"nybble.save: unsupported dtype {arr.dtype}")
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _pure(tree: Any) -> Any:
    """An ``nnx.State`` (or anything holding ``nnx.Variable``) as a pure dict; other trees unchanged."""
    if type(tree).__module__.startswith("flax"):
        from flax import nnx  # lazy: flax is an optional dependency

        if isinstance(tree, nnx.State):
            return nnx.to_pure_dict(tree)
    return tree


def _leaves(tree: Any) -> Iterator[tuple[list[list[Any]], Any]]:
    is_qw = lambda x: isinstance(x, QuantizedWeight)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_qw)
    for path, leaf in flat:
        yield _path_tokens(path), leaf


# ----------------------------------------------------------------------------------------------- save


def _bytes(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))


def _digest(tree_json: str, entries: list[tuple[str, np.ndarray]]) -> str:
    h = hashlib.sha256(tree_json.encode())
    for name, arr in entries:
        h.update(f"|{name}|{_DTYPE_NAMES[arr.dtype]}|{list(arr.shape)}|".encode())
        h.update(_bytes(arr))
    return h.hexdigest()


def save(path: str | os.PathLike[str], tree: Any) -> Path:
    """Writes a pytree of arrays and ``QuantizedWeight`` leaves to one safetensors file, atomically.

    Supported containers: nested dicts (str or int keys; Linen params, NNX pure state dicts; an
    ``nnx.State`` is converted with ``nnx.to_pure_dict``) and lists/tuples (loaded back as lists).
    Returns the path written.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"nybble.save: {path} is a directory; give a file name")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"nybble.save: directory {path.parent} does not exist")
    entries: list[tuple[str, np.ndarray]] = []
    tree_meta: list[dict[str, Any]] = []
    used: set[str] = set()

    def add(name: str, arr: Any) -> str:
        if name in used:
            raise ValueError(f"nybble.save: two leaves map to the tensor name {name!r}")
        used.add(name)
        entries.append((name, _to_numpy(arr)))
        return name

    for tokens, leaf in _leaves(_pure(tree)):
        name = _path_name(tokens)
        if isinstance(leaf, QuantizedWeight):
            meta: dict[str, Any] = {
                "path": tokens,
                "kind": "quantized",
                "layout": leaf.layout,
                "group_size": leaf.group_size,
                "symmetric": leaf.symmetric,
                "shape": list(leaf.shape),
                "codes": add(f"{name}::codes", leaf.codes),
                "scales": add(f"{name}::scales", leaf.scales),
            }
            if leaf.offsets is not None:
                meta["offsets"] = add(f"{name}::offsets", leaf.offsets)
            tree_meta.append(meta)
        elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            tree_meta.append({"path": tokens, "kind": "array", "tensor": add(name, leaf)})
        else:
            raise TypeError(
                f"nybble.save: leaf {name!r} is a {type(leaf).__name__}; only arrays and "
                f"QuantizedWeight can be saved"
            )
    tree_json = json.dumps(tree_meta, separators=(",", ":"))
    header: dict[str, Any] = {
        "__metadata__": {
            "format": FORMAT_NAME,
            "format_version": str(FORMAT_VERSION),
            "tree": tree_json,
            "sha256": _digest(tree_json, entries),
        }
    }
    offset = 0
    for name, arr in entries:
        header[name] = {
            "dtype": _DTYPE_NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600: give the file the mode open() would
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(header_bytes)))
            f.write(header_bytes)
            for _, arr in entries:
                f.write(_bytes(arr))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    """The process umask (reading it means setting it: put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------------------------- load


def _refuse(path: Path, why: str) -> ValueError:
    return ValueError(f"nybble.load: refusing {path}: {why}")


NOT_SAFETENSORS = (
    "not a safetensors file, so not a nybble checkpoint (a safetensors file starts with an 8-byte "
    "header length and a JSON header; write checkpoints with nybble.save or `nybble quantize`)"
)


def _header_size(path: Path, start: bytes) -> int:
    """The header length from a file's first 9 bytes, after checking they can begin a safetensors file."""
    if len(start) < 9:
        raise _refuse(path, f"file too short ({len(start)} bytes): {NOT_SAFETENSORS}")
    (n,) = struct.unpack("<Q", start[:8])
    if start[8:9] != b"{" or n > _MAX_HEADER:  # the JSON header is an object, under 100 MiB
        raise _refuse(path, NOT_SAFETENSORS)
    return n


def _read_header(path: Path, data: bytes) -> tuple[dict[str, Any], int]:
    n = _header_size(path, data[:9])
    if 8 + n > len(data):
        raise _refuse(path, f"header size {n} does not fit the {len(data)}-byte file (truncated?)")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(path, f"unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise _refuse(path, "the safetensors header is not a JSON object")
    return header, 8 + n


def _check_format(path: Path, meta: Any) -> None:
    """Refuses a safetensors file nybble did not write, or a newer nybble format version."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise _refuse(path, "not a nybble checkpoint (no format='nybble' in the safetensors metadata)")
    version = meta.get("format_version")
    if version != str(FORMAT_VERSION):
        raise _refuse(
            path,
            f"unsupported nybble checkpoint format version {version!r}; this nybble reads version "
            f"{FORMAT_VERSION} (upgrade nybble to read newer files)",
        )


def _tensor(path: Path, header: dict[str, Any], data: memoryview, name: str) -> np.ndarray:
    info = header.get(name)
    if not isinstance(info, dict):
        raise _refuse(path, f"tensor {name!r} is missing")
    try:
        dtype = np.dtype(_DTYPES[info["dtype"]])
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise _refuse(path, f"malformed entry for tensor {name!r}: {info!r}") from None
    if not 0 <= begin <= end <= len(data) or end - begin != dtype.itemsize * int(np.prod(shape)):
        raise _refuse(path, f"tensor {name!r} lies outside the file or has the wrong size (truncated?)")
    return np.frombuffer(data[begin:end], dtype=dtype).reshape(shape)


def _as_array(a: np.ndarray) -> Any:
    # 64-bit arrays stay numpy: jax without x64 would silently narrow them.
    return a.copy() if a.dtype.itemsize == 8 else jnp.asarray(a)


def _build(entries: list[tuple[list[list[Any]], Any]]) -> Any:
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


def load(path: str | os.PathLike[str]) -> Any:
    """Reads a file written by :func:`save`: the same pytree, jax arrays and ``QuantizedWeight`` leaves.

    Tuples come back as lists; 64-bit arrays come back as numpy arrays (never narrowed).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for anything that is not an
    intact nybble checkpoint this version can read (truncated, tampered, foreign, newer, unknown layout).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"nybble.load: no such file: {path}")
    if path.is_dir():
        raise IsADirectoryError(f"nybble.load: {path} is a directory, not a checkpoint file")
    data = path.read_bytes()
    header, start = _read_header(path, data)
    meta = header.get("__metadata__")
    _check_format(path, meta)
    body = memoryview(data)[start:]
    names = [k for k in header if k != "__metadata__"]
    expected_end = max((int(header[k]["data_offsets"][1]) for k in names), default=0)
    if len(body) != expected_end:
        raise _refuse(path, f"{len(body)} data bytes, the header describes {expected_end} (truncated?)")
    tensors = {name: _tensor(path, header, body, name) for name in names}
    try:
        tree_json = meta["tree"]
        tree_meta = json.loads(tree_json)
    except (KeyError, TypeError, json.JSONDecodeError):
        raise _refuse(path, "missing or unreadable 'tree' metadata") from None
    for m in tree_meta:
        if m.get("kind") == "quantized":
            try:
                get_layout(m.get("layout"))
            except ValueError:
                raise _refuse(
                    path,
                    f"unknown weight layout {m.get('layout')!r} for {_path_name(m['path'])} "
                    f"(written by a newer nybble?)",
                ) from None
    if _digest(tree_json, list(tensors.items())) != meta.get("sha256"):
        raise _refuse(path, "sha256 checksum mismatch: the file was modified or damaged")
    entries: list[tuple[list[list[Any]], Any]] = []
    for m in tree_meta:
        if m.get("kind") == "array":
            entries.append((m["path"], _as_array(tensors[m["tensor"]])))
            continue
        if m.get("kind") != "quantized":
            raise _refuse(path, f"unknown leaf kind {m.get('kind')!r}")
        offsets = tensors[m["offsets"]] if "offsets" in m else None
        try:  # a QuantizedWeight checks its own group size, layout and array shapes
            qw = QuantizedWeight(
                codes=jnp.asarray(tensors[m["codes"]]),
                scales=jnp.asarray(tensors[m["scales"]]),
                offsets=None if offsets is None else jnp.asarray(offsets),
                shape=tuple(int(d) for d in m["shape"]),
                group_size=m.get("group_size"),
                symmetric=bool(m["symmetric"]),
                layout=m["layout"],
            )
        except (ValueError, TypeError) as e:
            raise _refuse(path, f"{_path_name(m['path'])}: {e}") from None
        entries.append((m["path"], qw))
    return _build(entries)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The nybble metadata of a checkpoint (format, version, per-leaf entries) without loading tensors.

    Reads the header only; refuses (ValueError) a file that is not a nybble checkpoint this version reads.
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(9)
        n = _header_size(path, head)
        header, _ = _read_header(path, head + f.read(n - 1))
    meta = dict(header.get("__metadata__") or {})
    _check_format(path, meta)
    if "tree" in meta:
        meta["tree"] = json.loads(meta["tree"])
    return meta


__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "load", "read_metadata", "save"]
