"""Quantized Hugging Face formats (``nybble.quant.formats.hf_scheme``) against the libraries that write them.

The fixtures under tests/fixtures/quant/ were written by tools/make_quant_fixtures.py with torch,
compressed-tensors and auto-round (versions in versions.json): tensors packed by each format's own
packer, and each library's own unpacking and dequantized weights. No torch here.
"""

from __future__ import annotations

import json
import os
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import nybble
from nybble.quant import gptq
from nybble.quant.autoround import AutoRoundConfig, autoround
from nybble.quant.formats._common import regroup_natural
from nybble.quant.formats.hf_scheme import (
    SUPPORTED,
    pack_int32,
    scheme_from_config,
    writer_for,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "quant")
DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64}


def load_safetensors(path: str) -> dict[str, np.ndarray]:
    """A safetensors file read with numpy alone (bfloat16 through ml_dtypes)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        buf = data[8 + n + lo : 8 + n + hi]
        out[name] = np.frombuffer(buf, DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def fixture(family: str) -> tuple[dict[str, np.ndarray], dict, dict[str, np.ndarray]]:
    tensors = load_safetensors(os.path.join(FIXTURES, f"{family}_linears.safetensors"))
    with open(os.path.join(FIXTURES, f"{family}_linears.json")) as f:
        configs = json.load(f)
    ref = dict(np.load(os.path.join(FIXTURES, f"{family}_linears_ref.npz")))
    return tensors, configs, ref


def ct_config(scheme: dict, ignore: list[str] | None = None) -> dict:
    """A config.json quantization_config with one compressed-tensors group."""
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {**scheme, "format": "pack-quantized"}}, "ignore": ignore or [],
    }  # fmt: skip


def deq(qw, dtype=jnp.float32) -> np.ndarray:
    return np.asarray(nybble.dequantize(qw, dtype)).astype(np.float32)


CT = fixture("ct")
GPTQ = fixture("gptq")
AWQ = fixture("awq")


# ----------------------------------------------------------------------------------- compressed-tensors


@pytest.mark.parametrize("case", sorted(CT[1]))
def test_ct_read_bit_exact(case):
    tensors, configs, ref = CT
    c = configs[case]
    k, n = c["in_features"], c["out_features"]
    scheme = scheme_from_config(ct_config(c["scheme"]))
    assert scheme.is_quantized(case)
    names = scheme.tensor_names(case, available=tensors)
    assert set(names) == {t for t in tensors if t.startswith(case + ".")}
    qw = scheme.read_linear(case, tensors.__getitem__, in_features=k, out_features=n)
    assert qw.shape == (k, n)
    sym = c["scheme"]["weights"]["symmetric"]
    # Codes: nybble's signed codes are the library's own unpacking of weight_packed, transposed.
    np.testing.assert_array_equal(np.asarray(qw.logical_codes())[:k, :n], ref[f"{case}.lib_codes"].T)
    np.testing.assert_array_equal(ref[f"{case}.lib_codes"], ref[f"{case}.q"])  # the codes chosen
    groups = ref[f"{case}.s"].shape[1]
    if sym:
        assert qw.symmetric and qw.dtype == ref_dtype(c)
        np.testing.assert_array_equal(np.asarray(qw.scales, np.float32)[:groups, :n], ref[f"{case}.s"].T)
    else:
        np.testing.assert_array_equal(ref[f"{case}.lib_zeros"], ref[f"{case}.z"])
        # offsets = -z * s exactly (float32), scales kept in the checkpoint dtype
        assert qw.offsets.dtype == np.float32 and qw.scales.dtype == ref_dtype(c)
        s = ref[f"{case}.s"].T.astype(np.float64)
        np.testing.assert_array_equal(np.asarray(qw.offsets)[:groups, :n], -ref[f"{case}.lib_zeros"].T * s)
    # Dequantized: float32 is the exact (q - z) * s; in the scale dtype, the library's own weight bit for bit.
    q, z, s = ref[f"{case}.q"].astype(np.float64), ref[f"{case}.z"].astype(np.float64), ref[f"{case}.s"]
    g = k // groups
    exact = (q - np.repeat(z, g, axis=1)) * np.repeat(s.astype(np.float64), g, axis=1)
    np.testing.assert_array_equal(deq(qw), exact.T.astype(np.float32))
    lib = ref[f"{case}.lib_weight"]
    np.testing.assert_array_equal(deq(qw, ref_dtype(c)), lib.T)


def ref_dtype(c: dict) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if c["scale_dtype"] == "bfloat16" else np.dtype(c["scale_dtype"])


@pytest.mark.parametrize("case", sorted(CT[1]))
def test_ct_writer_byte_identical(case):
    """nybble's writer, given the same codes and scales, writes compressed-tensors' exact bytes."""
    tensors, configs, ref = CT
    c = configs[case]
    k, n = c["in_features"], c["out_features"]
    sym = c["scheme"]["weights"]["symmetric"]
    g = c["scheme"]["weights"]["group_size"]
    s = ref[f"{case}.s"].T.astype(ref_dtype(c))
    offsets = None if sym else (-ref[f"{case}.z"].T.astype(np.float32) * s.astype(np.float32))
    qw = nybble.QuantizedWeight.from_codes(ref[f"{case}.q"].T, s, offsets, shape=(k, n), group_size=g)
    writer = writer_for("compressed-tensors")
    out = writer.write_linear(case, qw)
    expected = {t: v for t, v in tensors.items() if t.startswith(case + ".")}
    assert sorted(out) == sorted(expected)
    for name, v in expected.items():
        assert out[name].dtype == v.dtype and out[name].shape == v.shape, name
        assert out[name].tobytes() == v.tobytes(), name
    # ... and a config compressed-tensors' own scheme parses back to the same group.
    cfg = writer.quantization_config(ignore=["lm_head"])
    weights = cfg["config_groups"]["group_0"]["weights"]
    lib = c["scheme"]["weights"]
    for key in ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic"):
        assert weights[key] == lib[key], key


def test_ct_read_then_write_round_trip():
    tensors, configs, _ = CT
    for case, c in configs.items():
        scheme = scheme_from_config(ct_config(c["scheme"]))
        qw = scheme.read_linear(
            case, tensors.__getitem__, in_features=c["in_features"], out_features=c["out_features"]
        )
        out = writer_for("compressed-tensors").write_linear(case, qw)
        for name, v in out.items():
            assert v.tobytes() == tensors[name].tobytes(), name


@pytest.mark.parametrize("name", ["ct_tiny_sym_g128", "ct_tiny_asym_g32"])
def test_ct_model_directory(name):
    """A directory compressed by compressed-tensors' ModelCompressor: every linear reads, dequantizes to the
    weights transformers itself loaded, and writes back byte-identically with the same config."""
    d = os.path.join(FIXTURES, name)
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    tensors = load_safetensors(os.path.join(d, "model.safetensors"))
    qc = config["quantization_config"]
    scheme = scheme_from_config(qc)
    assert not scheme.is_quantized("lm_head")
    layers = sorted({t.rsplit(".", 1)[0] for t in tensors if t.endswith(".weight_packed")})
    assert len(layers) == 14
    writer = writer_for("compressed-tensors", version=qc["version"])
    ref = dict(np.load(os.path.join(d, "transformers_weights.npz")))
    for m in layers:
        assert scheme.is_quantized(m)
        n, k = (int(v) for v in tensors[f"{m}.weight_shape"])
        qw = scheme.read_linear(m, tensors.__getitem__, in_features=k, out_features=n)
        if f"{m}.weight" in ref:  # transformers' own dequantization (bf16 weights, as float32)
            np.testing.assert_array_equal(deq(qw, jnp.bfloat16), ref[f"{m}.weight"].T)
        for t, v in writer.write_linear(m, qw).items():
            assert v.tobytes() == tensors[t].tobytes(), t
    assert writer.quantization_config(ignore=["lm_head"]) == qc


# ----------------------------------------------------------------------------------- GPTQ, AutoRound, AWQ


@pytest.mark.parametrize("case", sorted(GPTQ[1]))
@pytest.mark.parametrize("method", ["gptq", "auto-round"])
def test_gptq_read_bit_exact(case, method):
    tensors, configs, ref = GPTQ
    c = configs[case]
    k, n = c["in_features"], c["out_features"]
    qc = dict(c["quantization_config"])
    if method == "auto-round":  # the same tensors as AutoRound's exporter writes them
        qc = {**qc, "quant_method": "auto-round", "packing_format": c["autoround_packing_format"]}
        qc.pop("checkpoint_format")
    scheme = scheme_from_config(qc)
    names = scheme.tensor_names(case, available=tensors)
    assert set(names) == {t for t in tensors if t.startswith(case + ".")}
    qw, perm = scheme.read_linear_with_perm(case, tensors.__getitem__, in_features=k, out_features=n)
    lib = ref[f"{case}.lib_weight"]  # auto-round QuantLinear's own forward on I: the (K, N) weight
    g_idx = tensors.get(f"{case}.g_idx")
    u, z, s = ref[f"{case}.u"].astype(np.float64), ref[f"{case}.z"], ref[f"{case}.s"].astype(np.float64)
    rows = np.arange(k) // (k // z.shape[0]) if g_idx is None else g_idx.astype(np.int64)
    exact = (u - z[rows]) * s[rows]
    if perm is None:
        np.testing.assert_array_equal(deq(qw), exact.astype(np.float32))
        np.testing.assert_array_equal(deq(qw, jnp.float16), lib)
        codes = np.asarray(qw.logical_codes())[:k, :n].astype(np.int64) + 8
        np.testing.assert_array_equal(codes, ref[f"{case}.u"])
    else:  # scattered act-order: rows sorted by group; x @ W == x[..., perm] @ weight, exactly
        assert case == "v1_actorder_g16"
        np.testing.assert_array_equal(deq(qw), exact[perm].astype(np.float32))
        np.testing.assert_array_equal(deq(qw, jnp.float16), lib[perm])
        with pytest.raises(ValueError, match=r"v1_actorder_g16: activation-order .*read_linear_with_perm"):
            scheme.read_linear(case, tensors.__getitem__, in_features=k, out_features=n)
        x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
        y = np.asarray(nybble.matmul(jnp.asarray(x[:, perm]), qw, implementation="xla"))
        np.testing.assert_allclose(y, x @ exact, rtol=1e-5, atol=1e-5)
    if case == "v1_actorder_blocks_g32":  # groups moved in runs of 16 rows: regrouped exactly, no perm
        assert perm is None and qw.group_size == 16
    if "negative" in case:
        assert (np.asarray(qw.scales, np.float32) < 0).any()


def test_gptq_v1_writer_matches_auto_round_packer():
    """nybble's GPTQ v1 writer gives the tensors auto-round's AutoGPTQ-layout packer wrote (v1 cases)."""
    tensors, configs, _ = GPTQ
    for case in ("v1_sym_g32", "v1_asym_g32", "v1_sym_negative_scales_g32", "v1_sym_channel"):
        c = configs[case]
        k, n = c["in_features"], c["out_features"]
        qw = scheme_from_config(c["quantization_config"]).read_linear(
            case, tensors.__getitem__, in_features=k, out_features=n
        )
        out = writer_for("gptq").write_linear(case, qw)
        for key in ("qweight", "qzeros", "scales"):
            assert out[f"{case}.{key}"].tobytes() == tensors[f"{case}.{key}"].tobytes(), (case, key)
        np.testing.assert_array_equal(out[f"{case}.g_idx"], np.arange(k) // (qw.group_size or k))


@pytest.mark.parametrize("case", sorted(AWQ[1]))
def test_awq_read_bit_exact(case):
    tensors, configs, ref = AWQ
    c = configs[case]
    k, n = c["in_features"], c["out_features"]
    scheme = scheme_from_config(c["quantization_config"])
    assert set(scheme.tensor_names(case)) == {t for t in tensors if t.startswith(case + ".")}
    qw = scheme.read_linear(case, tensors.__getitem__, in_features=k, out_features=n)
    np.testing.assert_array_equal(deq(qw, jnp.float16), ref[f"{case}.lib_weight"])  # dequantize_gemm
    np.testing.assert_array_equal(
        np.asarray(qw.logical_codes())[:k, :n].astype(np.int64) + 8, ref[f"{case}.u"]
    )
    g = c["quantization_config"]["group_size"]
    z, s = np.repeat(ref[f"{case}.z"], g, 0), np.repeat(ref[f"{case}.s"].astype(np.float64), g, 0)
    np.testing.assert_array_equal(deq(qw), ((ref[f"{case}.u"] - z) * s).astype(np.float32))


# ----------------------------------------------------------------------------------- round trips, nybble


def random_weights():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((256, 96)).astype(np.float32)
    return {
        "sym_g128": nybble.quantize(w, group_size=128),
        "sym_channel": nybble.quantize(w, group_size=None, scale_dtype=jnp.float16),
        "asym_int_g32": nybble.quantize(w, group_size=32, symmetric=False, zero_point="integer"),
        "asym_int_g64_k200": nybble.quantize(w[:200], group_size=64, symmetric=False, zero_point="integer"),
    }


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "nybble"])
def test_write_read_round_trip(fmt):
    """write -> quantization_config -> read gives the same weight (codes, dequantized values)."""
    for name, qw in random_weights().items():
        writer = writer_for(fmt)
        tensors = writer.write_linear(f"model.layers.0.{name}", qw)
        scheme = scheme_from_config(json.loads(json.dumps(writer.quantization_config(["lm_head"]))))
        m = f"model.layers.0.{name}"
        assert scheme.is_quantized(m) and not scheme.is_quantized("lm_head")
        assert sorted(scheme.tensor_names(m)) == sorted(tensors)
        got = scheme.read_linear(m, tensors.__getitem__, in_features=qw.shape[0], out_features=qw.shape[1])
        np.testing.assert_array_equal(deq(got), deq(qw))
        k, n = qw.shape
        np.testing.assert_array_equal(
            np.asarray(got.logical_codes())[:k, :n], np.asarray(qw.logical_codes())[:k, :n]
        )


def test_nybble_format_keeps_float_offsets():
    qw = nybble.quantize(np.random.default_rng(2).standard_normal((128, 64)), group_size=64, symmetric=False)
    w = writer_for("nybble")
    t = w.write_linear("l", qw)
    got = scheme_from_config(w.quantization_config([])).read_linear(
        "l", t.__getitem__, in_features=128, out_features=64
    )
    np.testing.assert_array_equal(np.asarray(got.offsets), np.asarray(qw.offsets))
    assert got.offsets.dtype == qw.offsets.dtype


# ----------------------------------------------------------------------------------- integer zero points


def test_integer_zero_points_rtn_gptq_autoround():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    qws = {
        "rtn": nybble.quantize(w, group_size=32, symmetric=False, zero_point="integer"),
        "gptq_act": gptq(w, inputs=x, group_size=32, symmetric=False, zero_point="integer", act_order=True),
        "autoround": autoround(
            w, x, group_size=32, symmetric=False, zero_point="integer", config=AutoRoundConfig(steps=4)
        ),
    }
    for name, qw in qws.items():
        s = np.asarray(qw.scales, np.float64)
        o = np.asarray(qw.offsets, np.float64)
        assert qw.scales.dtype == jnp.bfloat16 and qw.offsets.dtype == np.float32, name
        z = 8 - o / np.where(s == 0, 1, s)
        assert np.array_equal(z, np.round(z)) and z.min() >= 1 and z.max() <= 15, name
        # dequantized == (u - z) * s exactly (float64 reference), u = q + 8
        u = np.asarray(qw.logical_codes()).astype(np.float64) + 8
        g = 32
        ref = (u - np.repeat(z, g, 0)) * np.repeat(s, g, 0)
        np.testing.assert_array_equal(np.asarray(nybble.dequantize(qw, padded=True)), ref.astype(np.float32))
        err = np.abs(deq(qw) - w).max() / np.abs(w).max()
        assert err < 0.25, (name, err)  # a 4-bit grid: a step is ~1/15 of a group's range
        y = nybble.matmul(jnp.asarray(x[:4], jnp.bfloat16), qw, implementation="xla")
        np.testing.assert_allclose(np.asarray(y, np.float32), x[:4] @ deq(qw), rtol=0.05, atol=0.3)
    rtn = np.abs(deq(qws["rtn"]) - w)
    s = np.repeat(np.asarray(qws["rtn"].scales, np.float32), 32, 0)[:64, :64]
    assert (rtn <= s * 0.5 + 1e-6).mean() > 0.99  # round to nearest: within half a step but for clipped ends


def test_refit_keeps_integer_zero_points():
    from nybble.quant import hessian_from_inputs, refit_group_params

    rng = np.random.default_rng(8)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    x = rng.standard_normal((48, 64)).astype(np.float32)
    qw = nybble.quantize(w, group_size=32, symmetric=False, zero_point="integer")
    h = hessian_from_inputs(x)
    new = refit_group_params(qw, w, h, zero_point="integer")
    s0, o0 = np.asarray(qw.scales, np.float64)[:, :32], np.asarray(qw.offsets, np.float64)[:, :32]
    s1, o1 = np.asarray(new.scales, np.float64)[:, :32], np.asarray(new.offsets, np.float64)[:, :32]
    np.testing.assert_array_equal(8 - o1 / s1, 8 - o0 / s0)  # the same integer zeros
    assert not np.array_equal(s1, s0)
    loss = [float(np.sum((x @ (deq(q) - w)) ** 2)) for q in (qw, new)]
    assert loss[1] < loss[0]
    writer_for("compressed-tensors").write_linear("l", new)  # still exportable


def test_integer_zero_of_a_nonnegative_group_fits_gptq_v1():
    """A group without negative values would take z = 0, which GPTQ v1 (stored z - 1) cannot hold: nybble
    gives it z = 1 and a step of max / 14 instead, still covering [0, max]."""
    w = np.abs(np.random.default_rng(6).standard_normal((64, 64))).astype(np.float32)
    qw = nybble.quantize(w, group_size=32, symmetric=False, zero_point="integer", scale_dtype=jnp.float16)
    s, o = np.asarray(qw.scales, np.float64), np.asarray(qw.offsets, np.float64)
    np.testing.assert_array_equal(8 - o / s, 1.0)
    assert np.abs(deq(qw) - w).max() <= 0.5 * s.max() * (1 + 1e-3)
    tensors = writer_for("gptq").write_linear("l", qw)
    qzeros = tensors["l.qzeros"].view(np.uint32)
    assert (qzeros == 0).all()  # zero 1 stored as 0


def test_mixed_scale_offset_dtypes_run_everywhere():
    """Integer-zero weights hold bfloat16 scales and float32 offsets: nybble.dequantize, the XLA matmul and
    the Mosaic GPU kernel (GPU interpret mode on the CPU, race detector on) accept them and agree.
    Small-integer data (integer x, power-of-two scales, integer zeros) keep every product exact."""
    import nybble.kernels.mosaic_gpu as mg
    from nybble.kernels.mosaic_gpu.interpret import interpret

    rng = np.random.default_rng(7)
    k, n = 128, 64
    u, z = rng.integers(0, 16, (k, n)), rng.integers(1, 16, (2, n))
    s = (2.0 ** rng.integers(-3, 1, (2, n))).astype(np.float32)
    offsets = ((8 - z) * s).astype(np.float32)
    qw = nybble.QuantizedWeight.from_codes(
        (u - 8).astype(np.int8), s.astype(ml_dtypes.bfloat16), offsets, shape=(k, n), group_size=64
    )
    assert mg.is_supported(jnp.zeros((8, k), jnp.bfloat16), qw) is None
    x = jnp.asarray(rng.integers(-2, 3, (8, k)), jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ ((u - np.repeat(z, 64, 0)) * np.repeat(s, 64, 0))
    y_xla = np.asarray(nybble.matmul(x, qw, implementation="xla"), np.float32)
    np.testing.assert_array_equal(y_xla, exact.astype(ml_dtypes.bfloat16).astype(np.float32))
    mg.reset_state()
    with interpret(detect_races=True):
        y = np.asarray(nybble.matmul(x, qw, implementation="mosaic_gpu"), np.float32)
    assert not mg.races_found()
    np.testing.assert_array_equal(y, y_xla)


def test_zero_point_value_checked():
    with pytest.raises(ValueError, match=r"zero_point must be one of \('float', 'integer'\), got 'int'"):
        nybble.quantize(np.ones((64, 64), np.float32), symmetric=False, zero_point="int")


# ----------------------------------------------------------------------------------- act-order regrouping


def test_regroup_natural():
    k = 128
    g_idx = np.repeat(np.array([1, 0, 3, 2, 1, 0, 3, 2]), 16)  # runs of 16 rows moved between g32 groups
    assert regroup_natural(g_idx, k, 32)[0] == 16
    np.testing.assert_array_equal(regroup_natural(g_idx, k, 32)[1], [1, 0, 3, 2, 1, 0, 3, 2])
    assert regroup_natural(np.arange(k) // 32, k, 32)[0] == 32
    scattered = np.random.default_rng(0).permutation(np.arange(k) // 32)
    assert regroup_natural(scattered, k, 32) is None


def test_ct_actorder_group_g_idx():
    """compressed-tensors < 0.20 wrote weight_g_idx (actorder "group"): weight (q - z[g_idx]) * s[g_idx]."""
    tensors, configs, ref = CT
    case = "asym_g32"
    c = configs[case]
    k, n = c["in_features"], c["out_features"]
    scheme_dict = json.loads(json.dumps(c["scheme"]))
    scheme_dict["weights"]["actorder"] = "group"
    scheme = scheme_from_config(ct_config(scheme_dict))
    assert f"{case}.weight_g_idx" in scheme.tensor_names(case)
    rng = np.random.default_rng(5)
    for g_idx, regroups in (
        (np.repeat(rng.permutation(np.repeat(np.arange(4), 2)), 16), True),
        (rng.permutation(np.arange(k) // 32), False),
    ):
        t = {**tensors, f"{case}.weight_g_idx": g_idx.astype(np.int32)}
        qw, perm = scheme.read_linear_with_perm(case, t.__getitem__, in_features=k, out_features=n)
        q, z, s = (
            ref[f"{case}.q"].T.astype(np.float64),
            ref[f"{case}.z"].T,
            ref[f"{case}.s"].T.astype(np.float64),
        )
        exact = ((q - z[g_idx]) * s[g_idx]).astype(np.float32)
        assert (perm is None) == regroups
        np.testing.assert_array_equal(deq(qw), exact if perm is None else exact[perm])


# ----------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"quant_method": "bitsandbytes"}, r"quant_method='bitsandbytes'"),
        ({"quant_method": "gptq", "bits": 8}, r"bits=8 \(only 4-bit"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"version='gemv'"),
        ({"quant_method": "auto-round", "bits": 4, "packing_format": "auto_round:fp8"}, r"packing_format"),
        ({"quant_method": "auto-round", "bits": 4, "data_type": "nv_fp"}, r"data_type='nv_fp'"),
        ({"quant_method": "fp8"}, r"quant_method='fp8'"),
    ],
)
def test_unsupported_configs(config, match):
    with pytest.raises(ValueError, match=match) as e:
        scheme_from_config(config)
    assert "nybble reads: " + SUPPORTED in str(e.value)


def ct_group(**weights):
    base = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    return {"targets": ["Linear"], "weights": {**base, **weights}}


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"format": "float-quantized"}, r"float-quantized \(fp8 weights\)"),
        ({"format": "nvfp4-pack-quantized"}, r"nvfp4"),
        ({"format": "marlin-24"}, r"marlin-24 \(2:4 sparse\)"),
        ({"format": "sparse-24-bitmask"}, r"2:4 sparse"),
        ({"weights": {"num_bits": 8}}, r"num_bits=8"),
        ({"weights": {"type": "float"}}, r"type='float'"),
        ({"weights": {"strategy": "tensor"}}, r"strategy='tensor'"),
        ({"weights": {"dynamic": True}}, r"dynamic=True"),
        (
            {"input_activations": {"num_bits": 8, "dynamic": True}},
            r"input_activations=.*activation quantization",
        ),
        ({"sparsity_config": {"format": "sparse-24-bitmask"}}, r"sparsity_config"),
        ({"quantization_status": "frozen"}, r"quantization_status='frozen'"),
    ],
)
def test_unsupported_compressed_tensors(config, match):
    group = ct_group(**config.get("weights", {}))
    if "input_activations" in config:
        group["input_activations"] = config["input_activations"]
    qc = {
        "quant_method": "compressed-tensors", "format": config.get("format", "pack-quantized"),
        "quantization_status": config.get("quantization_status", "compressed"),
        "config_groups": {"group_0": group}, "sparsity_config": config.get("sparsity_config", {}),
    }  # fmt: skip
    with pytest.raises(ValueError, match=match) as e:
        scheme_from_config(qc)
    assert "nybble reads: " in str(e.value)


def test_ct_ignore_and_targets():
    qc = ct_config(ct_group(), ignore=["lm_head", "re:.*mlp\\.down_proj$", "model.layers.1.self_attn.q_proj"])
    s = scheme_from_config(qc)
    assert s.is_quantized("model.layers.0.self_attn.q_proj")
    assert not s.is_quantized("model.layers.1.self_attn.q_proj")
    assert not s.is_quantized("model.layers.3.mlp.down_proj")
    assert s.is_quantized("model.layers.3.mlp.up_proj")
    assert not s.is_quantized("lm_head")
    # Targets by regex: only the attention projections, at g32; the most specific group wins.
    qc = ct_config({"targets": ["re:.*self_attn\\..*_proj$"], "weights": ct_group(group_size=32)["weights"]})
    qc["config_groups"]["group_1"] = {**ct_group(), "targets": ["model.layers.0.self_attn.o_proj"]}
    s = scheme_from_config(qc)
    assert s.is_quantized("model.layers.0.self_attn.k_proj") and not s.is_quantized(
        "model.layers.0.mlp.up_proj"
    )
    assert s.group_for("model.layers.0.self_attn.o_proj").group_size == 128
    assert s.group_for("model.layers.0.self_attn.k_proj").group_size == 32


def test_missing_and_misshaped_tensors():
    tensors, configs, _ = CT
    case = "asym_g32"
    c = configs[case]
    k, n = c["in_features"], c["out_features"]
    scheme = scheme_from_config(ct_config(c["scheme"]))
    t = {key: v for key, v in tensors.items() if key != f"{case}.weight_zero_point"}
    with pytest.raises(ValueError, match=r"asym_g32.weight_zero_point: missing from the checkpoint"):
        scheme.read_linear(case, t.__getitem__, in_features=k, out_features=n)
    with pytest.raises(
        ValueError, match=r"asym_g32.weight_packed: expected shape \(48, 16\).*got \(44, 16\)"
    ):
        scheme.read_linear(case, tensors.__getitem__, in_features=k, out_features=48)
    with pytest.raises(ValueError, match=r"asym_g32.weight_shape: expected \[44, 120\]"):
        t = {**tensors, f"{case}.weight_packed": tensors[f"{case}.weight_packed"][:, :15]}
        scheme.read_linear(case, t.__getitem__, in_features=120, out_features=n)
    t = {**tensors, f"{case}.weight_scale": tensors[f"{case}.weight_scale"][:, :3]}
    with pytest.raises(ValueError, match=r"asym_g32.weight_scale: expected shape \(44, 4\).*got \(44, 3\)"):
        scheme.read_linear(case, t.__getitem__, in_features=k, out_features=n)
    t = {**tensors, f"{case}.weight_packed": tensors[f"{case}.weight_packed"].astype(np.int64)}
    with pytest.raises(ValueError, match=r"asym_g32.weight_packed: expected dtype int32, got int64"):
        scheme.read_linear(case, t.__getitem__, in_features=k, out_features=n)
    gt, gc, _ = GPTQ
    g = gc["v1_asym_g32"]
    gs = scheme_from_config(g["quantization_config"])
    t = {**gt, "v1_asym_g32.qzeros": gt["v1_asym_g32.qzeros"][:2]}
    with pytest.raises(ValueError, match=r"v1_asym_g32.qzeros: expected shape \(4, 8\).*got \(2, 8\)"):
        gs.read_linear("v1_asym_g32", t.__getitem__, in_features=128, out_features=64)
    with pytest.raises(ValueError, match=r"v1_asym_g32.scales: missing"):
        gs.read_linear("v1_asym_g32", lambda name: None if name.endswith("scales") else gt[name],
                       in_features=128, out_features=64)  # fmt: skip
    sym = scheme_from_config({**g["quantization_config"], "sym": True})
    with pytest.raises(ValueError, match=r"v1_asym_g32: the config says symmetric but zero point"):
        sym.read_linear("v1_asym_g32", gt.__getitem__, in_features=128, out_features=64)


def test_writers_refuse_inexact():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((128, 64)).astype(np.float32)
    flt = nybble.quantize(w, group_size=32, symmetric=False)  # float zero points
    for fmt in ("compressed-tensors", "gptq"):
        with pytest.raises(ValueError, match=r"model.layers.2.mlp.up_proj: offset .* integer zero point"):
            writer_for(fmt).write_linear("model.layers.2.mlp.up_proj", flt)
    f32 = nybble.quantize(w, group_size=32, scale_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"layer7: scale .* not exactly representable in bfloat16"):
        writer_for("compressed-tensors", scale_dtype="bfloat16").write_linear("layer7", f32)
    with pytest.raises(ValueError, match=r"layer7: scale .* not exactly representable in float16"):
        writer_for("gptq").write_linear("layer7", f32)
    # GPTQ v1 cannot store a zero point 0 (zero - 1 = -1); one group size per model; K, N multiples of 8.
    z0 = nybble.QuantizedWeight.from_codes(
        np.zeros((64, 64), np.int8), np.ones((1, 64), np.float16), np.full((1, 64), 8.0, np.float32),
        shape=(64, 64), group_size=None,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"zp0: zero point 0 at \(group, n\) = \(0, 0\)"):
        writer_for("gptq").write_linear("zp0", z0)
    wr = writer_for("gptq")
    wr.write_linear("a", nybble.quantize(w, group_size=32, scale_dtype=jnp.float16))
    with pytest.raises(ValueError, match=r"b: group_size 64 \(K=128\) differs from the 32 of a"):
        wr.write_linear("b", nybble.quantize(w, group_size=64, scale_dtype=jnp.float16))
    with pytest.raises(ValueError, match=r"odd: GPTQ packs .* \(in, out\) = \(128, 60\)"):
        writer_for("gptq").write_linear("odd", nybble.quantize(w[:, :60], scale_dtype=jnp.float16))
    with pytest.raises(ValueError, match=r"format='awq': nybble writes"):
        writer_for("awq")


def test_pack_int32_layout():
    v = np.arange(16).reshape(2, 8) % 16
    words = pack_int32(v, axis=1)
    assert words.shape == (2, 1) and words.dtype == np.int32
    assert int(words[0, 0]) == 0x76543210 and int(np.uint32(words[1, 0].view(np.uint32))) == 0xFEDCBA98
    np.testing.assert_array_equal(pack_int32(v.T, axis=0), words.T)
