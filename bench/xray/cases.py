"""What the X-ray compiles: one case per (peer, shape, M, group setting), and the program of each."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterable
from typing import Any

from bench.arg_specs import Shape
from bench.xray.launch import dense_launch

MOSAIC = "nybble:mosaic_gpu"
NYBBLE_XLA = "nybble:xla"
XLA_BF16 = "xla:bf16"
# The peers compiled with their own toolchains (``--peers``; bench.xray.peer_tools installs them).
MARLIN = "vllm:marlin"  # vLLM's gptq_marlin (mma.sync), nvcc from PyPI wheels
TOKAMAX = "tokamax:ragged_dot"  # tokamax's sm90 int4 ragged_dot (Mosaic GPU): dense = one group
JAX_MIXED = "jax:mixed-int8"  # JAX's hopper_mixed_type_matmul_mgpu example: int8 x bf16, no scales
PEERS = (MOSAIC, NYBBLE_XLA, XLA_BF16)
EXTERNAL_PEERS = (MARLIN, TOKAMAX, JAX_MIXED)
ALL_PEERS = PEERS + EXTERNAL_PEERS
# Peers with no group settings: one case per (shape, M).
UNQUANTIZED = (XLA_BF16, JAX_MIXED)
# MoE expert layers (hidden, expert intermediate, experts, top-k), compiled for tokamax as the fused
# gate-up projection: K = hidden, N = 2 x intermediate, E experts, M tokens x top-k rows.
MOE_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "gpt-oss-120b": (2880, 2880, 128, 4),
}
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
    experts: int = 0  # > 0: a grouped (MoE) case of that many experts, M tokens routed to top_k each
    top_k: int = 0

    @property
    def key(self) -> str:
        """A stable name: ``llama3-8b-qo/M1/g128-sym/nybble:mosaic_gpu``."""
        if self.peer in UNQUANTIZED:
            return f"{self.shape}/M{self.m}/{self.peer}"
        return f"{self.shape}/M{self.m}/{self.quant_label}/{self.peer}"

    @property
    def rows(self) -> int:
        """Rows of x the kernel multiplies: M, or M x top-k for a grouped case."""
        return self.m * self.top_k if self.experts else self.m

    @property
    def quant_label(self) -> str:
        if self.peer == XLA_BF16:
            return "-"
        if self.peer == JAX_MIXED:
            return "int8"
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
    unknown = set(peers) - set(ALL_PEERS)
    if unknown:
        raise ValueError(f"unknown X-ray peers {sorted(unknown)}; known: {ALL_PEERS}")
    out: list[Case] = []
    groups = list(groups)
    for shape, m in itertools.product(list(shapes), list(ms)):
        if m < 1:
            raise ValueError(f"M must be >= 1, got {m}")
        for peer in peers:
            if peer in UNQUANTIZED:
                out.append(Case(peer, shape.name, shape.k, shape.n, m))
                continue
            # tokamax has no zero points (it drops them): symmetric groups only.
            settings = [(g, sym) for g, sym in groups if sym or peer != TOKAMAX]
            out.extend(Case(peer, shape.name, shape.k, shape.n, m, g, sym) for g, sym in settings)
    return out


def moe_cases(names: Iterable[str], ms: Iterable[int], group_size: int | None = 128) -> list[Case]:
    """tokamax's grouped cases: the fused gate-up projection of each MoE shape at M tokens."""
    out = []
    for name in names:
        if name not in MOE_SHAPES:
            raise ValueError(f"unknown MoE shape {name!r}: use one of {sorted(MOE_SHAPES)}")
        hidden, inter, experts, top_k = MOE_SHAPES[name]
        for m in ms:
            out.append(Case(TOKAMAX, name, hidden, 2 * inter, m, group_size, True, experts, top_k))
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

    if case.peer == TOKAMAX:
        return tokamax_program(case)
    if case.peer == JAX_MIXED:
        return jax_mixed_program(case)
    x = jax.ShapeDtypeStruct((case.m, case.k), jnp.bfloat16)
    if case.peer == XLA_BF16:
        w = jax.ShapeDtypeStruct((case.k, case.n), jnp.bfloat16)
        return (lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)), (x, w)
    implementation = "mosaic_gpu" if case.peer == MOSAIC else "xla"
    fn = functools.partial(nybble.matmul, implementation=implementation)
    return fn, (x, abstract_weight(case))


def tokamax_deviceless(num_sms: int) -> None:
    """Makes tokamax pick its sm90 kernel in a process whose default device is the CPU: its capability
    check and the persistent kernel's grid (SM count) read the default device, which a deviceless
    compile does not have. Its heuristics config is then the one it uses on an H100/H200."""
    import types

    from tokamax._src import gpu_utils
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_kernel_sm90_quant as sm90_quant

    gpu_utils._compute_capability = lambda device=None: 9.0
    device = types.SimpleNamespace(core_count=num_sms)
    sm90_quant.backend = types.SimpleNamespace(get_default_device=lambda: device)


def tokamax_program(case: Case) -> tuple[Any, tuple[Any, ...]]:
    """``tokamax.ragged_dot(x, QArray(int4 codes, bf16 scales), group_sizes)``: one group for a dense
    case, ``experts`` groups for a MoE case (its (E, K, N) weights)."""
    import jax
    import jax.numpy as jnp
    import qwix
    import tokamax

    if case.group_size is None or not case.symmetric:
        raise ValueError("tokamax's int4 path takes symmetric grouped scales only")
    groups = max(case.experts, 1)

    def fn(x: Any, q: Any, s: Any, sizes: Any) -> Any:
        rhs = qwix.QArray(qvalue=q, scale=s, zero_point=None, qtype=jnp.int4)
        out = tokamax.ragged_dot(x, rhs, group_sizes=sizes, implementation="mosaic_gpu")
        return out.astype(x.dtype)

    args = (
        jax.ShapeDtypeStruct((case.rows, case.k), jnp.bfloat16),
        jax.ShapeDtypeStruct((groups, case.k, case.n), jnp.int4),
        jax.ShapeDtypeStruct((groups, -(-case.k // case.group_size), case.n), jnp.bfloat16),
        jax.ShapeDtypeStruct((groups,), jnp.int32),
    )
    return fn, args


def jax_mixed_config(m: int) -> Any:
    """A config from the example's own tuning space: two compute warpgroups over 2 x 128 weight rows
    (its M, the int8 operand), 64 token columns and K tiles of 128 (M <= 64), else 128 columns and K tiles
    of 64 (128 x 128 would need 256 KiB of SMEM for 4 steps), 4 steps in flight."""
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mixed

    return mixed.TuningConfig(
        tile_m=128,
        tile_n=64 if m <= 64 else 128,
        tile_k=128 if m <= 64 else 64,
        max_concurrent_steps=4,
        epi_tile_n=64,
        epi_tile_m=64,
        grid_minor_dim=mixed.MatmulDimension.N,
        grid_tile_width=1,
        wg_dimension=mixed.MatmulDimension.M,
    )


def jax_mixed_program(case: Case, num_sms: int = 132) -> tuple[Any, tuple[Any, ...]]:
    """JAX's ``hopper_mixed_type_matmul_mgpu``: int8 weights (N, K) as the quantized LHS times x^T
    (K, M), tokens padded to its tile; no scales (the example has none). Its persistent grid reads the
    SM count off the default device, which a deviceless compile lacks: given ``num_sms`` instead."""
    import types

    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mixed

    device = types.SimpleNamespace(core_count=num_sms)
    mixed.backend = types.SimpleNamespace(get_default_device=lambda: device)

    config = jax_mixed_config(case.m)
    m_pad = -(-case.m // config.tile_n) * config.tile_n

    def fn(x: Any, w: Any) -> Any:
        xt = jnp.pad(x, ((0, m_pad - x.shape[0]), (0, 0))).T
        y = mixed.mixed_matmul_kernel(w, xt, out_dtype=jnp.bfloat16, config=config)
        return y.T[: x.shape[0]]

    return fn, (
        jax.ShapeDtypeStruct((case.m, case.k), jnp.bfloat16),
        jax.ShapeDtypeStruct((case.n, case.k), jnp.int8),
    )


def kernel_plan(case: Case, num_sms: int) -> dict[str, Any]:
    """The Mosaic GPU launch nybble plans for this case: its config and grid (``mosaic_gpu.plan``)."""
    from nybble.kernels import mosaic_gpu

    return dense_launch(mosaic_gpu.plan(case.m, abstract_weight(case), num_sms=num_sms))


def kernel_key(case: Case, num_sms: int) -> tuple[Any, Any, bool]:
    """What the kernel's code depends on: (config, how groups meet the K tile, symmetric), the same key
    as ``bench.xray.heuristic_cases.heuristic_cases``."""
    from bench.xray.heuristic_cases import group_structure
    from nybble.kernels import mosaic_gpu

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
