"""Writes tests/fixtures/quant/: quantized linears packed by the libraries that own each format.

Run by hand, once, in a torch virtual environment made outside the repository (never by the tests, which
read only the files)::

    python3 -m venv ~/hfenv && ~/hfenv/bin/pip install torch compressed-tensors transformers
    ~/hfenv/bin/pip install --no-deps auto-round autoawq && ~/hfenv/bin/pip install py-cpuinfo datasets
    ~/hfenv/bin/python tools/make_quant_fixtures.py [OUT_DIR]

Needs torch, compressed-tensors, transformers, auto-round and AutoAWQ (all of it pure Python on a CPU).
GPTQModel and AutoGPTQ need a CUDA build, so auto-round's GPTQ packers stand in. The
versions used are recorded in ``OUT_DIR/versions.json``. Everything is seeded: a rerun writes the same
tensors.

Who produced what (the point of the fixtures: nybble is checked against the writing library itself):

* ``ct_linears.safetensors`` + ``ct_linears.json`` + ``ct_linears_ref.npz``: compressed-tensors'
  ``PackedQuantizationCompressor.compress`` (pack-quantized) of tiny linears whose float weight is
  ``(q - z) * s`` for chosen codes q, zeros z and scales s (so the compressor's own quantize reproduces
  exactly those codes). The reference holds the chosen q / z / s, the library's own unpacking
  (``unpack_from_int32`` of weight_packed and weight_zero_point) and its dequantized weight
  (``PackedQuantizationCompressor.decompress``).
* ``gptq_linears.*``: GPTQ tensors packed by auto-round's ``auto_round_extension.torch`` QuantLinear
  classes, the ones auto-round's exporter packs with (``qlinear_torch_zp``: ``auto_round:auto_gptq``,
  AutoGPTQ's v1 "stored zero - 1" layout; ``qlinear_torch``: ``auto_round`` / ``auto_round:gptqmodel``,
  the zero stored as is (GPTQ v2)). The reference dequantized weight is the same class's own forward
  pass on an identity matrix (``x = I`` gives ``I @ W = W`` exactly), act-order cases included (their
  ``g_idx`` set on the packed module, which its forward honours).
* ``awq_linears.*``: AWQ GEMM tensors from AutoAWQ's own ``WQLinear_GEMM.from_linear`` (interleaved
  nibble order; auto-round's copy is checked to write the same bytes), reference from AutoAWQ's
  ``awq.utils.packing_utils.dequantize_gemm``.
* ``autoround_sym_g32/``, ``autoround_asym_g32/``: a tiny random Llama quantized and saved by AutoRound
  itself (``AutoRound(iters=0)``, its RTN mode, ``quantize_and_save(format="auto_round")``: symmetric
  becomes ``packing_format: auto_round:auto_gptq``, asymmetric ``auto_round:auto_awq``), with
  ``autoround_weights.npz``: every linear dequantized by the class auto-round's exporter packs with
  (``dynamic_import_quant_linear_for_packing``; its forward on an identity matrix) or its AWQ
  ``dequantize_gemm``.
* ``ct_tiny_sym_g128/``, ``ct_tiny_asym_g32/``: a tiny random Llama (2 layers, hidden 128) saved by
  transformers and compressed by compressed-tensors' ``ModelCompressor`` (``compress_model`` +
  ``update_config``, what llm-compressor does), with ``logits.npy``: transformers' float32 logits of
  ``prompt.npy`` after loading the directory with ``CompressedTensorsConfig(dequantize=True)`` (which
  rounds each dequantized weight to the bfloat16 scale dtype), and ``logits_exact.npy``: the same model
  with the exact float32 weights ``(q - z) * s`` (compressed-tensors' unpacking), what nybble's float32
  dequantization gives.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from importlib.metadata import version

import numpy as np
import torch
from safetensors.torch import save_file

SEED = 20261203
OUT = (
    sys.argv[1]
    if len(sys.argv) > 1
    else os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "quant")
)


def chosen_params(rng, n, k, groups, *, sym, zero_range=(-8, 7), negative_scales=False, dtype=torch.bfloat16):
    """Codes q (N, K) int8 in [-8, 7], zeros z (N, groups) int8 (0 when sym), scales (N, groups) in dtype."""
    q = rng.integers(-8, 8, size=(n, k)).astype(np.int8)
    s = rng.uniform(0.002, 0.05, size=(n, groups)).astype(np.float32)
    if negative_scales:
        s *= np.where(rng.random((n, groups)) < 0.5, -1.0, 1.0).astype(np.float32)
    z = (
        np.zeros((n, groups), np.int8)
        if sym
        else rng.integers(zero_range[0], zero_range[1] + 1, (n, groups)).astype(np.int8)
    )
    return torch.from_numpy(q), torch.from_numpy(z), torch.from_numpy(s).to(dtype)


def expand(p, k):
    """(N, groups) -> (N, K) by natural groups of ceil(K / groups)."""
    g = -(-k // p.shape[1])
    return p.repeat_interleave(g, dim=1)[:, :k]


# --------------------------------------------------------------------------------------------------
# compressed-tensors


CT_CASES = {
    # name: (in K, out N, strategy, group_size, symmetric, scale dtype)
    "sym_g32": (128, 48, "group", 32, True, torch.bfloat16),
    "asym_g32": (128, 44, "group", 32, False, torch.bfloat16),  # N % 8 != 0: the zero points' packing pads
    "sym_g128": (256, 64, "group", 128, True, torch.bfloat16),
    "asym_g64_fp16": (192, 40, "group", 64, False, torch.float16),
    "sym_channel_fp16": (72, 32, "channel", None, True, torch.float16),  # K % 8 != 0: packing pads K
    "asym_channel": (64, 40, "channel", None, False, torch.bfloat16),
}


def ct_linears(out):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    rng = np.random.default_rng(SEED)
    tensors, configs, ref = {}, {}, {}
    for name, (k, n, strategy, g, sym, dtype) in CT_CASES.items():
        groups = 1 if g is None else k // g
        q, z, s = chosen_params(rng, n, k, groups, sym=sym, dtype=dtype)
        args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy=strategy, group_size=g)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        # The float weight (q - z) * s, exact in float32: the compressor's round(w / s + z) gives back q.
        w = (q.float() - expand(z, k).float()) * expand(s, k).float()
        state = {"weight": w, "weight_scale": s.clone()}
        if not sym:
            state["weight_zero_point"] = z.clone()
        packed = PackedQuantizationCompressor.compress(state, scheme)
        for key, t in packed.items():
            tensors[f"{name}.{key}"] = t.contiguous()
        back = PackedQuantizationCompressor.decompress(dict(packed), scheme)
        ref[f"{name}.q"], ref[f"{name}.z"] = q.numpy(), z.numpy()
        ref[f"{name}.s"] = s.float().numpy()
        ref[f"{name}.lib_codes"] = unpack_from_int32(packed["weight_packed"], 4, torch.Size((n, k))).numpy()
        if not sym:
            ref[f"{name}.lib_zeros"] = unpack_from_int32(
                packed["weight_zero_point"], 4, torch.Size((n, groups)), packed_dim=0
            ).numpy()
        ref[f"{name}.lib_weight"] = back["weight"].float().numpy()
        ref[f"{name}.lib_weight_dtype"] = np.array(str(back["weight"].dtype))
        configs[name] = {
            "in_features": k,
            "out_features": n,
            "scale_dtype": str(dtype).removeprefix("torch."),
            "scheme": json.loads(scheme.model_dump_json()),
        }
    save_file(tensors, os.path.join(out, "ct_linears.safetensors"))
    with open(os.path.join(out, "ct_linears.json"), "w") as f:
        json.dump(configs, f, indent=1, sort_keys=True)
    np.savez_compressed(os.path.join(out, "ct_linears_ref.npz"), **ref)


# --------------------------------------------------------------------------------------------------
# GPTQ and AWQ, packed by auto-round's QuantLinear classes


GPTQ_CASES = {
    # name: (K, N, group_size (-1: per column), sym, packer, g_idx kind, negative scales)
    "v1_sym_g32": (128, 64, 32, True, "zp", None, False),
    "v1_asym_g32": (128, 64, 32, False, "zp", None, False),
    "v1_sym_negative_scales_g32": (128, 64, 32, True, "zp", None, True),  # AutoRound's signed sym scales
    "v1_sym_channel": (64, 32, -1, True, "zp", None, False),
    "v2_asym_g64": (128, 64, 64, False, "v2", "natural", False),
    "v1_actorder_g16": (64, 32, 16, False, "zp", "scattered", False),
    "v1_actorder_blocks_g32": (128, 32, 32, True, "zp", "blocks", False),
}


def _g_idx(rng, kind, k, g):
    natural = np.arange(k) // g
    if kind == "scattered":  # GPTQ desc_act: rows quantized in a permuted order, group = rank // G
        perm = rng.permutation(k)
        g_idx = np.empty(k, np.int64)
        g_idx[perm] = np.arange(k) // g
        return g_idx
    if kind == "blocks":  # whole runs of 16 rows moved between groups: regroupable exactly at g16
        blocks = natural[::16].copy()
        rng.shuffle(blocks)
        return np.repeat(blocks, 16)[:k]
    return natural


def gptq_linears(out):
    from auto_round_extension.torch.qlinear_torch import QuantLinear as QuantLinearV2
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear as QuantLinearZP

    rng = np.random.default_rng(SEED + 1)
    tensors, configs, ref = {}, {}, {}
    for name, (k, n, g, sym, packer, gkind, neg) in GPTQ_CASES.items():
        gs = k if g == -1 else g
        groups = -(-k // gs)
        zr = (1, 15) if packer == "zp" else (0, 15)  # v1 cannot store zero 0 (zero - 1 = -1)
        u = rng.integers(0, 16, size=(n, k)).astype(np.int64)
        s = rng.uniform(0.002, 0.05, size=(n, groups)).astype(np.float32)
        if neg:
            s *= np.where(rng.random((n, groups)) < 0.5, -1.0, 1.0).astype(np.float32)
        s = torch.from_numpy(s).half()
        z = np.full((n, groups), 8) if sym else rng.integers(zr[0], zr[1] + 1, size=(n, groups))
        z = torch.from_numpy(z.astype(np.int32))
        lin = torch.nn.Linear(k, n, bias=False)
        # The packers compute round(W / s + z) over natural groups: W = (u - z) * s gives back u.
        with torch.no_grad():
            lin.weight.copy_((torch.from_numpy(u).float() - expand(z, k).float()) * expand(s, k).float())
        cls = QuantLinearZP if packer == "zp" else QuantLinearV2
        kwargs = {"g_idx": True} if gkind is not None else {}
        ql = cls(4, g, k, n, False, **kwargs)
        ql.device = torch.device("cpu")  # qlinear_torch.pack reads self.device, which it never sets (0.16.1)
        ql.pack(lin, s.clone(), z.clone(), None)
        if gkind is not None:
            g_idx = _g_idx(rng, gkind, k, gs)
            ql.g_idx = torch.from_numpy(g_idx.astype(np.int32))
        with torch.no_grad():
            lib_w = ql(torch.eye(k, dtype=torch.float16)).float().numpy()  # (K, N): I @ W
        for key in ("qweight", "qzeros", "scales") + (("g_idx",) if gkind is not None else ()):
            tensors[f"{name}.{key}"] = getattr(ql, key).contiguous()
        ref[f"{name}.u"] = u.T.astype(np.int8)  # (K, N) unsigned codes as packed
        ref[f"{name}.z"], ref[f"{name}.s"] = z.numpy().T, s.float().numpy().T  # (groups, N)
        ref[f"{name}.lib_weight"] = lib_w
        configs[name] = {
            "in_features": k, "out_features": n,
            "quantization_config": {
                "quant_method": "gptq", "bits": 4, "group_size": g, "sym": sym,
                "desc_act": gkind == "scattered" or gkind == "blocks",
                "checkpoint_format": "gptq" if packer == "zp" else "gptq_v2",
            },
            "autoround_packing_format": "auto_round:auto_gptq" if packer == "zp" else "auto_round:gptqmodel",
            "packer": cls.__module__ + ".QuantLinear",
        }  # fmt: skip
    save_file(tensors, os.path.join(out, "gptq_linears.safetensors"))
    with open(os.path.join(out, "gptq_linears.json"), "w") as f:
        json.dump(configs, f, indent=1, sort_keys=True)
    np.savez_compressed(os.path.join(out, "gptq_linears_ref.npz"), **ref)


AWQ_CASES = {"g32": (128, 64, 32), "g64": (128, 96, 64)}  # AutoAWQ packs N % 32 == 0 only


def awq_linears(out):
    # AutoAWQ's own packer and unpacking (pip install --no-deps autoawq: pure torch on a CPU); auto-round's
    # copy of them must write the same bytes.
    from auto_round.export.export_to_awq.utils import WQLinear_GEMM as ARWQLinear_GEMM
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    rng = np.random.default_rng(SEED + 2)
    tensors, configs, ref = {}, {}, {}
    for name, (k, n, g) in AWQ_CASES.items():
        groups = k // g
        u = rng.integers(0, 16, size=(n, k)).astype(np.int64)
        s = torch.from_numpy(rng.uniform(0.002, 0.05, size=(groups, n)).astype(np.float32)).half()
        z = torch.from_numpy(rng.integers(0, 16, size=(groups, n)).astype(np.int32))
        lin = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            w = (torch.from_numpy(u).float() - expand(z.t(), k).float()) * expand(s.t(), k).float()
            lin.weight.copy_(w)
        wq = WQLinear_GEMM.from_linear(lin, 4, g, scales=s.clone(), zeros=z.clone())
        other = ARWQLinear_GEMM.from_linear(lin, 4, g, scales=s.clone(), zeros=z.clone())
        for key in ("qweight", "qzeros", "scales"):
            tensors[f"{name}.{key}"] = getattr(wq, key).contiguous()
            assert torch.equal(getattr(wq, key), getattr(other, key)), (name, key)
        lib_w = dequantize_gemm(wq.qweight, wq.qzeros, wq.scales, 4, g)  # (K, N) float16
        ref[f"{name}.u"] = u.T.astype(np.int8)
        ref[f"{name}.z"], ref[f"{name}.s"] = z.numpy(), s.float().numpy()
        ref[f"{name}.lib_weight"] = lib_w.float().numpy()
        configs[name] = {
            "in_features": k, "out_features": n,
            "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
                                    "version": "gemm"},
            "packer": "awq.modules.linear.gemm.WQLinear_GEMM (AutoAWQ; auto-round's copy writes the same)",
        }  # fmt: skip
    save_file(tensors, os.path.join(out, "awq_linears.safetensors"))
    with open(os.path.join(out, "awq_linears.json"), "w") as f:
        json.dump(configs, f, indent=1, sort_keys=True)
    np.savez_compressed(os.path.join(out, "awq_linears_ref.npz"), **ref)


# --------------------------------------------------------------------------------------------------
# Tiny compressed-tensors model directories


def ct_tiny(out, name, *, sym, group_size):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED + (0 if sym else 1))
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        dtype="bfloat16",
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    qcfg = QuantizationConfig(
        config_groups={
            "group_0": QuantizationScheme(
                targets=["Linear"],
                weights=QuantizationArgs(
                    num_bits=4, type="int", symmetric=sym, strategy="group", group_size=group_size
                ),
            )
        },
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.FROZEN,
    )
    apply_quantization_config(model, qcfg)
    # Min-max parameters per group (what llm-compressor's RTN observer computes), set on the modules.
    with torch.no_grad():
        for mod in model.modules():
            if not hasattr(mod, "weight_scale"):
                continue
            w = mod.weight.float()
            n, k = w.shape
            wg = w.reshape(n, k // group_size, group_size)
            if sym:
                s = wg.abs().amax(-1) / 7.5
                s = s.to(torch.bfloat16)
                zp = torch.zeros_like(s, dtype=torch.int8)
            else:
                lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
                s = ((hi - lo) / 15).to(torch.bfloat16)
                zp = (-8 - torch.round(lo / s.float())).clamp(-8, 7).to(torch.int8)
            mod.weight_scale.copy_(s.reshape(mod.weight_scale.shape))
            if hasattr(mod, "weight_zero_point"):
                mod.weight_zero_point.data = zp.reshape(mod.weight_scale.shape).to(
                    mod.weight_zero_point.dtype
                )
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(d)
    compressor.update_config(d)
    # transformers' own load of the directory, dequantized, in float32.
    loaded = AutoModelForCausalLM.from_pretrained(
        d, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    ).eval()
    prompt = torch.from_numpy(np.random.default_rng(SEED).integers(0, 256, size=(1, 12)))
    with torch.no_grad():
        logits = loaded(prompt).logits.float().numpy()
    np.save(os.path.join(d, "prompt.npy"), prompt.numpy().astype(np.int32))
    np.save(os.path.join(d, "logits.npy"), logits)
    # The weights transformers dequantized, for a direct check of two layers (float32, (out, in)).
    sd = loaded.state_dict()
    ref = {
        key: sd[key].float().numpy()
        for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight")
    }
    np.savez_compressed(os.path.join(d, "transformers_weights.npz"), **ref)
    # transformers dequantizes (q - z) * s in the scale dtype (bfloat16: one rounding of each product);
    # the same model with the exact float32 products (q - z) * s, from compressed-tensors' own unpacking,
    # is logits_exact.npy: what a float32 evaluation of the exact quantized weights gives.
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    packed = load_file(os.path.join(d, "model.safetensors"))
    with torch.no_grad():
        for mod_name, mod in loaded.named_modules():
            if f"{mod_name}.weight_packed" not in packed:
                continue
            n, k = (int(v) for v in packed[f"{mod_name}.weight_shape"])
            q = unpack_from_int32(packed[f"{mod_name}.weight_packed"], 4, torch.Size((n, k))).float()
            s = packed[f"{mod_name}.weight_scale"].float()
            zp = packed.get(f"{mod_name}.weight_zero_point")
            z = torch.zeros_like(s) if zp is None else unpack_from_int32(zp, 4, s.shape, packed_dim=0).float()
            g = k // s.shape[1]
            mod.weight.copy_((q - z.repeat_interleave(g, 1)) * s.repeat_interleave(g, 1))
        np.save(os.path.join(d, "logits_exact.npy"), loaded(prompt).logits.float().numpy())


def autoround_dir(out, name, *, sym):
    """A tiny Llama quantized and saved by AutoRound itself (iters=0: its RTN mode, no calibration data)
    in its own format (``format="auto_round"``), plus the library's dequantized weight of every linear."""
    from auto_round import AutoRound
    from auto_round.export.export_to_autoround.export import dynamic_import_quant_linear_for_packing
    from auto_round.export.export_to_awq.utils import dequantize_gemm
    from safetensors.torch import load_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED + 3)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    vocab = {f"w{i}": i for i in range(256)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="w0", bos_token="w1", eos_token="w2")
    tmp = os.path.join(out, f".{name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ar = AutoRound(model, tokenizer=tok, bits=4, group_size=32, sym=sym, iters=0, disable_opt_rtn=True)
    ar.quantize_and_save(tmp, format="auto_round")
    (sub,) = os.listdir(tmp)  # AutoRound writes into OUT/w4g32/
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    shutil.move(os.path.join(tmp, sub), d)
    shutil.rmtree(tmp)
    with open(os.path.join(d, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    tensors = load_file(os.path.join(d, "model.safetensors"))
    ref = {}
    for prefix in sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")):
        qweight, qzeros, scales = (tensors[f"{prefix}.{t}"] for t in ("qweight", "qzeros", "scales"))
        g = qc["group_size"]
        if "awq" in qc["packing_format"]:
            w = dequantize_gemm(qweight, qzeros, scales, 4, g)  # (K, N)
        else:
            cls = dynamic_import_quant_linear_for_packing(qc["packing_format"], 4, g, qc["sym"])
            k, n = qweight.shape[0] * 8, qweight.shape[1]
            ql = cls(4, g, k, n, False)
            ql.qweight, ql.qzeros, ql.scales = qweight, qzeros, scales
            with torch.no_grad():
                w = ql(torch.eye(k, dtype=torch.float16))  # its own forward: I @ W
        ref[f"{prefix}.lib_weight"] = w.half().numpy()  # computed in float16: stored exactly
    np.savez_compressed(os.path.join(d, "autoround_weights.npz"), **ref)


def main():
    out = os.path.abspath(OUT)
    os.makedirs(out, exist_ok=True)
    ct_linears(out)
    gptq_linears(out)
    awq_linears(out)
    ct_tiny(out, "ct_tiny_sym_g128", sym=True, group_size=128)
    ct_tiny(out, "ct_tiny_asym_g32", sym=False, group_size=32)
    autoround_dir(out, "autoround_sym_g32", sym=True)
    autoround_dir(out, "autoround_asym_g32", sym=False)
    libs = ("torch", "transformers", "compressed-tensors", "auto-round", "autoawq", "safetensors")
    versions = {p: version(p) for p in libs}
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump(versions, f, indent=1, sort_keys=True)
    print("wrote", out, versions)


if __name__ == "__main__":
    main()
