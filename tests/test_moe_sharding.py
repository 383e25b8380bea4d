"""MoE expert stacks beyond one device: 8 CPU devices (exact), and MoE experts compiled for 8 deviceless GPUs.

* tests/multidevice/moe_8dev.py, with 8 CPU devices: expert-parallel and expert + tensor-parallel ragged
  products equal the unsharded op bit for bit, ``nybble.models.shard`` of an int4 MoE block keeps its
  outputs. It runs in tests/test_sharding_devices.py's 8-device pytest subprocess (one jax start for
  both files' tests).
* tests/multidevice/moe_8gpu.py compiles the experts' SwiGLU (experts split 4 ways, each expert cut 2 ways:
  gate/up column-, down row-parallel) for 8 deviceless H100s with the X-ray toolchain and reports the
  per-device program: each device's codes hold E / 4 experts' blocks, no float stack of experts exists,
  and the collectives are the expected all-reduces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent / "multidevice"


def _env(base=None, **extra: str) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.pop("JAX_PLATFORMS", None)
    path = [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(extra)
    return env


def test_moe_experts_compiled_for_eight_h100s():
    from bench.kernel_xray import ToolchainMissing
    from bench.kernel_xray.toolchain import child_environment, find_toolchain

    try:
        toolchain = find_toolchain()
    except ToolchainMissing as e:
        pytest.fail(f"the X-ray toolchain is missing: {e}")
    proc = subprocess.run(
        [sys.executable, str(HERE / "moe_8gpu.py")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(child_environment(toolchain)),
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    e, hidden, inter = facts["experts"], facts["hidden"], facts["intermediate"]
    ep, tp, rows = facts["ep"], facts["tp"], facts["rows"]
    # Each device's parameters: its E / ep experts, each cut tp ways (wgmma_int4 words: (N / 8, K) an expert).
    assert sorted(facts["code_params"]) == sorted(
        [[e // ep, inter // tp // 8, hidden]] * 2 + [[e // ep, hidden // 8, inter // tp]]
    ), facts
    # The largest float buffer is one expert's block of one weight (its (N_pad, K_pad) dequantized), never
    # the device's stack of experts.
    assert facts["max_float_elements"] == hidden * inter // tp, facts
    # All-reduces only: gate and up over the expert axis (XLA may combine the two), down over all 8 devices.
    assert {c["op"] for c in facts["collectives"]} == {"all-reduce"}, facts
    by_group: dict[int, int] = {}
    for c in facts["collectives"]:
        by_group[c["group_size"]] = by_group.get(c["group_size"], 0) + c["buffer_bytes"]
    assert by_group == {ep: 2 * rows * (inter // tp) * 2, ep * tp: rows * hidden * 2}, facts
