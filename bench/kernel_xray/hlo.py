"""The launches one compiled call costs, read off XLA's optimized HLO (``compiled.as_text()``).

Every instruction of the ENTRY computation that does work on the device is one launch: a fusion, a custom
call (a Mosaic GPU kernel, a cuBLAS GEMM), a copy, a collective. Parameters, constants, bitcasts and tuple
plumbing cost nothing. Each launch's bytes are its operands plus its result as XLA types them; operands are
traced back through bitcasts to the entry parameters so bytes can be charged to what they are (the
codes, the scales, x) rather than to an HLO name.

In an SPMD program (one compiled for several devices) the entry computation is one device's program, and
:func:`collectives` reads its collectives: the op, its buffer, the devices in each group, and the bytes a
ring algorithm sends per device.
"""

from __future__ import annotations

import dataclasses
import re

_FREE_OPCODES = frozenset(
    {
        "parameter",
        "constant",
        "bitcast",
        "get-tuple-element",
        "tuple",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
        "add-dependency",
        "copy-done",
        "all-reduce-done",
        "all-gather-done",
        "collective-permute-done",
        "async-done",
        "send-done",
        "recv-done",
    }
)
_DTYPE_BITS = {
    "pred": 8,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "f8e4m3fn": 8,
    "f8e5m2": 8,
    "token": 0,
}
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")
_LINE = re.compile(r"^\s*(?P<root>ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_ARRAY_TYPE = re.compile(r"(?P<dtype>[a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[(?P<dims>[\d,]*)\]")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')
_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_FUSION_KIND = re.compile(r"kind=(?P<kind>k\w+)")
_BACKEND_KIND = re.compile(r'"kind":"(?P<kind>__[\w$]+)"')


@dataclasses.dataclass(frozen=True)
class Value:
    name: str
    opcode: str
    bytes: int
    operands: tuple[str, ...]
    is_root: bool
    op_name: str  # the op_name metadata (the argument's path for parameters: "x", "qw.codes")
    line: str


@dataclasses.dataclass(frozen=True)
class Launch:
    """One device launch of the compiled entry computation."""

    name: str
    kind: str  # "mosaic_gpu", "cublas", "cublasLt", "triton_gemm", "fusion", "copy", "all-reduce", ...
    detail: str  # custom call target or fusion kind
    operand_bytes: dict[str, int]  # by source: a parameter's op_name, or "intermediate"
    result_bytes: int
    result_is_output: bool

    @property
    def bytes(self) -> int:
        return sum(self.operand_bytes.values()) + self.result_bytes


def _type_bytes(type_text: str) -> int:
    bits = 0
    for m in _ARRAY_TYPE.finditer(type_text):
        dims = [int(d) for d in m["dims"].split(",") if d]
        count = 1
        for d in dims:
            count *= d
        bits += count * _DTYPE_BITS.get(m["dtype"], 32)
    return (bits + 7) // 8


def _split_type_and_op(rest: str) -> tuple[str, str, str]:
    """'bf16[8]{0} fusion(%a, %b), kind=...' -> (type text, opcode, the rest after the opcode)."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == " " and depth == 0:
            type_text, tail = rest[:i], rest[i + 1 :].lstrip()
            m = re.match(r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<after>.*)$", tail)
            if m is None:
                raise ValueError(f"unparsed HLO instruction: {rest[:200]}")
            return type_text, m["op"], m["args"] + "\x00" + m["after"]
    raise ValueError(f"unparsed HLO instruction: {rest[:200]}")


def entry_values(hlo_text: str) -> dict[str, Value]:
    """The instructions of the ENTRY computation, by name, in program order."""
    start = hlo_text.find("\nENTRY ")
    if start < 0:
        raise ValueError("entry_values: no ENTRY computation in this HLO text")
    values: dict[str, Value] = {}
    for line in hlo_text[start:].splitlines()[1:]:
        if line.strip() == "}":
            break
        m = _LINE.match(line)
        if not m:
            continue
        type_text, opcode, packed = _split_type_and_op(m["rest"])
        args, _, _after = packed.partition("\x00")
        # XLA numbers every fifth operand with a comment: "..., /*index=5*/%k_cache.1, ..."
        args = _INDEX_COMMENT.sub("", args)
        operands = tuple(a.strip().lstrip("%") for a in args.split(",") if a.strip().startswith("%"))
        op_name = _OP_NAME.search(line)
        values[m["name"]] = Value(
            name=m["name"],
            opcode=opcode,
            bytes=_type_bytes(type_text),
            operands=operands,
            is_root=bool(m["root"]),
            op_name=op_name["name"] if op_name else "",
            line=line.strip(),
        )
    return values


def _source(values: dict[str, Value], name: str) -> str:
    """What an operand is: the entry parameter it is a view of (its op_name), else "intermediate"."""
    v = values.get(name)
    while v is not None and v.opcode in ("bitcast", "get-tuple-element") and v.operands:
        v = values.get(v.operands[0])
    if v is not None and v.opcode == "parameter":
        return v.op_name or v.name
    return "intermediate"


def _kind(v: Value) -> tuple[str, str]:
    if v.opcode == "custom-call":
        target = _TARGET.search(v.line)
        t = target["target"] if target else "?"
        if t.startswith("mosaic_gpu"):
            return "mosaic_gpu", t
        if t == "__cublas$lt$matmul" or t.startswith("__cublas$lt"):
            return "cublasLt", t
        if t.startswith("__cublas"):
            return "cublas", t
        return "custom-call", t
    if v.opcode == "fusion":
        kind = _FUSION_KIND.search(v.line)
        backend = _BACKEND_KIND.search(v.line)
        if backend and "triton" in backend["kind"] and "gemm" in backend["kind"]:
            return "triton_gemm", backend["kind"]
        if backend and "cublas" in backend["kind"]:
            return "cublas", backend["kind"]
        return "fusion", kind["kind"] if kind else "?"
    return v.opcode, v.opcode


def launch_kind(v: Value) -> tuple[str, str]:
    """(kind, detail) of an instruction, as :class:`Launch` names them ("mosaic_gpu", "triton_gemm", ...)."""
    return _kind(v)


def launches(hlo_text: str) -> list[Launch]:
    """The device launches of a compiled computation, in program order."""
    values = entry_values(hlo_text)
    root = next((v for v in values.values() if v.is_root), None)
    outputs = {root.name} if root is not None else set()
    if root is not None and root.opcode == "tuple":
        outputs.update(root.operands)
    out = []
    for v in values.values():
        if v.opcode in _FREE_OPCODES or v.opcode.endswith("-done"):
            continue
        kind, detail = _kind(v)
        operand_bytes: dict[str, int] = {}
        for operand in v.operands:
            src = _source(values, operand)
            size = values[operand].bytes if operand in values else 0
            operand_bytes[src] = operand_bytes.get(src, 0) + size
        out.append(Launch(v.name, kind, detail, operand_bytes, v.bytes, v.name in outputs))
    return out


_CALLS = re.compile(r"calls=%(?P<comp>[\w.\-]+)")
_COMPUTATION = re.compile(r"^%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_PARAMETER = re.compile(r"parameter\((?P<index>\d+)\)")


def gathered_reads(hlo_text: str) -> dict[str, dict[str, int]]:
    """What the entry's fusions read of an operand they gather from: {fusion: {operand source (as
    :class:`Launch` names it): bytes}}, for each fusion whose computation applies ``gather`` straight to
    one of its parameters (the bytes of the gather's result, the slices it reads, not the whole operand:
    an embedding row, an expert's matrix)."""
    gathers: dict[str, dict[int, int]] = {}  # computation -> parameter index -> bytes gathered
    current: str | None = None
    params: dict[str, int] = {}
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head is not None:
            current, params = head["name"], {}
            continue
        m = _LINE.match(line)
        if current is None or m is None:
            continue
        type_text, opcode, packed = _split_type_and_op(m["rest"])
        if opcode == "parameter" and (p := _PARAMETER.search(line)) is not None:
            params[m["name"]] = int(p["index"])
        elif opcode == "gather":
            first = packed.split(",")[0].strip().lstrip("%")
            if first in params:
                per = gathers.setdefault(current, {})
                per[params[first]] = per.get(params[first], 0) + _type_bytes(type_text)
    values = entry_values(hlo_text)
    out: dict[str, dict[str, int]] = {}
    for v in values.values():
        calls = _CALLS.search(v.line) if v.opcode == "fusion" else None
        if calls is None or calls["comp"] not in gathers:
            continue
        for index, size in gathers[calls["comp"]].items():
            if index < len(v.operands):
                src = _source(values, v.operands[index])
                reads = out.setdefault(v.name, {})
                reads[src] = reads.get(src, 0) + size
    return out


_COLLECTIVE_OPS = {
    # op -> bytes each device sends in a ring, as a fraction of the buffer (the result; the operand for
    # reduce-scatter), over a group of g devices.
    "all-reduce": lambda g: 2 * (g - 1) / g,  # reduce-scatter + all-gather
    "all-gather": lambda g: (g - 1) / g,
    "reduce-scatter": lambda g: (g - 1) / g,
    "all-to-all": lambda g: (g - 1) / g,
    "collective-permute": lambda g: 1.0,
}
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<names>[^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<dims>[\d,]+)\]<=")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{(?P<first>[\d,\s]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled SPMD program (one device's view)."""

    name: str
    op: str  # "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"
    buffer_bytes: int  # the reduced/gathered buffer: the result (the operand for reduce-scatter)
    group_size: int  # devices in each replica group
    line: str  # the HLO instruction

    @property
    def ring_bytes_per_device(self) -> float:
        """Bytes each device sends (and receives) in a ring algorithm: the link traffic of the op."""
        return self.buffer_bytes * _COLLECTIVE_OPS[self.op](self.group_size)


def group_size(line: str) -> int:
    """Devices in each replica group of a collective instruction (1 when it names none)."""
    if m := _MESH_GROUPS.search(line):
        sizes = dict(
            (name.strip().strip("'"), int(size))
            for name, size in (part.split("=") for part in m["axes"].split(",") if "=" in part)
        )
        names = [n.strip().strip("'") for n in m["names"].split(",") if n.strip()]
        count = 1
        for n in names:
            count *= sizes[n]
        return count
    if m := _IOTA_GROUPS.search(line):
        return int(m["dims"].split(",")[-1])
    if m := _LIST_GROUPS.search(line):
        return len([d for d in m["first"].split(",") if d.strip()])
    return 1


def collectives(hlo_text: str) -> list[Collective]:
    """The collectives of a compiled computation's entry, in program order (async starts counted once)."""
    values = entry_values(hlo_text)
    # An async op's result is its "-done" instruction's (the start's type may be an (operand, result) tuple).
    done = {v.operands[0]: v for v in values.values() if v.opcode.endswith("-done") and v.operands}
    out = []
    for v in values.values():
        op = v.opcode.removesuffix("-start")
        if op not in _COLLECTIVE_OPS:
            continue
        size = done[v.name].bytes if v.opcode.endswith("-start") and v.name in done else v.bytes
        if op == "reduce-scatter" and v.operands and v.operands[0] in values:
            size = values[v.operands[0]].bytes
        out.append(Collective(v.name, op, size, group_size(v.line), v.line))
    return out
