"""The X-ray's static model of one call: issue-, HBM- and tensor-core-bound times. A model, not a timing.

- issue-bound: the main loop's warp-instructions on the busiest SM over 4 issues per cycle at the boost
  clock (only the main loop counts: prologue, epilogue and the TMA warpgroup are left out, so this is a
  lower bound on the issue time). The loop count comes from the SASS; how often it runs from the weights
  the launch dequantizes (every M tile dequantizes all of W) over the weights one loop pass feeds.
- HBM-bound: the bytes every launch of the call reads and writes (XLA's operand and result types, each
  byte once: L2 reuse of x across CTAs is assumed perfect) over the copy bandwidth measured on that GPU by
  ``python -m bench`` when such a run is in ``bench/results/``, else the spec sheet's.
- tensor-core-bound: 2 * M * N * K FLOPs (M padded to the kernel's tile for nybble's kernels) over the
  bf16 dense rate, measured when available, else the spec sheet's.
The largest of the three is the model's time; its name is the bound.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from nybble.kernels.xray import GpuSpec

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
WARP_THREADS = 32
WARPGROUP_THREADS = 128


@dataclasses.dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float
    bf16_flops_per_s: float
    source: str  # "spec sheet" or the bench.json they were measured in


def ceilings_for(gpu: GpuSpec, results_dir: Path = RESULTS_DIR) -> Ceilings:
    """Measured ceilings from the newest ``bench.json`` of a run on this GPU model, else the spec sheet's."""
    found: list[tuple[str, Path, dict[str, Any]]] = []
    for path in results_dir.glob("*/bench.json"):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        machine = json.dumps(result.get("machine", {})).lower()
        ceilings = result.get("ceilings", {})
        gpu_word = gpu.name.lower()
        if gpu_word in machine and ceilings.get("copy_bytes_per_s") and ceilings.get("bf16_flops_per_s"):
            found.append((str(result.get("machine", {}).get("date", "")), path, ceilings))
    if found:
        _, path, ceilings = max(found, key=lambda t: (t[0], str(t[1])))
        return Ceilings(ceilings["copy_bytes_per_s"], ceilings["bf16_flops_per_s"], f"measured: {path}")
    return Ceilings(gpu.hbm_bytes_per_s, gpu.bf16_flops, "spec sheet")


def resident_ctas(gpu: GpuSpec, *, smem_bytes: int, registers: int, threads: int) -> int:
    """CTAs of one kernel that fit on an SM at once (SMEM, registers, threads, the block limit)."""
    limits = [gpu.max_blocks_per_sm, gpu.max_threads_per_sm // threads]
    if registers:
        limits.append(gpu.registers_per_sm // (registers * threads))
    limits.append(gpu.smem_per_sm // (smem_bytes + 1024))  # 1 KiB per CTA reserved by the driver
    return max(0, min(limits))


def byte_categories(launches: list[dict[str, Any]]) -> dict[str, int]:
    """Bytes by what they are: codes, scales (and offsets), x, output, intermediate (written and read)."""
    out = {"codes": 0, "scales": 0, "x": 0, "w": 0, "output": 0, "intermediate": 0}
    names = {"qw.codes": "codes", "qw.scales": "scales", "qw.offsets": "scales", "x": "x", "w": "w"}
    for launch in launches:
        for source, size in launch["operand_bytes"].items():
            out[names.get(source, "intermediate")] += size
        out["output" if launch["result_is_output"] else "intermediate"] += launch["result_bytes"]
    return out


def model_case(record: dict[str, Any], gpu: GpuSpec, ceilings: Ceilings) -> dict[str, Any]:
    """The static model of one compiled case (a worker record), as a flat dict of numbers."""
    case, report = record["case"], record["report"]
    launches = report["launches"]
    total_bytes = sum(sum(la["operand_bytes"].values()) + la["result_bytes"] for la in launches)
    plan = record.get("plan")
    m_eff = plan["m_pad"] if plan else case["m"]
    flops = 2.0 * m_eff * case["n"] * case["k"]
    out: dict[str, Any] = {
        "launches": len(launches),
        "launch_names": [f"{la['kind']}:{la['name']}" for la in launches],
        "bytes": total_bytes,
        "bytes_by_kind": byte_categories(launches),
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
