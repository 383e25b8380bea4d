"""The bytes of a checkpoint's tensors: the whole file in memory, or positioned reads of exactly a block."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import numpy as np

from nybble.checkpoint.format import DTYPE_NAMES, digest, digest_seed
from nybble.checkpoint.header import Header

_CHUNK = 64 * 2**20


class Reader:
    """Reads tensors (or blocks of them) of a checkpoint whose :class:`Header` has been checked.

    With ``data`` (the whole file's bytes) every read is a view of it; else each read is ``os.pread`` of
    the open file ``fd``, exactly the block's bytes (a block is contiguous runs along its first axes)."""

    def __init__(self, header: Header, *, fd: int | None = None, data: memoryview | None = None) -> None:
        if (fd is None) == (data is None):
            raise ValueError("Reader: give exactly one of fd= and data=")
        self.header, self.fd, self.data = header, fd, data

    def _bytes(self, size: int, offset: int) -> bytes | memoryview:
        offset += self.header.data_start
        if self.data is not None:
            return self.data[offset : offset + size]
        out = os.pread(self.fd, size, offset)  # type: ignore[arg-type]
        if len(out) != size:
            raise ValueError(f"nybble.load: short read ({len(out)} of {size} bytes): truncated file?")
        return out

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """``tensor[index]`` (unit-step slices), reading only the bytes it covers."""
        t = self.header.tensors[name]
        dtype, shape, begin = t.dtype, t.shape, t.begin
        if index is None:
            return np.frombuffer(self._bytes(t.end - t.begin, begin), dtype).reshape(shape)
        if not shape:
            return np.frombuffer(self._bytes(dtype.itemsize, begin), dtype).reshape(())
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
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
            chunk = self._bytes(run * dtype.itemsize, begin + offset * dtype.itemsize)
            out[tuple(i - s for i, s in zip(idx, starts[:k], strict=True))] = np.frombuffer(
                chunk, dtype
            ).reshape(sizes[k:])
        return out

    def digest(self) -> str:
        """The checkpoint's sha256 over its tree, info and every tensor (streamed in chunks from a file)."""

        def chunks(begin: int, end: int) -> Iterator[bytes | memoryview]:
            for offset in range(begin, end, _CHUNK):
                yield self._bytes(min(_CHUNK, end - offset), offset)

        tensors = (
            (name, DTYPE_NAMES[t.dtype], list(t.shape), chunks(t.begin, t.end))
            for name, t in self.header.tensors.items()
        )
        return digest(digest_seed(self.header.meta), tensors)
