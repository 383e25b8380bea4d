"""nybble.save / nybble.load: bit-exact round trips, metadata, and every refusal."""

from __future__ import annotations

import json
import os
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import nybble
from nybble.checkpoint import FORMAT_VERSION, load, read_metadata, save
from nybble.models import Llama, LlamaConfig, QLinear, load_model, quantize, save_model
from nybble.packing import DEFAULT_LAYOUT


def _tree():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((192, 130)).astype(np.float32)
    return {
        "layers": {
            0: {
                "sym": nybble.quantize(w, group_size=64),
                "asym": nybble.quantize(w, group_size=32, symmetric=False),
                "col": nybble.quantize(w, group_size=None, scale_dtype=jnp.float32),
                "bias": jnp.asarray(rng.standard_normal(130), jnp.bfloat16),
            },
        },
        "embed": jnp.asarray(rng.standard_normal((10, 4)), jnp.float32),
        "list": [jnp.arange(5, dtype=jnp.int32), np.float16(1.5), jnp.zeros((0, 3))],
        "step": np.int64(7),
    }


def _assert_same(a, b):
    if isinstance(a, nybble.QuantizedWeight):
        assert isinstance(b, nybble.QuantizedWeight)
        assert (a.shape, a.group_size, a.symmetric, a.layout) == (
            b.shape,
            b.group_size,
            b.symmetric,
            b.layout,
        )
        for x, y in ((a.codes, b.codes), (a.scales, b.scales), (a.offsets, b.offsets)):
            if x is None:
                assert y is None
            else:
                _assert_same(x, y)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        x, y = np.asarray(a), np.asarray(b)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()  # bit-exact


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "tree.safetensors"
    save(path, _tree())
    return path


def test_round_trip_bit_exact(saved):
    _assert_same(_tree(), load(saved))
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]  # no temporary left behind


def test_top_level_api_and_tuple(tmp_path):
    path = tmp_path / "t.safetensors"
    nybble.save(path, {"a": (jnp.ones(2), jnp.zeros(3))})
    out = nybble.load(path)
    assert isinstance(out["a"], list) and out["a"][1].shape == (3,)
    np.testing.assert_array_equal(np.asarray(out["a"][0]), np.ones(2))
    save(path, jnp.arange(3))  # a bare array, and overwriting an existing file
    np.testing.assert_array_equal(np.asarray(load(path)), np.arange(3))


def test_metadata(saved):
    meta = read_metadata(saved)
    assert meta["format"] == "nybble" and meta["format_version"] == str(FORMAT_VERSION)
    assert len(meta["sha256"]) == 64
    entries = {".".join(str(k) for _, k in e["path"]): e for e in meta["tree"]}
    asym = entries["layers.0.asym"]
    assert asym["kind"] == "quantized" and asym["layout"] == DEFAULT_LAYOUT
    assert (asym["group_size"], asym["symmetric"], asym["shape"]) == (32, False, [192, 130])
    assert entries["layers.0.col"]["group_size"] is None
    assert entries["layers.0.sym"]["path"] == [["d", "layers"], ["d", 0], ["d", "sym"]]
    assert entries["embed"]["kind"] == "array"
    # a standard safetensors file: any reader can open it
    from safetensors import safe_open

    with safe_open(saved, framework="numpy") as f:
        assert "embed" in set(f.keys())
        np.testing.assert_array_equal(f.get_tensor("embed"), np.asarray(_tree()["embed"]))


@pytest.mark.parametrize("keep", [0, 7, 100, -1, -200])
def test_truncated_file_refused(saved, keep):
    data = saved.read_bytes()
    saved.write_bytes(data[:keep])
    with pytest.raises(ValueError, match="refusing"):
        load(saved)


def test_appended_bytes_refused(saved):
    saved.write_bytes(saved.read_bytes() + b"\0" * 8)
    with pytest.raises(ValueError, match=r"truncated|data bytes"):
        load(saved)


def _header(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data, n


def test_tampered_tensor_bytes_refused(saved):
    data, n = _header(saved)
    pos = 8 + n + 1000
    data = data[:pos] + bytes([data[pos] ^ 0x10]) + data[pos + 1 :]
    saved.write_bytes(data)
    with pytest.raises(ValueError, match="sha256"):
        load(saved)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'\\"group_size\\":64', b'\\"group_size\\":32'),  # changed group size
        (b'\\"symmetric\\":false', b'\\"symmetric\\":true '),  # changed symmetry
    ],
)
def test_tampered_metadata_refused(saved, old, new):
    data, _ = _header(saved)
    assert old in data
    saved.write_bytes(data.replace(old, new, 1))
    with pytest.raises(ValueError, match=r"sha256|refusing"):
        load(saved)


def test_unknown_version_refused(saved):
    data, _ = _header(saved)
    old = b'"format_version":"1"'
    assert old in data
    saved.write_bytes(data.replace(old, b'"format_version":"9"'))
    with pytest.raises(ValueError, match="format version '9'"):
        load(saved)


def test_unknown_layout_refused(saved):
    data, _ = _header(saved)
    name = DEFAULT_LAYOUT.encode()
    assert name in data
    saved.write_bytes(data.replace(name, b"z" * len(name)))
    with pytest.raises(ValueError, match=f"unknown weight layout '{'z' * len(name)}'"):
        load(saved)


def test_foreign_files_refused(tmp_path):
    from safetensors.numpy import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"a": np.ones(3, np.float32)}, plain)
    with pytest.raises(ValueError, match="not a nybble checkpoint"):
        load(plain)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(struct.pack("<Q", 12) + b"{not json!!!" + b"\0" * 16)
    with pytest.raises(ValueError, match="unreadable"):
        load(junk)


@pytest.mark.parametrize("kind", ["random", "text", "short"])
def test_non_safetensors_files_named_as_such(tmp_path, kind):
    """Random bytes or a text file are "not a safetensors file", not a huge header size or "truncated"."""
    data = {
        "random": np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "text": b"To be, or not to be, that is the question:\n" * 100,
        "short": b"abc",
    }[kind]
    path = tmp_path / "weights.safetensors"
    path.write_bytes(data)
    for read in (load, read_metadata):
        with pytest.raises(ValueError, match="not a safetensors file") as e:
            read(path)
        assert "truncated" not in str(e.value) and "header size" not in str(e.value)


def test_truncated_header_still_says_truncated(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[:100])  # 8-byte length and the start of the JSON header
    with pytest.raises(ValueError, match="truncated"):
        load(saved)


def test_saved_file_mode_follows_umask(tmp_path):
    """Not mkstemp's 0600: the mode a plain open() would give under the umask."""
    for umask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        old = os.umask(umask)
        try:
            path = save(tmp_path / f"m{umask:o}.safetensors", {"a": jnp.ones(3)})
        finally:
            os.umask(old)
        assert path.stat().st_mode & 0o777 == mode, (oct(umask), oct(path.stat().st_mode))


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.safetensors")
    with pytest.raises(IsADirectoryError):
        load(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save(tmp_path / "no" / "such" / "dir.safetensors", {"a": jnp.ones(2)})
    with pytest.raises(IsADirectoryError):
        save(tmp_path, {"a": jnp.ones(2)})


def test_bad_trees(tmp_path):
    with pytest.raises(TypeError, match="only arrays"):
        save(tmp_path / "x.safetensors", {"a": "text"})
    with pytest.raises(TypeError, match="dict keys"):
        save(tmp_path / "x.safetensors", {(1, 2): jnp.ones(2)})
    assert not list(tmp_path.iterdir())


def test_failed_write_leaves_old_file_and_no_temp(saved, monkeypatch):
    before = saved.read_bytes()

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        save(saved, {"other": jnp.ones(4)})
    assert saved.read_bytes() == before
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]


def test_bfloat16_stored_as_bf16(saved):
    header = json.loads(_header(saved)[0][8 : 8 + _header(saved)[1]])
    assert header["layers.0.bias"]["dtype"] == "BF16"
    assert load(saved)["layers"][0]["bias"].dtype == ml_dtypes.bfloat16


def _small_llama():
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
    )
    return cfg, Llama(cfg, rngs=nnx.Rngs(0))


def test_save_load_model_round_trip(tmp_path):
    cfg, model = _small_llama()
    quantize(
        model, group_size=32, rules=[nybble.models.QuantRule(pattern="down", symmetric=False)], progress=False
    )
    path = save_model(tmp_path / "m.safetensors", model)
    ids = jnp.arange(16)[None] % 64
    want = model(ids)
    fresh = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(5)))
    loaded = load_model(path, fresh)
    assert isinstance(loaded.layers[1].mlp.down_proj, QLinear)
    assert loaded.layers[1].mlp.down_proj.weight.symmetric is False
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(want))
    # a real (float) model works as the template too
    _, other = _small_llama()
    np.testing.assert_array_equal(np.asarray(load_model(path, other)(ids)), np.asarray(want))


def test_save_nnx_state_directly(tmp_path):
    _, model = _small_llama()
    quantize(model, progress=False)
    path = save(tmp_path / "s.safetensors", nnx.state(model))
    _assert_same(nnx.to_pure_dict(nnx.state(model)), load(path))


def test_load_model_refuses_other_architecture(tmp_path):
    _, model = _small_llama()
    quantize(model, progress=False)
    path = save_model(tmp_path / "m.safetensors", model)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2
    )
    # Checked from the header first: a layer the checkpoint lacks, named.
    missing = r"belongs to another model: .* 9 missing.*layers\.2\..*not in the checkpoint"
    with pytest.raises(ValueError, match=missing):
        load_model(path, Llama(cfg, rngs=nnx.Rngs(0)))
    cfg2 = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2
    )
    differ = r"another model: \d+ entries differ in shape.*saved \(64, 128\), this model \(64, 192\)"
    with pytest.raises(ValueError, match=differ):
        load_model(path, Llama(cfg2, rngs=nnx.Rngs(0)))
