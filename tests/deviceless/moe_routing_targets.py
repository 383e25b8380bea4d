"""Compiles the Triton MoE routing kernel for deviceless GPUs of each compute capability named on the
command line, at Qwen3-30B-A3B's shape (128 experts, top 8, hidden 2048) and at 256 experts (the kernel's
largest, DeepSeek-V3's count): the router's logits, the residual stream's two parts, the norm's weight and
the router launch's sums of squares in, one token; and the tokens' kernel (``moe_routing_tokens``) at 8
tokens of Qwen3's shape and 16 of 256 experts. Prints one JSON line: per GPU and shape, the optimized
program's launches (kind, name, operand bytes by source, result bytes) and the kernel's SASS (instructions,
registers, local-memory spills). Run it in the X-ray toolchain's environment with ptxas wrapped to keep its
cubins, as tests/test_moe_routing_sass.py does."""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from bench.kernel_xray import hlo
from bench.kernel_xray.target import deviceless_devices
from nybble.kernels.triton import moe_routing as kernel
from nybble.kernels.triton import moe_routing_tokens as tokens_kernel
from tests.deviceless.common import kernel_code

# tokens, experts, top k, hidden (one token: route_one; more: route_tokens)
SHAPES = {"qwen3": (1, 128, 8, 2048), "e256": (1, 256, 8, 7168), "qwen3-t8": (8, 128, 8, 2048),
          "e256-t16": (16, 256, 8, 7168)}  # fmt: skip


def kernel_sass(cubins: list[Path], name: str) -> dict:
    """The routing kernel ``name``'s SASS: instructions, the registers it names, spills."""
    found = kernel_code(cubins, name)
    if found is None:
        return {}
    code, text = found
    opcodes = collections.Counter(ins.base_opcode for ins in code.instructions)
    return {
        "instructions": len(code.instructions),
        "registers": max(int(r) for r in re.findall(r"\bR(\d+)\b", text)) + 1,
        "spills": opcodes["STL"] + opcodes["LDL"],
    }


def compile_for(gpu: str, tokens: int, experts: int, top_k: int, hidden: int) -> dict:
    device = deviceless_devices(gpu, 1)[0]
    sharding = SingleDeviceSharding(device)
    cfg = kernel.choose_config(hidden, top_k, 1e-6)
    if tokens > 1:
        cfg = tokens_kernel.choose_config(hidden, top_k, 1e-6, tokens, experts)

    def arg(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def route(logits, x, a, weight, sums):
        if tokens == 1:
            return kernel.route_one(logits, [x, a], weight, sums, cfg)
        return tokens_kernel.route_tokens(logits, [x, a], weight, sums, cfg)

    lead = () if tokens == 1 else (tokens,)
    args = (
        arg((*lead, experts), jnp.float32),
        arg((*lead, hidden)),
        arg((*lead, hidden)),
        arg((hidden,)),
        arg((*lead, experts), jnp.float32),
    )
    dump = Path(tempfile.mkdtemp(prefix="nybble-routing-cubins-"))
    os.environ["NYBBLE_PTX_DUMP"] = str(dump)  # read by the ptxas wrapper XLA runs
    with jax.set_mesh(Mesh(np.array([device]), ("x",))):  # the Triton lowering reads its target here
        text = jax.jit(route).trace(*args).lower(lowering_platforms=("cuda",)).compile().as_text()
    os.environ.pop("NYBBLE_PTX_DUMP")
    launches = [
        {"kind": la.kind, "name": la.name, "operands": la.operand_bytes, "result_bytes": la.result_bytes}
        for la in hlo.launches(text)
    ]
    name = "nybble_moe_routing" if tokens == 1 else "nybble_moe_routing_tokens"
    return {"launches": launches, "sass": kernel_sass(sorted(dump.glob("*.cubin")), name)}


if __name__ == "__main__":
    print(
        json.dumps(
            {gpu: {name: compile_for(gpu, *shape) for name, shape in SHAPES.items()} for gpu in sys.argv[1:]}
        )
    )
