"""nybble.models.io.gguf_file reads what gguf.GGUFReader reads (metadata, tensor bytes), refuses bad files."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from nybble.models.io.gguf_file import read_gguf


def _finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write(path, rng, alignment=None):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 12345.5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("tokenizer.ggml.pre", "smollm ünïcode")
    w.add_array("tokenizer.ggml.tokens", ["a", "bc", "", "Ġthe", "<|im_end|>"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3, 1, 3])
    w.add_array("some.floats", [0.5, -2.25])
    w.add_int64("some.int64", -(2**40))
    w.add_tensor("f32.vector", rng.standard_normal(7).astype(np.float32))
    w.add_tensor("f32.matrix", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16.matrix", rng.standard_normal((4, 6)).astype(np.float16))
    w.add_tensor("i8.matrix", rng.integers(-128, 128, (2, 9)).astype(np.int8))
    w.add_tensor("i32.vector", rng.integers(-(2**31), 2**31, 5).astype(np.int32))
    q8 = gguf.GGMLQuantizationType.Q8_0
    cube = gguf.quants.quantize(rng.standard_normal((2, 3, 64)).astype(np.float32), q8)
    w.add_tensor("q8_0.cube", cube, raw_dtype=q8)
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        blocks = gguf.quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), qtype)
        w.add_tensor(f"{qtype.name}.matrix", blocks, raw_dtype=qtype)
    _finish(w)


@pytest.mark.parametrize("alignment", [None, 64])
def test_same_as_gguf_reader(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    _write(path, np.random.default_rng(3), alignment)
    want, got = gguf.GGUFReader(str(path)), read_gguf(path)
    assert got.version == 3
    expected = {k: f.contents() for k, f in want.fields.items() if not k.startswith("GGUF.")}
    assert got.fields == expected and got.fields["tokenizer.ggml.pre"] == "smollm ünïcode"
    assert {t.data.dtype for t in got.tensors} >= {np.dtype(np.int8), np.dtype(np.int32), np.dtype(np.uint8)}
    assert [t.data.shape for t in got.tensors if t.name == "q8_0.cube"] == [(2, 3, 68)]
    assert [t.name for t in got.tensors] == [t.name for t in want.tensors]
    for a, b in zip(want.tensors, got.tensors, strict=True):
        assert b.tensor_type == a.tensor_type and b.shape == tuple(int(d) for d in a.shape), a.name
        assert b.data.dtype == a.data.dtype and b.data.shape == a.data.shape, a.name
        np.testing.assert_array_equal(b.data, np.asarray(a.data))
        if b.data.dtype.kind == "i":  # integer tensors: values, nothing to dequantize
            continue
        np.testing.assert_array_equal(
            gguf.quants.dequantize(b.data, b.tensor_type), gguf.quants.dequantize(a.data, a.tensor_type)
        )


def test_refuses_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        read_gguf(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(bad)
    good = tmp_path / "t.gguf"
    _write(good, np.random.default_rng(4))
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ValueError, match="truncated GGUF"):
        read_gguf(cut)
    key = b"tokenizer.ggml.token_type"
    cut.write_bytes(data[: data.index(key) + len(key) + 4 + 4 + 8 + 6])  # inside its 5 numbers
    with pytest.raises(ValueError, match="truncated GGUF array"):
        read_gguf(cut)
    cut.write_bytes(data[:-48])  # into the last tensor (240 bytes; at most 31 bytes of padding follow it)
    with pytest.raises(ValueError, match="runs past the end of the file"):
        read_gguf(cut)
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(40))
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        read_gguf(old)


def test_refuses_a_quantized_row_of_partial_blocks(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("q8.only", gguf.quants.quantize(np.ones((2, 64), np.float32), q8), raw_dtype=q8)
    _finish(w)
    dims = b"q8.only" + (2).to_bytes(4, "little") + (64).to_bytes(8, "little")
    data = path.read_bytes()
    assert data.count(dims) == 1
    path.write_bytes(data.replace(dims, dims[:-8] + (48).to_bytes(8, "little")))
    with pytest.raises(ValueError, match=r"'q8.only' has dims \(48, 2\).*multiple of Q8_0's 32-element"):
        read_gguf(path)
