"""``python -m bench.xray --gpu b200``: the Blackwell W4A16 kernel compiled for sm_100a on a CPU.

Compiles nybble's tcgen05 kernel (``nybble.kernels.mosaic_gpu.blackwell``) and XLA's int4 path for a
deviceless B200 (``bench.kernel_xray.target`` with compute capability 10.0; ``target_arch`` makes Mosaic
emit sm_100a code on a machine whose default device is a CPU), and reads from the SASS the K loop of each
of the kernel's roles (:func:`kernel_loops`: each dequantizing warpgroup's, each MMA warp's, the TMA
warp's), their instructions per weight (every warp's loop counted once per warp running it, over the
weights of a step: 4 warps x tile_n x tile_k / 128 a thread; two dequantizing warpgroups take alternate
steps, each loop turn over a step's weights; the dequantizing loops' alone beside it),
registers, spills, TMEM columns (the kernel's allocation), launches per call. The model beside them (a
model, not a timing): HBM-bound = the call's bytes over 8 TB/s; issue-bound = the cycles of a step (an SM
scheduler issues its dequantizing warp's loop and the issue warp beside it, one instruction a cycle, and
no warp beats its own stall counts; one CTA per SM) x steps x waves; tensor-bound = the busiest SM's MMAs
(waves x a CTA's 2 tile_n tile_m K / S) at its share of the dense bf16 rate (XLA's and the peer's launches,
whose grids the model does not read: 2 M N K over the whole GPU's rate). The largest is the model's time;
``% bf16`` is the call's 2 M N K at the bf16 rate over it.

The MoE rows (``moe/<model>-<projection>/T<tokens>/...``, the grouped kernel
``blackwell_grouped_matmul`` against ``nybble.ragged_matmul``'s XLA path) are one grouped matmul of tokens x
top-k rows at the MoE shapes of bench/xray/moe_cases.py (gate: K = hidden, N = expert intermediate; down:
the reverse), modelled for the balanced grouping the config is chosen for (``planned_rows`` rows on each of
``active_experts``): the CTAs that work, and HBM bytes of x, y and the active experts' weights only (an
expert without rows is never read). The XLA path's bytes are its launches' operands in full, the whole
expert stack included: an upper bound at decode.

The MoE rows' peer is tokamax's sm100 int4 ``ragged_dot`` (``tokamax:sm100``, symmetric groups only): see
``PEER_NOTE`` for how it is compiled and modelled.
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
# The MoE models of issue 45 (bench/xray/moe_cases.MOE_SHAPES' names) and tokens per step: decode and prefill.
MOE_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")
MOE_TOKENS = (1, 8, 64, 512)
B200_SMS = 148
TOKAMAX = "tokamax:sm100"  # tokamax's sm100 int4 ragged_dot (Mosaic GPU, tcgen05): MoE rows, symmetric groups
PEER_NOTE = (
    "MoE peer: tokamax's sm100 int4 ragged_dot (tokamax:sm100; bench/xray/peer_tools' tokamax, its own "
    "heuristic config, compute capability 10.0 and a B200's 148 SMs forced in its deviceless process), "
    "symmetric groups only (it has no zero points). Its model time, like nybble:xla's, counts every launch's "
    "operands in full, the whole expert stack included: an upper bound at decode, where nybble:blackwell "
    "counts the active experts' weights only; compare launches, registers and spills as compiled."
)
_MMA = re.compile(r"^UTC[A-Z]*MMA")
# The A operand's stores: STSM into SMEM, or tcgen05.st of packed pairs (16x128b) into TMEM (the fold's
# f32 total goes by 32x32b, its zeroing by 16x256b).
_A_STORE = re.compile(r"^(STSM|STTM\.16dp128bit)")
_TMA = re.compile(r"^UTMALDG")
_BAR_SYNC = re.compile(r"^BAR\.SYNC")
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
    experts: int = 0  # > 0: a grouped matmul of m rows over this many (K, N) experts
    tokens: int = 0  # the MoE rows' tokens (m = tokens x top-k)

    @property
    def key(self) -> str:
        g = "col" if self.group_size is None else f"g{self.group_size}"
        quant = f"{g}-{'sym' if self.symmetric else 'asym'}"
        if self.experts:
            return f"moe/{self.shape}/T{self.tokens}/{quant}/{self.peer}"
        return f"{self.shape}/M{self.m}/{quant}/{self.peer}"


def build_cases(shapes: dict[str, tuple[int, int]], ms: Any, groups: Any, xla: bool = True) -> list[Case]:
    out = []
    for name, (k, n) in shapes.items():
        for m in ms:
            for group, symmetric in groups:
                out.append(Case(name, k, n, m, group, symmetric))
                if xla:
                    out.append(Case(name, k, n, m, group, symmetric, "nybble:xla"))
    return out


def build_moe_cases(
    models: Any, tokens: Any, groups: Any, xla: bool = True, tokamax: bool = False
) -> list[Case]:
    """The grouped matmuls of ``models``' MoE layers (bench/xray/moe_cases.problems) for each tokens count."""
    from bench.xray.moe_cases import MOE_SHAPES, problems

    out = []
    for name, t, rows, experts, k, n in problems({m: MOE_SHAPES[m] for m in models}, tuple(tokens)):
        for group, symmetric in groups:
            out.append(Case(name, k, n, rows, group, symmetric, experts=experts, tokens=t))
            if xla:
                out.append(Case(name, k, n, rows, group, symmetric, "nybble:xla", experts, t))
            if tokamax and symmetric and group is not None:  # tokamax has no zero points
                out.append(Case(name, k, n, rows, group, symmetric, TOKAMAX, experts, t))
    return out


def _loops(s: sass_mod.Sass) -> list[sass_mod.Loop]:
    """Every backward branch whose body holds no EXIT: conditional (``@P BRA``, ``BRA.U UPn``) or not (a
    rotated loop leaves by a conditional branch forward and closes with a plain ``BRA`` back)."""
    loops = []
    for end, ins in enumerate(s.instructions):
        if ins.base_opcode != "BRA":
            continue
        m = _BACK_BRANCH.search(ins.text)
        if m is None or m["label"] not in s.labels:
            continue
        start = s.labels[m["label"]]
        body = s.instructions[start : end + 1]
        if start <= end and not any(i.base_opcode == "EXIT" for i in body):
            loops.append(sass_mod.Loop(start, end, body))
    return loops


def _count(loop: sass_mod.Loop, pattern: re.Pattern) -> int:
    return sum(1 for i in loop.instructions if pattern.match(i.opcode))


def _innermost(loops: list[sass_mod.Loop]) -> list[sass_mod.Loop]:
    """The loops that contain no other of ``loops``."""
    return [a for a in loops if not any(b is not a and a.start <= b.start and b.end <= a.end for b in loops)]


@dataclasses.dataclass(frozen=True)
class RoleLoop:
    """One role's K loop, per step: instructions, summed stall counts, and its body (for the mix)."""

    instructions: float
    stall_cycles: float
    mmas: float
    body: sass_mod.Loop
    barriers: float = 0.0  # warpgroup barriers (BAR.SYNC): each waits for the warpgroup's 4 warps

    @classmethod
    def of(cls, loop: sass_mod.Loop, steps: int = 1) -> RoleLoop:
        """``loop`` spanning ``steps`` K steps (more than 1 where the compiler unrolled them)."""
        return cls(
            loop.size / steps,
            loop.stall_cycles / steps,
            _count(loop, _MMA) / steps,
            loop,
            _count(loop, _BAR_SYNC) / steps,
        )


@dataclasses.dataclass(frozen=True)
class KernelLoops:
    """The warp-specialized kernel's K loops, one per role: each dequantizing warpgroup's (4 warps: the
    loop that stores the A operand, ``STSM`` or ``STTM``; two at decode tiles, by turns), each MMA
    warp's (one warp: ``UTCHMMA``, no stores), and the TMA warp's (one warp: ``UTMALDG``). Where the
    compiler unrolled a role's short K loop (``straight_line``), its stretch from the wait before its first
    step to its last store, MMA or copy, over the steps (with two alternating dequantizing warpgroups, the
    first one's turns); unrolled MMA warps count as one (an upper bound on the issue beside a dequantizing
    warp)."""

    dequant: tuple[RoleLoop, ...]
    mma: tuple[RoleLoop, ...]
    tma: float
    straight_line: bool = False
    # K steps between two turns of a dequantizing loop: 2 where two warpgroups take alternate steps
    # (each loop turn then dequantizes a whole step, and runs every other step).
    dequant_every: int = 1

    def per_step(self, weights_per_thread: float) -> dict[str, Any]:
        """The loop record of one K step: instructions per weight over all the CTA's warps (each role's
        loop times the warps running it, a dequantizing loop over the steps between its turns, over the
        weights a warpgroup's thread would dequantize alone: ``weights_per_thread``), the dequantizing
        loops' alone, and the cycles of a step: a warp's loop needs its stall counts (a dequantizing warp's
        spread over the steps between its turns), and an SM scheduler issues one instruction a cycle for
        the dequantizing warps and the issue warp it holds (warp w of every warpgroup runs on scheduler
        w % 4)."""
        turns = [loop.instructions for loop in self.dequant]
        label = " + ".join(f"{round(t, 1):g}" for t in turns)
        if self.dequant_every == 2:
            # Alternating warpgroups: each step is one turn of one of them, the same code (a warpgroup whose
            # few turns the compiler unrolled takes the other's loop as its turn).
            dq = sum(turns) / len(turns)
            if len(turns) == 2:
                label += " (alternate steps)"
            else:  # the turns of one or both unrolled
                both = self.dequant[0].body.straight_line
                label += " (alternate steps, " + ("unrolled)" if both else "one unrolled)")
        else:
            dq = sum(turns)
        issue = [loop.instructions for loop in self.mma] + [self.tma]
        own = [loop.stall_cycles / self.dequant_every for loop in self.dequant]
        own += [loop.stall_cycles for loop in self.mma]
        cycles = max(*own, dq + max(issue))
        return {
            "instructions": label,
            "dequant_warpgroups": len(self.dequant),
            "issue_instructions": [round(i, 1) for i in issue],
            "mmas": round(sum(loop.mmas for loop in self.mma)),
            "warpgroup_barriers": [round(loop.barriers, 1) for loop in self.dequant],
            "stall_cycles": round(cycles, 1),
            "instructions_per_weight": (dq + sum(issue) / 4) / weights_per_thread,
            "dequant_instructions_per_weight": dq / weights_per_thread,
            "straight_line": self.straight_line,
            "mix": self.dequant[0].body.opcode_mix(12),
        }


def _unrolled(s: sass_mod.Sass, pattern: re.Pattern) -> sass_mod.Loop | None:
    """The stretch of unrolled steps of one role: from the last barrier wait before its first ``pattern``
    instruction to its last."""
    return sass_mod.unrolled_stretch(s, lambda ins: bool(pattern.match(ins.opcode)), from_start=False)


def _first_warpgroups_turns(s: sass_mod.Sass, k_steps: int) -> RoleLoop | None:
    """Alternating dequantizing warpgroups, every turn unrolled: the first warpgroup's (its code comes
    first, its ceil(K steps / 2) turns hold that share of the stores), from the wait before its first store
    to its last, over its turns; not its fold and epilogue after them."""
    stores = [i for i, ins in enumerate(s.instructions) if _A_STORE.match(ins.opcode)]
    turns = -(-k_steps // 2)
    if not stores or len(stores) * turns % k_steps:
        return None
    last = stores[len(stores) * turns // k_steps - 1]
    start = _unrolled(s, _A_STORE).start
    body = tuple(s.instructions[start : last + 1])
    return RoleLoop.of(sass_mod.Loop(start, last, body, straight_line=True), turns)


def kernel_loops(s: sass_mod.Sass, k_steps: int, dequant_every: int = 1) -> KernelLoops | None:
    """The K loops of nybble's Blackwell kernel (``blackwell/kernel.py``'s roles): the innermost loops
    with the most A stores (one per dequantizing warpgroup; ``dequant_every``: 2 where two take alternate
    steps), the innermost loops issuing ``UTCHMMA`` without storing, and the TMA warp's copies;
    barrier-wait retry loops hold none of these. A role whose steps the compiler unrolled (a short K
    loop) counts its unrolled stretch over the steps (every warpgroup's, where they alternate)."""
    loops = _loops(s)
    unrolled = False
    stores = _innermost([loop for loop in loops if _count(loop, _A_STORE)])
    if stores:
        most = max(_count(loop, _A_STORE) for loop in stores)
        dequant = tuple(RoleLoop.of(loop) for loop in stores if _count(loop, _A_STORE) == most)
    elif dequant_every == 2 and (turns := _first_warpgroups_turns(s, k_steps)) is not None:
        dequant, unrolled = (turns,), True
    elif (stretch := _unrolled(s, _A_STORE)) is not None:  # every step, over the steps
        dequant, unrolled = (RoleLoop.of(stretch, k_steps),), True
    else:
        return None
    mma_loops = _innermost([loop for loop in loops if _count(loop, _MMA) and not _count(loop, _A_STORE)])
    if mma_loops:
        mma = tuple(RoleLoop.of(loop) for loop in sorted(mma_loops, key=lambda loop: loop.start))
    elif (stretch := _unrolled(s, _MMA)) is not None:
        mma, unrolled = (RoleLoop.of(stretch, k_steps),), True
    else:
        return None
    tma_loops = _innermost(
        [loop for loop in loops if _count(loop, _TMA) and not (_count(loop, _A_STORE) or _count(loop, _MMA))]
    )
    if tma_loops:
        tma = float(sum(loop.size for loop in tma_loops))
    else:
        stretch = _unrolled(s, _TMA)
        tma = stretch.size / k_steps if stretch is not None else 0.0
    return KernelLoops(dequant, mma, tma, unrolled, dequant_every)


def _program(case: Case) -> tuple[Any, tuple[Any, ...]]:
    import functools

    import jax
    import jax.numpy as jnp

    import nybble
    from nybble.kernels.mosaic_gpu.blackwell import blackwell_matmul

    if case.experts:
        from bench.xray.moe_cases import abstract_weight
        from nybble.kernels.mosaic_gpu.blackwell import blackwell_grouped_matmul

        qw = abstract_weight(case.experts, case.k, case.n, case.group_size, case.symmetric)
        args = (
            jax.ShapeDtypeStruct((case.m, case.k), jnp.bfloat16),
            qw,
            jax.ShapeDtypeStruct((case.experts,), jnp.int32),
        )
        if case.peer == "nybble:xla":
            return (lambda x, qw, s: nybble.ragged_matmul(x, qw, s, implementation="xla")), args
        if case.peer == TOKAMAX:
            return tokamax_program(case)
        return blackwell_grouped_matmul, args
    quant = functools.partial(nybble.quantize, group_size=case.group_size, symmetric=case.symmetric)
    qw = jax.eval_shape(quant, jax.ShapeDtypeStruct((case.k, case.n), jnp.float32))
    x = jax.ShapeDtypeStruct((case.m, case.k), jnp.bfloat16)
    if case.peer == "nybble:xla":
        return functools.partial(nybble.matmul, implementation="xla"), (x, qw)
    return (lambda x, qw: blackwell_matmul(x, qw)), (x, qw)


def tokamax_sm100_deviceless(num_sms: int) -> None:
    """Makes tokamax pick its sm100 kernels in a process whose default device is the CPU (as
    ``cases.tokamax_deviceless`` does for sm90): its capability check answers 10.0, and its int4 kernels'
    grid reads the SM count of a B200."""
    import types

    from tokamax._src import gpu_utils
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_kernel_sm100_quant as quant
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_kernel_sm100_quant_post_scale as post_scale

    gpu_utils._compute_capability = lambda device=None: 10.0
    device = types.SimpleNamespace(core_count=num_sms)
    for module in (quant, post_scale):
        module.backend = types.SimpleNamespace(get_default_device=lambda: device)


def tokamax_program(case: Case) -> tuple[Any, tuple[Any, ...]]:
    """``tokamax.ragged_dot(x, QArray(int4 codes, bf16 scales), group_sizes)`` on ``case.experts`` (K, N)
    weights, its heuristic config (bench/xray/cases.tokamax_program's call, M = the case's rows)."""
    from bench.xray import cases

    tokamax_sm100_deviceless(B200_SMS)
    # cases.Case's rows are m x top_k: m rows as one token each routed to one expert.
    peer = cases.Case(cases.TOKAMAX, "moe", case.k, case.n, case.m, case.group_size, True, case.experts, 1)
    return cases.tokamax_program(peer)


def compile_case(case: Case, out: dict) -> None:
    """Compiles one case (in a process set up by the X-ray toolchain) and fills ``out``."""
    import tempfile

    from bench.kernel_xray import xray_compile
    from nybble.kernels.mosaic_gpu.blackwell.target import target_arch

    fn, args = _program(case)
    with tempfile.TemporaryDirectory(prefix="nybble-xray-b200-") as tmp, target_arch(10, 0):
        report = xray_compile(fn, *args, gpu="b200", keep_dumps=Path(tmp))
        out["report"] = report.to_dict()
        if case.peer != "nybble:blackwell":
            return
        out["plan"] = grouped_plan_record(case, args[1]) if case.experts else dense_plan_record(case, args[1])
        sass_files = sorted(Path(tmp).glob("*.sass_ctrl"))
        plan = out["plan"]
        sass = sass_mod.parse_sass(sass_files[0].read_text()) if sass_files else None
        loops = kernel_loops(sass, plan["k_steps"], plan["dequant_every"]) if sass is not None else None
        if loops is not None:
            out["loop"] = loops.per_step(plan["weights_per_thread"])


def dense_plan_record(case: Case, qw: Any) -> dict[str, Any]:
    """The dense kernel's launch as the model reads it."""
    from nybble.kernels.mosaic_gpu.blackwell import plan
    from nybble.kernels.mosaic_gpu.blackwell.kernel import dequant_warpgroups

    p = plan(case.m, qw)
    c = p.config
    return {
        "config": c.tag,
        "ctas": p.m_tiles * p.n_tiles,
        "k_steps": p.k_steps,
        "m_pad": p.m_tiles * c.tile_m,
        "cta_mma_flops": 2 * c.tile_n * c.tile_m * p.slice_k,
        "tmem_columns": p.tmem_columns,
        "weights_per_thread": c.tile_n * c.tile_k / 128,
        "dequant_every": dequant_warpgroups(p),
    }


def grouped_plan_record(case: Case, qw: Any) -> dict[str, Any]:
    """The grouped kernel's launch for the balanced grouping its config is chosen for: the CTAs that work
    (``grid``: the launch's, the bound on M tiles), M as the tensor cores see it, and the bytes it reads
    (x, y and the active experts' weights)."""
    import numpy as np

    from nybble.kernels.mosaic_gpu.blackwell.grouped import grouped_plan
    from nybble.kernels.mosaic_gpu.blackwell.kernel import dequant_warpgroups
    from nybble.kernels.mosaic_gpu.grouped_config import active_experts, planned_rows

    p, work = grouped_plan(case.m, qw)
    c = p.config
    active = active_experts(case.m, case.experts)
    m_tiles = active * c.m_tiles(planned_rows(case.m, case.experts))
    per_expert = sum(
        int(np.prod(a.shape[1:])) * np.dtype(a.dtype).itemsize
        for a in (qw.codes, qw.scales, qw.offsets)
        if a is not None
    )
    return {
        "config": c.tag,
        "ctas": m_tiles * p.n_tiles,
        "grid": work.ctas(p),
        "k_steps": p.k_steps,
        "m_pad": m_tiles * c.tile_m,
        "cta_mma_flops": 2 * c.tile_n * c.tile_m * p.slice_k,
        "tmem_columns": p.tmem_columns,
        "weights_per_thread": c.tile_n * c.tile_k / 128,
        "dequant_every": dequant_warpgroups(p),
        "active_experts": active,
        "read_bytes": active * per_expert + 2 * case.m * (case.k + case.n),
    }


def model(record: dict, gpu: Any) -> dict[str, Any]:
    """HBM-, issue- and tensor-bound times of one record (seconds) and the bound."""
    case = record["case"]
    launches = record["report"]["launches"]
    plan, loop = record.get("plan"), record.get("loop")
    if plan and "read_bytes" in plan:  # the grouped kernel: the active experts' weights only
        hbm = plan["read_bytes"] / gpu.hbm_bytes_per_s
    else:
        hbm = sum(sum(la["operand_bytes"].values()) + la["result_bytes"] for la in launches)
        hbm /= gpu.hbm_bytes_per_s
    times = {"hbm": hbm}
    useful = 2 * case["m"] * case["n"] * case["k"] / gpu.bf16_flops  # the call's flops, nothing padded
    times["tensor"] = useful
    if plan:
        # The busiest SM's MMAs: an SM runs one CTA at a time (TMEM, SMEM), each over its whole tile.
        waves = math.ceil(plan["ctas"] / gpu.sms)
        times["tensor"] = waves * plan["cta_mma_flops"] / (gpu.bf16_flops / gpu.sms)
        if loop:
            times["issue"] = loop["stall_cycles"] * plan["k_steps"] * waves / gpu.clock_hz
    bound = max(times, key=times.get)
    total = times[bound] + gpu.launch_s * max(0, len(launches) - 1)
    return {
        "times_us": {k: v * 1e6 for k, v in times.items()},
        "bound": bound,
        "model_us": total * 1e6,
        "hbm_fraction": hbm / total,
        "tensor_fraction": useful / total,
    }


def main(ms: Any, groups: Any, shapes: Any, out: Path, jobs: int | None) -> int:
    from bench.kernel_xray import get_gpu
    from bench.xray.runner import run_cases

    gpu = get_gpu("b200")
    names = [s for s in shapes or list(SHAPES) if s not in MOE_MODELS]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        print(
            f"python -m bench.xray --gpu b200: unknown shapes {unknown}; known: {sorted(SHAPES)}",
            file=sys.stderr,
        )
        return 2
    cases = build_cases({s: SHAPES[s] for s in names}, ms, groups)
    models = [m for m in MOE_MODELS if shapes is None or m in shapes]
    cases += build_moe_cases(models, MOE_TOKENS, groups, tokamax=True)
    print(
        f"X-ray: {len(cases)} compiles for an {gpu.description} (sm_100a) on this CPU; a static view, not a "
        "timing.",
        file=sys.stderr,
    )
    env = None
    if any(c.peer == TOKAMAX for c in cases):
        from bench.xray import peer_tools

        env = peer_tools.environment_site_env()
    records = run_cases(cases, gpu="b200", jobs=jobs, worker="bench.xray.blackwell_worker", extra_env=env)
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
        "dequant loop: each dequantizing warpgroup's K loop, instructions a turn (a step; \"alternate "
        "steps\": two warpgroups take turns, one a step, and a step costs one turn); BAR.SYNC: its warpgroup "
        "barriers a turn (each waits for the warpgroup's 4 warps).",
        "",
        "model: the largest of HBM (the call's bytes at 8 TB/s), issue (the busiest SM's steps at the loops' "
        "cycles) and tensor (nybble's rows: the busiest SM's MMAs, waves of CTAs at an SM's share of the "
        "bf16 rate; other rows: the call's flops at the whole GPU's); % HBM, % bf16: the call's bytes and "
        "flops at the full rates over the model's time.",
        "",
        "| case | config | launches | regs | spills | TMEM cols | dequant loop | BAR.SYNC | issue loops | "
        "UTCHMMA | instr/weight | dequant instr/weight | model bound | model us | % HBM | % bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['key']} | error: {r['error'][:120]} |" + " |" * 14)
            continue
        plan, loop, mdl = r.get("plan") or {}, r.get("loop") or {}, r["model"]
        ipw = f"{loop['instructions_per_weight']:.2f}" if loop else "-"
        dequant_ipw = f"{loop['dequant_instructions_per_weight']:.2f}" if loop else "-"
        issue = " + ".join(f"{i:g}" for i in loop.get("issue_instructions", [])) or "-"
        barriers = " + ".join(f"{b:g}" for b in loop.get("warpgroup_barriers", [])) or "-"
        lines.append(
            f"| {r['key']} | {plan.get('config', '-')} | {r['launches']} | {r['registers'] or '-'} | "
            f"{r['spill_bytes']} | {plan.get('tmem_columns', '-')} | {loop.get('instructions', '-')} | "
            f"{barriers} | {issue}{' (a role unrolled)' if loop.get('straight_line') else ''} | "
            f"{loop.get('mmas', '-')} | "
            f"{ipw} | {dequant_ipw} | {mdl['bound']} | {mdl['model_us']:.1f} | "
            f"{100 * mdl['hbm_fraction']:.0f} | {100 * mdl['tensor_fraction']:.0f} |"
        )
    return "\n".join(lines) + "\n"
