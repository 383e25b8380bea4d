"""Test-session setup shared by every test file: the pytest header says where the GPU tests run."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from bench.kernel_xray import layout_key
from tests import fast_io_callback

# Without a GPU, XLA compiles the CPU programs of the tests at LLVM's lowest optimization level: the suite's
# many small programs (each kernel's interpret-mode simulation, the models' steps) then compile faster than
# they run slower, about 15% off the whole suite on two cores. It changes no result the tests check: the
# same HLO runs, and the X-ray's CUDA compiles (ptxas, Mosaic GPU) are not affected (their reports are the
# same with and without it). Set before jax starts a backend; the processes the tests start inherit it. On
# a machine with an NVIDIA GPU, XLA's flags are left as they are.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

# One JAX compilation cache for the whole run, both xdist workers and the processes tests start: many files
# compile the same programs (SmolLM2's steps, the tiny models' blocks), each once per run now. Set here in
# the controller before it starts the workers, which inherit it; the controller removes it at the end
# (pytest_unconfigure). A run's own directory, never a shared one: nothing carries over between runs.
_JAX_CACHE, _JAX_CACHE_OWNER = "NYBBLE_TEST_JAX_CACHE", "NYBBLE_TEST_JAX_CACHE_OWNER"
if _JAX_CACHE not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ[_JAX_CACHE] = tempfile.mkdtemp(prefix="nybble-test-jax-cache-")
    os.environ[_JAX_CACHE_OWNER] = str(os.getpid())
if _JAX_CACHE in os.environ:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ[_JAX_CACHE])
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# GPU interpret mode runs each warpgroup of a kernel on a thread of XLA's CPU client, whose pool has one
# thread a core unless NPROC says otherwise (read once, when jax starts its CPU backend). A warpgroup
# waiting at a barrier holds its thread, so a CTA of more warpgroups than the pool has threads never
# finishes: the Blackwell kernel's decode tiles run three (nybble.kernels.mosaic_gpu.interpret).
os.environ.setdefault("NPROC", str(max(os.cpu_count() or 1, 4)))

# Lowering nybble's Mosaic GPU kernels for CUDA (the lowering tests, the models' compiles for a GPU): jax
# 0.11.2's layout inference without re-verifying the kernel for each of its sort keys, the same lowering
# in less time (bench/kernel_xray/layout_key.py; tests/test_xray.py proves the keys and modules equal).
layout_key.install()

# Mosaic GPU's interpret mode (every kernel test here): jax 0.11.2's io_callback host side without
# jax.device_put's dispatch on each of the interpreter's callbacks, the same arrays for a quarter less time
# (tests/fast_io_callback.py; test_kernel_interpret.py compares what the callbacks get with jax's own).
fast_io_callback.install()


def pytest_report_header(config):
    from tests.kernel_checks import gpu_tests_mode

    try:
        mode, why = gpu_tests_mode()
    except RuntimeError as e:
        return f"nybble GPU tests: {e}"
    if mode == "gpu":
        where = "on the GPU, every case"
    elif "NYBBLE_GPU_TESTS_INTERPRET" in why:
        where = "in GPU interpret mode on the CPU, the cheap cases"
    else:
        where = "in GPU interpret mode on the CPU, a smoke check (NYBBLE_GPU_TESTS_INTERPRET=1: more)"
    return f"nybble GPU tests (tests/test_kernel_gpu.py): {where} ({why})"


# The files that take longest on CI's two cores, started first so that both xdist workers end together; the
# Makefile's --no-loadscope-reorder keeps this order (xdist would otherwise start the files with the most
# tests first and leave a long file with few tests for the end). Files under ~10 s follow in collection
# order. Seconds: each file's test durations summed in a clean `.ci/run` of 2026-12-08 (make test 630 s),
# less the tests that moved to the sweeps that day; the X-ray's compile workers take both cores.
_SLOW_FILES = {
    "test_kernel_interpret.py": 58,
    "test_models_smollm2.py": 54,
    "test_grouped_swiglu.py": 47,
    "test_moe.py": 46,
    "test_kernel_lowering.py": 46,
    "test_fuse.py": 45,
    "test_decode_attention_kernel.py": 45,
    "test_xray.py": 40,  # compile workers on both cores
    "test_quant_format.py": 38,
    "test_readme.py": 31,
    "test_cli.py": 29,
    "test_moe_routing_kernel.py": 26,
    "test_grouped_interpret.py": 25,
    "test_quant.py": 22,
    "test_moe_pretrained.py": 22,
    "test_gptq.py": 20,
    "test_hf_blockwise.py": 19,
    "test_gpu_check.py": 19,
    "test_decode_step.py": 19,
    "test_blackwell_interpret.py": 19,
    "test_bench.py": 19,
    "test_swiglu.py": 18,
    "test_triton_lowering.py": 17,
    "test_residual.py": 17,
    "test_autoround_model.py": 17,
    "test_models_decode.py": 16,
    "test_hf_smollm2.py": 16,
    "test_refit.py": 15,
    "test_hf_models.py": 15,
    "test_moe_routing_tokens_kernel.py": 14,
    "test_matmul.py": 14,
    "test_models_adapter.py": 13,
    "test_model_bench.py": 13,
    "test_autoround.py": 13,
    "test_ragged.py": 12,
    "test_xray_peers.py": 11,
    "test_hf_cli.py": 10,
    "test_hardware_gate.py": 10,
    "test_blackwell_lowering.py": 10,
    "test_blackwell_gpu.py": 10,
    "test_bench_moe.py": 10,
}


# The same for the sweeps (`make test-sweeps`, `-m sweep`): seconds of each file's sweeps in that `.ci/run`
# (464 s in all), with the tests that joined them that day. test_decode_bench's decode-step compiles run in
# its module fixture, one after the other; the X-ray gate's in two compile workers.
_SLOW_SWEEP_FILES = {
    "test_xray.py": 200,  # two compile workers
    "test_decode_bench.py": 162,
    "test_kernel_interpret.py": 135,
    "test_kernel_lowering.py": 89,
    "test_residual.py": 81,
    "test_sharding_devices.py": 76,  # an 8-CPU-device pytest subprocess
    "test_grouped_swiglu.py": 37,
    "test_blackwell_interpret.py": 36,
    "test_blackwell_lowering.py": 32,
    "test_grouped_configs.py": 31,
    "test_moe_routing_sass.py": 29,
    "test_blackwell_grouped.py": 28,
    "test_triton_interpret.py": 23,
    "test_decode_attention_sass.py": 23,
}


def pytest_collection_modifyitems(session, config, items):
    # A stable sort: each file's tests keep their order, the other files theirs.
    sweeps = config.getoption("markexpr", "") == "sweep"
    weights = _SLOW_SWEEP_FILES if sweeps else _SLOW_FILES
    items.sort(key=lambda item: -weights.get(item.path.name, 0))


# A kernel crash on a GPU ("CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure") leaves the process's CUDA
# context unusable: every later test in it would fail for that one crash (the first hardware check,
# bench/results/gpu-check-2026-12-04, lost most of its verdicts so). Under pytest-xdist the worker exits
# after reporting such a failure, and xdist starts a fresh one for the remaining tests.
_CUDA_CONTEXT_LOST = ("CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ILLEGAL_ADDRESS", "unspecified launch failure")
_context_lost = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    global _context_lost
    outcome = yield
    report = outcome.get_result()
    if report.failed and any(s in str(report.longrepr) for s in _CUDA_CONTEXT_LOST):
        _context_lost = True


def pytest_runtest_logfinish(nodeid, location):
    if _context_lost and os.environ.get("PYTEST_XDIST_WORKER"):
        os._exit(3)  # after the report went out: xdist replaces this worker


def pytest_unconfigure(config):
    if os.environ.get(_JAX_CACHE_OWNER) == str(os.getpid()):
        shutil.rmtree(os.environ[_JAX_CACHE], ignore_errors=True)
