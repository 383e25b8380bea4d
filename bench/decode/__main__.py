"""``python -m bench.decode``: predicted decode tokens/s of whole models from one compiled step (no GPU).

    python -m bench.decode --models llama3-8b llama3-70b qwen3-30b-a3b --gpu h200 --batch 1 8 64 \\
        --context 4096 --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.decode.count import StepCase, extrapolate
from bench.decode.models import DEFAULT_MODELS, HF_CONFIGS, config_for
from bench.decode.predict import hbm_limit, needed_bytes, predict

VARIANTS = {
    "baseline": {"fused": False, "donate": False},  # the step as the model first ran it
    "fused": {"fused": True, "donate": True},  # fuse_projections=True, donated cache
    # the serving setup: fused, donated, set_decode_attention(model, "triton") (one-launch attention) and
    # set_decode_routing(model, "triton") (an MoE token's routing in one launch)
    "serving": {"fused": True, "donate": True, "attention": "triton", "routing": "triton"},
}
DEFAULT_VARIANT = "serving"


def rows_for(records: dict[str, Any], cases: Sequence[StepCase], gpu: Any) -> list[dict[str, Any]]:
    """One row per case from the workers' records (layers extrapolated, prediction, HBM limit)."""
    rows = []
    for case in cases:
        record = records[case.key]
        if "error" in record:
            raise RuntimeError(
                f"bench.decode: {case.key} did not compile: {record['error']}\n{record.get('traceback', '')}"
            )
        cfg = config_for(case.model)
        launches = extrapolate(record["launches"], case.layers, cfg.num_layers)
        p = predict(launches, gpu, case.batch)
        int4_head = case.int4_lm_head and case.weights == "int4"
        needed = needed_bytes(cfg, case.weights, case.batch, case.context, int4_lm_head=int4_head)
        limit = hbm_limit(needed, gpu, case.batch)
        rows.append(
            {
                "model": case.model,
                "gpu": gpu.name,
                "batch": case.batch,
                "weights": case.weights,
                "context": case.context,
                **p,
                "needed_bytes": needed,
                "hbm_limit_tokens_per_s": limit,
                "pct_of_hbm_limit": p["predicted_tokens_per_s"] / limit,
                "pct_of_hbm_limit_captured_free": p["tokens_per_s_captured_free"] / limit,
                "compiled_layers": case.layers,
                "layers": cfg.num_layers,
                "launch_overhead_s": gpu.launch_s,
                "lm_head": "int4" if int4_head else "bf16",
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from bench.decode import report
    from bench.kernel_xray import get_gpu
    from bench.xray.runner import default_jobs, run_cases

    ap = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(HF_CONFIGS))
    ap.add_argument("--gpu", default="h200", help="a nybble.kernels.gpu spec name (h200, h100, ...)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=4096, help="KV-cache positions each sequence attends to")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variant", choices=sorted(VARIANTS), default=DEFAULT_VARIANT)
    ap.add_argument(
        "--layers",
        type=int,
        default=3,
        help="layers to compile (3 or more: layer 1 repeated for every middle layer; 1: the one layer "
        "multiplied, which misses what a layer does for the next: an int4 down kernel's residual epilogue); "
        "0: the whole model",
    )
    ap.add_argument("--int4-lm-head", action="store_true", help="int4 rows: the LM head int4 too (QuantRule)")
    ap.add_argument("--jobs", type=int, default=None, help=f"compile workers (default {default_jobs()})")
    ap.add_argument(
        "--records",
        type=Path,
        default=None,
        help="recompute the tables from this records.json of an earlier run (no compile)",
    )
    args = ap.parse_args(argv)
    gpu = get_gpu(args.gpu)
    cases = []
    for model in args.models:
        model_layers = config_for(model).num_layers
        layers = min(args.layers, model_layers) if args.layers else model_layers
        for batch in args.batch:
            for weights in ("bf16", "int4"):
                case = StepCase(model, weights, batch, args.context, layers, **VARIANTS[args.variant])
                cases.append(dataclasses.replace(case, int4_lm_head=args.int4_lm_head))
    if args.records is not None:
        records = json.loads(args.records.read_text())
    else:
        records = run_cases(cases, gpu=gpu.name, jobs=args.jobs, worker="bench.decode.worker")
        report.write_atomic(args.out / "records.json", json.dumps(records) + "\n")
    rows = rows_for(records, cases, gpu)
    import jax

    meta = {
        "gpu": gpu.name,
        "jax": jax.__version__,  # the workers compile with this environment's jax and CUDA plugin
        "context": args.context,
        "variant": args.variant,
        "compiled_layers": args.layers or "all",
        "int4_lm_head": args.int4_lm_head,
        "launch_overhead_s": gpu.launch_s,
        "graph_launch_overhead_s": gpu.graph_launch_s,
        "hbm_bytes_per_s": gpu.hbm_bytes_per_s,
        "bf16_flops": gpu.bf16_flops,
        "notes": NOTES,
    }
    js, md = report.write(args.out, rows, meta)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0


NOTES: list[str] = [
    "## How these numbers are made",
    "",
    "- **Compiled, not run**: one decode step (`nybble.models.evaluate.decode_step`, the step `generate`'s "
    "loop runs) of nybble's own Llama/MoE model, for the GPU named, on a deviceless topology (JAX's CUDA "
    "plugin, XLA's GPU compiler, ptxas for nybble's Mosaic GPU kernels: Hopper's on h200, the Blackwell "
    "tcgen05 kernels on b200, dense and grouped), weights "
    "abstract (`jax.ShapeDtypeStruct`): bf16, and int4 g128 symmetric as `nybble.models.quantize` makes them "
    "(the LM head stays bf16, `DEFAULT_RULES`). Variant `baseline`: separate q/k/v and gate/up, the cache "
    "not donated (the model code of the commit otherwise); "
    "`fused`: `quantize(..., fuse_projections=True)` (q/k/v, gate/up and the MoE "
    "experts' gate/up fused), the cache donated; the step as the model code of the commit computes it (one "
    "token: written to the cache, then attended in a few fused reductions; each norm's row scale deferred "
    "past its projections); `serving` (the default): `fused` with `set_decode_attention(model, 'triton')`, "
    "nybble's Pallas-on-Triton decode attention kernel (from the qkv kernel's output: the deferred norm "
    "scale, q/k norms, rotary embedding, cache write and attention in one launch, the splits merged in a "
    "second; opt-in until a GPU has run it), and for an MoE model `set_decode_routing(model, 'triton')`, "
    "nybble's Pallas-on-Triton routing kernel (a batch-1 token's top k, group sizes, scores in slot order "
    "and the experts' k rows in one launch; opt-in likewise).",
    "- **Three layers compiled, the middle one repeated**: the model is compiled with 3 layers (`--layers`); "
    "layer 1's launches (its ops' scope, `layer_1`) count once for each of the model's `layers - 2` middle "
    "layers, every other launch once (embedding gather, final norm, LM head, the rotary angles XLA computes "
    "once for all layers; layers 0 and 2, the first and the last). Layer 1, like every middle layer, reads a "
    "residual stream a layer wrote and writes one a layer reads, so what XLA fuses across a layer boundary "
    "is its own. Checked against whole compiles of 5-layer models in tests/test_decode_bench.py (launches "
    "equal, per family, inside command buffers and the command buffers too; bytes within 0.9%, each norm "
    "re-summing the residual stream's parts a layer deeper). Until 2026-12-07 one layer was compiled and "
    "multiplied, with the launches a layer boundary adds patched in: it missed fusions only a middle layer "
    "has (the residual add fused with the next layer's input norm).",
    "- **Launches and bytes** are read off XLA's optimized HLO (`bench.kernel_xray.hlo`: every fusion, "
    "custom call and copy of the entry computation; bytes = operands + result as typed), with three "
    "corrections where the type is not the traffic: the embedding gather (alone or fused into the first "
    "norm) reads one row per token; the in-place cache update reads and writes one row (the Triton "
    "attention kernel's caches too, which it returns aliased); a grouped MoE "
    "kernel reads the experts its tokens reach (expected distinct experts of `batch` tokens routed "
    "uniformly to their top k). Launch counts equal the thunks XLA's runtime executes (its dumped thunk "
    "sequence; tested): a fusion XLA runs as two thunks (the MoE top-k: a copy and a sort) counts two "
    "launches, the second moving no bytes.",
    "- **Prediction per launch**: max(bytes / HBM rate, flops / bf16 tensor rate, issue-bound time of "
    "nybble's kernels from the X-ray model: `bench.xray.model` for Hopper's dense one, "
    "`bench.xray.blackwell` for the Blackwell kernel on b200; the grouped kernels' for the balanced "
    "grouping their config is "
    "chosen for, as the X-ray's MoE rows: `bench.xray.moe_cases`, `bench.xray.blackwell`) + one launch "
    "overhead. "
    "Flops: 2 x rows x weights read, 2 x query heads per KV head x cache elements read. Step time = sum "
    "over launches; tokens/s = batch / step time.",
    "- **Launch overhead**, the same constants for bf16 and int4: `GpuSpec.launch_s` = 2 us for a launch "
    "the host submits on its own (a thunk outside any command buffer, and each command buffer's own "
    "launch: column `graphs`), nybble's working figure (`nybble.kernels.gpu`), between the ~1 us a "
    "back-to-back stream launch adds on the GPU and the 4-6 us the host spends submitting one (NVIDIA's "
    "technical blog, 'Getting Started with CUDA Graphs', 2019; the pegainfer CUDA-graph write-up, 2025); "
    "`GpuSpec.graph_launch_s` = 0.875 us for a kernel replayed inside a command buffer (CUDA.jl's "
    "documentation, 'Graphs': 80 small broadcast kernels in 70 us as one graph, 260 us launched one by "
    "one; each kernel's own run included). Not checked against a measurement: none of decode tokens/s "
    "exists yet.",
    "- **Command buffers (CUDA graphs)**: read from XLA's thunk sequence after its thunk passes "
    "(`--xla_dump_to`; a custom call's thunk named from the dump's thunk metadata). Column `in graphs`: "
    "launches inside command buffers. jax 0.11.2: XLA captures runs of its own fusions and Triton GEMMs; "
    "nybble's Mosaic GPU kernels (custom call `mosaic_gpu_v2`, a typed FFI handler) stay outside and cut "
    "the step into pieces, also with `--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,"
    "CUDNN` and a minimum graph size of 1 (tried): that XLA asks the handler's registration for the "
    "command-buffer trait, which jaxlib's registration does not pass. jax 0.12.0.1: the whole step, "
    "nybble's kernels included, is one command buffer (its XLA reads the trait the handler itself "
    "declares; our reading of both XLAs). A captured launch costs less than an uncaptured one (a graph "
    "replays with no host work per launch): `predicted` charges it `graph_launch_s`, plus `launch_s` "
    "once per command buffer (a run of consecutive captured launches in program order, counted as often "
    "as its layer runs; the whole step is one on jax 0.12); `graphs free` charges the captured launches "
    "nothing, the bound the other way (the GPU's own gap between kernels left out).",
    "- **HBM limit**: (weights + KV cache + activations a step must read) / HBM rate, per batch: weights "
    "once (MoE: the experts reached), the embedding rows, the bf16 LM head, the whole KV cache "
    "(`--context` positions per sequence and layer), the rows of x each projection reads. The ideal "
    "int4/bf16 ratio is the ratio of these bytes (bf16 over int4).",
    "",
]

if __name__ == "__main__":
    sys.exit(main())
