"""Test-session setup shared by every test file: the pytest header says where the GPU tests run."""

from __future__ import annotations

import os
import shutil

import pytest

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


# The files that take longest on CI's two cores (rough seconds; a timed run on 2026-12-01 measured interpret
# 474, lowering 265, xray 224, sharding_devices 144, the rest under 100), started first so
# that both xdist workers end together; the Makefile's --no-loadscope-reorder keeps this order (xdist would
# otherwise start the files with the most tests first and leave a long file with few tests for the end).
_SLOW_FILES = {
    "test_xray.py": 300,
    "test_kernel_interpret.py": 230,
    "test_kernel_lowering.py": 200,
    "test_sharding_devices.py": 140,
    "test_models_smollm2.py": 90,
    "test_quant.py": 85,
    "test_readme.py": 85,
    "test_cli.py": 65,
    "test_autoround_model.py": 50,
    "test_kernel_gpu.py": 45,
    "test_grouped_lowering.py": 10,
    "test_grouped_configs.py": 55,
    "test_moe_sharding.py": 100,  # 8-CPU-device subprocess and a deviceless 8-GPU compile
    "test_moe_pretrained.py": 90,
    "test_moe.py": 45,
}


def pytest_collection_modifyitems(session, config, items):
    # A stable sort: each file's tests keep their order, the other files theirs.
    items.sort(key=lambda item: -_SLOW_FILES.get(item.path.name, 0))


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
