"""Writes tests/fixtures/moe/: tiny random Mixtral and Qwen3-MoE checkpoints and transformers' logits.

The independent reference of ``tests/test_moe_pretrained.py``. Run by hand in the torch environment of
tools/make_hf_fixtures.py (torch CPU, transformers 5.x, tokenizers), never nybble's own; made outside the
repository with::

    python3 -m venv ~/hfenv && ~/hfenv/bin/pip install torch transformers tokenizers
    ~/hfenv/bin/python tools/make_moe_fixtures.py

It does not import nybble. Re-running rewrites the fixtures (seeded). For each ``tests/fixtures/moe/<name>/``
(2 layers, hidden 64, 4 experts, top-2, vocab 320; norms and router random and large enough that routing is
decided by clear margins): what ``save_pretrained`` writes (config.json, model.safetensors,
generation_config.json, tokenizer files), ``prompt_ids.npy`` (int32 (16,)) and ``transformers_logits.npy``
(float32 (1, 16, vocab), the directory reloaded in float32 with eager attention). ``MANIFEST.json`` records
the library versions and the tensor names each checkpoint holds (transformers 5 writes the experts per
expert, as on the Hub, though it holds them fused in memory).

=================  ==============================================================================
``mixtral``        ``block_sparse_moe`` router + experts w1/w3/w2 in both layers, top-2 renormalized
``mixtral_fused``  the ``mixtral`` model's ``state_dict()`` as transformers 5 holds it in memory
                   (experts fused: ``mlp.experts.gate_up_proj`` (E, 2I, H), ``mlp.experts.down_proj``;
                   router ``mlp.gate``), with config.json only (its logits are ``mixtral``'s)
``qwen3_moe``      ``mlp_only_layers: [0]`` (layer 0 a dense SwiGLU of intermediate 96), layer 1 MoE with
                   ``moe_intermediate_size`` 32, ``norm_topk_prob: false``, q/k norms, head_dim 32
``qwen3_moe_ct_    ``qwen3_moe`` with its experts in compressed-tensors W4A16 (pack-quantized, sym g32)
experts``          packed by compressed-tensors expert by expert; logits: transformers' model with the
                   library's own dequantization of those experts (see ``make_ct_experts``)
=================  ==============================================================================
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_hf_fixtures import PROMPT, PROMPT_LEN, TINY, build_tokenizer, logits_of, randomize, rel

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "moe"
ROPE = dict(rope_type="default", rope_theta=1000000.0)

CHECKPOINTS = {
    "mixtral": (
        "MixtralConfig",
        dict(
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            rope_parameters=ROPE,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            head_dim=32,
            tie_word_embeddings=False,
            rope_parameters=ROPE,
        ),
    ),
}


def randomize_routers(model: torch.nn.Module, seed: int) -> None:
    """Router weights N(0, 0.5): top-2 choices decided by clear margins, not float noise."""
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def make_checkpoint(name: str, tokenizer, seed: int) -> list[str]:
    cls_name, extra = CHECKPOINTS[name]
    config = getattr(transformers, cls_name)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    randomize(model, seed)
    randomize_routers(model, seed)
    model.eval()
    d = OUT / name
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    ids = tokenizer(PROMPT)["input_ids"][:PROMPT_LEN]
    assert len(ids) == PROMPT_LEN, len(ids)
    x = torch.tensor([ids])
    logits = logits_of(d, x)
    with torch.no_grad():
        same = model(x).logits.numpy()
    assert rel(logits, same) < 1e-5, (name, rel(logits, same))
    # Routing must matter: with the experts' outputs averaged (top-k = all experts) the logits move.
    moved = rel(logits_of(d, x, num_experts_per_tok=4), logits)
    assert moved > 1e-3, (name, "routing did not change the logits", moved)
    np.save(d / "prompt_ids.npy", np.asarray(ids, np.int32))
    np.save(d / "transformers_logits.npy", logits.astype(np.float32))
    if name == "mixtral":  # the same model under transformers 5's fused in-memory names
        fused = OUT / "mixtral_fused"
        shutil.rmtree(fused, ignore_errors=True)
        fused.mkdir()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state), sorted(state)[:8]
        save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
        shutil.copy(d / "config.json", fused / "config.json")
    with safe_open(d / "model.safetensors", "np") as f:
        names = sorted(f.keys())
    size = sum(p.stat().st_size for p in d.iterdir())
    experts = [n for n in names if "expert" in n][:3]
    print(f"{name}: {size / 1e3:.0f} KB, {len(names)} tensors, e.g. {experts}")
    return names


CT_GROUP = 32


@torch.no_grad()
def make_ct_experts(tokenizer) -> None:
    """``qwen3_moe`` with its experts in compressed-tensors W4A16 (pack-quantized, symmetric g32), packed by
    compressed-tensors' own ``PackedQuantizationCompressor`` expert by expert, everything else float.

    Reference logits: transformers' float32 model whose expert weights are the library's own unpacking of
    the codes times the stored scales in float32 (so nybble must read exactly the codes and scales the
    library wrote); checked against the library's ``decompress`` (which rounds to bf16).
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
    )
    from safetensors.torch import load_file

    src, d = OUT / "qwen3_moe", OUT / "qwen3_moe_ct_experts"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.npy"))
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=CT_GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors = load_file(src / "model.safetensors")
    out, dequantized = {}, {}
    for name, w in tensors.items():
        if ".mlp.experts." not in name:
            out[name] = w
            continue
        module = name.removesuffix(".weight")
        n, k = w.shape
        wg = w.float().reshape(n, k // CT_GROUP, CT_GROUP)
        s = (wg.abs().amax(-1) / 7.5).to(torch.bfloat16)  # min-max, as llm-compressor's RTN observer
        packed = PackedQuantizationCompressor.compress({"weight": w.float(), "weight_scale": s}, scheme)
        for key, t in packed.items():
            out[f"{module}.{key}"] = t.contiguous()
        # The library's own unpacking of the codes times the scales, in float32 (its decompress rounds
        # the product to the scale dtype; nybble, like vLLM's kernels, keeps it in float32).
        codes = unpack_from_int32(packed["weight_packed"], 4, torch.Size((n, k))).float()
        exact = codes * packed["weight_scale"].float().repeat_interleave(CT_GROUP, dim=1)
        back = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"].float()
        assert torch.allclose(exact, back, rtol=2**-8, atol=0), name
        dequantized[name] = exact
    save_file(out, d / "model.safetensors", metadata={"format": "pt"})
    qcfg = QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:model\\.layers\\.0\\.mlp\\..*"],
        quantization_status=QuantizationStatus.COMPRESSED,
        format="pack-quantized",
    )
    ModelCompressor(quantization_config=qcfg).update_config(str(d))
    # transformers' float model with the library's dequantized experts: the reference.
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    state = dict(model.state_dict())
    e = model.config.num_experts
    for key in [k for k in state if k.endswith("mlp.experts.gate_up_proj")]:
        prefix = key.removesuffix("gate_up_proj")
        gate = [dequantized[f"{prefix}{i}.gate_proj.weight"] for i in range(e)]
        up = [dequantized[f"{prefix}{i}.up_proj.weight"] for i in range(e)]
        state[key] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
        down = [dequantized[f"{prefix}{i}.down_proj.weight"] for i in range(e)]
        state[f"{prefix}down_proj"] = torch.stack(down)
    model.load_state_dict(state)
    ids = np.load(src / "prompt_ids.npy")
    logits = model(torch.tensor(ids[None].astype(np.int64))).logits.numpy()
    assert rel(logits, np.load(src / "transformers_logits.npy")) > 1e-4  # int4 experts change the numbers
    np.save(d / "prompt_ids.npy", ids)
    np.save(d / "transformers_logits.npy", logits.astype(np.float32))
    config = json.loads((d / "config.json").read_text())
    print(f"qwen3_moe_ct_experts: {config['quantization_config']['format']}, {len(out)} tensors")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    names = {name: make_checkpoint(name, tokenizer, seed) for seed, name in enumerate(CHECKPOINTS)}
    make_ct_experts(tokenizer)
    manifest = {
        "generator": "tools/make_moe_fixtures.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt": PROMPT,
        "tensors": names,
    }
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    main()
