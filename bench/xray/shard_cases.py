"""What ``python -m bench.xray.shard`` compiles: tensor-parallel layers on tp deviceless GPUs, as programs.

A case is one program at one tensor-parallel size: ``column`` (x @ W with W split along N: every shard
multiplies the whole x), ``row`` (W split along K, x arriving split along K as a column-parallel layer
leaves it, partial outputs summed by an all-reduce), or ``mlp`` (a Llama SwiGLU block, gate and up
column-parallel, down row-parallel: ``down(silu(x @ gate) * (x @ up))``, K = hidden, N = intermediate).
Peers: nybble's kernel per shard (``nybble:mosaic_gpu``), nybble's XLA path per shard (``nybble:xla``) and
XLA's own bf16 dot partitioned by GSPMD from ``NamedSharding`` s (``xla:bf16``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from bench.xray.launch import dense_launch

MOSAIC = "nybble:mosaic_gpu"
NYBBLE_XLA = "nybble:xla"
XLA_BF16 = "xla:bf16"
PEERS = (MOSAIC, NYBBLE_XLA, XLA_BF16)
PROGRAMS = ("column", "row", "mlp")
AXES = ("data", "model")


@dataclasses.dataclass(frozen=True)
class ShardCase:
    program: str  # "column", "row" or "mlp"
    k: int  # the weight's K (mlp: the hidden size)
    n: int  # the weight's N (mlp: the intermediate size)
    m: int
    tp: int
    peer: str = MOSAIC
    group_size: int | None = 128
    symmetric: bool = True
    layout: str = "wgmma_int4"  # nybble.packing.DEFAULT_LAYOUT: what the kernel reads
    hosts: int = 1  # hosts the tp devices are spread over (1: one NVLink node)

    @property
    def key(self) -> str:
        quant = "" if self.peer == XLA_BF16 else f"/{self.quant_label}"
        return f"tp{self.tp}/{self.program}/{self.k}x{self.n}/M{self.m}{quant}/{self.peer}"

    @property
    def quant_label(self) -> str:
        group = "col" if self.group_size is None else f"g{self.group_size}"
        return f"{group}-{'sym' if self.symmetric else 'asym'}-{self.layout}"

    def splits(self) -> list[tuple[str, int, int]]:
        """(split, K, N) of each weight of the program, in the order it multiplies them."""
        if self.program == "column":
            return [("column", self.k, self.n)]
        if self.program == "row":
            return [("row", self.k, self.n)]
        if self.program == "mlp":
            return [("column", self.k, self.n), ("column", self.k, self.n), ("row", self.n, self.k)]
        raise ValueError(f"unknown program {self.program!r}; one of {PROGRAMS}")


def build_cases(
    programs: list[str],
    shape: tuple[int, int],
    ms: list[int],
    tps: list[int],
    peers: list[str],
    groups: list[tuple[int | None, bool]],
    layout: str = "wgmma_int4",
    hosts: int = 1,
) -> list[ShardCase]:
    """Every (program, M, tp, peer, group) combination; xla:bf16 once per (program, M, tp)."""
    k, n = shape
    out = []
    for program in programs:
        if program not in PROGRAMS:
            raise ValueError(f"unknown program {program!r}; one of {PROGRAMS}")
        # The row program's weight is (N, K): it takes what the column layer produced.
        kk, nn = (n, k) if program == "row" else (k, n)
        for tp in tps:
            if tp < 1:
                raise ValueError(f"tp must be >= 1, got {tp}")
            for m in ms:
                for peer in peers:
                    if peer == XLA_BF16:
                        out.append(ShardCase(program, kk, nn, m, tp, peer, None, True, layout, hosts))
                        continue
                    for g, sym in groups:
                        out.append(ShardCase(program, kk, nn, m, tp, peer, g, sym, layout, hosts))
    return out


@functools.cache
def _abstract_weight(k: int, n: int, group_size: int | None, symmetric: bool, layout: str) -> Any:
    import jax
    import jax.numpy as jnp

    import nybble

    quantize = functools.partial(nybble.quantize, group_size=group_size, symmetric=symmetric, layout=layout)
    return jax.eval_shape(quantize, jax.ShapeDtypeStruct((k, n), jnp.float32))


def program(case: ShardCase, devices: list[Any]) -> tuple[Any, tuple[Any, ...]]:
    """(function, abstract arguments placed on a (1, tp) mesh of ``devices``) of one case."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import nybble
    from nybble.sharding import TensorParallel, shard_weight

    mesh = Mesh(np.array(devices).reshape(1, case.tp), AXES)

    def placed(shape: tuple[int, ...], dtype: Any, spec: PartitionSpec) -> Any:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    # x: whole for a column-parallel first layer, split along K for a row-parallel one.
    x_spec = PartitionSpec(None, "model") if case.program == "row" else PartitionSpec()
    x = placed((case.m, case.k), jnp.bfloat16, x_spec)
    weights = []
    for split, k, n in case.splits():
        if case.peer == XLA_BF16:
            spec = PartitionSpec(None, "model") if split == "column" else PartitionSpec("model", None)
            weights.append(placed((k, n), jnp.bfloat16, spec))
        else:
            qw = _abstract_weight(k, n, case.group_size, case.symmetric, case.layout)
            weights.append(shard_weight(qw, TensorParallel(mesh, split), name=f"{split} {k}x{n}"))

    if case.peer == XLA_BF16:

        def mm(x: Any, w: Any) -> Any:
            return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    else:
        impl = "mosaic_gpu" if case.peer == MOSAIC else "xla"
        mm = functools.partial(nybble.matmul, implementation=impl)

    if case.program == "mlp":

        def fn(x: Any, gate: Any, up: Any, down: Any) -> Any:
            return mm(jax.nn.silu(mm(x, gate)) * mm(x, up), down)

        return fn, (x, *weights)

    def single(x: Any, qw: Any) -> Any:
        return mm(x, qw)

    return single, (x, weights[0])


def kernel_plans(case: ShardCase, num_sms: int) -> list[dict[str, Any]]:
    """The Mosaic GPU launch nybble plans for each shard's product: config and grid of its kernel."""
    from nybble.kernels import mosaic_gpu
    from nybble.sharding import plan_split

    out = []
    for split, k, n in case.splits():
        local = plan_split(
            (k, n), group_size=case.group_size, layout=case.layout, split=split, num_shards=case.tp
        ).local_shape
        p = mosaic_gpu.plan(
            case.m, _abstract_weight(*local, case.group_size, case.symmetric, case.layout), num_sms=num_sms
        )
        out.append(
            {"split": split, "local_shape": list(local), **dense_launch(p)}
        )
    return out


__all__ = ["MOSAIC", "NYBBLE_XLA", "PEERS", "PROGRAMS", "XLA_BF16", "ShardCase", "build_cases", "program"]
