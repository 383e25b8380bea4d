"""What the X-ray compiles: one case per (peer, shape, M, group setting), and the program of each."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterable
from typing import Any

from bench.arg_specs import Shape

MOSAIC = "nybble:mosaic_gpu"
NYBBLE_XLA = "nybble:xla"
XLA_BF16 = "xla:bf16"
PEERS = (MOSAIC, NYBBLE_XLA, XLA_BF16)
DEFAULT_MS = (1, 16, 64, 128, 2048, 4096)
# (group size, symmetric): g128 symmetric and asymmetric.
DEFAULT_GROUPS: tuple[tuple[int | None, bool], ...] = ((128, True), (128, False))


@dataclasses.dataclass(frozen=True)
class Case:
    peer: str
    shape: str
    k: int
    n: int
    m: int
    group_size: int | None = None  # None: per column (int4 peers) / not applicable (xla:bf16)
    symmetric: bool = True

    @property
    def key(self) -> str:
        """A stable name: ``llama3-8b-qo/M1/g128-sym/nybble:mosaic_gpu``."""
        if self.peer == XLA_BF16:
            return f"{self.shape}/M{self.m}/{self.peer}"
        return f"{self.shape}/M{self.m}/{self.quant_label}/{self.peer}"

    @property
    def quant_label(self) -> str:
        group = "col" if self.group_size is None else f"g{self.group_size}"
        return f"{group}-{'sym' if self.symmetric else 'asym'}"


def build_cases(
    shapes: Iterable[Shape],
    ms: Iterable[int],
    groups: Iterable[tuple[int | None, bool]] = DEFAULT_GROUPS,
    peers: Iterable[str] = PEERS,
) -> list[Case]:
    """Every (peer, shape, M, group) combination; xla:bf16 once per (shape, M)."""
    peers = list(peers)
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown X-ray peers {sorted(unknown)}; known: {PEERS}")
    out: list[Case] = []
    groups = list(groups)
    for shape, m in itertools.product(list(shapes), list(ms)):
        if m < 1:
            raise ValueError(f"M must be >= 1, got {m}")
        for peer in peers:
            if peer == XLA_BF16:
                out.append(Case(peer, shape.name, shape.k, shape.n, m))
                continue
            out.extend(Case(peer, shape.name, shape.k, shape.n, m, g, sym) for g, sym in groups)
    return out


def abstract_weight(case: Case) -> Any:
    """The QuantizedWeight ``nybble.quantize`` would return for this case, as ShapeDtypeStructs."""
    return _abstract_weight(case.k, case.n, case.group_size, case.symmetric)


@functools.cache
def _abstract_weight(k: int, n: int, group_size: int | None, symmetric: bool) -> Any:
    import jax
    import jax.numpy as jnp

    import nybble

    quantize = functools.partial(nybble.quantize, group_size=group_size, symmetric=symmetric)
    return jax.eval_shape(quantize, jax.ShapeDtypeStruct((k, n), jnp.float32))


def program(case: Case) -> tuple[Any, tuple[Any, ...]]:
    """(function, abstract arguments) of one case: what a user would jit."""
    import jax
    import jax.numpy as jnp

    import nybble

    x = jax.ShapeDtypeStruct((case.m, case.k), jnp.bfloat16)
    if case.peer == XLA_BF16:
        w = jax.ShapeDtypeStruct((case.k, case.n), jnp.bfloat16)
        return (lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)), (x, w)
    implementation = "mosaic_gpu" if case.peer == MOSAIC else "xla"
    fn = functools.partial(nybble.matmul, implementation=implementation)
    return fn, (x, abstract_weight(case))


def kernel_plan(case: Case, num_sms: int) -> dict[str, Any]:
    """The Mosaic GPU launch nybble plans for this case: its config and grid (``mosaic_gpu.plan``)."""
    from nybble.kernels import mosaic_gpu

    p = mosaic_gpu.plan(case.m, abstract_weight(case), num_sms=num_sms)
    return {
        "config": dataclasses.asdict(p.config),
        "m_pad": p.m_pad,
        "m_tiles": p.m_tiles,
        "ctas": p.ctas,
        "threads": p.threads,
        "weight_bytes_in_flight": p.weight_bytes_in_flight,
        "dequantized_weights": p.dequantized_weights,
    }


def kernel_key(case: Case, num_sms: int) -> tuple[Any, Any, bool]:
    """What the kernel's code depends on: (config, how groups meet the K tile, symmetric), the same key
    as ``nybble.kernels.mosaic_gpu.config.heuristic_cases``."""
    from nybble.kernels import mosaic_gpu
    from nybble.kernels.mosaic_gpu.config import group_structure

    p = mosaic_gpu.plan(case.m, abstract_weight(case), num_sms=num_sms)
    return p.config, group_structure(p.group, p.config), case.symmetric


def distinct_kernels(cases: Iterable[Case], num_sms: int) -> list[Case]:
    """One nybble kernel case per distinct kernel (``kernel_key``).

    The code of the main loop depends on the key, not on the problem's extent, so compiling one case of
    each covers every kernel the heuristics pick at those cases (what the test suite does).
    """
    seen: dict[tuple[Any, ...], Case] = {}
    for case in cases:
        if case.peer == MOSAIC:
            seen.setdefault(kernel_key(case, num_sms), case)
    return list(seen.values())


def gate_cases(num_sms: int) -> list[Case]:
    """The test suite's X-ray gate: one case per distinct kernel config (and how groups meet its K tile)
    the heuristics pick at the named shapes (``bench.arg_specs.SHAPES``) for ``DEFAULT_MS`` and
    ``DEFAULT_GROUPS``. A config picked for both symmetric and asymmetric groups is compiled asymmetric
    only: the same kernel plus the offsets' registers and instructions, so where the symmetric one would
    spill or grow, so does it (``python -m bench.xray --check`` compiles both). That holds where the
    symmetric kernel folds the bias into WGMMA (``config.folds_bias``) too: it keeps one accumulator and
    one FMA a group fewer (2026-12-01 v5 sweep: every such symmetric loop shorter than its asymmetric
    twin's, and fewer registers); being other code, it is lowered by tests/test_kernel_lowering.py (see
    :func:`is_twin`). Each kernel here is compiled down to SASS, which lowers it for CUDA first:
    tests/test_kernel_lowering.py skips the kernels listed here."""
    from bench.arg_specs import SHAPES

    kernels = distinct_kernels(build_cases(SHAPES.values(), DEFAULT_MS, DEFAULT_GROUPS, (MOSAIC,)), num_sms)
    keyed = [(kernel_key(c, num_sms), c) for c in kernels]
    asymmetric = {key[:2] for key, c in keyed if not c.symmetric}
    return [c for key, c in keyed if not c.symmetric or key[:2] not in asymmetric]


def is_twin(key: tuple[Any, Any, bool], asymmetric: set[tuple[Any, Any]]) -> bool:
    """Whether a kernel key is a symmetric twin of an asymmetric kernel in ``asymmetric`` ((config,
    structure) pairs) with the same code minus the offsets, so that lowering the asymmetric one covers it:
    not where the symmetric kernel folds the bias (other code, lowered on its own)."""
    from nybble.kernels.mosaic_gpu.config import folds_bias

    config, structure, symmetric = key
    return symmetric and (config, structure) in asymmetric and not folds_bias(config, has_offsets=False)
