"""Compiles the Triton decode attention kernel for deviceless GPUs of each compute capability named on the
command line, at Llama-3-8B's shape: the qkv projection's output of one token (32 query heads, 8 KV heads
of 128), the deferred input norm's input rows (the kernel sums their squares), a 4096-position bf16 cache,
batch 1, the caches donated, the splits' arrival counters given (the model's setup: the last split merges
them in the launch). Prints one JSON line: per GPU, the config, the optimized program's launches (kind,
name, bytes of each operand by source, result bytes) and the attention kernel's SASS (its instructions, its
main loop's instructions and opcodes, its atomics, local-memory spills). Run it in the X-ray toolchain's
environment with ptxas wrapped to keep its cubins (``bench.kernel_xray.toolchain.child_environment``,
``CUDA_ROOT`` from ``bench.xray.gpus.wrapped_cuda_root``), as tests/test_decode_attention_sass.py does."""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from bench.kernel_xray import get_gpu, hlo
from bench.kernel_xray.target import deviceless_devices
from nybble.kernels.triton import decode_attention as kernel
from tests.deviceless.common import kernel_code

BATCH, KV_HEADS, GROUPS, HEAD_DIM, CONTEXT = 1, 8, 4, 128, 4096


def kernel_sass(cubins: list[Path]) -> dict:
    """The attention kernel's SASS: its main loop (``bench.xray.gpus.mma_loop``) and spills."""
    from bench.xray.gpus import mma_loop

    found = kernel_code(cubins, "nybble_decode_attention")
    if found is None:
        return {}
    code = found[0]
    loop = mma_loop(code) or []
    opcodes = collections.Counter(ins.base_opcode for ins in code.instructions)
    return {
        "instructions": len(code.instructions),
        "loop_instructions": len(loop),
        "loop_opcodes": dict(collections.Counter(ins.base_opcode for ins in loop)),
        "atomics": sum(n for op, n in opcodes.items() if op.startswith(("ATOM", "RED"))),
        "spills": opcodes["STL"] + opcodes["LDL"],
    }


def compile_for(gpu: str) -> dict:
    device = deviceless_devices(gpu, 1)[0]
    sharding = SingleDeviceSharding(device)
    cfg = kernel.choose_config(BATCH, KV_HEADS, CONTEXT, get_gpu(gpu).sms)
    token = kernel.NewToken(KV_HEADS * GROUPS, KV_HEADS, row_norm=(4096, 1e-5))
    inv_freq = 1.0 / (500000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))

    def arg(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def step(qkv, row_inputs, k_cache, v_cache, position):
        rope = kernel.rope_factors(position, inv_freq)
        # the splits' arrival counters: zeros, a launch of their own here (the model writes them in the
        # launch that writes the q/k/v projection's input: tests/test_decode_bench.py)
        arrivals = (row_inputs[:, :KV_HEADS].astype(jnp.float32) * 0).astype(jnp.int32)
        return kernel.write_and_attend(
            qkv, k_cache, v_cache, position, None, cfg, token, rope, row_inputs=row_inputs,
            arrivals=arrivals, out_dtype=jnp.bfloat16,
        )  # fmt: skip

    cache = arg((BATCH, KV_HEADS, CONTEXT, HEAD_DIM))
    qkv = arg((BATCH, KV_HEADS * (GROUPS + 2), HEAD_DIM))
    args = (qkv, arg((BATCH, 4096)), cache, cache, arg((), jnp.int32))
    dump = Path(tempfile.mkdtemp(prefix="nybble-attention-cubins-"))
    os.environ["NYBBLE_PTX_DUMP"] = str(dump)  # read by the ptxas wrapper XLA runs
    with jax.set_mesh(Mesh(np.array([device]), ("x",))):  # the Triton lowering reads its target here
        jitted = jax.jit(step, donate_argnums=(2, 3))
        text = jitted.trace(*args).lower(lowering_platforms=("cuda",)).compile().as_text()
    os.environ.pop("NYBBLE_PTX_DUMP")
    sass_facts = kernel_sass(sorted(dump.glob("*.cubin")))
    launches = [
        {"kind": la.kind, "name": la.name, "operands": la.operand_bytes, "result_bytes": la.result_bytes}
        for la in hlo.launches(text)
    ]
    return {"config": [cfg.block_s, cfg.splits], "launches": launches, "sass": sass_facts}


if __name__ == "__main__":
    print(json.dumps({gpu: compile_for(gpu) for gpu in sys.argv[1:]}))
