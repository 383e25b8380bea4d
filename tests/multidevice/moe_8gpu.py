"""Compiles an int4 MoE layer's experts for 8 deviceless H100s (one NVLink node); prints a JSON line of facts.

Run by tests/test_moe_sharding.py in a process set up by ``bench.kernel_xray.toolchain.child_environment``.
The experts' SwiGLU, ``down(silu(x @ gate) * (x @ up))`` over rows sorted by expert, with the stacks split
4 ways over the mesh's expert axis and 2 ways inside each expert (gate/up column-, down row-parallel), on the
XLA path (the grouped kernel is the per-device op once it is built in). Facts: the per-device codes
parameters, the largest float buffer of the per-device program, its collectives.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import nybble
from bench.kernel_xray import deviceless_devices, xray_compile
from nybble.sharding import ExpertParallel, shard_experts

EXPERTS, HIDDEN, INTER, ROWS, EP, TP = 16, 1024, 512, 64, 4, 2


def main() -> None:
    devices = deviceless_devices("h100", EP * TP, hosts=1)
    mesh = Mesh(np.array(devices).reshape(EP, TP), ("expert", "model"))

    def stack(k: int, n: int, split: str):
        qw = jax.eval_shape(lambda: nybble.quantize(jnp.zeros((EXPERTS, k, n)), group_size=128))
        return shard_experts(qw, ExpertParallel(mesh, "expert", "model", split))

    gate, up, down = (
        stack(HIDDEN, INTER, "column"),
        stack(HIDDEN, INTER, "column"),
        stack(INTER, HIDDEN, "row"),
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    x = jax.ShapeDtypeStruct((ROWS, HIDDEN), jnp.bfloat16, sharding=replicated)
    gs = jax.ShapeDtypeStruct((EXPERTS,), jnp.int32, sharding=replicated)

    def experts(x, gs, gate, up, down):
        def mm(a, w):
            return nybble.ragged_matmul(a, w, gs, implementation="xla")

        return mm(jax.nn.silu(mm(x, gate)) * mm(x, up), down)

    report = xray_compile(experts, x, gs, gate, up, down, gpu="h100", devices=devices, keep_hlo=True)
    text = report.hlo_text or ""
    entry = text[text.index("ENTRY") :]
    params = [
        [int(d) for d in dims.split(",")] for dims in re.findall(r"u32\[([\d,]+)\][^ ]* parameter\(", entry)
    ]
    floats = [
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for dims in re.findall(r"\b(?:f32|bf16|f16)\[([\d,]+)\]", text)
    ]
    facts = {
        "experts": EXPERTS,
        "hidden": HIDDEN,
        "intermediate": INTER,
        "ep": EP,
        "rows": ROWS,
        "tp": TP,
        "code_params": params,
        "max_float_elements": max(floats),
        "collectives": [
            {k: v for k, v in dataclasses.asdict(c).items() if k != "line"} for c in report.collectives
        ],
    }
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
