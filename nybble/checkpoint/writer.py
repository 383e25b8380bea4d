"""``nybble.save``: a pytree of arrays and ``QuantizedWeight`` leaves to one safetensors file, atomically."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nybble.checkpoint.format import DTYPE_NAMES, FORMAT_NAME, FORMAT_VERSION, digest, path_name, path_tokens
from nybble.quant.qweight import QuantizedWeight
from nybble.sharding import ShardedWeight


def _to_numpy(a: Any) -> np.ndarray:
    arr = np.asarray(jax.device_get(a))
    if arr.dtype not in DTYPE_NAMES:
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
    is_qw = lambda x: isinstance(x, QuantizedWeight | ShardedWeight)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_qw)
    for path, leaf in flat:
        yield path_tokens(path), leaf.gather() if isinstance(leaf, ShardedWeight) else leaf


def _bytes(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))


def _umask() -> int:
    """The process umask (reading it means setting it: put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save(path: str | os.PathLike[str], tree: Any, *, info: Mapping[str, Any] | None = None) -> Path:
    """Writes a pytree of arrays and ``QuantizedWeight`` leaves to one safetensors file, atomically.

    Supported containers: nested dicts (str or int keys; Linen params, NNX pure state dicts; an
    ``nnx.State`` is converted with ``nnx.to_pure_dict``) and lists/tuples (loaded back as lists).
    Sharded arrays and ``ShardedWeight`` leaves are gathered to the host and written unsharded (one
    process, holding every shard). ``info``: JSON-serializable facts about the file (``save_model``
    records the quantization method), covered by the checksum; ``read_metadata(path)["info"]`` returns
    it. Returns the path written.
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
        name = path_name(tokens)
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
    metadata: dict[str, str] = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "tree": json.dumps(tree_meta, separators=(",", ":")),
    }
    if info:
        try:
            metadata["info"] = json.dumps(dict(info), separators=(",", ":"), sort_keys=True)
        except TypeError as e:
            raise TypeError(f"nybble.save: info must be JSON-serializable ({e})") from None
    seed = metadata["tree"] + metadata.get("info", "")
    metadata["sha256"] = digest(
        seed, ((n, DTYPE_NAMES[a.dtype], list(a.shape), iter((_bytes(a),))) for n, a in entries)
    )
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, arr in entries:
        header[name] = {
            "dtype": DTYPE_NAMES[arr.dtype],
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
