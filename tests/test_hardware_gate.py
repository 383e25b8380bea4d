"""The hardware gate: on a real Hopper GPU implementation=None runs only kernel structures that passed the
hardware check (nybble/kernels/mosaic_gpu/hardware.py), derived from the committed log of that check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble import device
from nybble.kernels import backends
from nybble.kernels.mosaic_gpu import backend as mosaic_backend
from nybble.kernels.mosaic_gpu import hardware
from nybble.kernels.mosaic_gpu.dense import plan
from tools import hardware_verdicts

LOG = "bench/results/gpu-check-2026-12-04/tests.log.gz"


class _Gpu:
    device_kind, compute_capability, core_count = "NVIDIA H200", "9.0", 132


@pytest.fixture
def h200(monkeypatch):
    """Fakes a real H200 for the dispatcher (no interpreter active)."""
    monkeypatch.setattr(device, "gpu_device", lambda: _Gpu())
    monkeypatch.setattr(device, "hopper_device", lambda: _Gpu())
    monkeypatch.setattr(backends, "_WARNED", set())


@pytest.fixture(scope="module")
def verdicts():
    return hardware_verdicts.structure_verdicts(hardware_verdicts.read_log(LOG))


def test_verified_set_is_what_the_log_says(verdicts):
    log = hardware_verdicts.read_log(LOG)
    assert hardware.HOPPER_VERIFIED == hardware_verdicts.verified_structures(log)
    failed = {s for s, v in verdicts.items() if v["fail"]}
    # The check's own findings: clean failures (crashes and wrong outputs) in split-K and two-tile configs.
    assert len(failed) >= 8 and any(s[4] > 1 for s in failed) and any(s[0] == 2 and s[4] == 1 for s in failed)
    assert not failed & hardware.HOPPER_VERIFIED
    assert all(s[4] == 1 for s in hardware.HOPPER_VERIFIED)


def test_clean_outcomes_ignore_failures_after_a_crash():
    log = (
        "[gw0] [ 1%] PASSED tests/t.py::test_a\n[gw0] [ 2%] FAILED tests/t.py::test_b\n"
        "[gw0] [ 3%] FAILED tests/t.py::test_c\n[gw1] [ 4%] FAILED tests/t.py::test_d\n"
        "[gw1] [ 5%] FAILED tests/t.py::test_e\n[gw1] [ 6%] FAILED tests/t.py::test_f\n"
        "= FAILURES =\n___ test_b ___\nCUDA_ERROR_LAUNCH_FAILED: unspecified launch failure\n"
        "___ test_d ___\nAssertionError: 3 of 9 outputs differ\n___ test_e ___\nno CUDA context\n"
    )
    # b crashed: c after it says nothing; d's wrong output leaves the context usable, e's unknown failure
    # does not (f after it is dropped).
    outcomes = hardware_verdicts.clean_outcomes(log)
    assert outcomes == {"test_a": "pass", "test_b": "fail", "test_d": "fail", "test_e": "fail"}


_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024), (576, 1536)]


@pytest.mark.parametrize("k, n", _SHAPES)
def test_real_hopper_runs_only_verified_structures(h200, k, n):
    qw = nybble.quantize(np.zeros((k, n), np.float32), group_size=128)
    ran_kernel = 0
    for m in (1, 2, 7, 16, 33, 64, 256, 2048):
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        text = nybble.kernels.explain(x, qw)
        config, ok = mosaic_backend._dense_config(m, qw)
        if "runs 'mosaic_gpu'" in text:
            ran_kernel += 1
            assert ok and hardware.verified(config) and config.split_k == 1, (m, config)
            assert "(a structure that passed the hardware check)" in text
        else:
            assert "runs 'xla'" in text and "none fits this problem" in text and not ok
    assert ran_kernel >= 4  # the gate leaves the kernel most of the sweep


def test_the_split_k_pick_that_crashed_on_the_h200_is_replaced(h200):
    qw = nybble.quantize(np.zeros((4096, 4096), np.float32), group_size=128)
    ungated = plan(16, qw, num_sms=132).config
    assert ungated.split_k == 2  # the config the benchmark's M = 16 point crashed with
    config, ok = mosaic_backend._dense_config(16, qw)
    assert ok and config.split_k == 1 and config != ungated
    # A forced call with no verified fit runs the heuristics' own pick; the CPU path is not gated.
    assert mosaic_backend.unverified(jnp.zeros((16, 4096), jnp.bfloat16), qw) is None


def test_cpu_and_interpret_mode_are_not_gated():
    qw = nybble.quantize(np.zeros((4096, 4096), np.float32), group_size=128)
    assert mosaic_backend._dense_config(16, qw)[0] == plan(16, qw, num_sms=132).config
    with nybble.kernels.interpret():
        assert mosaic_backend.unverified(jnp.zeros((16, 4096), jnp.bfloat16), qw) is None


def test_grouped_kernel_is_gated_the_same_way(h200):
    w = np.zeros((8, 2048, 768), np.float32)
    qw = nybble.quantize(w, group_size=128)
    for rows in (1, 8, 64, 512):
        config, ok = mosaic_backend._grouped_config(rows, qw)
        why = mosaic_backend.ragged_unverified(jnp.zeros((rows, 2048), jnp.bfloat16), qw, None)
        assert (why is None) == ok and (not ok or hardware.verified(config))


def test_every_gated_pick_is_a_structure_the_interpret_sweep_runs(h200):
    """The gate picks among structures the ungated heuristics pick at the named shapes (the interpret-mode
    sweep's configs), so interpret mode covers every code path it can run."""
    picked = {s for s in hardware.HOPPER_VERIFIED}
    rows = {hardware.structure(config) for _, config in hardware_verdicts.heuristic_rows()}
    assert picked <= rows
