"""The Triton MoE routing kernel compiled without a GPU for sm_90 and sm_100
(tests/deviceless/moe_routing_targets.py, in the X-ray toolchain's environment; the lowering alone, on
every jax of the range: tests/test_moe_routing_lowering.py), the optimized program and the SASS read back:
one launch reading its operands as given (no copy, no fusion before it), the routing and the k rows written
and nothing else, no spills."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deviceless.common import run_script

pytestmark = pytest.mark.sweep  # compile-heavy: CI's sweeps step (make test-sweeps)

SCRIPT = Path(__file__).resolve().parent / "deviceless" / "moe_routing_targets.py"
TARGETS = ("h200", "b200")
# the script's: tokens, experts, top k, hidden (one token: route_one; more: the tokens' kernel)
SHAPES = {"qwen3": (1, 128, 8, 2048), "e256": (1, 256, 8, 7168), "qwen3-t8": (8, 128, 8, 2048),
          "e256-t16": (16, 256, 8, 7168)}  # fmt: skip


@pytest.fixture(scope="module")
def programs():
    return run_script(SCRIPT, *TARGETS)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("gpu", TARGETS)
def test_one_launch_writing_the_routing_and_the_rows(programs, gpu, shape):
    tokens, experts, top_k, hidden = SHAPES[shape]
    (launch,) = programs[gpu][shape]["launches"]
    assert launch["kind"] == "custom-call"
    row = hidden * 2  # bf16
    assert launch["operands"] == {
        "logits": tokens * experts * 4,
        "x": tokens * row,
        "a": tokens * row,
        "weight": row,
        "sums": tokens * experts * 4,
    }
    # the group sizes (int32), the slots' scores and their total (f32), the k rows; more tokens: each
    # token's k rows (int32) and scores (f32) and its total, the T k rows
    routing = top_k * 4 + 4 if tokens == 1 else tokens * (2 * top_k * 4 + 4)
    assert launch["result_bytes"] == experts * 4 + routing + tokens * top_k * row


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("gpu", TARGETS)
def test_the_ranking_stays_in_registers(programs, gpu, shape):
    # Program 0 ranks the E experts, 32 columns of the (E, E) comparison at a time: no spills, within a
    # thread's 255 registers (2026-12-07, sm_90: 128 experts 1,016 instructions and 59 registers; 256
    # experts 3,576 and 166; the whole (256, 256) comparison at once spilled 200+ times). The tokens'
    # kernel, each token's k-th key searched bit by bit: 8 tokens of 128 experts 3,160 and 57; 16 of 256
    # at 8 warps 6,904 and 115 (at 4 warps: 253 registers, 14 spills)
    sass = programs[gpu][shape]["sass"]
    assert sass, "the routing kernel's cubin was not found"
    assert sass["spills"] == 0, sass
    assert sass["registers"] <= 255 and sass["instructions"] <= 8000, sass
