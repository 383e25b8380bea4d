"""A fast reader of GGUF files: metadata and tensor bytes, nothing else.

``gguf.GGUFReader`` builds a numpy view for every metadata item, which takes ~9 s for SmolLM2's 49,152-token
vocabulary and its merges; this reads the same metadata with ``struct`` from the file's bytes (~0.1 s).
Layout (GGUF v2/v3, little-endian): ``b"GGUF"``, u32 version, u64 tensor count, u64 key-value count; each
key-value is a string key, a u32 value type and the value (strings: u64 length + UTF-8; arrays: u32 element
type, u64 count, elements); each tensor info is a string name, u32 dims, u64 per dim (innermost first), u32
ggml type, u64 offset from the data section, which starts at the next multiple of ``general.alignment``
(default 32). Dequantization stays with ``gguf.quants``.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# value type -> struct format of one scalar (8 = string, 9 = array are read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``data`` is what ``gguf.quants.dequantize`` takes (float and integer types as values of
    the tensor's shape; quantized ones as uint8 blocks, the innermost dimension in bytes), ``shape`` GGUF's
    dims (innermost first)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (``fields``: key -> Python value; arrays as lists) and its tensors."""

    path: str
    version: int
    fields: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str, what: str = "header") -> tuple[Any, ...]:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF {what} at byte {self.pos}")
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return values

    def take(self, fmt: str) -> Any:
        return self.unpack(fmt)[0]

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF string at byte {self.pos}")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.take("I"), self.take("Q")
            if elem == _STRING:
                return [self.string() for _ in range(count)]
            if elem in _SCALARS:
                return list(self.unpack(f"{count}{_SCALARS[elem]}", "array"))
            return [self.value(elem) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind} at byte {self.pos}")
        return self.take(_SCALARS[kind])


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Reads ``path``'s metadata and maps its tensors (``data`` are copies, not memory maps)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw), path)
    if bytes(raw[:4]) != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {bytes(raw[:4])!r}, expected {_MAGIC!r})")
    cur.pos = 4
    version = cur.take("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_fields = cur.take("Q"), cur.take("Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.take("Q") for _ in range(cur.take("I")))
        infos.append((name, GGMLQuantizationType(cur.take("I")), dims, cur.take("Q")))
    align = int(fields.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    plain = {  # element types read as numpy arrays of the tensor's shape; the rest as bytes of blocks
        GGMLQuantizationType.F32: np.float32,
        GGMLQuantizationType.F16: np.float16,
        GGMLQuantizationType.F64: np.float64,
        GGMLQuantizationType.I8: np.int8,
        GGMLQuantizationType.I16: np.int16,
        GGMLQuantizationType.I32: np.int32,
        GGMLQuantizationType.I64: np.int64,
    }
    tensors = []
    for name, qtype, dims, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if not dims or dims[0] % block:
            raise ValueError(
                f"{path}: tensor {name!r} has dims {dims}: the innermost must be a multiple of "
                f"{qtype.name}'s {block}-element blocks"
            )
        rows = int(np.prod(dims[1:], dtype=np.int64))
        row_bytes = dims[0] // block * block_bytes
        begin = start + offset
        if begin + rows * row_bytes > len(raw):
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
        blob = np.array(raw[begin : begin + rows * row_bytes])
        if qtype in plain:
            data = blob.view(plain[qtype]).reshape(dims[::-1])
        else:  # (outer dims..., bytes of one row's blocks), as gguf.GGUFReader shapes them
            data = blob.reshape(*dims[:0:-1], row_bytes)
        tensors.append(GGUFTensor(name, qtype, dims, data))
    del cur, raw
    return GGUFFile(path, version, fields, tensors)


__all__ = ["GGUFFile", "GGUFTensor", "read_gguf"]
