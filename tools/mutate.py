"""A small mutation check: flip one operator or constant at a time in nybble's core, run the tests that
cover that module, and report the mutants no test kills.

    .venv/bin/python tools/mutate.py                 # every target module (CPU heavy: hours on 2 cores)
    .venv/bin/python tools/mutate.py --list          # the mutants only
    .venv/bin/python tools/mutate.py --module nybble/kernels/ops/matmul/xla.py --out /tmp/mutants.jsonl
    .venv/bin/python tools/mutate.py --module nybble/kernels/mosaic_gpu/split_k.py --sample 3

Each mutant is made on the module's syntax tree (``ast``) and written, unparsed, into a scratch copy of
the repository (the working tree is never touched); the module's test files run there with ``-x`` and
stop at the first failure. Mutations: arithmetic and bitwise operators (+ -, * /, // *, % //, << >>,
& | ^), comparisons (< <=, > >=, == !=, is / is not, in / not in), ``and`` / ``or``, dropping ``not`` and
unary minus, integer constants n -> n + 1, float constants x -> 2x (0 -> 1), True / False. Not mutated:
strings, f-strings, annotations, ``raise`` statements (their messages), ``__all__``.
Hypothesis runs derandomized and without shrinking there. Results go to a JSON-lines file (one line a
mutant, so a run can be resumed) and a summary to stdout.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Module -> the test files that cover it, the fastest and most direct first (pytest stops at a failure).
TARGETS: dict[str, list[str]] = {
    "nybble/packing/nibbles.py": ["tests/test_packing.py", "tests/test_reference.py"],
    "nybble/packing/layouts.py": ["tests/test_packing.py", "tests/test_reference.py"],
    "nybble/packing/fragments.py": ["tests/test_layout_wgmma.py", "tests/test_reference.py"],
    "nybble/packing/groups.py": ["tests/test_packing.py", "tests/test_quant.py"],
    "nybble/packing/padding.py": ["tests/test_packing.py", "tests/test_quant.py"],
    "nybble/quant/qweight.py": ["tests/test_reference.py", "tests/test_quant.py", "tests/test_matmul.py"],
    "nybble/quant/rtn.py": ["tests/test_quant.py"],
    "nybble/kernels/ops/matmul/xla.py": ["tests/test_matmul.py"],
    # The Mosaic GPU kernel's modules, killed in GPU interpret mode (race detector on) on the CPU: the bit
    # operations' twins first (no kernel), then bit-exact kernels over both routes, K slices, split-K, the
    # producer, partial last groups and offsets. Minutes a mutant: sample them (--sample).
    "nybble/kernels/mosaic_gpu/dequant_registers.py": [
        "tests/test_kernel_interpret.py",
        "tests/test_kernel_lowering.py",  # the GPU path's inline Mosaic GPU, lowered for CUDA: its IR checks
        "-k",
        "every_nibble or twin_places or slice_sum_twins or bias_folded or producer_warpgroup_exact"
        " or lower_float16_activations or lower_one_step_per_split",
    ],
    "nybble/kernels/mosaic_gpu/common.py": [
        "tests/test_kernel_interpret.py",
        "tests/test_grouped_interpret.py",  # the grouped kernel's row windows (StashedRows, store_rows)
        "-k",
        "bias_folded or producer_warpgroup_exact or partial_last_group_exact or groups_exact"
        " or injected_bugs or test_groups or partial_last_k_step_exact or persistent_grid_exact",
    ],
    "nybble/kernels/mosaic_gpu/split_k.py": [
        "tests/test_kernel_interpret.py",
        "tests/test_kernel_lowering.py",  # the slab rows and the cluster launch, lowered for CUDA
        "-k",
        "split_k_scratch or split_k_slabs or producer_warpgroup_exact or 512_deep_steps_exact"
        " or injected_bugs or split_k_shares or split_k_is_one_launch or lower_one_step_per_split",
    ],
}
COPY = ["nybble", "tests", "bench", "pyproject.toml"]

HYPOTHESIS_PROFILE = """

from hypothesis import Phase, settings

settings.register_profile(
    "mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate], derandomize=True, database=None
)
settings.load_profile("mutation")
"""

BINOPS = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
    ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.BitXor: ast.BitAnd,
}  # fmt: skip
CMPOPS = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}  # fmt: skip
SYMBOL = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
    ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is",
    ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.And: "and", ast.Or: "or",
}  # fmt: skip


@dataclasses.dataclass
class Mutant:
    module: str
    index: int  # the index-th mutation point of the module, in walk order
    line: int
    what: str  # e.g. "< -> <="
    source_line: str


def _skipped_subtrees(tree: ast.AST) -> set[int]:
    """ids of nodes not to mutate: annotations, raise statements, f-strings, __all__, docstrings."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.Raise | ast.JoinedStr):
            mark(node)
        elif isinstance(node, ast.arg):
            mark(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            mark(node.returns)
        elif isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            mark(node)
    return skip


def _points(tree: ast.AST) -> list[tuple[ast.AST, str, object]]:
    """Mutation points in a stable walk order: (node, description, how)."""
    skip = _skipped_subtrees(tree)
    points = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in BINOPS:
            new = BINOPS[type(node.op)]
            points.append((node, f"{SYMBOL[type(node.op)]} -> {SYMBOL[new]}", ("op", new)))
        elif isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                new = CMPOPS[type(op)]
                points.append((node, f"{SYMBOL[type(op)]} -> {SYMBOL[new]}", ("cmp", i, new)))
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            points.append((node, f"{SYMBOL[type(node.op)]} -> {SYMBOL[new]}", ("op", new)))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub):
            points.append((node, f"drop {'not' if isinstance(node.op, ast.Not) else 'unary -'}", ("unary",)))
        elif isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
            v = node.value
            if isinstance(v, bool):
                new_value = not v
            elif isinstance(v, int):
                new_value = v + 1
            else:
                new_value = 2 * v if v else 1.0
            points.append((node, f"{v!r} -> {new_value!r}", ("const", new_value)))
    return points


class _Apply(ast.NodeTransformer):
    def __init__(self, target: ast.AST, how: tuple) -> None:
        self.target, self.how = target, how

    def visit(self, node: ast.AST) -> ast.AST:
        node = self.generic_visit(node)
        if node is not self.target:
            return node
        kind = self.how[0]
        if kind == "op":
            node.op = self.how[1]()
        elif kind == "cmp":
            node.ops[self.how[1]] = self.how[2]()
        elif kind == "unary":
            return node.operand
        elif kind == "const":
            node.value = self.how[1]
        return node


@functools.cache
def _source(module: str) -> str:
    """The module as it was when first read: edits to the working tree during a run change nothing."""
    return (ROOT / module).read_text()


def mutants(module: str) -> list[Mutant]:
    source = _source(module)
    lines = source.splitlines()
    return [
        Mutant(module, i, node.lineno, what, lines[node.lineno - 1].strip())
        for i, (node, what, _) in enumerate(_points(ast.parse(source)))
    ]


def sampled(module: str, count: int, seed: int) -> list[Mutant]:
    """A uniform random sample of the module's mutants, in index order. Each module is shuffled on its own
    (seed and module name), and the sample is a prefix of that order: a larger count extends a smaller one,
    so a resumed run with a larger --sample only adds mutants."""
    import random

    order = mutants(module)
    random.Random(f"{seed}:{module}").shuffle(order)
    return sorted(order[:count], key=lambda m: m.index)


def mutated_source(module: str, index: int) -> str:
    tree = ast.parse(_source(module))
    node, _, how = _points(tree)[index]
    tree = ast.fix_missing_locations(_Apply(node, how).visit(tree))
    return ast.unparse(tree)


def _run_tests(workdir: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    """('killed' | 'survived' | 'timeout', seconds, the first failing test)."""
    env = {**os.environ, "PYTHONPATH": str(workdir), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t0, ""
    elapsed = time.monotonic() - t0
    failed = [ln for ln in done.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return ("survived" if done.returncode == 0 else "killed"), elapsed, (failed[0][:200] if failed else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", action="append", help="a target module (repeatable); default: all")
    ap.add_argument("--list", action="store_true", help="print the mutants and stop")
    default_out = Path(tempfile.gettempdir()) / "nybble-mutants.jsonl"
    ap.add_argument(
        "--out", action="append", help=f"results, a JSON a line (resumable; {default_out}); --summary merges"
    )
    ap.add_argument("--timeout-factor", type=float, default=5.0, help="x the unmutated run's time")
    ap.add_argument("--retry", action="store_true", help="run the survivors and timeouts in --out again")
    ap.add_argument("--summary", action="store_true", help="summarize --out and stop")
    ap.add_argument("--sample", type=int, default=None, help="only this many mutants a module, at random")
    ap.add_argument("--seed", type=int, default=0, help="the --sample draw's seed")
    ap.add_argument("--index", type=int, action="append", help="only these mutants (with one --module)")
    args = ap.parse_args(argv)
    modules = args.module or list(TARGETS)
    unknown = [m for m in modules if m not in TARGETS]
    if unknown:
        ap.error(f"unknown module(s) {unknown}; choose from {list(TARGETS)}")
    todo = [m for module in modules for m in mutants(module)]
    if args.sample is not None:
        todo = [m for module in modules for m in sampled(module, args.sample, args.seed)]
    if args.index is not None:
        if len(modules) != 1:
            ap.error("--index needs exactly one --module")
        todo = [m for m in todo if m.index in args.index]
    if args.list:
        for m in todo:
            print(f"{m.module}:{m.line} #{m.index}: {m.what}    {m.source_line}")
        print(f"{len(todo)} mutants")
        return 0
    outs = [Path(o) for o in args.out or [default_out]]
    if args.summary:  # with --sample: only the sampled mutants of the --module modules count
        sample = None if args.sample is None else {(m.module, m.index) for m in todo}
        return summarize(outs, sample if args.module else None, set(modules))
    if len(outs) > 1:
        ap.error("one --out for a run (several only with --summary)")
    out = outs[0]
    done = set()
    if out.exists():
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        if args.retry:
            rows = rows_kept_for_retry(rows, {(m.module, m.index) for m in todo})
            out.write_text("".join(json.dumps(r) + "\n" for r in rows))
        done = {(r["module"], r["index"]) for r in rows}
    todo = [m for m in todo if (m.module, m.index) not in done]
    modules = [module for module in modules if any(m.module == module for m in todo)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the scratch copy is removed
    work = Path(tempfile.mkdtemp(prefix="nybble-mutate-"))
    try:
        for name in COPY:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, work / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
            else:
                shutil.copy2(src, work / name)
        # Deterministic hypothesis runs without shrinking (a killed mutant is reported, not minimized).
        with (work / "tests" / "conftest.py").open("a") as conftest:
            conftest.write(HYPOTHESIS_PROFILE)
        probe = subprocess.run(
            [sys.executable, "-c", "import nybble; print(nybble.__file__)"],
            cwd=work, env={**os.environ, "PYTHONPATH": str(work)}, capture_output=True, text=True,
        )  # fmt: skip
        if not probe.stdout.startswith(str(work)):
            raise SystemExit(f"the scratch copy is not what gets imported: {probe.stdout or probe.stderr}")
        baseline: dict[str, float] = {}
        for module in modules:
            status, seconds, first = _run_tests(work, TARGETS[module], timeout=3600)
            if status != "survived":
                raise SystemExit(f"{module}: the tests fail without a mutant ({first}): fix them first")
            baseline[module] = seconds
            print(f"baseline {module}: {seconds:.0f} s", flush=True)
        with out.open("a") as log:
            for m in todo:
                original = _source(m.module)
                (work / m.module).write_text(mutated_source(m.module, m.index))
                try:
                    timeout = max(120.0, args.timeout_factor * baseline[m.module])
                    status, seconds, first = _run_tests(work, TARGETS[m.module], timeout)
                finally:
                    (work / m.module).write_text(original)
                row = {**dataclasses.asdict(m), "status": status, "seconds": round(seconds, 1)}
                log.write(json.dumps({**row, "first": first}) + "\n")
                log.flush()
                where = f"{m.module}:{m.line} {m.what}    {m.source_line}"
                print(f"{status:8s} {seconds:5.0f}s {where}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summarize([out])


# Survivors that no test can kill: the mutant behaves as the original for every input the module accepts.
# Matched on (module, the line's text, the mutation): every such mutant of that line is equivalent.
EQUIVALENT: list[tuple[str, str, str, str]] = [
    # (module, source line, mutation, why no behaviour changes)
    *[
        (
            "nybble/packing/nibbles.py",
            "if v.size == 0 or (v.min() >= lo and v.max() <= hi):  # the fast path: two reductions",
            what,
            "a stricter fast path only sends in-range codes at the range's ends to the exact check below",
        )
        for what in (">= -> >", "<= -> <")
    ],
    (
        "nybble/packing/layouts.py",
        "return pack_int4(codes_kn.T, axis=-1, signed=True)",
        "drop unary -",
        "a layout packs 2-D (K_pad, N_pad) codes: axis 1 is axis -1",
    ),
    (
        "nybble/packing/layouts.py",
        "return unpack_int4(packed, k_pad, axis=-1, signed=True).T",
        "drop unary -",
        "a layout stores nk_int4 codes 2-D (N_pad, K_pad / 2): axis 1 is axis -1",
    ),
    (
        "nybble/packing/groups.py",
        "power_of_two = isinstance(group_size, int | np.integer) and not group_size & (group_size - 1)",
        "1 -> 2",
        "g & (g - 2) == 0 iff g & (g - 1) == 0 for g >= 2 (g = 2m: 2 (m & (m - 1))); smaller g fail >= 16",
    ),
    (
        "nybble/packing/padding.py",
        "widths = [(0, t - s) for s, t in zip(x.shape, shape, strict=True)]",
        "True -> False",
        "the line above raises unless len(shape) == x.ndim: the zip's lengths are always equal",
    ),
    (  # both of the line's unary minuses
        "nybble/quant/qweight.py",
        "shape = (*shape[:-1], 2 * shape[-1])",
        "drop unary -",
        "every layout's stored shape is 2-D (layouts.py): shape[:1] is shape[:-1], shape[1] is shape[-1]",
    ),
    (
        "nybble/quant/qweight.py",
        "stacked = int(np.prod(self.codes.shape[:-2])) if np.ndim(self.codes) > 2 else 1  # experts",
        "> -> >=",
        "2-D codes: the product over codes.shape[:-2] = () is 1 as well",
    ),
    (
        "nybble/kernels/mosaic_gpu/common.py",
        "if k1 + width < g0 + span:  # the group's last call is awaited by reading its accumulators",
        "+ -> -",
        "adds a wgmma_wait(1) after a group's last call: no value changes (reading acc waits), only timing",
    ),
    *[
        (
            "nybble/kernels/mosaic_gpu/split_k.py",
            "mine = row0 + r * rows < m",
            what,
            "only adds stores of slabs that start at or past row m: the y store clips rows past M (TMA)",
        )
        for what in ("< -> <=", "* -> /")
    ],
    (
        "nybble/kernels/mosaic_gpu/split_k.py",
        "return slabs[base + t * row_slabs + r]",
        "+ -> -",
        "stores and loads share _slab: any bijection works, and with negative indices either one is one",
    ),
    (
        "nybble/quant/rtn.py",
        "return jnp.where(s == 0, 0.0, jnp.round(offsets.astype(jnp.float32) / jnp.where(s == 0, 1.0, s)))",
        "1.0 -> 2.0",
        "the inner where only guards a division by s = 0 whose result the outer where drops",
    ),
    (  # the inner s == 0 (the outer one's 0 -> 1 is killed by test_integer_zero_factor_and_stacked_quantize)
        "nybble/quant/rtn.py",
        "return jnp.where(s == 0, 0.0, jnp.round(offsets.astype(jnp.float32) / jnp.where(s == 0, 1.0, s)))",
        "0 -> 1",
        "only guards a division by s = 0 (s == 1 divides by 1 either way), whose result the outer drops",
    ),
    (
        "nybble/quant/rtn.py",
        "neg = -jnp.min(jnp.where(valid, wg, 0.0), axis=-2)",
        "0.0 -> 1.0",
        "padded rows: -min changes only where every valid w > 0, to below 0, and max(-min/8, max/7) >= 0",
    ),
    *[
        (
            "nybble/quant/rtn.py",
            "z = jnp.clip(jnp.round(-wmin / jnp.where(s == 0, 1.0, s)), 1, 15)",
            what,
            "only guards a division by s = 0, where the offset returned is 0 whatever z is",
        )
        for what in ("0 -> 1", "1.0 -> 2.0")
    ],
    (  # the first of the line's two (ast.walk order: jnp.minimum's); the second is killed
        "nybble/quant/rtn.py",
        "wmin, wmax = jnp.minimum(wmin, 0.0), jnp.maximum(wmax, 0.0)",
        "0.0 -> 1.0",
        "a group with min > 0 is low either way (-wmin <= s / 2): s = max / 14 and z = 1, whatever wmin",
    ),
    *[
        (
            "nybble/quant/rtn.py",
            "q = jnp.clip(jnp.round((w - b) / jnp.where(s == 0, 1, s)), -8, 7)",
            what,
            "the next line sets q = 0 where s = 0, and where s = 1 the guard divides by 1 either way",
        )
        for what in ("1 -> 2", "0 -> 1")
    ],
    (
        "nybble/quant/rtn.py",
        "wg: jax.Array, valid: jax.Array, symmetric: bool, scale_dtype: Any, shrink: float,"
        " integer: bool = False",
        "False -> True",
        "_range_params is private and both its calls pass integer",
    ),
]


# Functions (or single lines) that run only when lowering for the GPU (interpret mode takes their jax.numpy
# twins): a mutant there that still lowers can only be killed by tests/test_kernel_gpu.py on a Hopper GPU.
# Their survivors are counted as survivors and listed apart, for a GPU run to settle.
GPU_ONLY: dict[str, tuple[str, ...]] = {
    "nybble/kernels/mosaic_gpu/dequant_registers.py": (
        "words_layout",
        "_gpu_dequantize",
        "_gpu_slot_rows",
        "_gpu_sum_slices",
    ),
    # and a line: a CTA's own share on the GPU (interpret mode's one CTA sums every share, me is None)
    "nybble/kernels/mosaic_gpu/split_k.py": ("cluster_sync", "mine = mine & (me == q)"),
}


@functools.cache
def _gpu_only_lines(module: str) -> frozenset[int]:
    names = GPU_ONLY.get(module, ())
    if not names:
        return frozenset()
    functions = {
        line
        for node in ast.walk(ast.parse(_source(module)))
        if isinstance(node, ast.FunctionDef) and node.name in names
        for line in range(node.lineno, node.end_lineno + 1)
    }
    lines = {i for i, text in enumerate(_source(module).splitlines(), 1) if text.strip() in names}
    return frozenset(functions | lines)


def is_gpu_only(row: dict) -> bool:
    return row["line"] in _gpu_only_lines(row["module"])


def is_equivalent(row: dict) -> str | None:
    """The recorded reason when the row's mutant is in EQUIVALENT, else None."""
    for module, line, what, reason in EQUIVALENT:
        if (row["module"], row["source_line"], row["what"]) == (module, line, what):
            return reason
    return None


@dataclasses.dataclass
class ModuleTally:
    module: str
    mutants: int  # all of the module's mutants (a sample runs fewer)
    run: int = 0
    killed: int = 0
    survived: int = 0
    equivalent: int = 0
    gpu_only: int = 0  # of the survivors: in GPU_ONLY code
    timeouts: int = 0  # counted as killed in the rate: the tests do not pass

    @property
    def detected(self) -> int:
        return self.killed + self.timeouts

    @property
    def rate(self) -> float:
        """Killed (timeouts included) over the run mutants that are not equivalent."""
        return self.detected / max(1, self.run - self.equivalent)


def tally(rows: list[dict], totals: dict[str, int]) -> list[ModuleTally]:
    tallies = {module: ModuleTally(module, count) for module, count in totals.items()}
    for r in rows:
        t = tallies.setdefault(r["module"], ModuleTally(r["module"], 0))
        t.run += 1
        if r["status"] == "killed":
            t.killed += 1
        elif r["status"] == "timeout":
            t.timeouts += 1
        elif is_equivalent(r) is not None:
            t.equivalent += 1
        else:
            t.survived += 1
            t.gpu_only += is_gpu_only(r)
    return [t for t in tallies.values() if t.run]


def overall_rate(tallies: list[ModuleTally]) -> tuple[float, float, float]:
    """(estimate, low, high): the kill rate over all the modules' mutants, each module weighted by its
    estimated count of non-equivalent mutants. A fully run module adds no uncertainty; a sampled one adds
    the variance of a proportion drawn without replacement (finite population correction), taken at the
    Agresti-Coull proportion (k + 2) / (n + 4) so that a sample with no survivors still has some. 95%."""
    weights, rates, variances = [], [], []
    for t in tallies:
        n = t.run - t.equivalent
        weights.append(t.mutants * n / max(1, t.run))
        rates.append(t.rate)
        p = (t.detected + 2) / (n + 4)
        population = weights[-1]
        fpc = max(0.0, (population - n) / max(1.0, population - 1))
        variances.append(p * (1 - p) / (n + 4) * fpc if n else 0.0)
    total = sum(weights)
    estimate = sum(w * r for w, r in zip(weights, rates, strict=True)) / total
    half = 1.96 * sum(w * w * v for w, v in zip(weights, variances, strict=True)) ** 0.5 / total
    return estimate, max(0.0, estimate - half), min(1.0, estimate + half)


def rows_kept_for_retry(rows: list[dict], again: set[tuple[str, int]]) -> list[dict]:
    """``--retry``: the rows to keep, all but the survivors and timeouts among the mutants run again
    (``again``: (module, index)); other modules' rows stay as they are."""
    unsettled = ("survived", "timeout")
    return [r for r in rows if r["status"] not in unsettled or (r["module"], r["index"]) not in again]


def summarize(
    outs: list[Path], sample: set[tuple[str, int]] | None = None, sampled: set[str] | None = None
) -> int:
    """The results of ``outs`` by module; ``sample``: only those mutants of the ``sampled`` modules."""
    rows: dict[tuple[str, int], dict] = {}
    for out in outs:  # several runs' files merged; a later row of the same mutant wins
        for line in out.read_text().splitlines():
            r = json.loads(line)
            if sample is None or r["module"] not in (sampled or ()) or (r["module"], r["index"]) in sample:
                rows[r["module"], r["index"]] = r
    totals = {module: len(mutants(module)) for module in TARGETS}
    tallies = tally(list(rows.values()), totals)
    print(f"\n{'module':48s} {'mutants':>7s} {'run':>4s} {'killed':>6s} {'surv':>4s} {'(gpu)':>5s} "
          f"{'equiv':>5s} {'tmout':>5s} {'rate':>6s}")  # fmt: skip
    for t in tallies:
        print(f"{t.module:48s} {t.mutants:7d} {t.run:4d} {t.killed:6d} {t.survived:4d} {t.gpu_only:5d} "
              f"{t.equivalent:5d} {t.timeouts:5d} {100 * t.rate:5.1f}%")  # fmt: skip
    estimate, low, high = overall_rate(tallies)
    sampled = any(t.run < t.mutants for t in tallies)
    interval = f" (sample estimate, 95% interval {100 * low:.1f}-{100 * high:.1f}%)" if sampled else ""
    print(f"overall kill rate {100 * estimate:.1f}%{interval}")
    for r in sorted(rows.values(), key=lambda r: (r["module"], r["line"])):
        reason = is_equivalent(r) if r["status"] == "survived" else None
        if r["status"] == "survived":
            tag = "EQUIVALENT" if reason else "SURVIVED (GPU only)" if is_gpu_only(r) else "SURVIVED"
            print(f"  {tag} {r['module']}:{r['line']} #{r['index']} {r['what']}    {r['source_line']}"
                  + (f"    ({reason})" if reason else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
