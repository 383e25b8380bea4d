"""Reading what ptxas made of a kernel: SASS with control codes, ptxas' resource line, Mosaic's resources.

``nvdisasm -print-instruction-encoding``-style SASS as Mosaic GPU dumps it (``*.sass_ctrl``) has one
instruction a line, prefixed by its control code ``W:R:S:Y:NN`` (wait mask, read barrier, write barrier,
yield, stall cycles) and its byte offset::

    -:-:-:Y:01        /*2cf0*/                   HGMMA.64x8x16.F32.BF16 R24, R36, gdesc[UR8], R24

The steady-state main loop of a GEMM kernel is a conditional backward branch (``@P0 BRA`` to an earlier
label) whose span holds the HGMMAs and no EXIT. Unconditional backward branches are barrier-wait retry
paths and are never counted. A kernel whose K steps are all unrolled (nybble's pipelines unroll one round
of SMEM slots, so K of at most one round has no loop) is measured over its straight-line main stretch
instead: from the last barrier wait before its first weight HGMMA to its last weight HGMMA.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable

# Control codes: wait mask (scoreboards waited on: "2&1" for two, or a hex mask "0x1e" for many), read
# and write scoreboards, yield, stall.
_INSTRUCTION = re.compile(
    r"^\s*(?P<ctrl>(?:0x[0-9a-f]+|[-\d&]+):[-\d]+:[-\d]+:[-Y]:\d+)\s+/\*(?P<offset>[0-9a-f]+)\*/\s+(?P<text>.*?)\s*;?\s*$"
)
_LABEL = re.compile(r"^\s*(?P<label>\.L_x_\d+):\s*$")
_BRANCH_TARGET = re.compile(r"BRA\s+`?\(?(?P<label>\.L_x_\d+)\)?`?")
# HGMMA.64x8x16.F32.BF16: a 64 x K_h tile of A (the weights) times a K_h x N tile of B per instruction.
_HGMMA_SHAPE = re.compile(r"HGMMA\.(?P<m>\d+)x(?P<n>\d+)x(?P<k>\d+)")
# Operands after the opcode: the accumulator, then A as a register (R36) or as the descriptor pair.
_REGISTER_A = re.compile(r"HGMMA\S*\s+R\d+,\s*R\d+,")
_PTXAS_REGISTERS = re.compile(r"Used (?P<regs>\d+) registers")
_PTXAS_SPILLS = re.compile(r"(?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads")
_PTXAS_STACK = re.compile(r"(?P<stack>\d+) bytes stack frame")
_MAXNTID = re.compile(r"\.(?:maxntid|reqntid)\s+(?P<x>\d+)(?:,\s*(?P<y>\d+))?(?:,\s*(?P<z>\d+))?")
_SMEM_SCRATCH = re.compile(r"smem_scratch_bytes=(?P<bytes>\d+)")
# Threads of one warpgroup: every HGMMA is issued by a whole warpgroup.
WARPGROUP_THREADS = 128


@dataclasses.dataclass(frozen=True)
class Instruction:
    offset: int
    stall: int  # stall cycles the control code asks for after this instruction
    predicate: str | None  # "@P0", "@!P0", "@UP1", ... or None
    opcode: str  # full opcode with modifiers, e.g. "HGMMA.64x8x16.F32.BF16"
    text: str

    @property
    def base_opcode(self) -> str:
        """The opcode without modifiers (``LDS`` for ``LDS.U16``)."""
        return self.opcode.split(".", 1)[0]


@dataclasses.dataclass(frozen=True)
class Sass:
    """A kernel's instructions in program order, and the index of the instruction each label precedes."""

    instructions: tuple[Instruction, ...]
    labels: dict[str, int]


def parse_sass(text: str) -> Sass:
    """Parses a ``.sass_ctrl`` dump (one function) into instructions and label positions."""
    instructions: list[Instruction] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        if m := _LABEL.match(line):
            labels[m["label"]] = len(instructions)
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        body = m["text"].strip().rstrip(";").strip()
        predicate = None
        if body.startswith("@"):
            predicate, body = body.split(None, 1)
        opcode = body.split(None, 1)[0]
        stall = int(m["ctrl"].rsplit(":", 1)[1])
        instructions.append(Instruction(int(m["offset"], 16), stall, predicate, opcode, body))
    if not instructions:
        raise ValueError("parse_sass: no SASS instructions found (is this a .sass_ctrl dump?)")
    return Sass(tuple(instructions), labels)


@dataclasses.dataclass(frozen=True)
class Loop:
    """One steady-state loop: instructions [start, end] inclusive, the closing branch at ``end``; or, for
    a kernel with every K step unrolled (``straight_line``), its stretch of steps."""

    start: int
    end: int
    instructions: tuple[Instruction, ...]
    straight_line: bool = False

    @property
    def size(self) -> int:
        return len(self.instructions)

    @property
    def hgmmas(self) -> tuple[Instruction, ...]:
        return tuple(i for i in self.instructions if i.base_opcode == "HGMMA")

    @property
    def weight_hgmmas(self) -> tuple[Instruction, ...]:
        """The HGMMAs that consume dequantized weights: those whose A operand is in registers.

        ``HGMMA.64x8x16.F32.BF16 R24, R36, gdesc[UR8], R24`` reads A from registers (R36); ``..., R24,
        gdesc[UR8], R24`` reads both operands from SMEM (a constant tile, e.g. nybble's all-ones A that sums
        x, or its -136 tile). A loop without register-A HGMMAs (an SMEM-only GEMM) counts all of them.
        """
        register_a = tuple(h for h in self.hgmmas if _REGISTER_A.search(h.text))
        return register_a or self.hgmmas

    @property
    def stall_cycles(self) -> int:
        """Sum of the control codes' stall counts: the cycles one warp alone needs to issue the loop."""
        return sum(i.stall for i in self.instructions)

    @property
    def weights_per_thread(self) -> float:
        """A-operand elements (weights) one thread's share of the loop's HGMMAs consumes.

        An ``HGMMA.64xNxK`` multiplies a 64 x K tile of A held by the warpgroup's 128 threads.
        """
        total = 0
        for h in self.weight_hgmmas:
            shape = _HGMMA_SHAPE.search(h.opcode)
            if shape is None:
                raise ValueError(f"unrecognised HGMMA shape in {h.opcode!r}")
            total += int(shape["m"]) * int(shape["k"])
        return total / WARPGROUP_THREADS

    @property
    def instructions_per_weight(self) -> float:
        """SASS instructions one thread issues per weight it feeds to the tensor cores."""
        return self.size / self.weights_per_thread

    def opcode_mix(self, top: int | None = None, *, modifiers: bool = False) -> list[tuple[str, int]]:
        """(opcode, count) pairs, most frequent first."""
        names = (i.opcode if modifiers else i.base_opcode for i in self.instructions)
        return collections.Counter(names).most_common(top)


def main_loop(sass: Sass) -> Loop | None:
    """The loop that issues the HGMMAs: the conditional backward branch whose body has the most of them.

    Ties (nested loops with the same HGMMAs) go to the innermost, the smallest span. When no conditional
    backward branch encloses an HGMMA (every K step unrolled), :func:`straight_line_steps`; None when the
    kernel has no register-A HGMMA either.
    """
    best: Loop | None = None
    for end, instr in enumerate(sass.instructions):
        if instr.base_opcode != "BRA" or instr.predicate is None:
            continue
        target = _BRANCH_TARGET.search(instr.text)
        if target is None or target["label"] not in sass.labels:
            continue
        start = sass.labels[target["label"]]
        if start > end:
            continue  # forward branch
        body = sass.instructions[start : end + 1]
        if any(i.base_opcode == "EXIT" for i in body):
            continue
        loop = Loop(start, end, body)
        n = len(loop.hgmmas)
        if n == 0:
            continue
        if best is None or n > len(best.hgmmas) or (n == len(best.hgmmas) and loop.size < best.size):
            best = loop
    return best if best is not None else straight_line_steps(sass)


def straight_line_steps(sass: Sass) -> Loop | None:
    """The unrolled K steps of a kernel without a main loop: from the last mbarrier wait before the first
    register-A HGMMA (the first step's wait for its operands) to the last register-A HGMMA."""
    return unrolled_stretch(sass, _is_register_a_hgmma)


def _is_register_a_hgmma(ins: Instruction) -> bool:
    return ins.base_opcode == "HGMMA" and bool(_REGISTER_A.search(ins.text))


def unrolled_stretch(
    sass: Sass, in_step: Callable[[Instruction], bool], *, from_start: bool = True
) -> Loop | None:
    """Unrolled steps: from the last mbarrier wait before the first instruction ``in_step`` picks (the first
    step's wait for its operands) to the last one; without such a wait, from the kernel's start
    (``from_start``) or from that first instruction. None when ``in_step`` picks nothing."""
    code = sass.instructions
    picked = [i for i, ins in enumerate(code) if in_step(ins)]
    if not picked:
        return None
    waits = [i for i in range(picked[0]) if code[i].base_opcode == "SYNCS" and "TRYWAIT" in code[i].opcode]
    start = waits[-1] if waits else (0 if from_start else picked[0])
    return Loop(start, picked[-1], code[start : picked[-1] + 1], straight_line=True)


@dataclasses.dataclass(frozen=True)
class PtxasInfo:
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


def parse_ptxas(text: str) -> PtxasInfo:
    """The resource lines of ``ptxas -v`` for one entry function."""
    regs = _PTXAS_REGISTERS.search(text)
    spills = _PTXAS_SPILLS.search(text)
    stack = _PTXAS_STACK.search(text)
    if regs is None or spills is None:
        raise ValueError(f"parse_ptxas: no register/spill line in ptxas output:\n{text[:500]}")
    return PtxasInfo(
        registers=int(regs["regs"]),
        spill_store_bytes=int(spills["stores"]),
        spill_load_bytes=int(spills["loads"]),
        stack_bytes=int(stack["stack"]) if stack else 0,
    )


def threads_per_block(ptx: str) -> int:
    """Threads per CTA from the PTX entry's ``.maxntid`` / ``.reqntid`` directive."""
    m = _MAXNTID.search(ptx)
    if m is None:
        raise ValueError("threads_per_block: the PTX has no .maxntid/.reqntid directive")
    return int(m["x"]) * int(m["y"] or 1) * int(m["z"] or 1)


def smem_scratch_bytes(resources: str) -> int:
    """SMEM Mosaic GPU allocates for the kernel's scratch buffers (its ``resources.txt`` dump)."""
    m = _SMEM_SCRATCH.search(resources)
    if m is None:
        raise ValueError(f"smem_scratch_bytes: not found in {resources[:200]!r}")
    return int(m["bytes"])
