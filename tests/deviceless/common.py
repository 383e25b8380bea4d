"""What the deviceless compile scripts beside this file and their tests share: running a script in the X-ray
toolchain's environment with ptxas keeping its cubins (:func:`run_script`, from a test), and reading one
kernel's SASS back from those cubins (:func:`kernel_code`, in the script)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_script(script: Path, *args: str) -> Any:
    """Runs ``script ARGS`` in the X-ray toolchain's environment (``CUDA_ROOT``: ptxas wrapped to keep its
    cubins, so the SASS can be read); returns the JSON of its last line. Fails the test when the toolchain
    is missing or the script fails."""
    import pytest

    from bench.kernel_xray import ToolchainMissing
    from bench.kernel_xray.toolchain import child_environment, find_toolchain

    try:
        toolchain = find_toolchain()
    except ToolchainMissing as e:
        pytest.fail(f"the X-ray toolchain is missing: {e}")
    from bench.xray.gpus import wrapped_cuda_root

    env = child_environment(toolchain)
    env["CUDA_ROOT"] = str(wrapped_cuda_root(toolchain))  # ptxas keeps its cubins: the SASS is read
    path = env.get("PYTHONPATH", "").split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, path)])
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kernel_code(cubins: list[Path], name: str) -> tuple[Any, str] | None:
    """The parsed SASS (``bench.kernel_xray.sass``) and nvdisasm's text of the kernel ``name`` in these
    cubins, or None where none holds it."""
    from bench.kernel_xray import sass
    from bench.kernel_xray.toolchain import find_toolchain
    from bench.xray.marlin import control_code_sass

    nvdisasm = find_toolchain().nvdisasm
    for path in cubins:
        text = subprocess.run([str(nvdisasm), "-c", "-hex", str(path)], capture_output=True, text=True).stdout
        if re.search(rf"\.text\.{re.escape(name)}\b", text):
            return sass.parse_sass(control_code_sass(text)), text
    return None
