"""The Triton decode attention kernel compiled without a GPU for sm_80, sm_89, sm_90, sm_100 and sm_120
(tests/deviceless/decode_attention_targets.py, in the X-ray toolchain's environment: `make test`; the
lowering alone, on every jax of the range: tests/test_decode_attention_lowering.py), the optimized program
read back: the kernel one launch (its last split to arrive merges the splits) beside the rotary factors'
and the counters' zeros, the qkv projection's output read as it is, the caches read once and updated in
place, the output projection's bf16 input written and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deviceless.common import run_script

pytestmark = pytest.mark.sweep  # compile-heavy: CI's sweeps step (make test-sweeps)

SCRIPT = Path(__file__).resolve().parent / "deviceless" / "decode_attention_targets.py"
TARGETS = ("a100", "l40s", "h200", "b200", "rtx5090")
BATCH, KV_HEADS, GROUPS, HEAD_DIM, CONTEXT = 1, 8, 4, 128, 4096  # the script's shape


@pytest.fixture(scope="module")
def programs():
    return run_script(SCRIPT, *TARGETS)


@pytest.mark.parametrize("gpu", TARGETS)
def test_one_kernel_launch_and_the_cache_read_once(programs, gpu):
    program = programs[gpu]
    kinds = [la["kind"] for la in program["launches"]]
    assert sorted(kinds) == ["custom-call", "fusion", "fusion"] and kinds[-1] == "custom-call", kinds
    *fusions, kernel = program["launches"]
    counters = BATCH * KV_HEADS * 4  # int32 zeros (the model's come from a launch it has anyway)
    rope_bytes = 2 * HEAD_DIM * 4  # [cos, cos] and [-sin, sin], f32
    assert sorted(f["result_bytes"] for f in fusions) == [counters, rope_bytes]
    block_s, splits = program["config"]
    assert (block_s, splits) == (64, 16)  # 8 KV heads x 16 splits: 128 programs, one wave on 108..170 SMs
    cache = BATCH * KV_HEADS * CONTEXT * HEAD_DIM * 2
    # the kernel reads the qkv projection's output as it is (no fusion between: the scale, the rotation and
    # the padding of the query heads are the kernel's), both caches once, the rope factors, the input
    # norm's bf16 rows (the kernel sums their squares)
    assert kernel["operands"] == {
        "position": 4,
        "qkv": BATCH * KV_HEADS * (GROUPS + 2) * HEAD_DIM * 2,
        "intermediate": rope_bytes + counters,
        "row_inputs": BATCH * 4096 * 2,
        "k_cache": cache,
        "v_cache": cache,
    }
    # results: the caches and the counters (aliased: the same buffers, written one row and one count each),
    # each split's f32 (out, max, sum) of its 4 query heads (not the 16 rows of its MMAs), and the o
    # projection's bf16 input
    states = BATCH * KV_HEADS * splits * GROUPS * (HEAD_DIM + 2) * 4
    y = BATCH * KV_HEADS * GROUPS * HEAD_DIM * 2
    assert kernel["result_bytes"] == 2 * cache + states + y + counters
    assert program["sass"]["atomics"] >= 1  # the arrival


@pytest.mark.parametrize("gpu", TARGETS)
def test_the_kernels_loop_is_two_mmas_on_pipelined_loads(programs, gpu):
    # The SASS of the attention kernel's main loop (a 64-position block): the scores' and the values' MMAs
    # (16 x 64 x 128 each: 32 mma.sync m16n8k16) on keys and values that Triton's pipeliner staged in shared
    # memory (LDSM), no per-element work on them (the new token's row is folded in after the loop; swapped
    # into each block in registers, the loop took 872 instructions with 128 selects), no spills.
    sass = programs[gpu]["sass"]
    assert sass["spills"] == 0
    ops = sass["loop_opcodes"]
    assert ops.get("HMMA") == 32 and ops.get("LDSM", 0) > 0 and "SEL" not in ops, ops
    assert sass["loop_instructions"] <= 400, ops
