"""Perplexity of SmolLM2-135M: float against int4 (RTN, GPTQ, AutoRound), the README's accuracy table.

    .venv/bin/python examples/accuracy.py              # every row: over an hour on 2 CPU cores
    .venv/bin/python examples/accuracy.py AutoRound    # only the rows whose name contains a word (+ float)

Calibrates on ``eval_text("calib")``, evaluates on ``eval_text("eval")`` (disjoint), window 256. The time
column is the quantization alone (the evaluation takes about a minute per row); the machine's load average
is printed with each row, since a shared CPU changes the times, not the perplexities.
"""

import os
import sys
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
    ("AutoRound g128 symmetric, fast preset", dict(group_size=128, method="autoround", config="fast")),
    ("AutoRound g128 symmetric (default)", dict(group_size=128, method="autoround")),
    (
        "AutoRound g64 asymmetric, fast preset",
        dict(group_size=64, symmetric=False, method="autoround", config="fast"),
    ),
    ("AutoRound g64 asymmetric (default)", dict(group_size=64, symmetric=False, method="autoround")),
    (
        "AutoRound g128 symmetric, scale_lr=0.1, GPTQ start + least-squares scales",
        dict(group_size=128, method="autoround", start="gptq", refit_scales=True, scale_lr=0.1),
    ),
    (
        "AutoRound g128 symmetric, signed gradient",
        dict(group_size=128, method="autoround", optimizer="sign"),
    ),
    ("AutoRound g128 symmetric (default), seed=1", dict(group_size=128, method="autoround", seed=1)),
    (
        "AutoRound g128 symmetric, scale gradient through the rounding",
        dict(group_size=128, method="autoround", scale_gradient="ste"),
    ),
    (
        "AutoRound g128 symmetric, two windows a step",
        dict(group_size=128, method="autoround", batch_size=2),
    ),
    ("AutoRound g128 symmetric, 400 steps", dict(group_size=128, method="autoround", steps=400)),
    (
        "AutoRound g128 symmetric: GPTQ codes + end-to-end scales",
        dict(group_size=128, method="autoround", start="gptq", steps=0, end_to_end_epochs=4),
    ),
    (
        "AutoRound g128 symmetric: GPTQ codes + end-to-end scales, seed=1",
        dict(group_size=128, method="autoround", start="gptq", steps=0, end_to_end_epochs=4, seed=1),
    ),
    (
        "AutoRound g128 symmetric, fast preset + end-to-end scales at 1e-3",
        dict(group_size=128, method="autoround", config="fast", end_to_end_epochs=2, end_to_end_lr=1e-3),
    ),
]
# Calibrated rows also report the share of the same-format RTN row's perplexity increase they remove.
BASELINES = {
    "GPTQ g128 symmetric": "RTN g128 symmetric",
    "GPTQ g64 asymmetric": "RTN g64 asymmetric",
    "AutoRound g128 symmetric": "RTN g128 symmetric",
    "AutoRound g64 asymmetric": "RTN g64 asymmetric",
}


def main(words: list[str]) -> None:
    model, tokenizer = smollm2.load()
    graphdef, state = nnx.split(model)
    calib = tokenizer.encode(nm.eval_text("calib")).ids
    ids = tokenizer.encode(nm.eval_text("eval")).ids
    print(f"eval tokens: {len(ids)}, calibration tokens: {len(calib)}")
    print("| weights | perplexity | vs float | linear-layer MiB | quantization time |\n|---|---|---|---|---|")
    wanted = {name for name, _ in CONFIGS if not words or any(w in name for w in words)}
    wanted |= {"float"} | {b for g, b in BASELINES.items() if any(n.startswith(g) for n in wanted)}
    float_ppl = None
    results: dict[str, float] = {}
    for name, options in CONFIGS:
        if name not in wanted:
            continue
        m = nnx.merge(graphdef, state)
        mib, seconds = None, None
        if options is not None:
            if options.get("method") in ("gptq", "autoround"):
                options = dict(options, calibration=calib)
            start = time.perf_counter()
            m, report = nm.quantize(m, progress=False, return_report=True, **options)
            seconds = time.perf_counter() - start
            mib = report.bytes_after / 2**20
        ppl = nm.perplexity(m, ids)
        float_ppl = float_ppl or ppl
        results[name] = ppl
        delta = "" if options is None else f"{100 * (ppl / float_ppl - 1):+.1f}%"
        base = next((results[b] for g, b in BASELINES.items() if name.startswith(g)), None)
        if base is not None:
            delta += f"; removes {100 * (base - ppl) / (base - float_ppl):.0f}% of RTN's increase"
        size = "" if mib is None else f"{mib:.1f}"
        took = "" if seconds is None else f"{seconds:.0f} s"
        load = os.getloadavg()[0]
        print(f"| {name} | {ppl:.2f} | {delta} | {size} | {took} |  (load {load:.1f})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
