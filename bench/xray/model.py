"""The X-ray's static model of one call: issue-, HBM- and tensor-core-bound times. A model, not a timing.

- issue-bound: the main loop's warp-instructions on the busiest SM over 4 issues per cycle at the boost
  clock (only the main loop counts: prologue, epilogue and the TMA warpgroup are left out, so this is a
  lower bound on the issue time). The loop count comes from the SASS; how often it runs from the weights
  the launch dequantizes (every M tile dequantizes all of W) over the weights one loop pass feeds.
- HBM-bound: the bytes every launch of the call reads and writes (XLA's operand and result types, each
  byte once: L2 reuse of x across CTAs is assumed perfect) over the copy bandwidth measured on that GPU by
  ``python -m bench`` when its bench.json is given (``--ceilings``), else the spec sheet's.
- tensor-core-bound: 2 * M * N * K FLOPs (M padded to the kernel's tile for nybble's kernels) over the
  bf16 dense rate, measured when given, else the spec sheet's.
The largest of the three is the model's time; its name is the bound.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.kernel_xray import GpuSpec
from bench.metrics import Ceilings

WARP_THREADS = 32
WARPGROUP_THREADS = 128


def ceilings_for(gpu: GpuSpec, bench_json: Path | None = None) -> Ceilings:
    """The ceilings of the model: those measured in ``bench_json`` (a ``python -m bench`` result on this
    GPU model), else the spec sheet's. Never a file found on its own: which measurement a model uses is
    the caller's explicit choice (``python -m bench.xray --ceilings PATH``)."""
    if bench_json is None:
        return Ceilings(gpu.hbm_bytes_per_s, gpu.bf16_flops, "spec sheet")
    result = json.loads(Path(bench_json).read_text())
    ceilings = result.get("ceilings", {})
    machine = json.dumps(result.get("machine", {})).lower()
    if not (ceilings.get("copy_bytes_per_s") and ceilings.get("bf16_flops_per_s")):
        raise ValueError(f"{bench_json}: no measured ceilings (copy_bytes_per_s, bf16_flops_per_s)")
    if gpu.name.lower() not in machine:
        raise ValueError(
            f"{bench_json} was measured on {result.get('machine', {}).get('device', '?')!r}, not an "
            f"{gpu.description}: pass a bench.json of this GPU model, or none for the spec sheet"
        )
    return Ceilings(ceilings["copy_bytes_per_s"], ceilings["bf16_flops_per_s"], f"measured: {bench_json}")


def resident_ctas(gpu: GpuSpec, *, smem_bytes: int, registers: int, threads: int) -> int:
    """CTAs of one kernel that fit on an SM at once (SMEM, registers, threads, the block limit)."""
    limits = [gpu.max_blocks_per_sm, gpu.max_threads_per_sm // threads]
    if registers:
        limits.append(gpu.registers_per_sm // (registers * threads))
    limits.append(gpu.smem_per_sm // (smem_bytes + 1024))  # 1 KiB per CTA reserved by the driver
    return max(0, min(limits))


_WEIGHT_SOURCES = ("qw.codes", "qw.scales", "qw.offsets")


def read_bytes(launch: dict[str, Any], source: str, size: int, plan: dict[str, Any] | None) -> float:
    """Bytes a launch reads of one operand: all of it, except a grouped kernel's weight stack, of which it
    reads the experts that have rows (``plan['active_experts']`` of ``plan['experts']``; an expert
    without rows costs no weight traffic, grouped.py)."""
    if plan and plan.get("experts") and launch["kind"] == "mosaic_gpu" and source in _WEIGHT_SOURCES:
        return size * plan["active_experts"] / plan["experts"]
    return size


def byte_categories(
    launches: list[dict[str, Any]], plan: dict[str, Any] | None = None
) -> dict[str, float]:
    """Bytes by what they are: codes, scales (and offsets), x, output, intermediate (written and read)."""
    out: dict[str, float] = {"codes": 0, "scales": 0, "x": 0, "w": 0, "output": 0, "intermediate": 0}
    names = {"qw.codes": "codes", "qw.scales": "scales", "qw.offsets": "scales", "x": "x", "w": "w"}
    for launch in launches:
        for source, size in launch["operand_bytes"].items():
            out[names.get(source, "intermediate")] += read_bytes(launch, source, size, plan)
        out["output" if launch["result_is_output"] else "intermediate"] += launch["result_bytes"]
    return out


def model_case(record: dict[str, Any], gpu: GpuSpec, ceilings: Ceilings) -> dict[str, Any]:
    """The static model of one compiled case (a worker record), as a flat dict of numbers."""
    case, report = record["case"], record["report"]
    launches = report["launches"]
    plan = record.get("plan")
    by_kind = byte_categories(launches, plan)
    total_bytes = sum(by_kind.values())
    m_eff = plan["m_pad"] if plan else case["m"]
    flops = 2.0 * m_eff * case["n"] * case["k"]
    out: dict[str, Any] = {
        "launches": len(launches),
        "launch_names": [f"{la['kind']}:{la['name']}" for la in launches],
        "bytes": total_bytes,
        "bytes_by_kind": by_kind,
        "t_hbm_us": total_bytes / ceilings.copy_bytes_per_s * 1e6,
        "t_tc_us": flops / ceilings.bf16_flops_per_s * 1e6,
        "t_issue_us": None,
    }
    kernels = [k for k in report["kernels"] if k["loop"] is not None]
    if plan and kernels:
        k = kernels[0]
        loop = k["loop"]
        passes = plan["dequantized_weights"] / (loop["weights_per_thread"] * WARPGROUP_THREADS)
        warp_instructions = passes * loop["instructions"] * (WARPGROUP_THREADS // WARP_THREADS)
        busiest_sm = warp_instructions / plan["ctas"] * math.ceil(plan["ctas"] / gpu.sms)
        out["t_issue_us"] = busiest_sm / (gpu.issue_per_sm_cycle * gpu.clock_ghz * 1e9) * 1e6
        per_sm = resident_ctas(
            gpu, smem_bytes=k["smem_bytes"], registers=k["registers"], threads=k["threads"]
        )
        out["ctas_per_sm"] = per_sm
        out["weight_bytes_in_flight_per_sm"] = plan["weight_bytes_in_flight"] * min(
            per_sm, math.ceil(plan["ctas"] / gpu.sms)
        )
        out["sms_busy"] = min(gpu.sms, plan["ctas"])
    bounds = {"issue": out["t_issue_us"], "hbm": out["t_hbm_us"], "tensor": out["t_tc_us"]}
    bound, t = max(((b, v) for b, v in bounds.items() if v is not None), key=lambda p: p[1])
    out["bound"] = bound
    out["t_model_us"] = t
    # The share of HBM bandwidth the call could reach if nothing but these bounds held.
    out["model_pct_hbm"] = 100.0 * out["t_hbm_us"] / t
    return out
