"""One validated checkpoint header: read once, every check made here, whole loads and placed loads alike."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from nybble.checkpoint.format import DTYPES, FORMAT_NAME, FORMAT_VERSION, MAX_HEADER, path_name, refuse
from nybble.packing import get_layout

NOT_SAFETENSORS = (
    "not a safetensors file, so not a nybble checkpoint (a safetensors file starts with an 8-byte "
    "header length and a JSON header; write checkpoints with nybble.save or `nybble quantize`)"
)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: dtype, shape and its byte range within the data section."""

    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class Header:
    """A checkpoint's header, checked: a nybble file of this format version, every tensor inside the file
    and of its size, the data section as long as the tensors, a readable tree, known layouts."""

    path: Path
    meta: dict[str, Any]  # the safetensors ``__metadata__``
    tensors: dict[str, TensorEntry]  # in header order (the checksum's order)
    data_start: int  # file offset of the data section
    tree: list[dict[str, Any]]  # one entry per leaf, pytree order
    info: dict[str, Any]  # what ``save(..., info=...)`` recorded (empty if nothing)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each leaf's dotted name and shape (a quantized leaf's logical (K, N), after the leading axes of
        a stack: (experts, K, N)), from the header alone."""
        out = {}
        for m in self.tree:
            name = path_name(m["path"])
            if m.get("kind") == "quantized":  # scales are (*leading, groups, N_pad)
                out[name] = (*self.tensors[m["scales"]].shape[:-2], *m["shape"])
            else:
                out[name] = self.tensors[m["tensor"]].shape
        return out


def _header_size(path: Path, start: bytes) -> int:
    if len(start) < 9:
        raise refuse(path, f"file too short ({len(start)} bytes): {NOT_SAFETENSORS}")
    (n,) = struct.unpack("<Q", start[:8])
    if start[8:9] != b"{" or n > MAX_HEADER:  # the JSON header is an object, under 100 MiB
        raise refuse(path, NOT_SAFETENSORS)
    return n


def check_format(path: Path, meta: Any) -> None:
    """Refuses a safetensors file nybble did not write, or a newer nybble format version."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise refuse(path, "not a nybble checkpoint (no format='nybble' in the safetensors metadata)")
    version = meta.get("format_version")
    if version != str(FORMAT_VERSION):
        raise refuse(
            path,
            f"unsupported nybble checkpoint format version {version!r}; this nybble reads version "
            f"{FORMAT_VERSION} (upgrade nybble to read newer files)",
        )


def read_header(path: Path, f: BinaryIO, size: int, *, full: bool = True) -> Header:
    """Reads and checks the header of the open file ``f`` of ``size`` bytes.

    ``full=False`` checks the format only (no tensor table, tree or layouts): ``read_metadata``."""
    head = f.read(9)
    n = _header_size(path, head)
    if 8 + n > size:
        raise refuse(path, f"header size {n} does not fit the {size}-byte file (truncated?)")
    try:
        raw = json.loads(head[8:] + f.read(n - 1))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise refuse(path, f"unreadable safetensors header ({e})") from None
    if not isinstance(raw, dict):
        raise refuse(path, "the safetensors header is not a JSON object")
    meta = raw.get("__metadata__")
    check_format(path, meta)
    tensors: dict[str, TensorEntry] = {}
    body = size - 8 - n
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(DTYPES[entry["dtype"]])
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise refuse(path, f"malformed entry for tensor {name!r}: {entry!r}") from None
        if full and (not 0 <= begin <= end <= body or end - begin != dtype.itemsize * int(np.prod(shape))):
            raise refuse(path, f"tensor {name!r} lies outside the file or has the wrong size (truncated?)")
        tensors[name] = TensorEntry(dtype, shape, begin, end)
    if full and body != max((t.end for t in tensors.values()), default=0):
        raise refuse(
            path,
            f"{body} data bytes, the header describes {max((t.end for t in tensors.values()), default=0)} "
            "(truncated?)",
        )
    try:
        tree = json.loads(meta["tree"])
        info = json.loads(meta["info"]) if "info" in meta else {}
    except (KeyError, TypeError, json.JSONDecodeError):
        raise refuse(path, "missing or unreadable 'tree' metadata") from None
    if full:
        for m in tree:
            kind = m.get("kind")
            names = (
                [m.get("tensor")] if kind == "array" else [m.get(a) for a in ("codes", "scales", "offsets")]
            )
            if kind not in ("array", "quantized"):
                raise refuse(path, f"unknown leaf kind {kind!r}")
            if kind == "quantized":
                try:
                    get_layout(m.get("layout"))
                except ValueError:
                    raise refuse(
                        path,
                        f"unknown weight layout {m.get('layout')!r} for {path_name(m['path'])} "
                        f"(written by a newer nybble?)",
                    ) from None
                names = names[:2] + ([m["offsets"]] if "offsets" in m else [])
            for t in names:
                if t not in tensors:
                    raise refuse(path, f"tensor {t!r} is missing")
    return Header(path, meta, tensors, 8 + n, tree, info)
