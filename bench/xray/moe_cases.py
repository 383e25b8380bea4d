"""The X-ray of the grouped (mixture-of-experts) kernel at the MoE shapes of issue 36.

``python -m bench.xray.moe_cases`` compiles, for an H200 on this CPU, one case per distinct grouped
kernel the heuristics pick (``grouped_config.grouped_heuristic_config``) at the MoE shapes below, for
every tokens-per-step value, both projections (gate and up: K = hidden, N = expert intermediate; down:
K = intermediate, N = hidden) and g128 symmetric and asymmetric; ``--all`` compiles every case;
``--xla-peers`` adds the XLA programs bench/moe.py times beside it (``XLA_PEERS``: launches and bytes).
Rows are X-ray rows (bench/xray/report.py) keyed ``moe/<shape>-<proj>/T<tokens>/<quant>/<peer>``, M being
the grouped matmul's rows (tokens x top-k). ``--check`` compares with the MoE rows of
bench/xray_baseline.json, ``--update-baseline`` adds or refreshes them there (the dense rows untouched).

A kernel picked for both symmetric and asymmetric groups is compiled asymmetric only, as the dense gate
does (bench/xray/cases.py: the same code plus the offsets), except where the symmetric one folds the bias
into WGMMA (other code, ``config.folds_bias``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.xray import launch

MOSAIC = "nybble:mosaic_gpu"
# The XLA programs beside the kernel (bench/moe.py times the same ones): launches and bytes, no main loop.
# Their bytes are every operand of every launch in full (bench/xray/model.py), a gather's whole expert stack
# included, where the GPU reads the gathered experts only: an upper bound at decode.
NYBBLE_XLA = "nybble:xla"  # nybble.ragged_matmul(..., implementation="xla")
RAGGED_BF16 = "xla:ragged_dot-bf16"  # jax.lax.ragged_dot on the bf16 expert stack
RAGGED_DEQ_INT4 = "xla:ragged_dot-deq-int4"  # the int4 stack dequantized to bf16, then ragged_dot
XLA_PEERS = (NYBBLE_XLA, RAGGED_BF16, RAGGED_DEQ_INT4)
# name: (hidden, expert intermediate, experts, top-k). DeepSeek-V3's shared expert is a dense matmul.
MOE_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "gpt-oss-120b": (2880, 2880, 128, 4),
}
TOKENS = (1, 8, 64, 512, 4096)
PROJECTIONS = ("gate", "down")  # gate and up have the same shape
GROUPS: tuple[tuple[int | None, bool], ...] = ((128, True), (128, False))
DECODE_TOKENS = (1, 8, 64)  # the static goal's regime: <= 2.0 instructions per weight


@dataclasses.dataclass(frozen=True)
class MoeCase:
    """One grouped matmul: ``m`` = tokens x top-k rows of x over ``experts`` (K, N) weights."""

    shape: str  # "<model>-<projection>"
    k: int
    n: int
    m: int
    experts: int
    tokens: int
    group_size: int | None = 128
    symmetric: bool = True
    peer: str = MOSAIC

    @property
    def key(self) -> str:
        group = "col" if self.group_size is None else f"g{self.group_size}"
        quant = f"{group}-{'sym' if self.symmetric else 'asym'}"
        return f"moe/{self.shape}/T{self.tokens}/{quant}/{self.peer}"


def problems(
    shapes: dict[str, tuple[int, int, int, int]] = MOE_SHAPES, tokens: tuple[int, ...] = TOKENS
) -> list[tuple[str, int, int, int, int, int]]:
    """(shape name, tokens, rows, experts, K, N) of every grouped matmul of the MoE layers."""
    out = []
    for name, (hidden, inter, experts, top_k) in shapes.items():
        for t, proj in itertools.product(tokens, PROJECTIONS):
            k, n = (hidden, inter) if proj == "gate" else (inter, hidden)
            out.append((f"{name}-{proj}", t, t * top_k, experts, k, n))
    return out


def build_cases(
    shapes: dict[str, tuple[int, int, int, int]] = MOE_SHAPES,
    tokens: tuple[int, ...] = TOKENS,
    groups: tuple[tuple[int | None, bool], ...] = GROUPS,
) -> list[MoeCase]:
    return [
        MoeCase(name, k, n, rows, experts, t, g, sym)
        for (name, t, rows, experts, k, n), (g, sym) in itertools.product(problems(shapes, tokens), groups)
    ]


@functools.cache
def abstract_weight(experts: int, k: int, n: int, group_size: int | None, symmetric: bool) -> Any:
    """The stacked QuantizedWeight of ``experts`` (K, N) weights, as ShapeDtypeStructs."""
    import jax
    import jax.numpy as jnp

    import nybble

    quantize = functools.partial(nybble.quantize, group_size=group_size, symmetric=symmetric)
    qw = jax.eval_shape(quantize, jax.ShapeDtypeStruct((k, n), jnp.float32))
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((experts, *a.shape), a.dtype), qw)


def program(case: MoeCase) -> tuple[Any, tuple[Any, ...]]:
    """(function, abstract arguments): the grouped kernel, or an XLA peer (``XLA_PEERS``), as a user would
    jit it."""
    import jax
    import jax.numpy as jnp

    import nybble
    from nybble.kernels.mosaic_gpu.grouped import grouped_matmul

    x = jax.ShapeDtypeStruct((case.m, case.k), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((case.experts,), jnp.int32)
    qw = abstract_weight(case.experts, case.k, case.n, case.group_size, case.symmetric)
    if case.peer == MOSAIC:
        return grouped_matmul, (x, qw, sizes)
    if case.peer == NYBBLE_XLA:
        return (lambda x, qw, s: nybble.ragged_matmul(x, qw, s, implementation="xla")), (x, qw, sizes)
    if case.peer == RAGGED_BF16:
        w = jax.ShapeDtypeStruct((case.experts, case.k, case.n), jnp.bfloat16)
        return jax.lax.ragged_dot, (x, w, sizes)
    if case.peer == RAGGED_DEQ_INT4:
        dequantized = lambda x, qw, s: jax.lax.ragged_dot(x, nybble.dequantize(qw, jnp.bfloat16), s)
        return dequantized, (x, qw, sizes)
    raise ValueError(f"moe_cases: unknown peer {case.peer!r} (one of {(MOSAIC, *XLA_PEERS)})")


def kernel_key(case: MoeCase, num_sms: int) -> tuple[Any, Any, bool]:
    """(config, how groups meet the K step, symmetric): what the kernel's code depends on."""
    from bench.xray.heuristic_cases import group_structure
    from nybble.kernels.mosaic_gpu.grouped import grouped_plan

    qw = abstract_weight(case.experts, case.k, case.n, case.group_size, case.symmetric)
    p, _ = grouped_plan(case.m, qw, num_sms=num_sms)
    return p.config, group_structure(p.group, p.config), case.symmetric


def distinct_kernels(cases: list[MoeCase], num_sms: int) -> list[MoeCase]:
    """One case per distinct kernel; symmetric twins of asymmetric kernels left out (module docstring)."""
    from bench.xray.cases import is_twin

    seen: dict[tuple[Any, ...], MoeCase] = {}
    for case in cases:
        seen.setdefault(kernel_key(case, num_sms), case)
    asymmetric = {key[:2] for key in seen if not key[2]}
    return [c for key, c in seen.items() if not is_twin(key, asymmetric)]


def kernel_plan(case: MoeCase, num_sms: int, *, swiglu: bool = False) -> dict[str, Any]:
    """The launch as the X-ray's model reads it, for the balanced grouping the config was chosen for
    (``grouped_config.planned_rows`` rows on each of ``active_experts``): the CTAs that work, the weights
    they dequantize, M as the tensor cores see it, the experts whose weights it reads; ``grid`` is the
    launch's CTAs (the bound on tiles). ``swiglu``: the kernel with the SwiGLU epilogue, its heuristics'
    pick (``grouped_swiglu.py``)."""
    from nybble.kernels.mosaic_gpu.grouped import grouped_plan
    from nybble.kernels.mosaic_gpu.grouped_config import active_experts, planned_rows
    from nybble.kernels.mosaic_gpu.grouped_swiglu import grouped_swiglu_plan

    qw = abstract_weight(case.experts, case.k, case.n, case.group_size, case.symmetric)
    planner = grouped_swiglu_plan if swiglu else grouped_plan
    p, work = planner(case.m, qw, num_sms=num_sms)
    c = p.config
    active = active_experts(case.m, case.experts)
    rows = planned_rows(case.m, case.experts)
    m_tiles = active * c.m_tiles(rows)
    return {
        "config": dataclasses.asdict(c),
        "m_pad": m_tiles * c.wgmma_n,
        "m_tiles": m_tiles,
        "ctas": m_tiles * p.n_tiles,
        "grid": work.ctas(p),
        "threads": launch.threads(p),
        "weight_bytes_in_flight": launch.steps_in_flight(p) * launch.weight_bytes_per_step(p),
        # Of W: a partial last K step dequantizes its zero-filled rows too (config.runs_past_k).
        "dequantized_weights": active * c.dequantized_weights(rows, p.n_pad, p.k_pad),
        "experts": case.experts,
        "active_experts": active,  # the weights it reads (bench/xray/model.read_bytes)
    }


def worker_main() -> int:
    """The compiling side (``python -m bench.xray.moe_worker GPU``, bench/xray/worker.py's protocol)."""
    from bench.kernel_xray import get_gpu, xray_compile
    from bench.xray.worker import serve

    gpu = get_gpu(sys.argv[2] if len(sys.argv) > 2 else "h200")

    def compile_case(case: MoeCase, out: dict) -> None:
        fn, args = program(case)
        out["report"] = xray_compile(fn, *args, gpu=gpu.name).to_dict()
        if case.peer == MOSAIC:  # an XLA program has no kernel plan (launches and bytes only)
            out["plan"] = kernel_plan(case, gpu.sms)

    return serve(lambda d: MoeCase(**d), compile_case)


def update_baseline(rows: list[dict[str, Any]], path: Path | None = None) -> Path:
    """Adds (or refreshes) the MoE rows' entries in the X-ray baseline; every other entry is kept as is."""
    from bench.xray import report

    path = path or report.BASELINE_PATH
    data = json.loads(path.read_text())
    data["cases"].update(report.baseline_entries(rows))
    data["cases"] = dict(sorted(data["cases"].items()))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main()
    p = argparse.ArgumentParser(prog="python -m bench.xray.moe_cases", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=list(MOE_SHAPES), default=list(MOE_SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--all", action="store_true", help="every case, not one per distinct kernel")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="folder for xray.json / xray.md")
    p.add_argument("--check", action="store_true", help="exit 1 on a regression against the baseline")
    p.add_argument("--update-baseline", action="store_true")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument(
        "--xla-peers",
        action="store_true",
        help=f"also compile {', '.join(XLA_PEERS)} at every case's shape (g128 symmetric only)",
    )
    args = p.parse_args(argv)
    from bench.kernel_xray import get_gpu
    from bench.xray import model, report
    from bench.xray.runner import run_cases

    gpu = get_gpu("h200")
    cases = build_cases({s: MOE_SHAPES[s] for s in args.shapes}, tuple(args.tokens))
    peer_cases = [
        dataclasses.replace(c, peer=peer)
        for c in cases
        for peer in (XLA_PEERS if args.xla_peers and c.symmetric else ())
    ]
    if not args.all:
        cases = distinct_kernels(cases, gpu.sms)
    if args.list:
        for c in cases:
            print(c.key, report.short_config(dataclasses.asdict(kernel_key(c, gpu.sms)[0])))
        return 0
    started = time.time()
    records = run_cases(cases + peer_cases, gpu=gpu.name, jobs=args.jobs, worker="bench.xray.moe_worker")
    ceilings = model.ceilings_for(gpu)
    models = {k: model.model_case(r, gpu, ceilings) for k, r in records.items() if "error" not in r}
    rows = report.build_rows(records, models)
    print(report.table(rows))
    if args.out:
        import jax

        from bench.xray.provenance import source_commit

        result = {
            "schema": report.SCHEMA,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "commit": source_commit(),
            "versions": {"jax": jax.__version__},
            "gpu": dict(vars(gpu)),
            "ceilings": vars(ceilings),
            "model": model.__doc__,
            "rows": rows,
            "elapsed_s": round(time.time() - started, 1),
        }
        files = report.write_outputs(result, args.out)
        print(f"wrote {', '.join(map(str, files))}")
    if args.update_baseline:
        print(f"baseline updated: {update_baseline(rows)}")
    problems_found = report.check_against_baseline(rows, report.load_baseline()) if args.check else []
    for problem in problems_found:
        print(f"  {problem}")
    errors = [r for r in rows if "error" in r]
    return 1 if problems_found or errors else 0


if __name__ == "__main__":
    sys.exit(main())
