"""Tensor-parallel rules and shards in this (one-device) process: the cut, the padding, the errors, parsers.

What needs several devices (shard_map over 1x8, 2x4, 8x1 meshes, the kernel per shard, models, checkpoints
placed on a mesh, two processes) runs in subprocesses: tests/test_sharding_devices.py.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import nybble
from bench.kernel_xray import hlo
from nybble.kernels import mosaic_gpu
from nybble.kernels.mosaic_gpu.dense import SUPPORTED_LAYOUTS
from nybble.models.placement.shard import ShardRule, array_spec, decide
from nybble.packing import LAYOUTS, get_layout
from nybble.sharding import (
    SPLITS,
    ShardedWeight,
    ShardingError,
    TensorParallel,
    local_weights,
    plan_split,
    shard_weight,
)

LAYOUT_NAMES = ("nk_int4", "wgmma_int4")


def _weight(k, n, *, group_size=64, symmetric=True, layout="wgmma_int4", seed=0, small_int=False):
    """A random QuantizedWeight built in numpy (no compiles): codes in [-8, 7], scales, offsets
    (``small_int``: integer scales 1..3 and offsets -2..2, so that products are exact)."""
    rng = np.random.default_rng(seed)
    k_pad, n_pad = -(-k // 64) * 64, -(-n // 64) * 64
    q = np.zeros((k_pad, n_pad), np.int8)
    q[:k, :n] = rng.integers(-8, 8, (k, n))
    groups = 1 if group_size is None else -(-k_pad // group_size)
    scales = np.zeros((groups, n_pad), np.float32)
    scales[:, :n] = rng.integers(1, 4, (groups, n)) if small_int else rng.uniform(0.5, 2.0, (groups, n))
    shift = rng.integers(-2, 3, scales.shape) if small_int else rng.uniform(-1, 1, scales.shape)
    offsets = None if symmetric else np.where(scales != 0, shift, 0).astype(np.float32)
    return nybble.QuantizedWeight(
        get_layout(layout).pack(q), scales, offsets, (k, n), group_size, symmetric, layout
    )


def _dequantize(qw):
    """float64 W (K, N) of a QuantizedWeight, in numpy: the reference."""
    k_pad = qw.padded_shape[0]
    q = np.asarray(get_layout(qw.layout).unpack(np.asarray(qw.codes), k_pad), np.float64)
    per_row = lambda a: np.repeat(np.asarray(a, np.float64), qw.group, axis=0)[:k_pad]
    w = q * per_row(qw.scales) + (0 if qw.offsets is None else per_row(qw.offsets))
    return w[: qw.shape[0], : qw.shape[1]]


# ------------------------------------------------------------------------------------- layout declarations


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_stored_dims_slice_like_the_logical_codes(name):
    """A cut on the declared granules of N and K is a plain slice of the stored codes."""
    layout = get_layout(name)
    k_pad, n_pad = 256, 128
    q = np.random.default_rng(1).integers(-8, 8, (k_pad, n_pad)).astype(np.int8)
    stored = np.asarray(layout.pack(q))
    for dim, (size, other) in (("n", (n_pad, k_pad)), ("k", (k_pad, n_pad))):
        d = getattr(layout, dim)
        step = max(d.granule, 64)  # the packers take multiples of 64
        a, b = step, 3 * step if 3 * step <= size else size
        logical = q[:, a:b] if dim == "n" else q[a:b, :]
        index = [slice(None)] * stored.ndim
        index[d.axis] = slice(a // d.per_index, b // d.per_index)
        np.testing.assert_array_equal(stored[tuple(index)], np.asarray(layout.pack(logical)))
        assert other  # both dims are covered
    # Zero stored elements are zero codes: what per-shard padding appends.
    zeros = np.zeros(layout.stored_shape(64, 64), np.asarray(stored).dtype)
    np.testing.assert_array_equal(np.asarray(layout.unpack(zeros, 64)), np.zeros((64, 64), np.int8))


def test_every_registered_layout_declares_its_dims():
    for layout in LAYOUTS.values():
        assert {layout.n.axis, layout.k.axis} == {0, 1}
        assert layout.n.granule % layout.n.per_index == 0 and layout.k.granule % layout.k.per_index == 0


# ------------------------------------------------------------------------------------------------ the cut


@pytest.mark.parametrize(
    ("layout", "split", "group_size", "symmetric", "tp"),
    [
        *((layout, split, 64, True, 8) for layout, split in itertools.product(LAYOUT_NAMES, SPLITS)),
        *((layout, split, None, False, 3) for layout, split in itertools.product(LAYOUT_NAMES, SPLITS)),
        ("nk_int4", "row", 32, False, 6),
    ],
)
def test_shards_dequantize_to_the_slices_of_the_weight(layout, split, group_size, symmetric, tp):
    """Each shard is a kernel-ready weight of its own whose values are exactly its slice of W."""
    if split == "column":
        k, n = 384, 72 * tp  # 72 columns a shard (whole 8-row bands), each padded to 128 on its own
    else:  # 96 rows a shard (padded to 128) where groups and the layout allow, else 192
        k, n = (96 if layout == "nk_int4" and group_size in (32, None) else 192) * tp, 200
    qw = _weight(k, n, group_size=group_size, symmetric=symmetric, layout=layout)
    full = _dequantize(qw)
    shards = local_weights(qw, split, tp)
    assert len(shards) == tp
    for i, local in enumerate(shards):
        kl, nl = local.shape
        assert (kl, nl) == ((k, n // tp) if split == "column" else (k // tp, n))
        assert local.padded_shape == tuple(-(-d // 64) * 64 for d in local.shape)
        want = full[:, i * nl : (i + 1) * nl] if split == "column" else full[i * kl : (i + 1) * kl]
        np.testing.assert_array_equal(_dequantize(local), want)
        # Padding is zero codes, and zero scales in padded columns (x's padding meets the padded rows).
        codes = np.asarray(get_layout(layout).unpack(np.asarray(local.codes), local.padded_shape[0]))
        assert not codes[kl:].any() and not codes[:, nl:].any() and codes[:kl, :nl].any()
        assert not np.asarray(local.scales)[:, nl:].astype(np.float32).any()
        if layout in SUPPORTED_LAYOUTS:  # kernel-ready: the kernel plans a launch for the shard
            for m in (1, 2048):
                p = mosaic_gpu.plan(m, local)
                assert (p.k_pad, p.n_pad) == local.padded_shape and p.config.ctas(p.m, p.n_pad) >= 1


def test_row_shards_sum_to_the_product():
    qw = _weight(512, 96, group_size=32, layout="nk_int4")
    x = np.random.default_rng(2).standard_normal((5, 512))
    parts = [
        x[:, i * 128 : (i + 1) * 128] @ _dequantize(s) for i, s in enumerate(local_weights(qw, "row", 4))
    ]
    np.testing.assert_allclose(sum(parts), x @ _dequantize(qw), rtol=1e-12, atol=1e-12)


def test_per_shard_padding_and_global_shapes():
    # SmolLM2's q_proj over 8 shards: 72 columns each, each padded to 128 on its own.
    plan = plan_split((576, 576), group_size=64, layout="nk_int4", split="column", num_shards=8)
    assert plan.local_shape == (576, 72) and plan.local_padded_shape == (576, 128)
    assert plan.codes_shape == (8 * 128, 288) and plan.scales_shape == (9, 8 * 128)
    # Llama-3-70B's down_proj over 8: K = 3584 a shard, no padding, the unsharded arrays' shapes.
    plan = plan_split((28672, 8192), group_size=128, layout="nk_int4", split="row", num_shards=8)
    assert plan.codes_shape == (8192, 28672 // 2) and plan.scales_shape == (224, 8192)
    plan = plan_split((28672, 8192), group_size=128, layout="wgmma_int4", split="row", num_shards=8)
    assert plan.codes_axis == 1 and plan.codes_shape == (1024, 28672)
    plan = plan_split((8192, 28672), group_size=128, layout="wgmma_int4", split="column", num_shards=8)
    assert plan.codes_axis == 0 and plan.codes_shape == (3584, 8192)
    # Per column, row split: one scale row per shard, a copy of the weight's.
    plan = plan_split((576, 64), group_size=None, layout="nk_int4", split="row", num_shards=8)
    assert plan.local_scales_shape == (1, 64) and plan.scales_shape == (8, 64)


# ---------------------------------------------------------------------------------------------- the errors


@pytest.mark.parametrize(
    ("shape", "group_size", "layout", "split", "tp", "match"),
    [
        ((576, 576), 64, "nk_int4", "row", 8, r"72 rows of K per shard, not a multiple of the group size 64"),
        ((576, 576), 128, "nk_int4", "row", 4, r"split a quantization group.*group_size=None"),
        (
            (18, 64),
            None,
            "nk_int4",
            "row",
            2,
            r"split a byte of layout 'nk_int4' \(rule: K / tp must be a multiple of 2.*size in \[3, 9\]",
        ),
        (
            (128, 36),
            64,
            "wgmma_int4",
            "column",
            3,
            r"12 per shard, not a multiple of 8.*8-row band of layout 'wgmma.*no tensor-parallel size > 1",
        ),
        (
            (192, 64),
            32,  # whole groups in 96 rows: nk_int4 would do
            "wgmma_int4",
            "row",
            2,
            r"96 per shard, not a multiple of 64.*64-K chunk.*size in \[3\].*relayout\(qw, 'nk_int4'\).*"
            r"kernel reads only \('wgmma_int4',\), other layouts run on the XLA path",
        ),
        (
            (1024, 64),
            128,
            "wgmma_int4",
            "row",
            16,
            r"64 rows of K per shard, not a multiple of the group size 128.*size in \[2, 4, 8\]",
        ),
        ((128, 100), 64, "nk_int4", "column", 8, r"N is not a multiple of 8"),
        # SmolLM2's o_proj at g64: no layout keeps 72 rows whole groups, so none is suggested.
        (
            (576, 576),
            64,
            "wgmma_int4",
            "row",
            8,
            r"72 per shard.*64-K chunk.*Fix: use a tensor-parallel size in "
            r"\[3, 9\], or keep this layer replicated",
        ),
    ],
)
def test_bad_splits_name_the_rule_and_the_fix(shape, group_size, layout, split, tp, match):
    with pytest.raises(ShardingError, match=match) as e:
        plan_split(shape, group_size=group_size, layout=layout, split=split, num_shards=tp, name="layers.3.o")
    assert str(e.value).startswith("layers.3.o: ") and "Fix:" in str(e.value)


def test_one_shard_never_refused():
    plan = plan_split((18, 36), group_size=None, layout="nk_int4", split="row", num_shards=1)
    assert plan.local_shape == (18, 36)


def test_tensor_parallel_checks_its_axis():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(ValueError, match=r"'tp' is not in the mesh's axes \('data', 'model'\)"):
        TensorParallel(mesh, "column", axis="tp")
    with pytest.raises(ValueError, match="split must be one of"):
        TensorParallel(mesh, "diagonal")  # type: ignore[arg-type]
    assert TensorParallel(mesh, "row").num_shards == 1 and TensorParallel(mesh, "row").batch_axes == ()


# ------------------------------------------------------------------------- ShardedWeight on one device


@pytest.mark.parametrize(("layout", "split"), [("nk_int4", "column"), ("wgmma_int4", "row")])
def test_one_device_mesh_matmul_and_gather(layout, split):
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    qw = _weight(256, 128, group_size=32, symmetric=False, layout=layout, small_int=True)
    sw = shard_weight(qw, TensorParallel(mesh, split))
    assert isinstance(sw, ShardedWeight) and sw.local_shape == (256, 128)
    for a, b in zip(jax.tree.leaves(sw.gather()), jax.tree.leaves(qw), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.integers(-3, 4, (2, 3, 256)), jnp.float32)
    y = jax.jit(nybble.matmul)(x, sw)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(nybble.matmul(x, qw)))
    assert f"{split}-parallel over 'model' x1" in repr(sw)
    with pytest.raises(TypeError, match="already sharded"):
        shard_weight(sw, TensorParallel(mesh, split))  # type: ignore[arg-type]
    avail = nybble.kernels.available_implementations(x, sw)
    assert avail["xla"] and not avail["mosaic_gpu"]  # no Hopper here


def test_abstract_shard_weight_carries_the_shardings():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    abstract = jax.eval_shape(
        lambda w: nybble.quantize(w, group_size=128), jax.ShapeDtypeStruct((8192, 1024), jnp.float32)
    )
    assert abstract.layout == "wgmma_int4"  # the default: (N / 8, K) words, K along axis 1
    sw = shard_weight(abstract, TensorParallel(mesh, "row"))
    assert isinstance(sw.codes, jax.ShapeDtypeStruct) and sw.codes.shape == (128, 8192)
    assert sw.codes.sharding == NamedSharding(mesh, PartitionSpec(None, "model"))
    assert sw.scales.sharding == NamedSharding(mesh, PartitionSpec("model", None))


# ------------------------------------------------------------------------------------------- model rules


def test_default_placement_is_megatron():
    expect = {
        "layers.0.attn.q_proj": "column",
        "layers.0.attn.k_proj": "column",
        "layers.0.attn.v_proj": "column",
        "layers.0.attn.o_proj": "row",
        "layers.1.mlp.gate_proj": "column",
        "layers.1.mlp.up_proj": "column",
        "layers.1.mlp.down_proj": "row",
        "embed": "row",
        "lm_head": "column",
        "layers.0.input_norm": "replicate",
    }
    assert {p: decide(p, ()) for p in expect} == expect
    mine = [ShardRule(pattern=r"o_proj$", placement="replicate")]
    assert decide("layers.0.attn.o_proj", mine) == "replicate"
    assert array_spec("Linear", "kernel", "column", "m") == PartitionSpec(None, "m")
    assert array_spec("Embed", "embedding", "row", "m") == PartitionSpec("m", None)
    assert array_spec("QLinear", "bias", "row", "m") == PartitionSpec()
    with pytest.raises(ValueError, match="placement must be one of"):
        ShardRule(pattern="x", placement="diagonal")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- collectives in HLO

COLLECTIVE_HLO = """HloModule m

ENTRY %main (p: bf16[16,1024]) -> bf16[16,1024] {
  %p = bf16[16,1024]{1,0} parameter(0), metadata={op_name="x"}
  %ar = bf16[16,1024]{1,0} all-reduce(%p), replica_groups=mesh['data'=2,'model'=4] {'model'}, to_apply=%f
  %ags = (bf16[16,256]{1,0}, bf16[16,1024]{1,0}) all-gather-start(%p), replica_groups=[2,4]<=[8]
  %agd = bf16[16,1024]{1,0} all-gather-done(%ags)
  %rs = f32[16,128]{1,0} reduce-scatter(%ar), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={1}
  ROOT %out = bf16[16,1024]{1,0} add(%ar, %agd)
}
"""


def test_collectives_their_groups_and_ring_bytes():
    got = hlo.collectives(COLLECTIVE_HLO)
    assert [(c.op, c.buffer_bytes, c.group_size) for c in got] == [
        ("all-reduce", 16 * 1024 * 2, 4),
        ("all-gather", 16 * 1024 * 2, 4),
        ("reduce-scatter", 16 * 1024 * 2, 8),
    ]
    assert got[0].ring_bytes_per_device == pytest.approx(2 * 3 / 4 * 32768)
    assert got[1].ring_bytes_per_device == pytest.approx(3 / 4 * 32768)
    assert got[2].ring_bytes_per_device == pytest.approx(7 / 8 * 32768)
    assert hlo.group_size("%x = f32[2] add(%a, %b)") == 1


# ------------------------------------------------------------------------------- checkpoints, placed


def test_placed_load_on_one_device_equals_the_plain_load(tmp_path):
    from nybble.checkpoint import CheckpointLeaf

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    tree = {
        "w": _weight(192, 130, group_size=32, symmetric=False, layout="nk_int4"),
        "v": _weight(128, 64, group_size=None),
        "e": np.arange(24, dtype=np.float32).reshape(4, 6),
        "s": np.int64(7),
    }
    path = nybble.save(tmp_path / "t.safetensors", tree)
    seen: list[CheckpointLeaf] = []

    def placement(leaf):
        seen.append(leaf)
        if leaf.kind == "quantized":
            return TensorParallel(mesh, "row" if leaf.name == "w" else "column")
        return None if leaf.name == "s" else NamedSharding(mesh, PartitionSpec("model"))

    placed = nybble.load(path, placement=placement, verify=True)
    plain = nybble.load(path)
    assert {(leaf.name, leaf.kind, leaf.shape) for leaf in seen} == {
        ("w", "quantized", (192, 130)),
        ("v", "quantized", (128, 64)),
        ("e", "array", (4, 6)),
        ("s", "array", ()),
    }
    assert isinstance(placed["w"], ShardedWeight) and isinstance(placed["v"], ShardedWeight)
    for name in ("w", "v"):
        for a, b in zip(jax.tree.leaves(placed[name].gather()), jax.tree.leaves(plain[name]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(placed["e"]), tree["e"])
    assert placed["e"].sharding == NamedSharding(mesh, PartitionSpec("model")) and int(placed["s"]) == 7


def test_reader_reads_only_the_slice(tmp_path):
    import os
    from unittest import mock

    from nybble.checkpoint import read_header_of
    from nybble.checkpoint.reader import Reader

    a = np.arange(6 * 10 * 4, dtype=np.int16).reshape(6, 10, 4)
    path = nybble.save(tmp_path / "a.safetensors", {"a": a})
    header = read_header_of(path)
    with open(path, "rb") as f, mock.patch("nybble.checkpoint.reader.os.pread", wraps=os.pread) as pread:
        reader = Reader(header, fd=f.fileno())
        for index in [(slice(1, 3), slice(2, 7)), (slice(2, 5),), (slice(0, 6), slice(0, 10), slice(1, 3))]:
            pread.reset_mock()
            np.testing.assert_array_equal(reader.read("a", index), a[index])
            assert sum(c.args[1] for c in pread.call_args_list) == a[index].nbytes
