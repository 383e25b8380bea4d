"""``nybble.load(path, placement=...)``: a checkpoint read into sharded arrays, each process its shards.

The caller's ``placement(leaf)`` says where each leaf goes: None (one local array, as ``nybble.load``
without placement), a ``jax.sharding.Sharding`` (arrays; a quantized leaf then has each of its arrays placed
with it) or a :class:`nybble.sharding.TensorParallel` (a quantized leaf becomes a ``ShardedWeight``). Arrays
are built with ``jax.make_array_from_callback``, which asks only for the blocks this process's devices hold,
and each block is read from the file with positioned reads of exactly its bytes (plus zero padding for a
shard padded on its own): no process reads, or holds on the host, more than its shards.

The whole-file sha256 needs every byte, so a placed load checks it only when asked (``verify=True``: the
file is streamed through the hash in chunks, never held). The header, the tensor sizes against the file
size, the layouts and the shapes are always checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nybble.packing import get_layout
from nybble.quant.qweight import QuantizedWeight
from nybble.sharding.plan import TensorParallel
from nybble.sharding.weight import block_slice, build_sharded

_CHUNK = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class CheckpointLeaf:
    """What a placement function is told about one leaf of a checkpoint."""

    name: str  # dotted path: "layers.0.attn.q_proj.qweight"
    path: tuple[Any, ...]  # the same as keys: ("layers", 0, "attn", "q_proj", "qweight")
    kind: str  # "array" or "quantized"
    shape: tuple[int, ...]  # the array's shape, or the quantized weight's logical (K, N)
    dtype: str  # the array's dtype, or the quantized weight's scale dtype


Placement = Callable[[CheckpointLeaf], Any]


class _Reader:
    """Positioned reads of (parts of) the tensors of an open safetensors file."""

    def __init__(self, fd: int, data_start: int, header: dict[str, Any], dtypes: dict[str, Any]) -> None:
        self.fd, self.data_start, self.header, self.dtypes = fd, data_start, header, dtypes

    def info(self, name: str) -> tuple[np.dtype, tuple[int, ...], int]:
        entry = self.header[name]
        return np.dtype(self.dtypes[entry["dtype"]]), tuple(entry["shape"]), int(entry["data_offsets"][0])

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """``tensor[index]`` (unit-step slices), reading only the bytes it covers."""
        dtype, shape, begin = self.info(name)
        if not shape:
            return np.frombuffer(self._pread(dtype.itemsize, begin), dtype).reshape(())
        index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
        bounds = [s.indices(d) for s, d in zip(index, shape, strict=True)]
        if any(step != 1 for _, _, step in bounds):
            raise ValueError(f"checkpoint reads take unit-step slices, got {index}")
        starts = [a for a, _, _ in bounds]
        sizes = [max(0, b - a) for a, b, _ in bounds]
        out = np.empty(sizes, dtype)
        if out.size == 0:
            return out
        # Dims after `k` are whole, so each index of dims < k gives one contiguous run of the file.
        k = len(shape) - 1
        while k > 0 and sizes[k] == shape[k]:
            k -= 1
        strides = [int(np.prod(shape[i + 1 :])) for i in range(len(shape))]
        run = sizes[k] * strides[k]
        for idx in itertools.product(*(range(s, s + n) for s, n in zip(starts[:k], sizes[:k], strict=True))):
            offset = sum(i * st for i, st in zip(idx, strides[:k], strict=True)) + starts[k] * strides[k]
            chunk = self._pread(run * dtype.itemsize, begin + offset * dtype.itemsize)
            out[tuple(i - s for i, s in zip(idx, starts[:k], strict=True))] = np.frombuffer(
                chunk, dtype
            ).reshape(sizes[k:])
        return out

    def _pread(self, size: int, offset: int) -> bytes:
        data = os.pread(self.fd, size, self.data_start + offset)
        if len(data) != size:
            raise ValueError(f"nybble.load: short read ({len(data)} of {size} bytes): truncated file?")
        return data

    def digest(self, tree_json: str, names: list[str]) -> str:
        """The checkpoint's sha256 (``nybble.checkpoint._digest``), streaming each tensor in chunks."""
        h = hashlib.sha256(tree_json.encode())
        for name in names:
            entry = self.header[name]
            h.update(f"|{name}|{entry['dtype']}|{list(entry['shape'])}|".encode())
            begin, end = (int(x) for x in entry["data_offsets"])
            for offset in range(begin, end, _CHUNK):
                h.update(self._pread(min(_CHUNK, end - offset), offset))
        return h.hexdigest()


def _place_array(reader: _Reader, name: str, sharding: Any) -> Any:
    _, shape, _ = reader.info(name)
    cache: dict[tuple[Any, ...], np.ndarray] = {}  # a block held by several devices is read once

    def block(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop) for s in index)
        if key not in cache:
            cache[key] = reader.read(name, index)
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, block)


def _quantized(reader: _Reader, path: Path, meta: dict[str, Any], where: Any) -> Any:
    from nybble.checkpoint import _as_array, _path_name, _refuse

    name = _path_name(meta["path"])
    tensors = {a: meta[a] for a in ("codes", "scales", "offsets") if a in meta}
    abstract = {a: jax.ShapeDtypeStruct(reader.info(t)[1], reader.info(t)[0]) for a, t in tensors.items()}
    try:  # a QuantizedWeight checks its own group size, layout and (abstract) array shapes
        spec = QuantizedWeight(
            abstract["codes"],
            abstract["scales"],
            abstract.get("offsets"),
            shape=tuple(int(d) for d in meta["shape"]),  # type: ignore[arg-type]
            group_size=meta.get("group_size"),
            symmetric=bool(meta["symmetric"]),
            layout=meta["layout"],
        )
    except (KeyError, ValueError, TypeError) as e:
        raise _refuse(path, f"{name}: {e}") from None
    fields = dict(shape=spec.shape, group_size=spec.group_size, symmetric=spec.symmetric, layout=spec.layout)
    if isinstance(where, TensorParallel):
        plan = where.plan(spec, name)

        def block(array: str, shard: int) -> np.ndarray:
            b = block_slice(plan, array, shard)
            _, shape, _ = reader.info(tensors[array])
            index = [slice(None)] * len(shape)
            index[b.axis] = slice(b.start, b.stop)
            part = reader.read(tensors[array], tuple(index))
            pad = [(0, 0)] * part.ndim
            pad[b.axis] = (0, b.length - part.shape[b.axis])
            return np.pad(part, pad) if pad[b.axis][1] else part

        dtypes = {a: v.dtype for a, v in abstract.items()}
        return build_sharded(spec, where, block, dtypes, name=name)
    arrays = {
        a: _as_array(reader.read(t)) if where is None else _place_array(reader, t, where)
        for a, t in tensors.items()
    }
    return QuantizedWeight(arrays["codes"], arrays["scales"], arrays.get("offsets"), **fields)


def load_placed(path: Path, placement: Placement, *, verify: bool = False) -> Any:
    """``nybble.load(path, placement=..., verify=...)``: see the module docstring."""
    from nybble.checkpoint import (
        _DTYPES,
        _as_array,
        _build,
        _check_format,
        _header_size,
        _path_name,
        _refuse,
    )

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)
        n = _header_size(path, head)
        if 8 + n > size:
            raise _refuse(path, f"header size {n} does not fit the {size}-byte file (truncated?)")
        try:
            header = json.loads(head[8:] + f.read(n - 1))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _refuse(path, f"unreadable safetensors header ({e})") from None
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        _check_format(path, meta)
        names = [k for k in header if k != "__metadata__"]
        body = size - 8 - n
        for name in names:
            entry = header[name]
            try:
                dtype = np.dtype(_DTYPES[entry["dtype"]])
                begin, end = (int(x) for x in entry["data_offsets"])
                count = int(np.prod([int(s) for s in entry["shape"]]))
            except (KeyError, TypeError, ValueError):
                raise _refuse(path, f"malformed entry for tensor {name!r}: {entry!r}") from None
            if not 0 <= begin <= end <= body or end - begin != dtype.itemsize * count:
                raise _refuse(
                    path, f"tensor {name!r} lies outside the file or has the wrong size (truncated?)"
                )
        if body != max((int(header[k]["data_offsets"][1]) for k in names), default=0):
            raise _refuse(path, f"{body} data bytes do not match the header's tensors (truncated?)")
        try:
            tree_json = meta["tree"]
            tree_meta = json.loads(tree_json)
        except (KeyError, TypeError, json.JSONDecodeError):
            raise _refuse(path, "missing or unreadable 'tree' metadata") from None
        reader = _Reader(f.fileno(), 8 + n, header, _DTYPES)
        if verify and reader.digest(tree_json, names) != meta.get("sha256"):
            raise _refuse(path, "sha256 checksum mismatch: the file was modified or damaged")
        entries: list[tuple[list[list[Any]], Any]] = []
        for m in tree_meta:
            kind = m.get("kind")
            keys = tuple(k for _, k in m["path"])
            if kind == "array":
                dtype, shape, _ = reader.info(m["tensor"])
                leaf = CheckpointLeaf(_path_name(m["path"]), keys, "array", shape, dtype.name)
                where = placement(leaf)
                if isinstance(where, TensorParallel):
                    raise ValueError(
                        f"nybble.load: {leaf.name} is a plain array; TensorParallel is for "
                        f"quantized weights (place arrays with a jax.sharding.NamedSharding)"
                    )
                value = (
                    _as_array(reader.read(m["tensor"]))
                    if where is None
                    else _place_array(reader, m["tensor"], where)
                )
                entries.append((m["path"], value))
            elif kind == "quantized":
                try:
                    get_layout(m.get("layout"))
                except ValueError:
                    raise _refuse(
                        path,
                        f"unknown weight layout {m.get('layout')!r} for "
                        f"{_path_name(m['path'])} (written by a newer nybble?)",
                    ) from None
                scale_dtype = reader.info(m["scales"])[0].name
                leaf = CheckpointLeaf(
                    _path_name(m["path"]), keys, "quantized", tuple(m["shape"]), scale_dtype
                )
                entries.append((m["path"], _quantized(reader, path, m, placement(leaf))))
            else:
                raise _refuse(path, f"unknown leaf kind {kind!r}")
        return _build(entries)


__all__ = ["CheckpointLeaf", "Placement", "load_placed"]
