"""Hugging Face checkpoint directories on disk: a validated lazy reader and a streaming sharded writer.

``CheckpointDir(path)`` opens a local directory (``config.json`` plus ``model.safetensors``, or
``model.safetensors.index.json`` and the shards it names), reads every safetensors header (a few KB each)
and checks it against the file's size and the index, and then reads ONE tensor at a time with positioned
reads (never a whole file, never a memory map whose pages would count as the process's memory).

``ShardedWriter(out_dir, max_shard_bytes=...)`` takes tensors one at a time and writes them into
``model-0000i-of-0000n.safetensors`` shards as they fill, plus ``model.safetensors.index.json``
(``metadata.total_size``, ``weight_map``), or a single ``model.safetensors`` when everything fits one
shard, as ``transformers``' ``save_pretrained`` does. It holds no tensor after ``add`` returns: each
shard's tensor bytes go to a data file as they come and the shard file (header, then the bytes) is
assembled with a kernel-side copy when the shard is full. Everything is written into a temporary
directory beside ``out_dir`` and renamed into place on success; on any failure the temporary directory
is removed, so nothing half-written is ever left at ``out_dir``.

The safetensors format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length ``n``, ``n`` bytes of JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``, offsets relative to the end of the header), then the raw little-endian
tensor bytes, row-major.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Files besides the weights that a checkpoint directory carries and a written one gets copied.
AUXILIARY_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# safetensors dtype codes this module reads and writes.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
FLOAT_CODES = ("F16", "BF16", "F32", "F64")
_MAX_HEADER = 100 * 2**20  # the safetensors library's own limit on the JSON header
_READ_CHUNK = 1 << 30  # one read() call moves at most this much (Linux caps a call near 2 GiB)


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be read as it is: the message says what and how to fix."""


def _hub_like(text: str) -> str | None:
    """'url' or 'hub id' when ``text`` (a path that does not exist) looks like one, else None."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", text) or text.startswith("hf:"):
        return "URL"
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*", text):
        return "Hugging Face Hub id"
    return None


def local_dir(path: str | os.PathLike[str], what: str = "nybble") -> Path:
    """``path`` as an existing local directory, or an error saying why not.

    A hub id (``org/name``) or a URL that is not a local path gets an error saying to download it first:
    nybble reads local files only and assumes no network access.
    """
    text = os.fspath(path)
    p = Path(text).expanduser()
    if p.is_dir():
        return p
    kind = _hub_like(text)
    if kind is not None and not p.exists():
        raise CheckpointError(
            f"{what}: there is no local directory {text!r}, and it looks like a {kind}; nybble reads local "
            f"checkpoint directories only (no network access): download it first, e.g. "
            f"`huggingface-cli download {text if kind != 'URL' else 'ORG/NAME'} --local-dir DIR` "
            f"(or `git clone`), then pass DIR"
        )
    if p.is_file():
        raise CheckpointError(
            f"{what}: {text} is a file; give the checkpoint directory (the one holding config.json and "
            f"the safetensors weights)"
        )
    raise FileNotFoundError(f"{what}: no such directory: {text}")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: its file, safetensors dtype code, shape and absolute byte range."""

    file: Path
    dtype_code: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype (``ml_dtypes.bfloat16`` for BF16)."""
        return DTYPES[self.dtype_code]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Reads and validates one safetensors file's header: (tensors, ``__metadata__``).

    Reads the first ``8 + n`` bytes only. Checks the header length and every tensor's byte range against
    the file's size, and each range's length against its dtype and shape; raises ``CheckpointError``
    naming the file and what is wrong (truncated, not safetensors, an unknown dtype).
    """
    path = Path(path)
    size = path.stat().st_size
    hint = "re-download or re-write the file (it is truncated or corrupt)"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file; {hint}")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise CheckpointError(
                f"{path}: header length {n} is over the {_MAX_HEADER}-byte limit: not a safetensors file; "
                f"{hint}"
            )
        if 8 + n > size:
            raise CheckpointError(
                f"{path}: the header says it is {n} bytes but the file holds {size} bytes in all; {hint}"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e}); {hint}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object; {hint}")
    meta = header.pop("__metadata__", None) or {}
    start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, info in header.items():
        try:
            code = info["dtype"]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {info!r}") from None
        if code not in DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has safetensors dtype {code!r}, which nybble does not read "
                f"(known: {', '.join(DTYPES)})"
            )
        count = int(np.prod(shape, dtype=np.int64))
        if any(s < 0 for s in shape) or not 0 <= begin <= end or end - begin != count * DTYPES[code].itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r}: byte range [{begin}, {end}) does not hold a {code} tensor of "
                f"shape {list(shape)}; {hint}"
            )
        if start + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {start + end} but the file has {size} bytes; {hint}"
            )
        tensors[name] = TensorInfo(path, code, shape, start + begin, start + end)
    return tensors, {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def read_tensor(info: TensorInfo) -> np.ndarray:
    """One tensor's bytes read into a fresh array (positioned reads: the rest of the file is untouched)."""
    out = np.empty(info.shape, dtype=info.dtype)
    buf = memoryview(out.reshape(-1).view(np.uint8))
    with open(info.file, "rb", buffering=0) as f:
        f.seek(info.begin)
        done = 0
        while done < len(buf):
            got = f.readinto(buf[done : done + _READ_CHUNK])
            if not got:
                raise CheckpointError(
                    f"{info.file}: ended while reading bytes [{info.begin}, {info.end}) (file changed or "
                    f"truncated since it was opened)"
                )
            done += got
    return out


class CheckpointDir:
    """A local Hugging Face checkpoint directory, validated on open and read lazily, one tensor at a time.

    Opening reads ``config.json``, the index (if sharded) and every shard's header, and raises
    ``CheckpointError`` (a ``ValueError``) for: no config.json; no safetensors weights; a shard the index
    names that is missing; the index naming a tensor that its shard lacks; a truncated or corrupt shard
    (header length or a tensor's data range past the end of the file). A hub id or URL gets an error
    saying to download it first. ``FileNotFoundError`` for a path that does not exist.

        ckpt = CheckpointDir("Llama-3.2-1B")
        for name in ckpt.names():
            w = ckpt.get(name)            # np.ndarray, the stored dtype (bf16 as ml_dtypes.bfloat16)
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = local_dir(path, "CheckpointDir")
        config_path = self.path / CONFIG_NAME
        if not config_path.is_file():
            raise CheckpointError(
                f"{self.path}: no {CONFIG_NAME}; a Hugging Face checkpoint directory needs the model's "
                f"config.json beside its weights (copy it from where the weights came from)"
            )
        try:
            self.config: dict[str, Any] = json.loads(config_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{config_path}: expected a JSON object, got {type(self.config).__name__}")
        self._tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, dict[str, str]] = {}
        index_path = self.path / INDEX_NAME
        if index_path.is_file():
            self._open_index(index_path)
        elif (self.path / SINGLE_NAME).is_file():
            tensors, meta = read_header(self.path / SINGLE_NAME)
            self._tensors, self.metadata[SINGLE_NAME] = tensors, meta
        else:
            others = sorted(
                p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt", ".safetensors")
            )
            found = f"; found {others}" if others else ""
            raise CheckpointError(
                f"{self.path}: no {SINGLE_NAME} and no {INDEX_NAME}{found}; nybble reads safetensors "
                f"weights (convert .bin/.pt files with transformers' save_pretrained)"
            )

    def _open_index(self, index_path: Path) -> None:
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index_path}: not a safetensors index (a JSON object with a 'weight_map' of tensor name "
                f"-> shard file) ({type(e).__name__}: {e})"
            ) from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (self.path / s).is_file()]
        if missing:
            raise CheckpointError(
                f"{self.path}: {INDEX_NAME} names shard(s) that are missing: {missing} "
                f"({len(missing)} of {len(shards)}); download or copy every shard into the directory"
            )
        headers = {}
        for s in shards:
            headers[s], self.metadata[s] = read_header(self.path / s)
        lacking = [(t, s) for t, s in weight_map.items() if t not in headers[s]]
        if lacking:
            t, s = lacking[0]
            raise CheckpointError(
                f"{self.path}: {INDEX_NAME} maps tensor {t!r} to {s}, which has no such tensor "
                f"({len(lacking)} such tensor(s)); the index and the shards come from different checkpoints: "
                f"download them again together"
            )
        self._tensors = {t: headers[s][t] for t, s in weight_map.items()}

    # ----------------------------------------------------------------------------------------- queries

    def names(self) -> list[str]:
        """Every tensor name, in the order of the index (or the file's header)."""
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def info(self, name: str) -> TensorInfo:
        """Where ``name`` lies (KeyError naming the tensor and the directory if it does not exist)."""
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r} in the checkpoint") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> np.dtype:
        """The numpy dtype of ``name`` (``ml_dtypes.bfloat16`` for BF16)."""
        return self.info(name).dtype

    def nbytes(self, name: str) -> int:
        return self.info(name).nbytes

    def shard_of(self, name: str) -> str:
        """The file holding ``name`` (relative to the directory)."""
        return self.info(name).file.name

    @property
    def shard_files(self) -> list[Path]:
        """The distinct weight files, in the order they first appear."""
        return list(dict.fromkeys(i.file for i in self._tensors.values()))

    @property
    def total_bytes(self) -> int:
        """Tensor bytes over the whole checkpoint."""
        return sum(i.nbytes for i in self._tensors.values())

    def get(self, name: str) -> np.ndarray:
        """Reads tensor ``name`` alone into a new numpy array of its stored dtype and shape."""
        return read_tensor(self.info(name))

    def get_float(self, name: str, what: str = "a float checkpoint") -> np.ndarray:
        """``get(name)`` after :meth:`require_float`."""
        self.require_float([name], what)
        return self.get(name)

    def require_float(self, names: Iterable[str] | None = None, what: str = "a float checkpoint") -> None:
        """Raises ``CheckpointError`` if any of ``names`` (default: all) is not F16/BF16/F32/F64.

        What a loader calls for the tensors it will read as float weights (in a directory without
        ``quantization_config``: all of them).
        """
        for name in self.names() if names is None else names:
            code = self.info(name).dtype_code
            if code not in FLOAT_CODES:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} is {code} {list(self.shape(name))}, but {what} holds "
                    f"float weights ({'/'.join(FLOAT_CODES)}); a quantized checkpoint needs its "
                    f"quantization_config in config.json"
                )

    def file(self, name: str) -> Path | None:
        """``self.path / name`` if that file exists (tokenizer.json, generation_config.json...), else None."""
        p = self.path / name
        return p if p.is_file() else None

    def __repr__(self) -> str:
        return (
            f"CheckpointDir({str(self.path)!r}: {len(self)} tensors, {len(self.shard_files)} file(s), "
            f"{self.total_bytes / 1e9:.2f} GB)"
        )


# ------------------------------------------------------------------------------------------------ sizes


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"2GB"`` (10**9, as transformers counts) or ``"500MiB"``."""
    if isinstance(size, int | np.integer) and not isinstance(size, bool):
        value = int(size)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(size))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"size {size!r}: expected bytes as an integer or a number with a unit "
                f"({', '.join(u for u in _UNITS if u)}), e.g. '2GB'"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"size {size!r}: must be at least one byte")
    return value


# ------------------------------------------------------------------------------------------------ writer


def _as_numpy(array: Any, name: str) -> np.ndarray:
    arr = np.asarray(array)
    if arr.dtype not in DTYPE_CODES:
        raise TypeError(
            f"ShardedWriter: tensor {name!r} has dtype {arr.dtype}, which safetensors cannot hold "
            f"(known: {', '.join(DTYPES)})"
        )
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


def _copy_range(src: Any, dst: Any, count: int) -> None:
    """Copies ``count`` bytes from ``src``'s position to ``dst``'s, in the kernel where it can."""
    copied = 0
    if hasattr(os, "copy_file_range"):
        try:
            while copied < count:
                n = os.copy_file_range(src.fileno(), dst.fileno(), min(count - copied, _READ_CHUNK))
                if n == 0:
                    break
                copied += n
        except OSError:
            pass  # a file system without it (or cross-device): plain reads below
    if copied < count:
        src.seek(copied)
        dst.seek(0, os.SEEK_END)
        while copied < count:
            chunk = src.read(min(count - copied, 64 << 20))
            if not chunk:
                raise OSError(f"{src.name}: ended after {copied} of {count} bytes while writing a shard")
            dst.write(chunk)
            copied += len(chunk)


class ShardedWriter:
    """Writes a Hugging Face checkpoint directory tensor by tensor, shards written as they fill.

        with ShardedWriter("out", max_shard_bytes="2GB", overwrite=False) as w:
            for name, array in tensors:
                w.add(name, array)
            w.write_config(config)              # config.json
            w.copy_files(source_dir)            # tokenizer.json, generation_config.json, ... if present

    A shard holds at most ``max_shard_bytes`` of tensor data unless one tensor alone is bigger (then it
    gets a shard of its own, as in transformers). Shards are named ``model-0000i-of-0000n.safetensors``
    with ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": ...}``), or
    one ``model.safetensors`` (no index) if one shard holds everything. Each shard's ``__metadata__`` is
    ``{"format": "pt"}`` (transformers refuses files without a known format there).

    Nothing appears at ``out_dir`` until the ``with`` block ends without an exception: the files go to a
    temporary directory beside it, renamed into place at the end (an existing ``out_dir`` is replaced only
    with ``overwrite=True``, and refused at ``__enter__`` otherwise). On an exception the temporary
    directory is deleted and the exception propagates.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        max_shard_bytes: int | str = "5GB",
        overwrite: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = parse_size(max_shard_bytes)
        self.overwrite = overwrite
        self.metadata = {"format": "pt", **(metadata or {})}
        self._tmp: Path | None = None
        self._names: set[str] = set()
        self._weight_map: dict[str, int] = {}  # tensor -> shard number (0-based)
        self._shards = 0  # finished shards
        # the open shard's tensors: (name, dtype code, shape, bytes)
        self._entries: list[tuple[str, str, tuple[int, ...], int]] = []
        self._data: Any = None  # the open shard's data file
        self._data_bytes = 0
        self.total_size = 0
        self.files_written: list[str] = []

    # ------------------------------------------------------------------------------------- lifecycle

    def check_destination(self) -> None:
        """Raises unless ``out_dir`` can be written: refuses an existing one without ``overwrite``."""
        out = self.out_dir
        if out.exists() and not self.overwrite:
            raise FileExistsError(
                f"output directory {out} already exists; pass overwrite=True (--overwrite) to replace it, "
                f"or choose another path"
            )
        if out.exists() and not out.is_dir():
            raise FileExistsError(f"output path {out} exists and is not a directory; remove it first")
        parent = out.absolute().parent
        if not parent.is_dir():
            raise FileNotFoundError(f"output directory's parent {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise PermissionError(f"output directory's parent {parent} is not writable")

    def __enter__(self) -> ShardedWriter:
        self.check_destination()
        parent = self.out_dir.absolute().parent
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.", suffix=".partial", dir=parent))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                self._finish()
        except BaseException:
            self._abort()
            raise
        if exc_type is not None:
            self._abort()

    def _abort(self) -> None:
        if self._data is not None:
            with contextlib.suppress(OSError):
                self._data.close()
            self._data = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    @property
    def temp_dir(self) -> Path:
        """The temporary directory being written (only inside the ``with`` block)."""
        if self._tmp is None:
            raise RuntimeError("ShardedWriter: use it as a context manager (`with ShardedWriter(...) as w:`)")
        return self._tmp

    # ------------------------------------------------------------------------------------- tensors

    def add(self, name: str, array: Any) -> None:
        """Appends one tensor (numpy/jax array; bf16 as ``ml_dtypes.bfloat16``) to the open shard.

        The shard is closed first if this tensor would take it past ``max_shard_bytes``. The array is
        written out before this returns; the writer keeps no reference to it.
        """
        tmp = self.temp_dir
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"ShardedWriter: invalid tensor name {name!r}")
        if name in self._names:
            raise ValueError(f"ShardedWriter: tensor {name!r} added twice")
        arr = _as_numpy(array, name)
        if self._entries and self._data_bytes + arr.nbytes > self.max_shard_bytes:
            self._close_shard()
        if self._data is None:
            self._data = open(tmp / f"shard-{self._shards:05d}.data", "w+b")  # closed in _close_shard
            self._data_bytes = 0
        self._data.write(memoryview(arr.reshape(-1).view(np.uint8)))
        self._entries.append((name, DTYPE_CODES[arr.dtype], tuple(int(s) for s in arr.shape), arr.nbytes))
        self._names.add(name)
        self._weight_map[name] = self._shards
        self._data_bytes += arr.nbytes
        self.total_size += arr.nbytes

    def add_all(self, tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> None:
        """``add`` for each (name, array) pair (or each item of a mapping), in order."""
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        for name, array in items:
            self.add(name, array)

    def _close_shard(self) -> None:
        if self._data is None:
            return
        header: dict[str, Any] = {"__metadata__": dict(self.metadata)}
        offset = 0
        for name, code, shape, nbytes in self._entries:
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes
        data = self._data
        data.flush()
        shard = self.temp_dir / f"shard-{self._shards:05d}.safetensors"
        with open(shard, "wb") as out:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            out.flush()
            data.seek(0)
            _copy_range(data, out, offset)
            out.flush()
            os.fsync(out.fileno())
        data.close()
        os.unlink(data.name)
        self._data = None
        self._entries = []
        self._shards += 1

    # ------------------------------------------------------------------------------------- other files

    def write_json(self, name: str, obj: Any) -> None:
        """Writes ``obj`` as indented JSON to ``name`` in the output directory."""
        (self.temp_dir / name).write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")

    def write_config(self, config: Mapping[str, Any]) -> None:
        """Writes ``config.json``."""
        self.write_json(CONFIG_NAME, dict(config))

    def copy_files(
        self, source_dir: str | os.PathLike[str] | None, names: Iterable[str] = AUXILIARY_FILES
    ) -> list[str]:
        """Copies each of ``names`` that exists in ``source_dir`` (tokenizer, generation config...).

        Returns the names copied. ``config.json`` and weight files are never copied (they are written).
        """
        if source_dir is None:
            return []
        src = Path(source_dir)
        copied = []
        for name in names:
            if name in (CONFIG_NAME, SINGLE_NAME, INDEX_NAME) or name.endswith(".safetensors"):
                continue
            if (src / name).is_file():
                shutil.copyfile(src / name, self.temp_dir / name)
                copied.append(name)
        return copied

    # ------------------------------------------------------------------------------------- finish

    def _finish(self) -> None:
        self._close_shard()
        tmp = self.temp_dir
        n = self._shards
        if n == 0:
            raise ValueError(f"ShardedWriter: no tensors were added for {self.out_dir}")
        names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(names):
            os.replace(tmp / f"shard-{i:05d}.safetensors", tmp / final)
        if n > 1:
            self.write_json(
                INDEX_NAME,
                {
                    "metadata": {"total_size": self.total_size},
                    "weight_map": {t: names[s] for t, s in sorted(self._weight_map.items())},
                },
            )
        self.files_written = sorted(p.name for p in tmp.iterdir())
        out = self.out_dir
        if out.exists():  # overwrite=True (checked at __enter__): move the old one aside, then delete it
            self.check_destination()
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=tmp.parent))
            os.replace(out, trash / "old")
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
        self._tmp = None


def iter_tensors(ckpt: CheckpointDir, names: Iterable[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for each tensor, read one at a time."""
    for name in ckpt.names() if names is None else names:
        yield name, ckpt.get(name)


__all__ = [
    "AUXILIARY_FILES",
    "CONFIG_NAME",
    "DTYPES",
    "INDEX_NAME",
    "SINGLE_NAME",
    "CheckpointDir",
    "CheckpointError",
    "ShardedWriter",
    "TensorInfo",
    "iter_tensors",
    "local_dir",
    "parse_size",
    "read_header",
    "read_tensor",
]
