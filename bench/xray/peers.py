"""The X-ray's peers side by side: their toolchains, their records, and one table per shape and M.

``prepare`` installs what the requested peers need (``bench.xray.peer_tools``) and says, per peer, why it
cannot be compiled when an install fails (that peer's rows then carry the reason; the others still run).
Marlin compiles in this process (nvcc, no JAX); tokamax and JAX's int8 example compile in the X-ray's
workers like nybble's kernels.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
from collections.abc import Iterable, Sequence
from typing import Any

from bench.kernel_xray import GpuSpec
from bench.report import format_table
from bench.xray.cases import JAX_MIXED, MARLIN, MOSAIC, NYBBLE_XLA, TOKAMAX, XLA_BF16, Case

# Machete (vLLM's Hopper mixed-input CUTLASS GEMM) is not a row yet: what compiling it took here, by hand.
MACHETE_NOTE = (
    "vllm:machete (not wired in): compiled by hand on this CPU, one schedule (bf16 x GPTQ u4b8, g128 bf16 "
    "scales, 128x16 tile, cooperative, stream-K). It needs more than Marlin: csrc/quantization/machete/"
    "generate.py runs with nvidia-cutlass 4.2.0.0's cutlass_library and jinja2 (PyPI) and writes 8 .cu "
    "parts of ~9 schedules each; the sources include torch's stable C++ API (torch_utils.h: "
    "torch/csrc/stable, aoti shim), so torch's headers are needed (a CPU torch wheel's serve, with "
    "-DUSE_CUDA so that the CUDA stream shims are declared) plus cublas_v2.h (a one-line stand-in, host "
    "code only), and CUTLASS 4.x headers (nvidia-cutlass). nvcc 13.5 from the wheels then builds it: 168 "
    "registers, 8 + 16 bytes spill, ptxas C7510 'wgmma serialized ... crossing function boundary'; one "
    "schedule took ~25 min of a shared 2-core machine. Its HGMMA loop under the X-ray's rule (1,770 "
    "instructions, 12 HGMMA.64x16x16, 18.4 per weight) includes the stream-K scheduler and fixup, not the "
    "steady-state K loop: not a comparable count yet."
)


def prepare(peers: Sequence[str]) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(toolchain versions, {peer: why unavailable}, environment for the compile workers)."""
    from bench.xray import peer_tools

    versions: dict[str, str] = {}
    unavailable: dict[str, str] = {}
    env: dict[str, str] = {}
    if MARLIN in peers:
        try:
            peer_tools.vllm_source()
            root = peer_tools.cuda_tree()
            versions["vllm (sdist, Marlin source)"] = peer_tools.VLLM_VERSION
            versions["nvcc (PyPI wheels)"] = peer_tools.nvcc_version(root)
            versions["cuda wheels"] = " ".join(peer_tools.CUDA_WHEELS)
            versions["host compiler"] = peer_tools.gxx_version()
        except (peer_tools.PeerToolchainMissing, OSError) as e:
            unavailable[MARLIN] = str(e)
    if TOKAMAX in peers:
        try:
            site = peer_tools.tokamax_site()
            env["NYBBLE_XRAY_PEER_SITES"] = str(site)
            versions["tokamax"] = _site_version(site, "tokamax")
            versions["qwix"] = _site_version(site, "qwix")
        except (peer_tools.PeerToolchainMissing, OSError) as e:
            unavailable[TOKAMAX] = str(e)
    if JAX_MIXED in peers:
        versions["jax (hopper_mixed_type_matmul_mgpu)"] = importlib.metadata.version("jax")
    return versions, unavailable, env


def _site_version(site: Any, name: str) -> str:
    for dist in importlib.metadata.distributions(path=[str(site)]):
        if dist.metadata["Name"].lower() == name:
            return dist.version
    return "unknown"


def other_records(
    cases: Iterable[Case], unavailable: dict[str, str], gpu: GpuSpec
) -> dict[str, dict[str, Any]]:
    """Records of the cases the workers do not compile: Marlin's, and every unavailable peer's."""
    from bench.kernel_xray import find_toolchain
    from bench.xray import marlin

    out: dict[str, dict[str, Any]] = {}
    nvdisasm = None
    for case in cases:
        if case.peer in unavailable:
            out[case.key] = {
                "key": case.key,
                "case": dataclasses.asdict(case),
                "error": f"toolchain unavailable: {unavailable[case.peer]}",
            }
        elif case.peer == MARLIN:
            nvdisasm = nvdisasm or find_toolchain().nvdisasm
            out[case.key] = marlin.marlin_record(
                case, nvdisasm, sms=gpu.sms, max_shared_mem=gpu.smem_per_block_optin
            )
    return out


PEER_ORDER = {MOSAIC: 0, MARLIN: 1, TOKAMAX: 2, JAX_MIXED: 3, NYBBLE_XLA: 4, XLA_BF16: 5}


def peer_rows(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Rows grouped by (shape, M), peers in a fixed order: nybble, Marlin, tokamax, JAX int8, XLA."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        groups[(r["shape"], r["m"])].append(r)
    for v in groups.values():
        v.sort(key=lambda r: (PEER_ORDER.get(r["peer"], 9), r["quant"]))
    return dict(sorted(groups.items()))


def _kernel_cells(r: dict[str, Any]) -> list[str]:
    if "error" in r:
        return ["-"] * 4
    k = r.get("kernel") or {}
    loop = k.get("loop") or {}
    ipw = loop.get("instructions_per_weight")
    span = loop.get("span_instructions_per_weight")
    return [
        str(k.get("registers", "-")) if k else "-",
        str(k.get("spill_bytes", "-")) if k else "-",
        str(loop.get("instructions", "-")) if loop else "-",
        ("-" if ipw is None else f"{ipw:.2f}") + ("" if span is None else f" (span {span:.2f})"),
    ]


def peer_table(group: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """One (shape, M): regs, spills, loop instructions, instructions per weight, launches per peer."""
    header = ["peer", "quant", "kernel", "regs", "spill", "loop instr", "instr/w", "launches"]
    body = []
    for r in group:
        name = (r.get("kernel") or {}).get("name", "-") if "error" not in r else "ERROR: " + r["error"][:70]
        launches = "-" if "error" in r else str(r["launches"])
        body.append([r["peer"], r["quant"], name[:48], *_kernel_cells(r), launches])
    return format_table(header, body, markdown)


def peer_tables(rows: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """Every (shape, M) table, with a title line each; then the Machete note."""
    parts = []
    for (shape, m), group in peer_rows(rows).items():
        first = group[0]
        moe = first.get("experts") and f", {first['experts']} experts, top-{first['top_k']}"
        title = f"{shape} (K={first['k']}, N={first['n']}{moe or ''}), M={m}"
        parts.append(
            (f"### {title}\n\n" if markdown else f"{title}\n") + peer_table(group, markdown=markdown)
        )
    parts.append(MACHETE_NOTE)
    return "\n\n".join(parts)


PEER_COLUMNS = {
    "regs": "registers per thread (ptxas)",
    "spill": "spill bytes, stores + loads (ptxas)",
    "loop instr": "SASS instructions of the main loop; Marlin: its hot path (the loop span minus the slice "
    "epilogue steady state skips, bench/xray/marlin.py)",
    "instr/w": "loop instructions per weight per thread (HGMMA: 64 x K rows per warpgroup; Marlin's HMMA: "
    "4 weights a thread / m-blocks, 8 with m_block_size_8); span: Marlin over its whole loop span",
    "launches": "device launches of one call (XLA's compiled HLO; Marlin: kernels marlin_mm launches)",
}
