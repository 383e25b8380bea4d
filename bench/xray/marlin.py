"""Marlin (vLLM's ``gptq_marlin``) compiled for sm_90a on this CPU; its main loop read with the hot-path rule.

What vLLM runs for a W4A16 linear layer on Hopper is ``marlin_mm`` (``csrc/quantization/marlin/marlin.cu``)
launching one instantiation of the ``Marlin<...>`` template (``marlin_template.h``). :func:`marlin_launches`
replays ``marlin_mm``'s host-side choice (the M split, ``thread_m_blocks``, ``m_block_size_8``, the thread
tile from ``small_batch_thread_configs`` / ``large_batch_thread_configs``, the switch to 128 x 64 tiles
when the grid would be under-filled, the shared-memory check) so each (shape, M) gets the kernels vLLM
would launch. :func:`compile_kernel` compiles that instantiation, unmodified, from the pinned vLLM sdist
with nvcc from PyPI wheels (``bench.xray.peer_tools``) and the flags torch's extension build passes;
``core/scalar_type.hpp``'s one torch include (``STD_TORCH_CHECK``, host-side checks only) is given a
two-line stand-in.

Counting Marlin's loop (``hot_path``)
-------------------------------------
Marlin is an ``mma.sync`` kernel: its tensor-core instruction is ``HMMA.16816.F32.BF16``. Its K loop is
the conditional backward branch whose body holds the most HMMAs (no EXIT), as for nybble's HGMMA loop.
Marlin's loop body also holds the end of a K slice (the cross-CTA reduction and C write, guarded by
``if (slice_iters == 0)``): a forward branch jumps over it on every iteration but the last of a slice.
Steady state therefore runs **the loop span minus the largest forward-skipped region that holds no MMA**.
Worked example (vLLM 0.34.0, bf16, GPTQ int4, g128, ``Marlin<..., 128 threads, m 1, n 4, k 8, m8=true,
stages 4, groups 8>``, the kernel of M = 1 at 4096 x 4096): the loop spans instructions 527-2195, 1,669
instructions with 32 HMMAs; the largest forward branch inside it whose skipped range holds no HMMA skips
936 instructions (the slice epilogue); hot path 1,669 - 936 = 733 instructions.

Weights per thread: an ``m16n8k16`` HMMA with the weights as its B operand (a 16 x 8 tile, 128 weights per
warp) feeds 4 weights per thread, and each B fragment is multiplied by every one of the kernel's
``thread_m_blocks`` A fragments: weights = 4 x HMMAs / m_blocks. With ``m_block_size_8`` (M <= 8) Marlin
swaps the operands (``mma_trans``: the weights are the 16 x 16 A operand, 8 per thread, one HMMA each):
weights = 8 x HMMAs. The example: 32 x 8 = 256 weights per thread, 733 / 256 = 2.86 instructions per
weight on the hot path (6.52 over the whole span).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.kernel_xray import sass as sass_lib
from bench.xray import peer_tools

# torch's CUDA extension build (torch.utils.cpp_extension) passes these to nvcc; vLLM adds -O3.
TORCH_EXTENSION_FLAGS = (
    "-O3",
    "--expt-relaxed-constexpr",
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "-std=c++17",
)
TORCH_CHECK_STAND_IN = """#pragma once
// nybble's X-ray: stand-in for torch's header-only STD_TORCH_CHECK (host-side checks; no device code).
#include <stdexcept>
#define STD_TORCH_CHECK(cond, ...) do { if (!(cond)) throw std::runtime_error(#cond); } while (0)
#define STD_TORCH_CHECK_NOT_IMPLEMENTED(cond, ...) STD_TORCH_CHECK(cond)
"""
STAGES = 4  # marlin_mm: 4 pipeline stages on sm80+
MIN_THREAD_N = MIN_THREAD_K = 64
# marlin.cu's thread tiles (thread_k, thread_n, threads), in priority order.
SMALL_BATCH = ((128, 128, 256), (64, 128, 128), (128, 64, 128))
LARGE_BATCH = ((64, 256, 256), (64, 128, 128), (128, 64, 128))
GROUP_BLOCKS = (-1, 2, 4, 8)  # instantiated group sizes: per column, 32, 64, 128


@dataclasses.dataclass(frozen=True)
class MarlinKernel:
    """One ``Marlin<...>`` instantiation (the template arguments that change its code)."""

    b_type: str  # "kU4B8" (GPTQ symmetric, bias 8) or "kU4" (with integer zero points)
    threads: int
    thread_m_blocks: int
    thread_n_blocks: int
    thread_k_blocks: int
    m_block_size_8: bool
    group_blocks: int
    dtype: str = "kBFloat16"

    @property
    def tag(self) -> str:
        """``marlin_u4b8_t128_m1x8_n4_k8_g8``: a stable name for rows and caches."""
        m = f"m{self.thread_m_blocks}{'x8' if self.m_block_size_8 else ''}"
        return (
            f"marlin_{self.b_type[1:].lower()}_t{self.threads}_{m}_n{self.thread_n_blocks}_"
            f"k{self.thread_k_blocks}_g{self.group_blocks}"
        )

    def instantiation(self) -> str:
        t = f"vllm::{self.dtype}.id()"
        return (
            f"template __global__ void Marlin<{t}, vllm::{self.b_type}.id(), {t}, {t}, {self.threads}, "
            f"{self.thread_m_blocks}, {self.thread_n_blocks}, {self.thread_k_blocks}, "
            f"{'true' if self.m_block_size_8 else 'false'}, {STAGES}, {self.group_blocks}, false>"
            "( MARLIN_KERNEL_PARAMS );"
        )

    @property
    def weights_per_hmma(self) -> float:
        """Weights one thread feeds per HMMA (see the module docstring)."""
        return 8.0 if self.m_block_size_8 else 4.0 / self.thread_m_blocks


def _cache_bytes(tk: int, tn: int, tmb: int, group_size: int, has_zp: bool) -> int:
    """``get_kernel_cache_size`` of marlin.cu for 4-bit weights, 16-bit scales, integer zero points."""
    pack_factor = 8
    sh_a = STAGES * (tmb * 16 * tk) * 2
    sh_b = STAGES * (tk * tn // pack_factor) * 4
    sh_red = tmb * 16 * (tn + 8) * 2
    sh_bias = tn * 2
    tmp = max(max(sh_b, sh_red), min(sh_b, sh_red) + sh_bias)
    groups = 1 if group_size == -1 else -(-tk // group_size)
    sh_s = groups * tn * 2 * STAGES
    sh_zp = sh_s // 4 if has_zp else 0
    return tmp + sh_a + sh_s + sh_zp


def _valid(
    cfg: tuple[int, int, int], tmb: int, n: int, k: int, group_size: int, has_zp: bool, smem: int
) -> bool:
    tk, tn, threads = cfg
    if k % tk or n % tn or tn < MIN_THREAD_N or tk < MIN_THREAD_K or threads < 128:
        return False
    return _cache_bytes(tk, tn, tmb, group_size, has_zp) <= smem


def _instantiated(cfg: tuple[int, int, int], tmb: int) -> bool:
    """generate_kernels.py: 256-thread kernels only at 128 x 128 for m_blocks <= 1 and 64 x 256 above."""
    tk, tn, threads = cfg
    if threads == 256:
        return (tk, tn) == ((128, 128) if tmb <= 1 else (64, 256))
    return True


def marlin_launches(
    m: int,
    k: int,
    n: int,
    group_size: int | None,
    symmetric: bool,
    *,
    sms: int = 132,
    max_shared_mem: int = 232448,
) -> list[tuple[MarlinKernel, int]]:
    """The (kernel, rows) launches ``marlin_mm`` makes for an (M, K) x (K, N) int4 product.

    Raises ValueError for a problem Marlin refuses (it needs N % 64 == 0 and K % 64 == 0, groups of
    32, 64, 128 or per column).
    """
    gs = -1 if group_size is None else group_size
    if gs != -1 and gs // 16 not in GROUP_BLOCKS:
        raise ValueError(f"Marlin has kernels for group sizes 32, 64, 128 and per column, not {group_size}")
    has_zp = not symmetric
    b_type = "kU4B8" if symmetric else "kU4"
    max_par = 128 if n <= 4096 else 16
    rest, max_tmb, out = m, 4, []
    while rest:
        par = min(rest // (max_tmb * 16), max_par)
        split = par * max_tmb * 16 if par > 0 else rest
        tmb = min(-(-split // 16), max_tmb)
        m8 = split <= 8
        cfg = None
        for c in LARGE_BATCH if tmb > 1 else SMALL_BATCH:
            if _valid(c, tmb, n, k, gs, has_zp, max_shared_mem - 512) and _instantiated(c, tmb):
                cfg = c
                break
        if cfg is not None and n // cfg[1] * -(-split // (tmb * 16)) * 4 <= sms:
            if _valid((128, 64, 128), tmb, n, k, gs, has_zp, max_shared_mem):
                cfg = (128, 64, 128)
        if cfg is None:
            if max_tmb > 1:
                max_tmb -= 1
                continue
            raise ValueError(f"Marlin has no kernel for M={m} K={k} N={n} group {group_size}")
        tk, tn, threads = cfg
        kernel = MarlinKernel(b_type, threads, tmb, tn // 16, tk // 16, m8, gs if gs == -1 else gs // 16)
        out.append((kernel, split))
        rest -= split
    return out


@dataclasses.dataclass(frozen=True)
class HotLoop:
    span: sass_lib.Loop
    skipped: int  # instructions of the largest forward-skipped region without an MMA
    hmmas: int

    @property
    def hot_instructions(self) -> int:
        return self.span.size - self.skipped


def _is_mma(ins: sass_lib.Instruction) -> bool:
    return ins.base_opcode in ("HMMA", "HGMMA")


def hot_path(code: sass_lib.Sass) -> HotLoop | None:
    """The main loop (the conditional backward branch with the most MMAs, no EXIT; innermost on ties)
    and the largest region a forward branch inside it skips that holds no MMA (see the module docstring)."""
    ins = code.instructions
    best: tuple[int, int, int] | None = None
    for end, i in enumerate(ins):
        if i.base_opcode != "BRA" or i.predicate is None:
            continue
        target = sass_lib._BRANCH_TARGET.search(i.text)
        if target is None or target["label"] not in code.labels:
            continue
        start = code.labels[target["label"]]
        if start > end or any(b.base_opcode == "EXIT" for b in ins[start : end + 1]):
            continue
        n = sum(_is_mma(b) for b in ins[start : end + 1])
        if n and (best is None or n > best[2] or (n == best[2] and end - start < best[1] - best[0])):
            best = (start, end, n)
    if best is None:
        return None
    start, end, n = best
    skipped = 0
    for j in range(start, end + 1):
        if ins[j].base_opcode != "BRA":
            continue
        target = sass_lib._BRANCH_TARGET.search(ins[j].text)
        if target is None or target["label"] not in code.labels:
            continue
        to = code.labels[target["label"]]
        if j < to <= end + 1 and not any(_is_mma(b) for b in ins[j + 1 : to]):
            skipped = max(skipped, to - j - 1)
    return HotLoop(sass_lib.Loop(start, end, ins[start : end + 1]), skipped, n)


_HEX_LINE = re.compile(r"^\s*/\*(?P<off>[0-9a-f]{4,})\*/\s+(?P<text>.*?)\s*/\*\s*0x[0-9a-f]{16}\s*\*/\s*$")
_HEX_HIGH = re.compile(r"^\s*/\*\s*(?P<hi>0x[0-9a-f]{16})\s*\*/\s*$")


def control_code_sass(hex_listing: str) -> str:
    """``nvdisasm -c -hex`` output -> the ``W:R:S:Y:NN /*offset*/ TEXT`` lines ``sass.parse_sass`` reads.

    sm_90 instructions are 128 bits; the control code is bits 41-61 of the second 64-bit word: stall
    (4 bits), yield, write scoreboard (3), read scoreboard (3), wait mask (6).
    """
    out, pending = [], None
    for line in hex_listing.splitlines():
        if m := _HEX_LINE.match(line):
            pending = m
            continue
        if (h := _HEX_HIGH.match(line)) and pending is not None:
            ctrl = int(h["hi"], 16) >> 41
            stall, yld, wb, rb, wait = (
                ctrl & 0xF,
                (ctrl >> 4) & 1,
                (ctrl >> 5) & 7,
                (ctrl >> 8) & 7,
                (ctrl >> 11) & 0x3F,
            )
            sb = lambda b: "-" if b == 7 else str(b)
            w = "-" if wait == 0 else f"0x{wait:x}"
            text = pending["text"].rstrip(" ;")
            out.append(
                f"{w}:{sb(rb)}:{sb(wb)}:{'-' if yld else 'Y'}:{stall:02d}   /*{pending['off']}*/   {text} ;"
            )
            pending = None
            continue
        if re.match(r"^\s*\.L_x_\d+:\s*$", line):
            out.append(line.strip())
    return "\n".join(out)


def compile_kernel(kernel: MarlinKernel, nvdisasm: Path, *, cache: Path | None = None) -> dict[str, Any]:
    """Compiles one instantiation to a cubin (cached by its source and flags) and X-rays it: ptxas'
    registers and spills, the loop span, the hot path, instructions per weight."""
    csrc = peer_tools.vllm_source()
    root = peer_tools.cuda_tree()
    marlin_dir = csrc / "quantization" / "marlin"
    source = (
        '#include "kernel.h"\n#include "marlin_template.h"\nnamespace MARLIN_NAMESPACE_NAME {\n'
        f"{kernel.instantiation()}\n}}\n"
    )
    flags = ("-arch=sm_90a", "-cubin", *TORCH_EXTENSION_FLAGS)
    key = hashlib.sha256(
        (source + " ".join(flags) + peer_tools.VLLM_VERSION + str(root)).encode()
    ).hexdigest()[:12]
    cache = cache or (peer_tools.peers_dir() / "marlin-cubins")
    out_dir = cache / f"{kernel.tag}-{key}"
    if not (out_dir / "ptxas.txt").exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=cache))
        (tmp / "stub" / "torch" / "headeronly" / "util").mkdir(parents=True)
        (tmp / "stub" / "torch" / "headeronly" / "util" / "Exception.h").write_text(TORCH_CHECK_STAND_IN)
        (tmp / "kernel.cu").write_text(source)
        cmd = [
            str(root / "bin" / "nvcc"),
            *flags,
            "-ccbin",
            peer_tools.host_compiler(),
            f"-I{csrc}",
            f"-I{marlin_dir}",
            f"-I{tmp / 'stub'}",
            "-Xptxas",
            "-v",
            "-o",
            str(tmp / "kernel.cubin"),
            str(tmp / "kernel.cu"),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {kernel.tag}: {proc.stderr.strip()[-1500:]}")
        (tmp / "ptxas.txt").write_text(proc.stderr)
        listing = subprocess.run(
            [str(nvdisasm), "-c", "-hex", str(tmp / "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (tmp / "kernel.sass_ctrl").write_text(control_code_sass(listing))
        try:
            tmp.rename(out_dir)
        except OSError:
            pass
    code = sass_lib.parse_sass((out_dir / "kernel.sass_ctrl").read_text())
    info = sass_lib.parse_ptxas((out_dir / "ptxas.txt").read_text())
    loop = hot_path(code)
    if loop is None:
        raise RuntimeError(f"{kernel.tag}: no loop with HMMAs in its SASS")
    weights = loop.hmmas * kernel.weights_per_hmma
    hot_ipw = loop.hot_instructions / weights
    mix = collections.Counter(i.base_opcode for i in loop.span.instructions).most_common(12)
    return {
        "name": kernel.tag,
        "registers": info.registers,
        "spill_bytes": info.spill_bytes,
        "stack_bytes": info.stack_bytes,
        "threads": kernel.threads,
        "smem_bytes": 0,
        "sass_instructions": len(code.instructions),
        "loop": {
            "start_offset": loop.span.instructions[0].offset,
            "end_offset": loop.span.instructions[-1].offset,
            "instructions": loop.hot_instructions,
            "span_instructions": loop.span.size,
            "skipped_instructions": loop.skipped,
            "hgmmas": loop.hmmas,
            "weight_hgmmas": loop.hmmas,
            "hgmma_shape": next(i.opcode for i in loop.span.instructions if _is_mma(i)),
            "weights_per_thread": weights,
            "instructions_per_weight": hot_ipw,
            "span_instructions_per_weight": loop.span.size / weights,
            "stall_cycles": sum(i.stall for i in loop.span.instructions),
            "opcode_mix": mix,
            "straight_line": False,
        },
    }


def launch_record(
    kernel: MarlinKernel, rows: int, k: int, n: int, group_size: int | None, symmetric: bool
) -> dict[str, Any]:
    """One launch in the X-ray's ``hlo.Launch`` form: what it reads and writes."""
    groups = 1 if group_size is None else math.ceil(k / group_size)
    scales = groups * n * 2 + (0 if symmetric else groups * n // 2)
    return {
        "name": kernel.tag,
        "kind": "cuda",
        "detail": "Marlin",
        "operand_bytes": {"x": rows * k * 2, "qw.codes": k * n // 2, "qw.scales": scales},
        "result_bytes": rows * n * 2,
        "result_is_output": True,
    }


def marlin_record(
    case: Any, nvdisasm: Path, *, sms: int = 132, max_shared_mem: int = 232448
) -> dict[str, Any]:
    """A worker-style record (``key``, ``case``, ``report``) of the kernels vLLM launches for a case."""
    out: dict[str, Any] = {"key": case.key, "case": dataclasses.asdict(case)}
    try:
        launches = marlin_launches(
            case.m, case.k, case.n, case.group_size, case.symmetric, sms=sms, max_shared_mem=max_shared_mem
        )
        kernels: dict[str, dict[str, Any]] = {}
        for kernel, _ in launches:
            if kernel.tag not in kernels:
                kernels[kernel.tag] = compile_kernel(kernel, nvdisasm)
        out["report"] = {
            "launches": [
                launch_record(kr, rows, case.k, case.n, case.group_size, case.symmetric)
                for kr, rows in launches
            ],
            "kernels": list(kernels.values()),
            "collectives": [],
            "hlo_text": None,
        }
    except Exception as e:  # reported in the case's row, like a worker's failed compile
        out["error"] = f"{type(e).__name__}: {e}"
    return out
