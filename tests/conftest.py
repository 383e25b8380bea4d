"""Test-session setup shared by every test file: the pytest header says where the GPU tests run."""

from __future__ import annotations


def pytest_report_header(config):
    from tests.kernel_checks import gpu_tests_mode

    try:
        mode, why = gpu_tests_mode()
    except RuntimeError as e:
        return f"nybble GPU tests: {e}"
    where = "on the GPU, every case" if mode == "gpu" else "in GPU interpret mode on the CPU, the cheap cases"
    return f"nybble GPU tests (tests/test_kernel_gpu.py): {where} ({why})"
