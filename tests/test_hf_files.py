"""nybble.models.io.hf.files: the lazy checkpoint-directory reader and the streaming sharded writer.

References: the safetensors library's own readers (numpy for integer and float32 tensors, flax for bf16,
which numpy lacks) read what ShardedWriter writes, and ShardedWriter's files are read back by CheckpointDir
byte for byte. Every bad input of issue 35 that lives at the file level gets its error checked here.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.flax import load_file as flax_load_file
from safetensors.numpy import load_file as np_load_file
from safetensors.numpy import save_file as np_save_file

from nybble.models.io.hf.files import (
    INDEX_NAME,
    SINGLE_NAME,
    CheckpointDir,
    CheckpointError,
    ShardedWriter,
    parse_size,
    read_header,
)


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((40, 24)).astype(ml_dtypes.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((24, 24)).astype(ml_dtypes.bfloat16),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((48, 24)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(24).astype(np.float16),
        "codes": rng.integers(-(2**31), 2**31 - 1, (6, 3), dtype=np.int32),
        "shape": np.array([48, 24], dtype=np.int64),
    }


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _write(out: Path, tensors: dict[str, np.ndarray], **kw) -> ShardedWriter:
    with ShardedWriter(out, **kw) as w:
        w.add_all(tensors)
        w.write_config({"model_type": "llama"})
    return w


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------------------------ writer


def test_single_shard_round_trip_and_the_safetensors_library_reads_it(tmp_path):
    ts = _tensors()
    _write(tmp_path / "out", ts)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", SINGLE_NAME]
    ckpt = CheckpointDir(tmp_path / "out")
    assert ckpt.names() == list(ts)
    for name, ref in ts.items():
        assert _same(ckpt.get(name), ref), name
        assert ckpt.shape(name) == ref.shape and ckpt.dtype(name) == ref.dtype
    # the library's own readers (numpy has no bfloat16: read those through flax)
    f = tmp_path / "out" / SINGLE_NAME
    flax = flax_load_file(str(f))
    for name, ref in ts.items():
        if ref.dtype == ml_dtypes.bfloat16:
            assert flax[name].dtype == jnp.bfloat16
            assert np.asarray(flax[name]).view(np.uint16).tobytes() == ref.view(np.uint16).tobytes()
        elif ref.dtype != np.int64:  # jax without x64 narrows int64
            assert _same(np.asarray(flax[name]), ref), name
    with open(f, "rb") as fh:  # transformers refuses a file whose metadata names no known format
        (n,) = struct.unpack("<Q", fh.read(8))
        assert json.loads(fh.read(n))["__metadata__"] == {"format": "pt"}
        assert (8 + n) % 8 == 0


def test_shards_fill_to_the_cap_and_the_index_names_every_tensor(tmp_path):
    rng = np.random.default_rng(1)
    ts = {f"w{i}": rng.standard_normal((10, 10)).astype(np.float32) for i in range(7)}  # 400 bytes each
    ts["big"] = rng.standard_normal((40, 10)).astype(np.float32)  # 1600 bytes: over the cap, a shard alone
    w = _write(tmp_path / "out", ts, max_shard_bytes=1000)
    files = sorted(os.listdir(tmp_path / "out"))
    shards = [f for f in files if f.endswith(".safetensors")]
    # 2 tensors (800 bytes) fit under 1000, a third would not: w0 w1 | w2 w3 | w4 w5 | w6 | big
    assert shards == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in ts.values()) == w.total_size
    assert set(index["weight_map"]) == set(ts)
    assert index["weight_map"]["big"] == "model-00005-of-00005.safetensors"
    for s in shards:
        loaded = np_load_file(str(tmp_path / "out" / s))
        assert sum(a.nbytes for a in loaded.values()) <= 1000 or list(loaded) == ["big"]
        for name, arr in loaded.items():
            assert index["weight_map"][name] == s
            assert _same(arr, ts[name])
    ckpt = CheckpointDir(tmp_path / "out")
    assert sorted(ckpt.names()) == sorted(ts)
    assert all(_same(ckpt.get(n), ts[n]) for n in ts)
    assert ckpt.total_bytes == index["metadata"]["total_size"]


def test_writer_copies_tokenizer_and_generation_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
    ):
        (src / name).write_text(json.dumps({"name": name}))
    (src / "config.json").write_text("{}")  # never copied: the writer writes its own
    with ShardedWriter(tmp_path / "out") as w:
        w.add("x", np.ones(3, np.float32))
        copied = w.copy_files(src)
        w.write_config({"model_type": "llama", "x": 1})
    assert sorted(copied) == [
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in copied:
        assert (tmp_path / "out" / name).read_text() == (src / name).read_text()
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"model_type": "llama", "x": 1}


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"already exists.*overwrite"):
        _write(out, _tensors())
    assert os.listdir(out) == ["keep.txt"] and _leftovers(tmp_path) == []
    _write(out, _tensors(), overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", SINGLE_NAME]
    assert _leftovers(tmp_path) == []


def test_a_failure_leaves_nothing_half_written(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="injected"), ShardedWriter(out, max_shard_bytes=500) as w:
        for i in range(5):
            w.add(f"w{i}", np.zeros((10, 10), np.float32))  # several shards already on disk
        assert len(list(w.temp_dir.iterdir())) >= 4
        raise RuntimeError("injected")
    assert not out.exists() and _leftovers(tmp_path) == []
    # and with overwrite, the old directory survives a failed rewrite
    _write(out, {"a": np.ones(2, np.float32)})
    with pytest.raises(TypeError, match=r"'bad'.*dtype"), ShardedWriter(out, overwrite=True) as w:
        w.add("b", np.ones(2, np.float32))
        w.add("bad", np.array(["text"]))
    assert CheckpointDir(out).names() == ["a"] and _leftovers(tmp_path) == []


def test_writer_refuses_duplicates_and_nothing(tmp_path):
    with pytest.raises(ValueError, match="'a' added twice"), ShardedWriter(tmp_path / "o") as w:
        w.add("a", np.ones(1, np.float32))
        w.add("a", np.ones(1, np.float32))
    with pytest.raises(ValueError, match="no tensors"), ShardedWriter(tmp_path / "o"):
        pass
    assert sorted(os.listdir(tmp_path)) == []


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("0.5GB") == 5 * 10**8
    assert parse_size(1234) == 1234
    for bad in ("2 parsecs", "", "-1GB", 0):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


# ------------------------------------------------------------------------------------------------ reader


def _sharded(tmp_path: Path) -> Path:
    rng = np.random.default_rng(2)
    ts = {f"w{i}": rng.standard_normal((10, 10)).astype(np.float32) for i in range(4)}
    _write(tmp_path / "ck", ts, max_shard_bytes=800)
    return tmp_path / "ck"


def test_reader_reads_a_directory_the_safetensors_library_wrote(tmp_path):
    d = tmp_path / "lib"
    d.mkdir()
    ts = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int32)}
    np_save_file(ts, str(d / SINGLE_NAME), metadata={"format": "pt"})
    (d / "config.json").write_text("{}")
    ckpt = CheckpointDir(d)
    assert sorted(ckpt.names()) == ["a", "b"] and all(_same(ckpt.get(n), ts[n]) for n in ts)
    assert ckpt.metadata[SINGLE_NAME] == {"format": "pt"}


def test_no_config_json(tmp_path):
    d = _sharded(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config.json"):
        CheckpointDir(d)


def test_no_weights(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"no model.safetensors.*pytorch_model.bin"):
        CheckpointDir(d)


def test_a_shard_named_in_the_index_is_missing(tmp_path):
    d = _sharded(tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing: \['model-00002-of-00002.safetensors'\]"):
        CheckpointDir(d)


def test_the_index_names_a_tensor_its_shard_lacks(tmp_path):
    d = _sharded(tmp_path)
    index = json.loads((d / INDEX_NAME).read_text())
    index["weight_map"]["w0"] = "model-00002-of-00002.safetensors"  # w0 lives in shard 1
    (d / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"tensor 'w0' to model-00002-of-00002.safetensors, which has no"
    ):
        CheckpointDir(d)


def test_truncated_shard(tmp_path):
    d = _sharded(tmp_path)
    f = d / "model-00001-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"ends at byte \d+ but the file has \d+ bytes.*truncated"):
        CheckpointDir(d)
    f.write_bytes(f.read_bytes()[:30])  # cut inside the header
    with pytest.raises(CheckpointError, match=r"header says it is \d+ bytes but the file holds 30"):
        CheckpointDir(d)
    f.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="too short"):
        CheckpointDir(d)


def test_corrupt_header(tmp_path):
    d = _sharded(tmp_path)
    f = d / "model-00001-of-00002.safetensors"
    good = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 2**40) + good[8:])
    with pytest.raises(CheckpointError, match=r"over the .* limit: not a safetensors file"):
        CheckpointDir(d)
    f.write_bytes(good[:8] + b"\xff\xfe!!" + good[12:])
    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        CheckpointDir(d)
    f.write_bytes(good)
    assert CheckpointDir(d).names() == ["w0", "w1", "w2", "w3"]


def test_a_tensor_whose_range_disagrees_with_its_shape(tmp_path):
    f = tmp_path / "x.safetensors"
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with pytest.raises(
        CheckpointError, match=r"'a': byte range \[0, 12\) does not hold a F32 tensor of shape \[4\]"
    ):
        read_header(f)


def test_non_float_weights_in_a_float_checkpoint(tmp_path):
    ts = {"model.layers.0.mlp.up_proj.weight": np.ones((4, 4), np.int32), "ok": np.ones(4, np.float32)}
    _write(tmp_path / "ck", ts)
    ckpt = CheckpointDir(tmp_path / "ck")
    ckpt.require_float(["ok"])
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.up_proj.weight' is I32 \[4, 4\].*float"):
        ckpt.require_float()
    with pytest.raises(CheckpointError, match="quantization_config"):
        ckpt.get_float("model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize(
    "given", ["meta-llama/Llama-3.2-1B", "https://huggingface.co/meta-llama/Llama-3.2-1B", "hf://org/m"]
)
def test_a_hub_id_or_url_says_download_it_first(tmp_path, monkeypatch, given):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="download it first"):
        CheckpointDir(given)


def test_a_missing_directory_and_a_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        CheckpointDir(tmp_path / "nope")
    (tmp_path / "f.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file; give the checkpoint directory"):
        CheckpointDir(tmp_path / "f.safetensors")


def test_get_reads_one_tensor_not_the_file(tmp_path, monkeypatch):
    """get() asks the file for exactly the tensor's bytes (positioned reads), never the whole file."""
    rng = np.random.default_rng(3)
    ts = {f"w{i}": rng.standard_normal((64, 64)).astype(np.float32) for i in range(8)}
    _write(tmp_path / "ck", ts)
    ckpt = CheckpointDir(tmp_path / "ck")
    from nybble.models.io.hf import files

    sizes: list[int] = []

    class Spy:
        def __init__(self, *args, **kw):
            self.f = open(*args, **kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, pos):
            return self.f.seek(pos)

        def readinto(self, b):
            sizes.append(len(b))
            return self.f.readinto(b)

        def read(self, n=-1):
            raise AssertionError("get() must not read() the file")

    monkeypatch.setattr(files, "open", Spy, raising=False)
    assert _same(ckpt.get("w5"), ts["w5"])
    assert sum(sizes) == ts["w5"].nbytes
