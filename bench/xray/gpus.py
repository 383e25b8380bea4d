"""The X-ray of every GPU nybble targets: ``python -m bench.xray --gpu a100|l40s|b200|rtx5090`` (and the table
of all six, ``python -m bench.xray.gpus --gpus a100 l40s h100 h200 b200 rtx5090``).

For each GPU (a deviceless topology of its compute capability, ``nybble.kernels.gpu``), each shape and M,
compiles four programs and reads what was compiled:

- ``nybble``: nybble's kernel for that GPU: the portable Triton kernel (``nybble.kernels.triton``, a
  ``planes_nk_int4`` weight, the config its heuristics pick for that GPU) off Hopper; the Mosaic GPU kernel
  (``implementation="mosaic_gpu"``, a ``wgmma_int4`` weight) on h100/h200;
- ``nybble:xla``: ``nybble.matmul(implementation="xla")``, today's fallback (dequantize, then dot);
- ``xla:bf16``: XLA's dot of a bf16 weight, the baseline;
- ``xla:int4``: XLA's own int4, the codes as ``jnp.int4`` and the group scale in the dot's operand.
MoE rows: the grouped product (``nybble.ragged_matmul``'s kernels; ``lax.ragged_dot`` for bf16).

From the optimized HLO: launches, bytes per call (every launch's operands and result as XLA types them;
a grouped kernel's operand is the whole expert stack: for nybble's grouped kernels, which read only the
experts with rows, the bytes count min(experts, rows) experts; XLA's count the whole operand), and float
buffers of a quarter of the weight's elements or more (M <= 16: x and y are far smaller). From the Triton
kernel's cubin (XLA runs ptxas 12.9, which compiles sm_80..sm_120, on a temporary file; a wrapper keeps
it), disassembled by nvdisasm: the main loop (the backward branch with the most HMMAs) and its
thread-instructions per weight (loop instructions x threads / weights per pass). Predicted time: bytes at
the spec's HBM rate and 2 M N K FLOPs at its bf16 tensor rate, the larger, plus 2 us per extra launch. A
static model, not a timing.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HOPPER = ("h100", "h200")
GPU_NAMES = ("a100", "l40s", "h100", "h200", "b200", "rtx5090")
NYBBLE, NYBBLE_XLA, XLA_BF16, XLA_INT4 = "nybble", "nybble:xla", "xla:bf16", "xla:int4"
TRITON = "nybble:triton"  # the Triton kernel on any GPU, Hopper too (what f32 x runs there)
PEERS = (NYBBLE, NYBBLE_XLA, XLA_BF16, XLA_INT4)
DENSE_SHAPES = (
    "llama3-8b-qo",
    "llama3-8b-kv",
    "llama3-8b-gate-up",
    "llama3-8b-down",
    "llama3-70b-qo",
    "llama3-70b-gate-up",
    "llama3-70b-down",
)
# name: (K, N, experts, top-k): Mixtral-8x7B's fused gate-up projection.
MOE_SHAPES = {"mixtral-8x7b-gate-up": (4096, 2 * 14336, 8, 2)}
DEFAULT_MS = (1, 16, 64, 2048)


@dataclasses.dataclass(frozen=True)
class TpuSpec:
    """The figures the model needs of a TPU chip (the XLA path's rows: nybble has no TPU kernel)."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    launch_s: float = 2e-6


# Google Cloud TPU documentation (the "TPU v5e" and "TPU v6e" system architecture pages): per chip,
# v5e 819 GB/s HBM2e and 197 TFLOP/s bf16; v6e (Trillium) 1,640 GB/s and 918 TFLOP/s.
TPUS = {"v5e": TpuSpec("v5e", 819e9, 197e12), "v6e": TpuSpec("v6e", 1640e9, 918e12)}
TPU_PEERS = (NYBBLE_XLA, XLA_BF16, XLA_INT4)


def spec_of(name: str) -> Any:
    """The GpuSpec or TpuSpec named ``name``."""
    from nybble.kernels.gpu import get_gpu

    return TPUS[name] if name in TPUS else get_gpu(name)


GROUP = 128
RESULTS = Path(__file__).resolve().parents[1] / "results" / "xray-gpus"


@dataclasses.dataclass(frozen=True)
class Case:
    gpu: str
    peer: str
    shape: str
    k: int
    n: int
    m: int  # rows of x (tokens x top-k for MoE)
    experts: int = 0  # 0: dense

    @property
    def key(self) -> str:
        return f"{self.gpu}|{self.peer}|{self.shape}|m{self.m}"


def case_of(gpu: str, peer: str, shape: str, m: int) -> Case:
    """One case by names: a dense shape of ``bench.arg_specs.SHAPES`` or a MoE shape (``m`` tokens)."""
    from bench.arg_specs import SHAPES

    if shape in MOE_SHAPES:
        k, n, experts, top_k = MOE_SHAPES[shape]
        return Case(gpu, peer, shape, k, n, m * top_k, experts)
    s = SHAPES[shape]
    return Case(gpu, peer, shape, s.k, s.n, m)


def build_cases(gpu: str, shapes: list[str], ms: list[int], moe: list[str]) -> list[Case]:
    from bench.arg_specs import SHAPES

    peers = TPU_PEERS if gpu in TPUS else PEERS
    out = []
    for name in shapes:
        s = SHAPES[name]
        out += [Case(gpu, p, name, s.k, s.n, m) for m in ms for p in peers]
    for name in moe:
        k, n, experts, top_k = MOE_SHAPES[name]
        out += [Case(gpu, p, name, k, n, m * top_k, experts) for m in ms for p in peers if p != XLA_INT4]
    return out


# ---------------------------------------------------------------------------------------------- programs


def _weight(case: Case, layout: str, sharding: Any) -> Any:
    import jax
    import jax.numpy as jnp

    from nybble.packing import get_layout, num_groups, padded_weight_dims
    from nybble.quant.qweight import QuantizedWeight

    k_pad, n_pad = padded_weight_dims(case.k, case.n)
    lead = (case.experts,) if case.experts else ()
    stored = jax.eval_shape(get_layout(layout).pack, jax.ShapeDtypeStruct((k_pad, n_pad), jnp.int8))
    rows = num_groups(k_pad, GROUP)
    return QuantizedWeight(
        codes=jax.ShapeDtypeStruct((*lead, *stored.shape), stored.dtype, sharding=sharding),
        scales=jax.ShapeDtypeStruct((*lead, rows, n_pad), jnp.bfloat16, sharding=sharding),
        offsets=None,
        shape=(case.k, case.n),
        group_size=GROUP,
        symmetric=True,
        layout=layout,
    )


def program(case: Case, spec: Any, sharding: Any) -> tuple[Any, tuple[Any, ...]]:
    """(function, abstract arguments) of one case."""
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((case.m, case.k), jnp.bfloat16, sharding=sharding)
    sizes = jax.ShapeDtypeStruct((case.experts,), jnp.int32, sharding=sharding)
    hopper = getattr(spec, "name", "") in HOPPER
    if case.peer == XLA_BF16:
        lead = (case.experts,) if case.experts else ()
        w = jax.ShapeDtypeStruct((*lead, case.k, case.n), jnp.bfloat16, sharding=sharding)
        if case.experts:
            return (
                lambda x, w, s: jax.lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32).astype(
                    x.dtype
                )
            ), (
                x,
                w,
                sizes,
            )
        return (lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)), (x, w)
    if case.peer == XLA_INT4:
        codes = jax.ShapeDtypeStruct((case.k, case.n), jnp.int4, sharding=sharding)
        scales = jax.ShapeDtypeStruct((case.k // GROUP, case.n), jnp.bfloat16, sharding=sharding)

        def native(x, q, s):
            w = (q.astype(x.dtype).reshape(-1, GROUP, case.n) * s[:, None, :]).reshape(case.k, case.n)
            return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

        return native, (x, codes, scales)
    if case.peer == NYBBLE_XLA:
        qw = _weight(case, "wgmma_int4", sharding)
        if case.experts:
            from nybble.kernels.ops.ragged_matmul.xla import xla_ragged_matmul

            return xla_ragged_matmul, (x, qw, sizes)
        from nybble.kernels.ops.matmul.xla import xla_matmul

        return xla_matmul, (x, qw)
    if hopper and case.peer == NYBBLE:  # nybble's Mosaic GPU kernel
        qw = _weight(case, "wgmma_int4", sharding)
        import nybble

        if case.experts:
            return (lambda x, qw, s: nybble.ragged_matmul(x, qw, s, implementation="mosaic_gpu")), (
                x,
                qw,
                sizes,
            )
        return (lambda x, qw: nybble.matmul(x, qw, implementation="mosaic_gpu")), (x, qw)
    from nybble.kernels.triton import backend
    from nybble.kernels.triton.dense import dense_matmul
    from nybble.kernels.triton.grouped import grouped_matmul

    qw = _weight(case, "planes_nk_int4", sharding)
    if case.experts:
        cfg = dataclasses.replace(backend.plan(max(1, case.m // case.experts), qw, gpu=spec), splits=1)
        return (lambda x, qw, s: grouped_matmul(x, qw, s, cfg)), (x, qw, sizes)
    cfg = backend.plan(case.m, qw, gpu=spec)
    return (lambda x, qw: dense_matmul(x, qw, cfg)), (x, qw)


def triton_config(case: Case, spec: Any) -> Any:
    """The Triton kernel's TuningConfig of a case (None for the other peers and on Hopper)."""
    if not (case.peer == TRITON or (case.peer == NYBBLE and spec.name not in HOPPER)):
        return None
    from nybble.kernels.triton import backend

    qw = _weight(case, "planes_nk_int4", None)
    if case.experts:
        return dataclasses.replace(backend.plan(max(1, case.m // case.experts), qw, gpu=spec), splits=1)
    return backend.plan(case.m, qw, gpu=spec)


# ------------------------------------------------------------------------------------------- reading


def big_float_buffers(hlo_text: str, weight_elements: int) -> list[str]:
    """Float arrays the program computes (not its parameters) of >= a quarter of the weight's elements."""
    from bench.kernel_xray import hlo

    out = []
    for v in hlo.entry_values(hlo_text).values():
        if v.opcode in ("parameter", "bitcast", "get-tuple-element", "tuple"):
            continue
        for m in re.finditer(r"(bf16|f16|f32)\[([\d,]+)\]", v.line.split("=", 1)[1].split("(", 1)[0]):
            elements = 1
            for d in m.group(2).split(","):
                elements *= int(d)
            if elements * 4 >= weight_elements:
                out.append(f"{m.group(1)}[{m.group(2)}]")
    return out


# ptxas, wrapped: XLA runs ptxas as a program (on a temporary PTX file, ``-o`` a temporary cubin) and keeps
# neither; the wrapper keeps the cubin in $NYBBLE_PTX_DUMP when that is set, named by a count and its own
# process id (XLA runs several ptxas at once: two of them counting the same files wrote one name).
_PTXAS_WRAPPER = """#!/bin/sh
"{real}" "$@"
rc=$?
if [ -n "$NYBBLE_PTX_DUMP" ] && [ -d "$NYBBLE_PTX_DUMP" ]; then
  n=$(ls "$NYBBLE_PTX_DUMP" | wc -l)
  prev=""
  for a in "$@"; do
    if [ "$prev" = "-o" ]; then cp "$a" "$NYBBLE_PTX_DUMP/$n-$$.cubin" 2>/dev/null; fi
    prev="$a"
  done
fi
exit $rc
"""


def wrapped_cuda_root(toolchain: Any) -> Path:
    """A CUDA root like the X-ray's whose ``bin/ptxas`` keeps the cubins it writes (see above)."""
    from bench.kernel_xray.toolchain import cache_dir

    root = cache_dir() / "cuda-root-ptxas-kept"
    (root / "bin").mkdir(parents=True, exist_ok=True)
    script = root / "bin" / "ptxas"
    text = _PTXAS_WRAPPER.format(real=toolchain.ptxas)
    if not script.exists() or script.read_text() != text:
        tmp = root / "bin" / ".ptxas.tmp"
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, script)
    for name, target in (("bin/nvdisasm", toolchain.nvdisasm), ("nvvm", toolchain.cuda_root() / "nvvm")):
        link = root / name
        if not link.exists():
            link.symlink_to(target)
    return root


def triton_sass(
    cubins: list[Path], nvdisasm: Path, threads: int, weights_per_pass: int
) -> dict[str, Any] | None:
    """The Triton kernel's main loop, read from its cubin: instructions, HMMAs, the opcode mix, and
    thread-instructions per weight."""
    from bench.kernel_xray import sass as sass_lib
    from bench.xray.marlin import control_code_sass

    for path in cubins:
        proc = subprocess.run([str(nvdisasm), "-c", "-hex", str(path)], capture_output=True, text=True)
        if proc.returncode or "nybble_triton" not in proc.stdout:
            continue
        code = sass_lib.parse_sass(control_code_sass(proc.stdout))
        loop = mma_loop(code)
        if loop is None:
            continue
        mix = collections.Counter(ins.base_opcode for ins in loop).most_common(10)
        return {
            "loop_instructions": len(loop),
            "mmas": sum(_is_mma(ins) for ins in loop),
            "mma": next(ins.opcode for ins in loop if _is_mma(ins)),
            "instructions_per_weight": round(len(loop) * threads / weights_per_pass, 3),
            "opcode_mix": mix,
            "sass_instructions": len(code.instructions),
        }
    return None


def _is_mma(ins: Any) -> bool:
    """A tensor-core instruction: HMMA (mma.sync), HGMMA (Hopper's wgmma), UTC*MMA (Blackwell's tcgen05)."""
    op = ins.base_opcode
    return op in ("HMMA", "HGMMA") or (op.startswith("UTC") and "MMA" in op)


# A branch's target label, the uniform-predicate form too (``BRA.U UP0, `(.L_x_0)``: sm_100/sm_120 loops).
_LOOP_BRANCH = re.compile(r"BRA(?:\.U\s+!?UP\d+,)?\s+`?\(?(?P<label>\.L_x_\d+)\)?`?")


def mma_loop(code: Any) -> list[Any] | None:
    """The main loop of a Triton kernel: the backward branch (Triton's loops end in an unconditional one,
    the exit test at the top) whose body holds the most MMAs and no EXIT; the innermost on ties."""

    ins = code.instructions
    best = None
    for end, i in enumerate(ins):
        target = _LOOP_BRANCH.search(i.text) if i.base_opcode == "BRA" else None
        if target is None or target["label"] not in code.labels:
            continue
        start = code.labels[target["label"]]
        body = ins[start : end + 1]
        if start > end or any(b.base_opcode == "EXIT" for b in body):
            continue
        n = sum(_is_mma(b) for b in body)
        if n and (best is None or n > best[2] or (n == best[2] and end - start < best[1] - best[0])):
            best = (start, end, n)
    return None if best is None else ins[best[0] : best[1] + 1]


def compile_case(case: Case, spec: Any, device: Any, nvdisasm: Path | None) -> dict[str, Any]:
    import jax
    import numpy as np
    from jax.sharding import Mesh, SingleDeviceSharding

    from bench.kernel_xray import hlo

    fn, args = program(case, spec, SingleDeviceSharding(device))
    platform = "tpu" if case.gpu in TPUS else "cuda"
    started = time.time()
    dump = Path(tempfile.mkdtemp(prefix="nybble-xray-cubins-"))
    os.environ["NYBBLE_PTX_DUMP"] = str(dump)  # read by the ptxas wrapper XLA runs
    try:
        with jax.set_mesh(Mesh(np.array([device]), ("x",))):  # the Triton lowering reads the target here
            compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).compile()
    finally:
        os.environ.pop("NYBBLE_PTX_DUMP", None)
    text = compiled.as_text()
    launches = hlo.launches(text)
    record: dict[str, Any] = {
        "launches": len(launches),
        "launch_kinds": [lau.kind for lau in launches],
        "bytes": sum(sum(lau.operand_bytes.values()) + lau.result_bytes for lau in launches),
        "weight_sized_float_buffers": big_float_buffers(text, case.k * case.n),
        "compile_s": round(time.time() - started, 2),
    }
    if case.experts and case.peer in (NYBBLE, TRITON):
        # nybble's grouped kernels read the words of the experts with rows only: the stack's operand bytes
        # less the experts left unread at this M (all but min(experts, rows)).
        per_expert = case.k * case.n // 2 + (case.k // GROUP) * case.n * 2
        record["bytes_compiled"] = record["bytes"]
        record["bytes"] -= (case.experts - min(case.experts, case.m)) * per_expert
    cfg = triton_config(case, spec)
    if cfg is not None:
        record["config"] = str(cfg)
        if nvdisasm is not None:
            cubins = sorted(dump.glob("*.cubin"))
            record["sass"] = triton_sass(cubins, nvdisasm, 32 * cfg.num_warps, 8 * cfg.block_kw * cfg.block_n)
    for f in dump.iterdir():
        f.unlink()
    dump.rmdir()
    return record


# -------------------------------------------------------------------------------------------- model


def ideal_bytes(case: Case) -> int:
    """int4 codes + bf16 scales (over the active experts for MoE) + x + y, bf16."""
    active = min(case.experts, case.m) if case.experts else 1
    weight = case.k * case.n // 2 + (case.k // GROUP) * case.n * 2
    return active * weight + 2 * case.m * (case.k + case.n)


def issue_s(case: Case, record: dict[str, Any], spec: Any) -> float | None:
    """The Triton kernel's main loop alone at perfect issue: its thread-instructions per weight times the
    weights it dequantizes (every M tile all of its expert's, the active experts for MoE), over the SMs'
    4 x 32 thread-instructions per cycle at the boost clock. None where no SASS was read."""
    ipw = (record.get("sass") or {}).get("instructions_per_weight")
    match = re.search(r"block_m=(\d+)", record.get("config", ""))
    if ipw is None or match is None:
        return None
    bm = int(match.group(1))
    if case.experts:
        active = min(case.experts, case.m)
        tiles = active * -(-max(1, case.m // active) // bm)
    else:
        tiles = -(-case.m // bm)
    return ipw * case.k * case.n * tiles / (spec.sms * 4 * 32 * spec.clock_hz)


def predicted_s(case: Case, record: dict[str, Any], spec: Any) -> float:
    """The largest of the HBM, tensor-core and (where the SASS was read) issue times, plus 2 us per extra
    launch."""
    flops = 2 * case.m * case.k * case.n
    bound = max(
        record["bytes"] / spec.hbm_bytes_per_s, flops / spec.bf16_flops, issue_s(case, record, spec) or 0
    )
    return bound + spec.launch_s * (record["launches"] - 1)


def rows(records: dict[str, dict[str, Any]], cases: list[Case]) -> list[dict[str, Any]]:
    out = []
    by_key = {c.key: c for c in cases}
    for key, rec in records.items():
        case = by_key[key]
        spec = spec_of(case.gpu)
        row = {**dataclasses.asdict(case), **rec}
        if "error" not in rec:
            row["predicted_us"] = round(predicted_s(case, rec, spec) * 1e6, 2)
            issue = issue_s(case, rec, spec)
            row["issue_us"] = None if issue is None else round(issue * 1e6, 2)
            row["bytes_over_ideal"] = round(rec["bytes"] / ideal_bytes(case), 3)
        out.append(row)
    for row in out:  # ratio to XLA's bf16 dot of the same GPU, shape and M
        base = next(
            (
                r
                for r in out
                if (r["gpu"], r["shape"], r["m"], r["peer"]) == (row["gpu"], row["shape"], row["m"], XLA_BF16)
            ),
            None,
        )
        if base and "predicted_us" in row and "predicted_us" in base:
            row["vs_bf16"] = round(row["predicted_us"] / base["predicted_us"], 3)
    return out


def _merged_note(meta: dict[str, Any]) -> str:
    """Which runs a merged table's rows come from (their dates and commits), or nothing."""

    def runs(m: dict[str, Any]) -> list[str]:
        inner = m.get("merged_from")
        return [r for x in inner for r in runs(x)] if inner else [f"{m['date']} {m['commit']}"]

    found = list(dict.fromkeys(runs(meta))) if meta.get("merged_from") else []
    return (
        f" (rows merged from runs {'; '.join(found)}: a later run's case replaces an earlier's)"
        if found
        else ""
    )


def markdown(table: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# X-ray of nybble's kernels on six GPUs (compiled without a GPU; a static model, not a timing)",
        "",
        f"{meta['date']}, commit {meta['commit']}, jax {meta['jax']}{_merged_note(meta)}. "
        "g128 symmetric, bf16 x. "
        "`bytes/ideal`: bytes per call from the compiled program over int4 codes + bf16 scales (active "
        "experts for MoE) + x + y. `vs bf16`: predicted time over XLA's bf16 dot's on the same GPU "
        "(the largest of: bytes at the spec's HBM rate, 2MNK at its bf16 rate, and for the Triton kernel "
        "its main loop's SASS at perfect issue, `issue us`; + 2 us per extra launch). `big float`: "
        "float buffers of >= 1/4 of the weight's elements. `instr/w`: the Triton kernel's main-loop "
        "thread-instructions per weight (SASS).",
        "",
        "| gpu | shape | M | peer | launches | bytes/ideal | big float | predicted us | issue us | vs bf16 "
        "| instr/w | config |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        if "error" in r:
            lines.append(
                f"| {r['gpu']} | {r['shape']} | {r['m']} | {r['peer']} | error: {r['error'][:80]} |||||||"
            )
            continue
        sass = r.get("sass") or {}
        lines.append(
            f"| {r['gpu']} | {r['shape']} | {r['m']} | {r['peer']} | {r['launches']} | "
            f"{r['bytes_over_ideal']} | "
            f"{len(r['weight_sized_float_buffers'])} | {r['predicted_us']} | {r.get('issue_us') or ''} | "
            f"{r.get('vs_bf16', '')} | "
            f"{sass.get('instructions_per_weight', '')} | {r.get('config', '').replace('TuningConfig', '')} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- main


def run(cases: list[Case], sass: bool = True) -> list[dict]:
    """Compiles every case in this process (which must be set up for deviceless CUDA compiles)."""
    from bench.kernel_xray.target import deviceless_devices
    from bench.kernel_xray.toolchain import find_toolchain
    from nybble.kernels.gpu import get_gpu

    nvdisasm = find_toolchain().nvdisasm if sass and any(c.gpu not in TPUS for c in cases) else None
    records: dict[str, Any] = {}
    for gpu in dict.fromkeys(c.gpu for c in cases):
        if gpu in TPUS:  # libtpu's deviceless topology (as MaxText's AOT compile uses)
            from jax.experimental import topologies

            spec = TPUS[gpu]
            device = topologies.get_topology_desc(topology_name=f"{gpu}:2x2", platform="tpu").devices[0]
        else:
            spec = get_gpu(gpu)
            device = deviceless_devices(spec)[0]
        for case in (c for c in cases if c.gpu == gpu):
            try:
                records[case.key] = compile_case(case, spec, device, nvdisasm)
            except Exception as e:
                records[case.key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(f"{case.key}: {records[case.key]}", file=sys.stderr, flush=True)
    return rows(records, cases)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.xray.gpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", nargs="*", choices=GPU_NAMES, default=list(GPU_NAMES))
    p.add_argument(
        "--tpus",
        nargs="+",
        choices=tuple(TPUS),
        default=[],
        help="also the XLA path on these TPUs (deviceless, needs libtpu: pip install libtpu; run apart from "
        "the GPUs, without the CUDA toolchain)",
    )
    p.add_argument("--shapes", nargs="+", choices=DENSE_SHAPES, default=list(DENSE_SHAPES))
    p.add_argument("--ms", nargs="+", type=int, default=list(DEFAULT_MS))
    p.add_argument("--moe", nargs="*", choices=tuple(MOE_SHAPES), default=list(MOE_SHAPES))
    p.add_argument("--no-sass", action="store_true", help="skip disassembling the Triton kernel")
    p.add_argument(
        "--cases",
        nargs="+",
        metavar="GPU:PEER:SHAPE:M",
        help="these cases only (PEER nybble, nybble:triton, nybble:xla, xla:bf16, xla:int4), for the tests",
    )
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default {RESULTS})")
    p.add_argument(
        "--merge", nargs="+", type=Path, metavar="DIR", help="merge these runs' tables, compile nothing"
    )
    return p


_RECORD_FIELDS = (
    "launches",
    "launch_kinds",
    "bytes",
    "bytes_compiled",
    "weight_sized_float_buffers",
    "compile_s",
    "config",
    "sass",
    "error",
)


def merge(folders: list[Path]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of several runs' xray.json as one table, a later folder's case replacing an earlier's; the
    derived columns computed again."""
    records: dict[str, dict[str, Any]] = {}
    cases: dict[str, Case] = {}
    metas = []
    for folder in folders:
        data = json.loads((folder / "xray.json").read_text())
        metas.append(data["meta"])
        for r in data["rows"]:
            case = Case(**{f.name: r[f.name] for f in dataclasses.fields(Case)})
            cases[case.key] = case
            records[case.key] = {k: r[k] for k in _RECORD_FIELDS if k in r}
    shapes = (*DENSE_SHAPES, *MOE_SHAPES)
    ordered = sorted(  # by GPU, then shape, M and peer, whichever run a case came from
        cases.values(),
        key=lambda c: (
            (GPU_NAMES + tuple(TPUS)).index(c.gpu),
            shapes.index(c.shape) if c.shape in shapes else len(shapes),
            c.m,
            PEERS.index(c.peer) if c.peer in PEERS else len(PEERS),
        ),
    )
    table = rows({c.key: records[c.key] for c in ordered}, ordered)
    meta = {**metas[-1], "merged_from": metas}
    return table, meta


def _split(text: str) -> tuple[str, str, str, str, str]:
    """``a100:nybble:xla:llama3-8b-qo:16`` -> (gpu, peer head, peer tail, shape, m)."""
    parts = text.split(":")
    if len(parts) == 4:
        return parts[0], parts[1], "", parts[2], parts[3]
    if len(parts) == 5:
        return parts[0], parts[1], parts[2], parts[3], parts[4]
    raise SystemExit(f"--cases {text!r}: write GPU:PEER:SHAPE:M")


def main(argv: list[str] | None = None) -> int:
    from bench.kernel_xray.toolchain import (
        ToolchainMissing,
        child_environment,
        find_toolchain,
        in_compile_process,
    )

    args = build_parser().parse_args(argv)
    if args.merge:
        table, meta = merge(args.merge)
        return _write(args.out or RESULTS, table, meta)
    tpu_only = bool(args.tpus) and not args.cases and args.gpus == []
    if not in_compile_process() and not tpu_only:
        try:
            toolchain = find_toolchain()
        except ToolchainMissing as e:
            print(f"python -m bench.xray.gpus: {e}", file=sys.stderr)
            return 2
        env = child_environment(toolchain)
        env["CUDA_ROOT"] = str(wrapped_cuda_root(toolchain))
        argv = sys.argv[1:] if argv is None else argv
        return subprocess.run([sys.executable, "-m", "bench.xray.gpus", *argv], env=env).returncode
    import jax

    from bench.xray.provenance import source_commit

    started = time.time()
    if args.cases:
        cases = [
            case_of(g, f"{p1}:{p2}" if p2 else p1, shape, int(m))
            for g, p1, p2, shape, m in map(_split, args.cases)
        ]
    else:
        names = [*args.gpus, *args.tpus]
        cases = [c for gpu in names for c in build_cases(gpu, args.shapes, args.ms, args.moe)]
    table = run(cases, sass=not args.no_sass)
    meta = {
        "date": datetime.date.today().isoformat(),
        "commit": source_commit(),
        "jax": jax.__version__,
        "elapsed_s": round(time.time() - started, 1),
    }
    return _write(args.out or RESULTS, table, meta)


def _write(out: Path, table: list[dict[str, Any]], meta: dict[str, Any]) -> int:
    """xray.json and xray.md into ``out`` (temporary files, then renamed); the table printed."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("xray.json", json.dumps({"meta": meta, "rows": table}, indent=1, default=str)),
        ("xray.md", markdown(table, meta)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    print(markdown(table, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
