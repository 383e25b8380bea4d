"""Tensor parallelism beyond this process's one CPU device: 8 CPU devices, two processes, 8 deviceless GPUs.

* tests/multidevice/sharding_8dev.py runs in a pytest subprocess with 8 CPU devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=8``): sharded results equal the unsharded op on 1x8,
  2x4 and 8x1 meshes, bit for bit on small-integer data (XLA path, and the kernel in interpret mode),
  models, checkpoints read into shards, SmolLM2's perplexity; and, in the same process (one jax start
  for both), tests/multidevice/moe_8dev.py: the MoE expert stacks (tests/test_moe_sharding.py says what).
* two processes of a ``jax.distributed`` CPU cluster (4 devices each) load a checkpoint straight into the
  shards of a mesh spanning both, each reading half the bytes, and run a row-parallel product whose
  all-reduce crosses them.
* a Llama MLP compiled for 8 deviceless H100s (the X-ray toolchain): one nybble kernel per matmul in the
  per-device program, and one all-reduce.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nybble
from nybble.packing import get_layout

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent / "multidevice"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    )
    env.update(extra)
    return env


# With CI's second step (`make test-sweeps`): ~75 s on two busy cores, past make test's budget (2026-12-08).
@pytest.mark.sweep
def test_eight_cpu_devices():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            str(HERE / "sharding_8dev.py"),
            str(HERE / "moe_8dev.py"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"),
        timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "failed" not in proc.stdout and "skipped" not in proc.stdout, tail
    print(next((line for line in proc.stdout.splitlines() if "SmolLM2" in line), ""))


def _small_int(k, n, seed, layout):
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, (k, n)).astype(np.int8)
    scales = rng.integers(1, 3, (k // 32, n)).astype(np.float32)
    return nybble.QuantizedWeight(get_layout(layout).pack(q), scales, None, (k, n), 32, True, layout)


def test_two_processes_each_read_their_shards(tmp_path):
    # (128, 256) column-parallel then (256, 128) row-parallel: small integers, every sum exact in f32.
    # Both layouts: up in wgmma_int4 (4 bands a shard), down in nk_int4 (16 bytes of K a shard).
    tree = {"up": _small_int(128, 256, 1, "wgmma_int4"), "down": _small_int(256, 128, 2, "nk_int4")}
    path = nybble.save(tmp_path / "mlp.safetensors", tree)
    quantized_bytes = sum(a.nbytes for qw in tree.values() for a in (qw.codes, qw.scales))
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "two_process_load.py"), str(i), port, str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=_env(),
        )
        for i in range(2)
    ]
    facts = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-4000:]
            facts.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert sorted(f["process"] for f in facts) == [0, 1]
    for f in facts:
        assert (f["local_devices"], f["global_devices"]) == (4, 8)
        assert f["bytes_read"] == quantized_bytes // 2, f  # its 4 shards of 8, not a byte more
        assert f["exact"] and f["max_abs"] > 100, f


def test_llama_mlp_compiled_for_eight_h100s():
    """A SwiGLU block (gate, up column-parallel; down row-parallel) at tp = 8 on deviceless H100s."""
    from bench.kernel_xray import ToolchainMissing, get_gpu
    from bench.xray.runner import run_cases
    from bench.xray.shard import summarize
    from bench.xray.shard_cases import ShardCase

    case = ShardCase("mlp", 1024, 4096, 16, 8)
    try:
        record = run_cases([case], gpu="h100", jobs=1, progress=False, worker="bench.xray.shard_worker")[
            case.key
        ]
    except ToolchainMissing as e:
        pytest.fail(f"the X-ray toolchain is missing: {e}")
    assert "error" not in record, record.get("traceback", record.get("error"))
    assert record["case"]["layout"] == "wgmma_int4"
    kernels = [line for line in record["hlo_lines"] if 'custom_call_target="mosaic_gpu' in line]
    assert len(kernels) == 3, record["hlo_lines"]  # one per matmul of the shard, no more
    # Each kernel reads its shard's wgmma_int4 words, 1/8 of the weight's (1024 x 4096 / 8 words; the kernel
    # views them in its own blocks), and writes its shard's y: gate/up (16, 4096 / 8), down (16, 1024) whole.
    for line in kernels:
        (words,) = re.findall(r"u32\[([\d,]+)\]", line)
        assert math.prod(int(d) for d in words.split(",")) == 1024 * 4096 // 8 // 8, line
    assert sorted(re.search(r"= (\w+\[[\d,]+\])", line)[1] for line in kernels) == [
        "bf16[16,1024]",
        "bf16[16,512]",
        "bf16[16,512]",
    ]
    (collective,) = record["report"]["collectives"]
    assert (collective["op"], collective["group_size"]) == ("all-reduce", 8)
    assert collective["buffer_bytes"] == 16 * 1024 * 2  # y (M, hidden) in bf16
    row = summarize(record, get_gpu("h100"), get_gpu("h100").hbm_bytes_per_s)
    assert row["kernels"] == 3 and row["ring_bytes_per_device"] == 2 * 7 / 8 * 16 * 1024 * 2
    assert all(k["spill_bytes"] == 0 for k in record["report"]["kernels"])
