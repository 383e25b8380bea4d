"""``python -m bench.decode``: predicted decode tokens/s of whole models from one compiled step (no GPU).

    python -m bench.decode --models llama3-8b llama3-70b qwen3-30b-a3b --gpu h200 --batch 1 8 64 \\
        --context 4096 --out DIR
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.decode.count import StepCase, extrapolate
from bench.decode.models import DEFAULT_MODELS, HF_CONFIGS, config_for
from bench.decode.predict import hbm_limit, needed_bytes, predict

VARIANTS = {
    "baseline": {"fused": False, "donate": False},  # the step as the model first ran it
    "fused": {"fused": True, "donate": True},  # fused projections, donated cache (issue 46's work)
}
DEFAULT_VARIANT = "fused"


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
        needed = needed_bytes(cfg, case.weights, case.batch, case.context)
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
                "compiled_layers": case.layers,
                "layers": cfg.num_layers,
                "launch_overhead_s": gpu.launch_s,
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
        default=1,
        help="layers to compile (the rest extrapolated: non-layer + L x per-layer); 0: the whole model",
    )
    ap.add_argument("--jobs", type=int, default=None, help=f"compile workers (default {default_jobs()})")
    args = ap.parse_args(argv)
    gpu = get_gpu(args.gpu)
    cases = []
    for model in args.models:
        layers = args.layers or config_for(model).num_layers
        for batch in args.batch:
            for weights in ("bf16", "int4"):
                cases.append(StepCase(model, weights, batch, args.context, layers, **VARIANTS[args.variant]))
    records = run_cases(cases, gpu=gpu.name, jobs=args.jobs, worker="bench.decode.worker")
    rows = rows_for(records, cases, gpu)
    meta = {
        "gpu": gpu.name,
        "context": args.context,
        "variant": args.variant,
        "compiled_layers": args.layers or "all",
        "launch_overhead_s": gpu.launch_s,
        "hbm_bytes_per_s": gpu.hbm_bytes_per_s,
        "bf16_flops": gpu.bf16_flops,
        "notes": NOTES,
    }
    js, md = report.write(args.out, rows, meta)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    return 0


NOTES: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
