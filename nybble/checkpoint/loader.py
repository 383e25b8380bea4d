"""``nybble.load``: one loader over a :class:`Reader`, whole into local arrays or placed on a mesh.

Without ``placement`` the file is read whole and every leaf becomes a local array. With one, the caller's
``placement(leaf)`` says where each leaf goes: None (one local array), a ``jax.sharding.Sharding`` (arrays;
a quantized leaf has each of its arrays placed with it) or a :class:`nybble.sharding.TensorParallel` (a
quantized leaf becomes a ``ShardedWeight``). Placed arrays are built with ``jax.make_array_from_callback``,
which asks only for the blocks this process's devices hold, and each block is read with positioned reads
of exactly its bytes (plus zero padding for a shard padded on its own): no process reads, or holds on the
host, more than its shards. The whole-file sha256 needs every byte, so a placed load checks it only when
asked (``verify=True``: the file streamed through the hash in chunks, never held); the header is always
checked (:func:`nybble.checkpoint.header.read_header`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nybble.checkpoint.format import as_array, build_tree, path_name, refuse
from nybble.checkpoint.header import Header, read_header
from nybble.checkpoint.reader import Reader
from nybble.quant.qweight import QuantizedWeight
from nybble.sharding.split_plan import TensorParallel
from nybble.sharding.weight import block_slice, build_sharded


@dataclasses.dataclass(frozen=True)
class CheckpointLeaf:
    """What a placement function is told about one leaf of a checkpoint."""

    name: str  # dotted path: "layers.0.attn.q_proj.qweight"
    path: tuple[Any, ...]  # the same as keys: ("layers", 0, "attn", "q_proj", "qweight")
    kind: str  # "array" or "quantized"
    shape: tuple[int, ...]  # the array's shape, or the quantized weight's logical (K, N)
    dtype: str  # the array's dtype, or the quantized weight's scale dtype


Placement = Callable[[CheckpointLeaf], Any]


def _local(placement: Placement | None) -> Placement:
    return placement if placement is not None else (lambda leaf: None)


def _place_array(reader: Reader, name: str, sharding: Any) -> Any:
    if sharding is None:
        return as_array(reader.read(name))
    shape = reader.header.tensors[name].shape
    cache: dict[tuple[Any, ...], np.ndarray] = {}  # a block held by several devices is read once

    def block(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop) for s in index)
        if key not in cache:
            cache[key] = reader.read(name, index)
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, block)


def _quantized(reader: Reader, meta: dict[str, Any], where: Any) -> Any:
    path, name = reader.header.path, path_name(meta["path"])
    tensors = {a: meta[a] for a in ("codes", "scales", "offsets") if a in meta}
    entry = reader.header.tensors
    abstract = {a: jax.ShapeDtypeStruct(entry[t].shape, entry[t].dtype) for a, t in tensors.items()}
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
        raise refuse(path, f"{name}: {e}") from None
    fields = dict(shape=spec.shape, group_size=spec.group_size, symmetric=spec.symmetric, layout=spec.layout)
    if isinstance(where, TensorParallel):
        plan = where.plan(spec, name)

        def block(array: str, shard: int) -> np.ndarray:
            b = block_slice(plan, array, shard)
            index = [slice(None)] * len(entry[tensors[array]].shape)
            index[b.axis] = slice(b.start, b.stop)
            part = reader.read(tensors[array], tuple(index))
            pad = [(0, 0)] * part.ndim
            pad[b.axis] = (0, b.length - part.shape[b.axis])
            return np.pad(part, pad) if pad[b.axis][1] else part

        dtypes = {a: v.dtype for a, v in abstract.items()}
        return build_sharded(spec, where, block, dtypes, name=name)
    arrays = {a: _place_array(reader, t, where) for a, t in tensors.items()}
    return QuantizedWeight(arrays["codes"], arrays["scales"], arrays.get("offsets"), **fields)


def load_tree(reader: Reader, placement: Placement | None) -> Any:
    """Every leaf of the checkpoint ``reader`` reads, placed by ``placement`` (None: all local)."""
    place = _local(placement)
    entries: list[tuple[list[list[Any]], Any]] = []
    for m in reader.header.tree:
        keys = tuple(k for _, k in m["path"])
        name = path_name(m["path"])
        if m["kind"] == "array":
            t = reader.header.tensors[m["tensor"]]
            where = place(CheckpointLeaf(name, keys, "array", t.shape, t.dtype.name))
            if isinstance(where, TensorParallel):
                raise ValueError(
                    f"nybble.load: {name} is a plain array; TensorParallel is for quantized weights "
                    f"(place arrays with a jax.sharding.NamedSharding)"
                )
            entries.append((m["path"], _place_array(reader, m["tensor"], where)))
        else:
            scale_dtype = reader.header.tensors[m["scales"]].dtype.name
            leaf = CheckpointLeaf(name, keys, "quantized", tuple(m["shape"]), scale_dtype)
            entries.append((m["path"], _quantized(reader, m, place(leaf))))
    return build_tree(entries)


def _check_path(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"nybble.load: no such file: {path}")
    if path.is_dir():
        raise IsADirectoryError(f"nybble.load: {path} is a directory, not a checkpoint file")
    return path


def load(
    path: str | os.PathLike[str], *, placement: Placement | None = None, verify: bool | None = None
) -> Any:
    """Reads a file written by :func:`nybble.save`: the same pytree, arrays and ``QuantizedWeight`` leaves.

    Tuples come back as lists; 64-bit arrays come back as numpy arrays (never narrowed).

    Args:
      path: the checkpoint.
      placement: None reads every tensor whole into local arrays. Else a function of a
        :class:`CheckpointLeaf` (its dotted ``name``, ``kind``, ``shape``) giving None (a local array), a
        ``jax.sharding.Sharding`` for the leaf's arrays, or a :class:`nybble.sharding.TensorParallel` for a
        quantized leaf (loaded as a ``ShardedWeight``). Each process then reads only the bytes of the blocks
        its devices hold.
      verify: check the whole-file sha256. Default: True without placement; False with one (the hash
        needs every byte: ``verify=True`` streams the file through it, in chunks).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for anything that is not an
    intact nybble checkpoint this version can read (truncated, tampered, foreign, newer, unknown layout).
    """
    path = _check_path(path)
    verify = placement is None if verify is None else verify
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header = read_header(path, f, size)
        if placement is None:  # one read of the whole file, then views of it
            f.seek(0)
            reader = Reader(header, data=memoryview(f.read()))
        else:
            reader = Reader(header, fd=f.fileno())
        if verify and reader.digest() != header.meta.get("sha256"):
            raise refuse(path, "sha256 checksum mismatch: the file was modified or damaged")
        return load_tree(reader, placement)


def read_header_of(path: str | os.PathLike[str]) -> Header:
    """The checked header of the checkpoint at ``path`` (no tensor is read)."""
    path = _check_path(path)
    with open(path, "rb") as f:
        return read_header(path, f, os.fstat(f.fileno()).st_size)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The nybble metadata of a checkpoint (format, version, per-leaf ``tree``, ``info``) without loading
    tensors. Reads the header only; refuses (ValueError) a file that is not a nybble checkpoint this
    version reads."""
    header = read_header_of(path)
    return {**header.meta, "tree": header.tree, "info": header.info}
