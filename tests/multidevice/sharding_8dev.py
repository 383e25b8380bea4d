"""Tensor parallelism on 8 CPU devices: sharded results equal the unsharded op on 1x8, 2x4 and 8x1 meshes.

Runs in its own process with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (started by
tests/test_sharding_devices.py; the main test process keeps its single CPU device). Small-integer data
makes every product exact, so sharded and unsharded results are compared bit for bit, on the XLA path and
on the Mosaic GPU kernel in GPU interpret mode; real models are compared on their logits and perplexity.
"""

from __future__ import annotations

import math
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import nybble
from nybble import models
from nybble.kernels import mosaic_gpu
from nybble.packing import get_layout
from nybble.sharding import ShardedWeight, ShardingError, TensorParallel, shard_weight

if jax.device_count() != 8:
    raise RuntimeError(
        "tests/multidevice/sharding_8dev.py needs 8 devices: run it with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_sharding_devices.py does)"
    )

MESHES = {"1x8": (1, 8), "2x4": (2, 4), "8x1": (8, 1)}
LAYOUTS = ("nk_int4", "wgmma_int4")


def _mesh(name: str) -> Mesh:
    """A mesh whose axes XLA's sharding propagation partitions (AxisType.Auto, what the models need)."""
    return Mesh(np.array(jax.devices()).reshape(MESHES[name]), ("data", "model"))


def _small_int_weight(k, n, *, layout="wgmma_int4", group_size=32, symmetric=False, seed=0):
    """Codes in [-8, 7], scales in {1, 2}, offsets in {-1, 0, 1}: every dequantized value is an integer."""
    rng = np.random.default_rng(seed)
    k_pad, n_pad = -(-k // 64) * 64, -(-n // 64) * 64
    q = np.zeros((k_pad, n_pad), np.int8)
    q[:k, :n] = rng.integers(-8, 8, (k, n))
    groups = -(-k_pad // group_size)
    scales = np.zeros((groups, n_pad), np.float32)
    scales[:, :n] = rng.integers(1, 3, (groups, n))
    offsets = None if symmetric else np.where(scales != 0, rng.integers(-1, 2, scales.shape), 0)
    return nybble.QuantizedWeight(
        jnp.asarray(get_layout(layout).pack(q)),
        jnp.asarray(scales, jnp.bfloat16),
        None if offsets is None else jnp.asarray(offsets, jnp.bfloat16),
        (k, n),
        group_size,
        symmetric,
        layout,
    )


def _sparse_x(m, k, *, nonzeros=8, seed=1, dtype=jnp.float32):
    """x in {-1, 0, 1} with ``nonzeros`` entries a row: |x @ W| <= nonzeros * 17, exact even in bf16."""
    rng = np.random.default_rng(seed)
    x = np.zeros((m, k), np.float32)
    for row in x:
        row[rng.choice(k, nonzeros, replace=False)] = rng.choice([-1.0, 1.0], nonzeros)
    return jnp.asarray(x, dtype)


def _reference(x, qw):
    return np.asarray(x, np.float64) @ np.asarray(nybble.dequantize(qw), np.float64)


def _leaves_equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


# ------------------------------------------------------------------------------------- matmul, XLA path


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("split", ["column", "row"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_xla_path_bit_identical(mesh_name, split, layout):
    mesh = _mesh(mesh_name)
    k, n = (512, 576) if split == "column" else (1024, 200)  # column: 72 columns a shard on 1x8
    qw = _small_int_weight(k, n, layout=layout, group_size=64 if layout == "wgmma_int4" else 32)
    sw = shard_weight(qw, TensorParallel(mesh, split))
    x = _sparse_x(16, k, nonzeros=64)
    y = jax.jit(nybble.matmul)(x, sw)
    unsharded = nybble.matmul(x, qw)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(unsharded))
    np.testing.assert_array_equal(np.asarray(y, np.float64), _reference(x, qw))
    data = "data" if MESHES[mesh_name][0] > 1 else None  # rows split over the other axis (16 % 8 == 0)
    spec = (data, "model") if split == "column" else (data, None)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(*spec)), 2)
    # Each device holds its shard only: 1/tp of the weight.
    codes_shard = sw.codes.addressable_shards[0].data
    assert codes_shard.size * MESHES[mesh_name][1] == sw.codes.size


def test_explicit_mesh_axes(tiny_reference):
    """``jax.make_mesh``'s default (Explicit axes): x is resharded to the split; a model is placed on the
    same devices with Auto axes, and its logits match the unsharded model's as on an Auto mesh."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    qw = _small_int_weight(256, 128)
    x = _sparse_x(16, 256, nonzeros=64)
    for split in ("column", "row"):
        y = jax.jit(nybble.matmul)(x, shard_weight(qw, TensorParallel(mesh, split)))
        np.testing.assert_array_equal(np.asarray(y, np.float64), _reference(x, qw))
    graphdef, state, ids, logits = tiny_reference
    model = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    model, report = models.shard(model, mesh, return_report=True)
    assert report.layers and isinstance(model.layers[0].mlp.down_proj.weight, ShardedWeight)
    assert model.layers[0].mlp.down_proj.weight.codes.sharding.mesh.devices.tolist() == mesh.devices.tolist()
    got = np.asarray(_forward(model, ids))
    np.testing.assert_allclose(got, logits, rtol=1e-5, atol=1e-5)  # as test_llama_sharded_logits
    auto = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    models.shard(auto, _mesh("2x4"))  # the same devices in the same order, Auto axes: the same program
    np.testing.assert_array_equal(got, np.asarray(_forward(auto, ids)))


def test_float_data_and_gradient_against_float64():
    mesh = _mesh("2x4")
    w = np.random.default_rng(4).standard_normal((768, 320)).astype(np.float32)
    qw = nybble.quantize(w, group_size=64, symmetric=False)
    for split in ("column", "row"):
        sw = shard_weight(qw, TensorParallel(mesh, split))
        x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 4, 768)), jnp.float32)
        y = jax.jit(nybble.matmul)(x, sw)
        assert y.shape == (3, 4, 320)
        np.testing.assert_allclose(np.asarray(y, np.float64), _reference(x, qw), rtol=2e-5, atol=2e-4)
        g = jax.jit(jax.grad(lambda x, sw: nybble.matmul(x, sw).sum()))(x, sw)
        g_ref = np.broadcast_to(np.asarray(nybble.dequantize(qw), np.float64).sum(axis=1), x.shape)
        np.testing.assert_allclose(np.asarray(g, np.float64), g_ref, rtol=2e-5, atol=2e-4)


# ---------------------------------------------------------------------- matmul, the kernel per shard


@pytest.fixture(scope="module")
def kernel_problem():
    """A column-parallel and a row-parallel weight, bf16 inputs, and the unsharded kernel's results."""
    w_col = _small_int_weight(64, 256, seed=2)  # 32 columns (4 bands) a shard on 1x8, padded to 64
    w_row = _small_int_weight(512, 64, seed=3)  # 64 rows of K (one chunk, two groups) a shard on 1x8
    x_col = _sparse_x(8, 64, seed=4, dtype=jnp.bfloat16)
    x_row = _sparse_x(8, 512, seed=5, dtype=jnp.bfloat16)
    kernel = lambda x, w: nybble.matmul(x, w, implementation="mosaic_gpu")  # forced: never the XLA path
    fn = jax.jit(lambda a, wa, b, wb: (kernel(a, wa), kernel(b, wb)))
    assert mosaic_gpu.is_supported(x_col, w_col) is None and mosaic_gpu.is_supported(x_row, w_row) is None
    with nybble.kernels.interpret():
        unsharded = fn(x_col, w_col, x_row, w_row)
    return fn, (x_col, w_col, x_row, w_row), unsharded


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_kernel_per_shard_bit_identical(mesh_name, kernel_problem):
    fn, (x_col, w_col, x_row, w_row), unsharded = kernel_problem
    mesh = _mesh(mesh_name)
    s_col = shard_weight(w_col, TensorParallel(mesh, "column"))
    s_row = shard_weight(w_row, TensorParallel(mesh, "row"))
    # Each shard's product is one the kernel takes; it runs here only in interpret mode.
    assert not nybble.kernels.available_implementations(x_col, s_col)["mosaic_gpu"]
    with nybble.kernels.interpret():
        assert nybble.kernels.available_implementations(x_row, s_row)["mosaic_gpu"]
        y_col, y_row = fn(x_col, s_col, x_row, s_row)
    for got, want, (x, qw) in zip((y_col, y_row), unsharded, ((x_col, w_col), (x_row, w_row)), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(got, np.float64), _reference(x, qw))


# -------------------------------------------------------------------------------------------- models

# wgmma_int4 (the default layout) on 1x8: q 64 columns a shard, k and v 16 (two 8-row bands, padded to 64),
# o and down 64 rows of K a shard (one 64-K chunk, four groups of 16).
TINY = models.LlamaConfig(
    vocab_size=256, hidden_size=512, intermediate_size=512, num_layers=1, num_heads=4, num_kv_heads=1
)


@pytest.fixture(scope="module")
def tiny_reference():
    """The quantized model (as graphdef and state: each test merges a fresh copy), ids, unsharded logits."""
    model = models.Llama(TINY, rngs=nnx.Rngs(0))
    models.quantize(model, group_size=16)
    ids = jax.random.randint(jax.random.key(1), (8, 8), 0, TINY.vocab_size)
    graphdef, state = nnx.split(model)
    return graphdef, state, ids, np.asarray(_forward(model, ids))


@nnx.jit
def _forward(model, ids):
    return model(ids)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_llama_sharded_logits(mesh_name, tiny_reference):
    graphdef, state, ids, logits = tiny_reference
    model = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))  # fresh variables
    mesh = _mesh(mesh_name)
    model, report = models.shard(model, mesh, return_report=True)
    placements = {layer.path: layer.placement for layer in report.layers}
    assert placements["layers.0.attn.q_proj"] == "column" and placements["layers.0.mlp.down_proj"] == "row"
    assert placements["embed"] == "row" and len(report.layers) == 7 + 1
    q = model.layers[0].attn.q_proj.weight
    assert isinstance(q, ShardedWeight) and q.local_shape == (512, 512 // MESHES[mesh_name][1])
    assert q.layout == "wgmma_int4"
    emb = model.embed.embedding.get_value()
    assert emb.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("model", None)), 2)
    got = _forward(model, ids)
    np.testing.assert_allclose(np.asarray(got), logits, rtol=1e-5, atol=1e-5)
    assert (np.asarray(got).argmax(-1) == logits.argmax(-1)).all()


def test_llama_split_through_a_group_is_refused_by_name(tiny_reference):
    graphdef, state, _, _ = tiny_reference
    model = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))  # fresh variables
    for layer in (model.layers[0].attn.o_proj, model.layers[0].mlp.down_proj):  # g128: K = 512 = 8 x 64
        layer.qweight.set_value(_small_int_weight(512, 512, group_size=128, symmetric=True))
    refused = r"layers\.0\.attn\.o_proj: row-parallel split of K=512 over 8.*quantization group"
    with pytest.raises(ShardingError, match=refused):
        models.shard(model, _mesh("1x8"))
    assert not isinstance(model.layers[0].attn.q_proj.weight, ShardedWeight)  # nothing was placed
    rules = [models.ShardRule(pattern=r"o_proj$", placement="replicate")]
    with pytest.raises(ShardingError, match=r"layers\.0\.mlp\.down_proj: row-parallel split of K=512"):
        models.shard(model, _mesh("1x8"), rules=rules)
    models.shard(model, _mesh("2x4"), rules=rules)  # 512 / 4 = 128: one group a shard
    assert not isinstance(model.layers[0].attn.o_proj.weight, ShardedWeight)
    assert isinstance(model.layers[0].mlp.down_proj.weight, ShardedWeight)


# ---------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_read_straight_into_shards(tmp_path, tiny_reference):
    graphdef, state, ids, logits = tiny_reference
    model = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))  # fresh variables
    path = models.save_model(tmp_path / "tiny.safetensors", model)
    mesh = _mesh("2x4")
    models.shard(model, mesh)
    data_bytes = os.path.getsize(path) - 8 - int.from_bytes(path.read_bytes()[:8], "little")
    abstract = nnx.eval_shape(lambda: models.Llama(TINY, rngs=nnx.Rngs(0)))
    with mock.patch("nybble.checkpoint.reader.os.pread", wraps=os.pread) as pread:
        loaded = models.load_model(path, abstract, mesh=mesh)
    # Every byte of every tensor read exactly once: each shard's block once, however many devices hold it.
    assert sum(call.args[1] for call in pread.call_args_list) == data_bytes
    for layer in ("q_proj", "o_proj"):
        a, b = (getattr(m.layers[0].attn, layer).weight for m in (loaded, model))
        assert isinstance(a, ShardedWeight) and a.parallel == b.parallel
        _leaves_equal(a, b)
        assert a.codes.sharding == b.codes.sharding
    got, want = _forward(loaded, ids), _forward(model, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(got), logits, rtol=1e-5, atol=1e-5)
    # A sharded model saves as the unsharded one.
    again = models.save_model(tmp_path / "again.safetensors", model)
    _leaves_equal(nybble.load(again), nybble.load(path))


def test_checkpoint_placed_load_refuses_tampering_when_verifying(tmp_path):
    qw = _small_int_weight(512, 128)  # 64 rows of K a shard on 1x8
    path = nybble.save(tmp_path / "w.safetensors", {"w": qw})
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # the last byte of the last tensor
    path.write_bytes(bytes(raw))
    placement = lambda leaf: TensorParallel(_mesh("1x8"), "row")
    loaded = nybble.load(path, placement=placement)  # reads only shards: cannot see the whole-file hash
    assert isinstance(loaded["w"], ShardedWeight)
    with pytest.raises(ValueError, match="sha256 checksum mismatch"):
        nybble.load(path, placement=placement, verify=True)


# ----------------------------------------------------------------------------------- SmolLM2 perplexity


def test_smollm2_perplexity_sharded_tp8():
    """SmolLM2-135M's first 4 blocks (its real weights and shapes; all 30 took 45 s), int4 g64, on a 1x8
    mesh: attention's o_proj (K = 576 = 8 x 72, not whole groups of 64) replicated by a rule, everything
    else Megatron-placed; perplexity as unsharded."""
    from nybble.models import smollm2

    model, tok = smollm2.load()
    model.layers = nnx.List(list(model.layers)[:4])
    ids = tok.encode(models.eval_text("eval")).ids[:65]
    models.quantize(model, group_size=64)
    want = models.perplexity(model, ids, window=64, batch=1)
    with pytest.raises(ShardingError, match=r"o_proj: row-parallel split of K=576 over 8 shards"):
        models.shard(model, _mesh("1x8"))
    rules = [models.ShardRule(pattern=r"attn\.o_proj$", placement="replicate")]
    _, report = models.shard(model, _mesh("1x8"), rules=rules, return_report=True)
    assert sum(layer.placement == "column" for layer in report.layers) == 4 * 5
    assert sum(layer.placement == "row" for layer in report.layers) == 4 + 1  # down_proj, embed
    got = models.perplexity(model, ids, window=64, batch=1)
    print(f"SmolLM2-135M g64 perplexity over 64 tokens: unsharded {want:.6f}, tp=8 {got:.6f}")
    assert math.isfinite(want) and want > 1 and abs(got - want) / want < 1e-5
