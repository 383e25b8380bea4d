"""Perplexity of SmolLM2-135M: float against int4 (RTN and GPTQ), the README's accuracy table.

    .venv/bin/python examples/accuracy.py          # about 10 minutes on 2 CPU cores

Calibrates on ``eval_text("calib")``, evaluates on ``eval_text("eval")`` (disjoint), window 256.
"""

import time

from flax import nnx

import nybble.models as nm
from nybble.models import smollm2

CONFIGS = [
    ("float", None),
    ("RTN g128 symmetric", dict(group_size=128)),
    ("RTN g64 symmetric", dict(group_size=64)),
    ("RTN g64 asymmetric", dict(group_size=64, symmetric=False)),
    ("RTN g32 asymmetric", dict(group_size=32, symmetric=False)),
    ("GPTQ g128 symmetric, paper's algorithm", dict(group_size=128, method="gptq", refit_scales=False)),
    ("GPTQ g128 symmetric (default: + least-squares scales)", dict(group_size=128, method="gptq")),
    ("GPTQ g64 asymmetric (default)", dict(group_size=64, symmetric=False, method="gptq")),
]
# GPTQ rows also report the share of the same-format RTN row's perplexity increase they remove.
BASELINES = {"GPTQ g128 symmetric": "RTN g128 symmetric", "GPTQ g64 asymmetric": "RTN g64 asymmetric"}


def main() -> None:
    model, tokenizer = smollm2.load()
    graphdef, state = nnx.split(model)
    calib = tokenizer.encode(nm.eval_text("calib")).ids
    ids = tokenizer.encode(nm.eval_text("eval")).ids
    print(f"eval tokens: {len(ids)}, calibration tokens: {len(calib)}")
    print("| weights | perplexity | vs float | linear-layer MiB |\n|---|---|---|---|")
    float_ppl = None
    results: dict[str, float] = {}
    for name, options in CONFIGS:
        start = time.perf_counter()
        m = nnx.merge(graphdef, state)
        mib = None
        if options is not None:
            if options.get("method") == "gptq":
                options = dict(options, calibration=calib)
            m, report = nm.quantize(m, progress=False, return_report=True, **options)
            mib = report.bytes_after / 2**20
        ppl = nm.perplexity(m, ids)
        float_ppl = float_ppl or ppl
        results[name] = ppl
        delta = "" if options is None else f"{100 * (ppl / float_ppl - 1):+.1f}%"
        base = next((results[b] for g, b in BASELINES.items() if name.startswith(g)), None)
        if base is not None:
            delta += f"; removes {100 * (base - ppl) / (base - float_ppl):.0f}% of RTN's increase"
        size = "" if mib is None else f"{mib:.1f}"
        print(f"| {name} | {ppl:.2f} | {delta} | {size} |  ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
