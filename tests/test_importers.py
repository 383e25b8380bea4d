"""Importers are bit-exact against independent reference packers and the sources' own dequantization.

The reference packers below are written with plain loops from the formats' documentation (AutoGPTQ
``QuantLinear.pack``, AutoAWQ ``WQLinear_GEMM.from_linear``, torch's ``matrix_to_m16n8k16_Bint4_layout``),
sharing no code with ``nybble.quant.formats``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import nybble
from nybble.quant.formats import (
    from_awq,
    from_gptq,
    from_gptq_act_order,
    from_qwix,
    load_awq_checkpoint,
    load_gptq_checkpoint,
    to_torch_int4pack,
    to_torch_uint8_codes,
)

# ----------------------------------------------------------------------------- reference packers


def pack_along_k(u: np.ndarray) -> np.ndarray:
    """GPTQ qweight: int32 [K/8, N], row 8r+i in bits 4i of word row r."""
    k, n = u.shape
    out = np.zeros((k // 8, n), np.uint32)
    for r in range(k // 8):
        for i in range(8):
            out[r] |= u[8 * r + i].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def pack_along_n(z: np.ndarray, order: list[int]) -> np.ndarray:
    """[R, N] nibbles -> int32 [R, N/8]; nibble i of word c holds column 8c + order[i]."""
    r, n = z.shape
    out = np.zeros((r, n // 8), np.uint32)
    for c in range(n // 8):
        for i in range(8):
            out[:, c] |= z[:, 8 * c + order[i]].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


GPTQ_ORDER = [0, 1, 2, 3, 4, 5, 6, 7]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def nibble(words: np.ndarray, i: int) -> np.ndarray:
    return (words.view(np.uint32) >> np.uint32(4 * i)) & np.uint32(0xF)


def gptq_dequant_fp16(qweight, qzeros, scales, g_idx, v1: bool) -> np.ndarray:
    """AutoGPTQ's torch dequantization, in numpy float16."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = np.zeros((k, n), np.int32)
    for r in range(k // 8):
        for i in range(8):
            w[8 * r + i] = nibble(qweight[r], i)
    z = np.zeros(scales.shape, np.int32)
    for c in range(n // 8):
        for i in range(8):
            z[:, 8 * c + i] = nibble(qzeros[:, c], i)
    if v1:
        z = (z + 1) & 15
    return scales[g_idx] * (w - z[g_idx]).astype(np.float16)


def awq_dequant_fp16(qweight, qzeros, scales, group_size) -> np.ndarray:
    """AutoAWQ's dequantize_gemm: unpack, undo the interleave, (q - z) * s in float16."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]

    def unpack(words):
        raw = np.stack([nibble(words, i) for i in range(8)], axis=-1)  # [R, N/8, 8]
        return raw[:, :, reverse].reshape(words.shape[0], n).astype(np.int32)

    q, z = unpack(qweight), unpack(qzeros)
    rows = np.arange(k) // group_size
    return (q - z[rows]).astype(np.float16) * scales[rows]


def random_scales(rng, shape) -> np.ndarray:
    return rng.uniform(1e-3, 0.05, shape).astype(np.float16)


def assert_exact(qw: nybble.QuantizedWeight, ref_fp16: np.ndarray) -> None:
    got = np.asarray(nybble.dequantize(qw, jnp.float16))
    assert got.shape == ref_fp16.shape
    np.testing.assert_array_equal(got, ref_fp16)


# ----------------------------------------------------------------------------- GPTQ


@pytest.mark.parametrize(
    ("k", "n", "g", "sym", "v1"),
    [
        (256, 128, 128, True, True),
        (256, 128, 128, True, False),
        (256, 64, 64, False, True),
        (200, 72, 64, False, False),  # partial last group, K and N not tile multiples
        (192, 64, 32, False, True),
    ],
)
def test_gptq_exact(k, n, g, sym, v1):
    rng = np.random.default_rng(k + n + g)
    groups = -(-k // g)
    u = rng.integers(0, 16, (k, n))
    z = np.full((groups, n), 8) if sym else rng.integers(0, 16, (groups, n))
    stored = (z - 1) & 15 if v1 else z  # v1 writes zero - 1 (a zero of 0 wraps to 15)
    qweight, qzeros = pack_along_k(u), pack_along_n(stored, GPTQ_ORDER)
    scales = random_scales(rng, (groups, n))
    g_idx = (np.arange(k) // g).astype(np.int32)
    convention = "v1" if v1 else "v2"
    qw = from_gptq(qweight, qzeros, scales, g_idx, zero_convention=convention)
    assert qw.shape == (k, n) and qw.group_size == g and qw.symmetric == sym
    assert_exact(qw, gptq_dequant_fp16(qweight, qzeros, scales, g_idx, v1))
    exact = (u - z[g_idx]) * scales[g_idx].astype(np.float64)
    np.testing.assert_array_equal(np.asarray(nybble.dequantize(qw, jnp.float32)), exact.astype(np.float32))
    if sym:  # auto detection of the convention, and float16 scales kept (4.125 bits at g128)
        assert from_gptq(qweight, qzeros, scales).dtype == np.float16
        assert_exact(
            from_gptq(qweight, qzeros, scales), gptq_dequant_fp16(qweight, qzeros, scales, g_idx, v1)
        )


def test_gptq_per_column_and_matmul():
    rng = np.random.default_rng(0)
    k, n = 128, 64
    u = rng.integers(0, 16, (k, n))
    qweight, qzeros = pack_along_k(u), pack_along_n(np.full((1, n), 7), GPTQ_ORDER)
    scales = random_scales(rng, (1, n))
    qw = from_gptq(qweight, qzeros, scales, np.zeros(k, np.int32), group_size=-1)
    assert qw.group_size is None
    assert_exact(qw, gptq_dequant_fp16(qweight, qzeros, scales, np.zeros(k, int), True))
    x = rng.standard_normal((4, k)).astype(np.float32)
    ref = x @ gptq_dequant_fp16(qweight, qzeros, scales, np.zeros(k, int), True).astype(np.float32)
    np.testing.assert_allclose(np.asarray(nybble.matmul(jnp.asarray(x), qw)), ref, rtol=2e-2, atol=2e-2)


def test_gptq_act_order_permutation():
    rng = np.random.default_rng(1)
    k, n, g = 256, 64, 64
    order = rng.permutation(k)  # the order GPTQ quantized the rows in
    g_idx = np.empty(k, np.int32)
    g_idx[order] = np.arange(k) // g  # row order[i] belongs to group i // g
    u = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (k // g, n))
    qweight, qzeros, scales = pack_along_k(u), pack_along_n(z, GPTQ_ORDER), random_scales(rng, (k // g, n))
    ref = gptq_dequant_fp16(qweight, qzeros, scales, g_idx, v1=False)
    with pytest.raises(ValueError, match="from_gptq_act_order"):
        from_gptq(qweight, qzeros, scales, g_idx, zero_convention="v2")
    qw, perm = from_gptq_act_order(qweight, qzeros, scales, g_idx, zero_convention="v2")
    assert sorted(perm.tolist()) == list(range(k))
    got = np.asarray(nybble.dequantize(qw, jnp.float16))
    np.testing.assert_array_equal(got, ref[perm])  # row j of the import is checkpoint row perm[j]
    x = rng.standard_normal((3, k))
    np.testing.assert_allclose(x[:, perm] @ got.astype(np.float64), x @ ref.astype(np.float64), rtol=1e-12)
    # A natural g_idx needs no permutation.
    _, none = from_gptq_act_order(qweight, qzeros, scales, np.arange(k) // g, zero_convention="v2")
    assert none is None


def test_gptq_malformed():
    rng = np.random.default_rng(2)
    k, n = 128, 64
    qweight = pack_along_k(rng.integers(0, 16, (k, n)))
    qzeros = pack_along_n(rng.integers(0, 16, (2, n)), GPTQ_ORDER)
    scales = random_scales(rng, (2, n))
    with pytest.raises(ValueError, match="bits"):
        from_gptq(qweight, qzeros, scales, bits=8)
    with pytest.raises(ValueError, match=r"qweight: expected dtype int32, got float32"):
        from_gptq(qweight.astype(np.float32), qzeros, scales, zero_convention="v2")
    with pytest.raises(ValueError, match=r"qzeros: expected shape \(2, 8\).*got \(2, 4\)"):
        from_gptq(qweight, qzeros[:, :4], scales, zero_convention="v2")
    with pytest.raises(ValueError, match=r"scales: expected dtype float16, got int32"):
        from_gptq(qweight, qzeros, scales.astype(np.int32), zero_convention="v2")
    with pytest.raises(ValueError, match=r"g_idx: expected shape \(128,\)"):
        from_gptq(qweight, qzeros, scales, np.zeros(64, np.int32), zero_convention="v2")
    with pytest.raises(ValueError, match="exactly G=64 rows"):
        from_gptq_act_order(qweight, qzeros, scales, np.zeros(k, np.int32), zero_convention="v2")
    with pytest.raises(ValueError, match="zero_convention='v1'"):
        from_gptq(qweight, qzeros, scales)  # asymmetric: the convention cannot be guessed
    with pytest.raises(ValueError, match="sym=True"):
        from_gptq(qweight, qzeros, scales, sym=True, zero_convention="v2")
    with pytest.raises(ValueError, match="expected 4 scale rows"):
        from_gptq(qweight, qzeros, scales, group_size=32, zero_convention="v2")


# ----------------------------------------------------------------------------- AWQ


@pytest.mark.parametrize(("k", "n", "g"), [(256, 128, 128), (128, 200, 64), (192, 64, 32)])
def test_awq_exact(k, n, g):
    rng = np.random.default_rng(k * n)
    u = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (k // g, n))
    qweight, qzeros = pack_along_n(u, AWQ_ORDER), pack_along_n(z, AWQ_ORDER)
    scales = random_scales(rng, (k // g, n))
    qw = from_awq(qweight, qzeros, scales, group_size=g)
    assert qw.shape == (k, n) and not qw.symmetric and qw.dtype == np.float32
    assert_exact(qw, awq_dequant_fp16(qweight, qzeros, scales, g))
    assert_exact(from_awq(qweight, qzeros, scales), awq_dequant_fp16(qweight, qzeros, scales, g))


def test_awq_malformed():
    rng = np.random.default_rng(3)
    qweight = pack_along_n(rng.integers(0, 16, (128, 64)), AWQ_ORDER)
    qzeros = pack_along_n(rng.integers(0, 16, (1, 64)), AWQ_ORDER)
    scales = random_scales(rng, (1, 64))
    with pytest.raises(ValueError, match=r"awq.scales: expected shape \(1, 64\)"):
        from_awq(qweight, qzeros, scales[:, :32])
    with pytest.raises(ValueError, match=r"qweight: expected dtype int32, got int64"):
        from_awq(qweight.astype(np.int64), qzeros, scales)
    with pytest.raises(ValueError, match="bits"):
        from_awq(qweight, qzeros, scales, bits=3)


# ----------------------------------------------------------------------------- qwix


@dataclasses.dataclass(frozen=True)
class QArrayStandIn:
    """The fields of ``qwix._src.core.qarray.QArray`` (qwix is not a dependency)."""

    qvalue: Any
    scale: Any
    zero_point: Any = None
    qtype: Any = None


def qwix_dequant(qa: QArrayStandIn) -> np.ndarray:
    """qwix.dequantize: (qvalue - zero_point) * broadcast(scale), in the scale dtype."""
    q = jnp.asarray(qa.qvalue).astype(qa.scale.dtype)
    k, n = q.shape

    def bcast(p):
        return jnp.repeat(jnp.repeat(p, k // p.shape[0], axis=0), n // p.shape[1], axis=1)

    if qa.zero_point is not None:
        q = q - bcast(jnp.asarray(qa.zero_point).astype(q.dtype))
    return np.asarray(q * bcast(qa.scale))


@pytest.mark.parametrize(
    ("scale_shape", "dtype", "asym"),
    [((4, 64), jnp.bfloat16, False), ((4, 64), jnp.bfloat16, True), ((1, 64), jnp.float16, True),
     ((2, 16), jnp.bfloat16, True), ((4, 64), jnp.float32, False)],
)  # fmt: skip
def test_qwix_exact(scale_shape, dtype, asym):
    rng = np.random.default_rng(7)
    k, n = 256, 64
    qvalue = jnp.asarray(rng.integers(-8, 8, (k, n)), jnp.int4)
    scale = jnp.asarray(rng.uniform(1e-3, 0.05, scale_shape), dtype)
    zp = jnp.asarray(rng.integers(-8, 8, scale_shape), jnp.int4) if asym else None
    qa = QArrayStandIn(qvalue, scale, zp, jnp.int4)
    qw = from_qwix(qa)
    assert qw.symmetric == (not asym)
    np.testing.assert_array_equal(np.asarray(nybble.dequantize(qw, dtype)), qwix_dequant(qa))


def test_qwix_malformed():
    q = jnp.zeros((64, 64), jnp.int4)
    with pytest.raises(ValueError, match="no 'zero_point'"):
        from_qwix(dataclasses.make_dataclass("X", ["qvalue", "scale"])(q, jnp.ones((1, 64))))
    with pytest.raises(ValueError, match="int8"):
        from_qwix(QArrayStandIn(jnp.zeros((64, 64), jnp.int8), jnp.ones((1, 64)), None, jnp.int8))
    with pytest.raises(ValueError, match="not a nybble group size"):
        from_qwix(QArrayStandIn(q, jnp.ones((64, 64), jnp.bfloat16)))
    with pytest.raises(ValueError, match="must divide"):
        from_qwix(QArrayStandIn(q, jnp.ones((3, 64), jnp.bfloat16)))


# ----------------------------------------------------------------------------- torch tinygemm


def reference_uint8_codes(q: np.ndarray) -> np.ndarray:
    """gpt-fast packing: u8[N, K/2], even k in the HIGH nibble, u = q + 8."""
    u = (q.astype(np.int32) + 8).T
    k = u.shape[1]
    out = np.zeros((u.shape[0], k // 2), np.uint8)
    for b in range(k // 2):
        out[:, b] = (u[:, 2 * b] << 4) | u[:, 2 * b + 1]
    return out


def reference_convert_weight_to_int4pack(inp: np.ndarray, inner_k_tiles: int = 8) -> np.ndarray:
    """Line-by-line translation of torch's matrix_to_m16n8k16_Bint4_layout (CUDA, NVIDIA branch)."""
    n, half_k = inp.shape
    k_super = (2 * half_k) // (inner_k_tiles * 16)
    out = np.zeros((-(-n // 8), k_super, 32, inner_k_tiles // 2), np.uint32)
    for n_tile in range(out.shape[0]):
        for k_outer in range(k_super):
            for t in range(32):
                for inner in range(0, inner_k_tiles, 2):
                    n0 = n_tile * 8 + t // 4
                    k_base0 = (k_outer * inner_k_tiles + inner) * 16 // 2
                    ks = [k_base0 + t % 4, k_base0 + t % 4 + 4]
                    ks += [k_base0 + 8 + t % 4, k_base0 + 8 + t % 4 + 4]
                    v = [int(inp[n0, kk]) if n0 < n and kk < half_k else 0 for kk in ks]
                    pack = (
                        ((v[3] & 0xF) << 28) | ((v[2] & 0xF) << 24) | ((v[1] & 0xF) << 20)
                        | ((v[0] & 0xF) << 16) | ((v[3] & 0xF0) << 8) | ((v[2] & 0xF0) << 4)
                        | (v[1] & 0xF0) | ((v[0] & 0xF0) >> 4)
                    )  # fmt: skip
                    out[n_tile, k_outer, t, inner // 2] = pack
    return out.view(np.int32)


def tinygemm_dequant(packed: np.ndarray, sz: np.ndarray, group_size: int) -> np.ndarray:
    """What BLayout_TC_int4::load feeds the m16n8k16 MMA, as a (K, N) float32 matrix.

    Register j of lane t holds bf16x2 pairs ((w >> 4i) & 0x000f000f) - 8 for i = 0..3: the low half is
    nibble i, the high half nibble i + 4. Pair i is B-fragment register (i % 2) of k-tile 2 j + i // 2,
    i.e. rows c, c + 1 (register 0) or c + 8, c + 9 (register 1) with c = 2 (t % 4), column t // 4.
    """
    nt, ko, _, regs = packed.shape
    k, n = ko * 128, nt * 8
    w = np.full((k, n), np.nan, np.float32)
    words = packed.view(np.uint32)
    for a in range(nt):
        for b in range(ko):
            for t in range(32):
                col = a * 8 + t // 4
                for j in range(regs):
                    for i in range(4):
                        tile_k = b * 128 + (2 * j + i // 2) * 16
                        row = tile_k + 2 * (t % 4) + 8 * (i % 2)
                        lo = int(words[a, b, t, j] >> (4 * i)) & 0xF
                        hi = int(words[a, b, t, j] >> (4 * i + 16)) & 0xF
                        for kk, u in ((row, lo), (row + 1, hi)):
                            s, z = sz[kk // group_size, col].astype(np.float32)
                            w[kk, col] = (u - 8) * s + z
    return w


@pytest.mark.parametrize(
    ("k", "n", "g", "sym"), [(256, 64, 128, True), (128, 72, 32, False), (384, 64, None, True)]
)
def test_torch_int4pack(k, n, g, sym):
    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    qw = nybble.quantize(w, group_size=g, symmetric=sym)
    k_pad, n_pad = qw.padded_shape
    q = np.asarray(nybble.packing.get_layout(qw.layout).unpack(np.asarray(qw.codes), k_pad))  # (K_pad, N_pad)
    codes = to_torch_uint8_codes(qw)
    np.testing.assert_array_equal(codes.codes, reference_uint8_codes(q))
    pack = to_torch_int4pack(qw)
    assert pack.packed.dtype == np.int32 and pack.packed.shape == (n_pad // 8, k_pad // 128, 32, 4)
    np.testing.assert_array_equal(pack.packed, reference_convert_weight_to_int4pack(codes.codes))
    assert pack.scale_and_zero.dtype == ml_dtypes.bfloat16
    assert pack.scale_and_zero.shape == (k_pad // pack.group_size, n_pad, 2)
    # The MMA operands tinygemm builds from these are nybble's dequantized weight (bf16 scales: exact).
    got = tinygemm_dequant(pack.packed, pack.scale_and_zero, pack.group_size)
    np.testing.assert_array_equal(got, np.asarray(nybble.dequantize(qw, jnp.float32, padded=True)))


def test_torch_int4pack_refuses():
    with pytest.raises(ValueError, match="multiple of 128"):
        to_torch_int4pack(nybble.quantize(np.ones((64, 64), np.float32), group_size=32))
    with pytest.raises(ValueError, match="group sizes"):
        to_torch_int4pack(nybble.quantize(np.ones((128, 64), np.float32), group_size=16))


# ----------------------------------------------------------------------------- safetensors loaders


def _gptq_layer(rng, k, n, g, act_order=False):
    u = rng.integers(0, 16, (k, n))
    g_idx = (np.arange(k) // g).astype(np.int32)
    if act_order:
        g_idx[rng.permutation(k)] = np.arange(k) // g
    tensors = {
        "qweight": pack_along_k(u),
        "qzeros": pack_along_n(np.full((k // g, n), 7), GPTQ_ORDER),  # v1 symmetric
        "scales": random_scales(rng, (k // g, n)),
        "g_idx": g_idx,
    }
    return tensors


def test_gptq_checkpoint_round_trip(tmp_path):
    rng = np.random.default_rng(11)
    layers = {"model.layers.0.self_attn.q_proj": _gptq_layer(rng, 128, 64, 64),
              "model.layers.0.mlp.down_proj": _gptq_layer(rng, 256, 64, 128, act_order=True)}  # fmt: skip
    tensors = {f"{p}.{name}": t for p, layer in layers.items() for name, t in layer.items()}
    tensors["model.norm.weight"] = rng.standard_normal(64).astype(np.float16)
    tensors["model.layers.0.self_attn.q_proj.bias"] = rng.standard_normal(64).astype(np.float16)
    path = tmp_path / "model.safetensors"
    shard = {k: v for k, v in tensors.items() if "down_proj" in k}
    save_file({k: v for k, v in tensors.items() if k not in shard}, str(path))
    save_file(shard, str(tmp_path / "shard2.safetensors"))
    params = load_gptq_checkpoint([path, tmp_path / "shard2.safetensors"])
    assert set(params) == {*layers, "model.layers.0.mlp.down_proj.input_perm", "model.norm.weight",
                           "model.layers.0.self_attn.q_proj.bias"}  # fmt: skip
    np.testing.assert_array_equal(params["model.norm.weight"], tensors["model.norm.weight"])
    for p, t in layers.items():
        ref = gptq_dequant_fp16(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], v1=True)
        perm = params.get(p + ".input_perm", np.arange(ref.shape[0]))
        assert_exact(params[p], ref[perm])
    with pytest.raises(ValueError, match="act_order='permute'"):
        load_gptq_checkpoint([path, tmp_path / "shard2.safetensors"], act_order="error")


def test_awq_checkpoint_round_trip(tmp_path):
    rng = np.random.default_rng(12)
    u, z = rng.integers(0, 16, (128, 64)), rng.integers(0, 16, (1, 64))
    t = {"l.qweight": pack_along_n(u, AWQ_ORDER), "l.qzeros": pack_along_n(z, AWQ_ORDER),
         "l.scales": random_scales(rng, (1, 64)), "emb.weight": np.ones((4, 8), np.float32)}  # fmt: skip
    save_file(t, str(tmp_path / "awq.safetensors"))
    params = load_awq_checkpoint(tmp_path / "awq.safetensors", group_size=128)
    assert_exact(params["l"], awq_dequant_fp16(t["l.qweight"], t["l.qzeros"], t["l.scales"], 128))
    np.testing.assert_array_equal(params["emb.weight"], t["emb.weight"])


def test_checkpoint_malformed(tmp_path):
    rng = np.random.default_rng(13)
    layer = _gptq_layer(rng, 128, 64, 64)
    with pytest.raises(ValueError, match=r"^q\.scales: missing"):
        load_gptq_checkpoint({"q.qweight": layer["qweight"], "q.qzeros": layer["qzeros"]})
    with pytest.raises(ValueError, match=r"no '<prefix>\.qweight'"):
        load_awq_checkpoint({"w": np.ones(3)})
    with pytest.raises(ValueError, match=r"q\.qzeros: expected shape \(2, 8\)"):
        load_gptq_checkpoint({"q.qweight": layer["qweight"], "q.qzeros": layer["qzeros"][:1, :],
                              "q.scales": layer["scales"]})  # fmt: skip
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "a.safetensors"))
    with pytest.raises(ValueError, match="more than one shard"):
        load_gptq_checkpoint([tmp_path / "a.safetensors", tmp_path / "a.safetensors"])
    with pytest.raises(FileNotFoundError):
        load_gptq_checkpoint(tmp_path / "absent.safetensors")
