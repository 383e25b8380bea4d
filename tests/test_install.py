"""`make install` picks jax's CUDA extra from what `nvidia-smi` reports (a fake one on the PATH here)."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fake_nvidia_smi(folder: Path, gpu: bool, cuda: str) -> None:
    script = folder / "nvidia-smi"
    listing = 'echo "GPU 0: NVIDIA H200"; exit 0' if gpu else 'echo "No devices were found"; exit 6'
    header = f'echo "| NVIDIA-SMI 580.65.06   Driver Version: 580.65.06   CUDA Version: {cuda}     |"'
    script.write_text(f'#!/bin/sh\nif [ "$1" = "-L" ]; then {listing}; fi\n{header}\n')
    script.chmod(0o755)


def _install_line(tmp_path: Path, *make_args: str, gpu: bool = True, cuda: str = "13.0") -> str:
    """The `pip install -e` line `make` would run for a fresh install (dry run: nothing is executed)."""
    _fake_nvidia_smi(tmp_path, gpu, cuda)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(
        ["make", "-n", "-B", ".venv/.installed", *make_args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    (line,) = [x for x in res.stdout.splitlines() if "pip install -q" in x and ' -e ".[' in x]
    return line


@pytest.mark.parametrize(
    ("gpu", "cuda", "extras"),
    [
        (True, "13.0", "test,models,bench,cuda13"),
        (True, "13.1", "test,models,bench,cuda13"),
        (True, "12.8", "test,models,bench,cuda12"),
        (False, "13.0", "test,models,bench"),  # nvidia-smi present, but no GPU
    ],
)
def test_cuda_extra_follows_the_gpu_and_driver(tmp_path, gpu, cuda, extras):
    assert _install_line(tmp_path, gpu=gpu, cuda=cuda).endswith(f'-e ".[{extras}]"')


def test_install_pins_the_lower_end_of_the_jax_range(tmp_path):
    """pyproject.toml allows a range of jax; `make install` (and so `make test`, CI's first step) installs
    its lower end, the one the X-ray baseline was made with; `make test-jax-latest` the newest release, `make
    test-jax-cuda12` the newest with a CUDA 12 plugin."""
    from nybble.jax_range import TESTED

    assert f'"jax=={TESTED[0]}" "jaxlib=={TESTED[0]}" -e' in _install_line(tmp_path)
    for target, venv, version in (
        ("test-jax-latest", ".venv-jax-latest", TESTED[-1]),
        ("test-jax-cuda12", ".venv-jax-cuda12", TESTED[1]),
    ):
        res = subprocess.run(
            ["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        pip = f'{venv}/bin/python -m pip install -q --no-compile "jax=={version}" "jaxlib=={version}" -e'
        assert pip in res.stdout


def test_cuda_extra_can_be_chosen(tmp_path):
    assert _install_line(tmp_path, "CUDA_EXTRA=cuda12").endswith('".[test,models,bench,cuda12]"')
    assert _install_line(tmp_path, "CUDA_EXTRA=").endswith('".[test,models,bench]"')


def test_every_extra_the_makefile_installs_exists(tmp_path):
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    line = _install_line(tmp_path)
    named = set(re.search(r'"\.\[([\w,]+)\]"', line).group(1).split(","))
    assert named <= extras and {"cuda12", "cuda13"} <= extras


def test_only_the_xray_targets_install_the_xray_toolchain(tmp_path):
    """`make bench` installs the package, not the 600 MB X-ray toolchain; `make xray` and `make test` (the
    X-ray gate) do. Dry runs from scratch (-B: every stamp out of date), nothing executed."""
    _fake_nvidia_smi(tmp_path, gpu=False, cuda="13.0")
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}

    def plan(target: str) -> str:
        res = subprocess.run(
            ["make", "-n", "-B", target], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        return res.stdout

    for target in ("bench", "install", "quickstart"):
        out = plan(target)
        assert ' -e ".[' in out and "nybble-xray" not in out, target
    for target in ("xray", "xray-install", "test"):
        assert "--target .venv/nybble-xray" in plan(target), target
