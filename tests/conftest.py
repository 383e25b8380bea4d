"""Test-session setup shared by every test file: the pytest header says where the GPU tests run."""

from __future__ import annotations


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
