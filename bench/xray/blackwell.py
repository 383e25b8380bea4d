"""``python -m bench.xray --gpu b200``: the Blackwell W4A16 kernel compiled for sm_100a on a CPU.

Compiles nybble's tcgen05 kernel (``nybble.kernels.mosaic_gpu.blackwell``) and XLA's int4 path for a
deviceless B200 (``bench.kernel_xray.target`` with compute capability 10.0; ``target_arch`` makes Mosaic
emit sm_100a code on a machine whose default device is a CPU), and reads from the SASS: the main loop
(the conditional backward branch whose body issues the ``UTCHMMA``s), its instructions per weight (the
loop's instructions over the weights one thread dequantizes per pass: tile_n x tile_k / 128), registers,
spills, TMEM columns (the accumulator's allocation), launches per call. The model beside them (a model,
not a timing): HBM-bound = the call's bytes over 8 TB/s; issue-bound = the loop's summed stall counts
(one warp per scheduler, one CTA per SM: the cycles of a step) x steps x waves; tensor-bound = 2 M_pad N K
over the dense bf16 rate. The largest is the model's time.

The peer, tokamax's sm100 int4 ``ragged_dot``, is left out: see ``PEER_NOTE``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from bench.kernel_xray import sass as sass_mod

# Llama-3-8B / 70B projections and MoE experts (one expert's gate-up and down as a dense matmul: the
# grouped Blackwell kernel does not exist yet, so an expert's shape is what one group would run).
SHAPES: dict[str, tuple[int, int]] = {
    "llama3-8b-qo": (4096, 4096),
    "llama3-8b-kv": (4096, 1024),
    "llama3-8b-gate-up": (4096, 14336),
    "llama3-8b-down": (14336, 4096),
    "llama3-70b-qo": (8192, 8192),
    "llama3-70b-gate-up": (8192, 28672),
    "llama3-70b-down": (28672, 8192),
    "mixtral-expert-gate-up": (4096, 28672),
    "qwen3-30b-a3b-expert-gate-up": (2048, 1536),
    "qwen3-235b-expert-gate-up": (4096, 3072),
    "deepseek-v3-expert-gate-up": (7168, 4096),
    "deepseek-v3-expert-down": (2048, 7168),
}
DEFAULT_MS = (1, 16, 64, 2048)
PEER_NOTE = (
    "tokamax's sm100 int4 ragged_dot is not compiled here: bench/xray/peers.py builds tokamax's sm90 path "
    "(cases.tokamax_deviceless forces compute capability 9.0 in its deviceless process); wiring its sm100 "
    "path into the b200 X-ray was not attempted yet."
)
_MMA = re.compile(r"^UTC[A-Z]*MMA")
_BACK_BRANCH = re.compile(r"BRA(?:\.U)?\s+(?:!?U?P\d+,\s*)?`?\(?(?P<label>\.L_x_\d+)\)?`?")


@dataclasses.dataclass(frozen=True)
class Case:
    shape: str
    k: int
    n: int
    m: int
    group_size: int | None = 128
    symmetric: bool = True
    peer: str = "nybble:blackwell"

    @property
    def key(self) -> str:
        g = "col" if self.group_size is None else f"g{self.group_size}"
        return f"{self.shape}/M{self.m}/{g}-{'sym' if self.symmetric else 'asym'}/{self.peer}"


def build_cases(shapes: dict[str, tuple[int, int]], ms: Any, groups: Any, xla: bool = True) -> list[Case]:
    out = []
    for name, (k, n) in shapes.items():
        for m in ms:
            for group, symmetric in groups:
                out.append(Case(name, k, n, m, group, symmetric))
                if xla:
                    out.append(Case(name, k, n, m, group, symmetric, "nybble:xla"))
    return out


def tcgen05_loop(s: sass_mod.Sass) -> sass_mod.Loop | None:
    """The main loop: the conditional backward branch (``@P BRA`` or ``BRA.U UPn``) whose body, without an
    EXIT, holds the most tcgen05 MMAs (innermost on a tie)."""
    best = None
    for end, ins in enumerate(s.instructions):
        if ins.base_opcode != "BRA":
            continue
        conditional = ins.predicate is not None or re.search(r"BRA\.U\s+!?UP\d", ins.text)
        m = _BACK_BRANCH.search(ins.text)
        if not conditional or m is None or m["label"] not in s.labels:
            continue
        start = s.labels[m["label"]]
        if start > end:
            continue
        body = s.instructions[start : end + 1]
        if any(i.base_opcode == "EXIT" for i in body):
            continue
        mmas = sum(1 for i in body if _MMA.match(i.opcode))
        if mmas == 0:
            continue
        key = (mmas, -len(body))
        if best is None or key > best[0]:
            best = (key, sass_mod.Loop(start, end, body))
    return None if best is None else best[1]


def _program(case: Case) -> tuple[Any, tuple[Any, ...]]:
    import functools

    import jax
    import jax.numpy as jnp

    import nybble
    from nybble.kernels.mosaic_gpu.blackwell import blackwell_matmul

    quant = functools.partial(nybble.quantize, group_size=case.group_size, symmetric=case.symmetric)
    qw = jax.eval_shape(quant, jax.ShapeDtypeStruct((case.k, case.n), jnp.float32))
    x = jax.ShapeDtypeStruct((case.m, case.k), jnp.bfloat16)
    if case.peer == "nybble:xla":
        return functools.partial(nybble.matmul, implementation="xla"), (x, qw)
    return (lambda x, qw: blackwell_matmul(x, qw)), (x, qw)


def compile_case(case: Case, out: dict) -> None:
    """Compiles one case (in a process set up by the X-ray toolchain) and fills ``out``."""
    import tempfile

    from bench.kernel_xray import xray_compile
    from nybble.kernels.mosaic_gpu.blackwell import plan
    from nybble.kernels.mosaic_gpu.blackwell.target import target_arch

    fn, args = _program(case)
    with tempfile.TemporaryDirectory(prefix="nybble-xray-b200-") as tmp, target_arch(10, 0):
        report = xray_compile(fn, *args, gpu="b200", keep_dumps=Path(tmp))
        out["report"] = report.to_dict()
        if case.peer != "nybble:blackwell":
            return
        p = plan(case.m, args[1])
        c = p.config
        sass_files = sorted(Path(tmp).glob("*.sass_ctrl"))
        loop = tcgen05_loop(sass_mod.parse_sass(sass_files[0].read_text())) if sass_files else None
        weights_per_thread = c.tile_n * c.tile_k / 128
        out["plan"] = {
            "config": c.tag,
            "ctas": p.m_tiles * p.n_tiles,
            "k_steps": p.k_steps,
            "m_pad": p.m_tiles * c.tile_m,
            "tmem_columns": c.tmem_columns(),
        }
        if loop is not None:
            out["loop"] = {
                "instructions": loop.size,
                "mmas": sum(1 for i in loop.instructions if _MMA.match(i.opcode)),
                "stall_cycles": loop.stall_cycles,
                "instructions_per_weight": loop.size / weights_per_thread,
                "mix": loop.opcode_mix(12),
            }


def model(record: dict, gpu: Any) -> dict[str, Any]:
    """HBM-, issue- and tensor-bound times of one record (seconds) and the bound."""
    case = record["case"]
    launches = record["report"]["launches"]
    hbm = sum(sum(la["operand_bytes"].values()) + la["result_bytes"] for la in launches) / gpu.hbm_bytes_per_s
    times = {"hbm": hbm}
    plan, loop = record.get("plan"), record.get("loop")
    m_pad = plan["m_pad"] if plan else case["m"]
    times["tensor"] = 2 * m_pad * case["n"] * case["k"] / gpu.bf16_flops
    if plan and loop:
        waves = math.ceil(plan["ctas"] / gpu.sms)
        times["issue"] = loop["stall_cycles"] * plan["k_steps"] * waves / gpu.clock_hz
    bound = max(times, key=times.get)
    total = times[bound] + gpu.launch_s * max(0, len(launches) - 1)
    return {
        "times_us": {k: v * 1e6 for k, v in times.items()},
        "bound": bound,
        "model_us": total * 1e6,
        "hbm_fraction": hbm / total,
        "tensor_fraction": times["tensor"] / total,
    }


def main(ms: Any, groups: Any, shapes: Any, out: Path, jobs: int | None) -> int:
    from bench.kernel_xray import get_gpu
    from bench.xray.runner import run_cases

    gpu = get_gpu("b200")
    names = shapes or list(SHAPES)
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        print(
            f"python -m bench.xray --gpu b200: unknown shapes {unknown}; known: {sorted(SHAPES)}",
            file=sys.stderr,
        )
        return 2
    cases = build_cases({s: SHAPES[s] for s in names}, ms, groups)
    print(
        f"X-ray: {len(cases)} compiles for an {gpu.description} (sm_100a) on this CPU; a static view, not a "
        "timing.",
        file=sys.stderr,
    )
    records = run_cases(cases, gpu="b200", jobs=jobs, worker="bench.xray.blackwell_worker")
    rows = []
    for case in cases:
        r = records[case.key]
        row: dict[str, Any] = {"key": case.key, **dataclasses.asdict(case)}
        if "error" in r:
            row["error"] = r["error"]
        else:
            kernels = r["report"]["kernels"]
            row.update(
                launches=len(r["report"]["launches"]),
                registers=max((k["registers"] for k in kernels), default=None),
                spill_bytes=sum(k["spill_bytes"] for k in kernels),
                plan=r.get("plan"),
                loop=r.get("loop"),
                model=model(r, gpu),
            )
        rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    import jax

    result = {"gpu": vars(gpu), "jax": jax.__version__, "peer_note": PEER_NOTE, "rows": rows}
    tmp = out / "xray.json.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.rename(out / "xray.json")
    md = out / "xray.md.tmp"
    md.write_text(markdown(result))
    md.rename(out / "xray.md")
    print(markdown(result))
    return 1 if any("error" in r for r in rows) else 0


def markdown(result: dict) -> str:
    lines = [
        "# Kernel X-ray: NVIDIA B200 (sm_100a), compiled on a CPU without a GPU",
        "",
        f"jax {result['jax']}. A static view: SASS counts and a model, no timing. {result['peer_note']}",
        "",
        "| case | config | launches | regs | spills | TMEM cols | loop instr | UTCHMMA | instr/weight | "
        "model bound | model us | % HBM | % bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['key']} | error: {r['error'][:120]} |" + " |" * 11)
            continue
        plan, loop, mdl = r.get("plan") or {}, r.get("loop") or {}, r["model"]
        ipw = f"{loop['instructions_per_weight']:.2f}" if loop else "-"
        lines.append(
            f"| {r['key']} | {plan.get('config', '-')} | {r['launches']} | {r['registers'] or '-'} | "
            f"{r['spill_bytes']} | {plan.get('tmem_columns', '-')} | {loop.get('instructions', '-')} | "
            f"{loop.get('mmas', '-')} | {ipw} | {mdl['bound']} | {mdl['model_us']:.1f} | "
            f"{100 * mdl['hbm_fraction']:.0f} | {100 * mdl['tensor_fraction']:.0f} |"
        )
    return "\n".join(lines) + "\n"
