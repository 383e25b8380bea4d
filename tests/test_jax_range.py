"""nybble's jax range (nybble/jax_range.py): declared in pyproject.toml, warned about on import outside it,
and the Mosaic GPU kernels refused there with the same words (the installed jax's version string is
monkeypatched: no other jax is installed)."""

from __future__ import annotations

import importlib
import re
import tomllib
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble import jax_range
from nybble.kernels import mosaic_gpu

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = "0.13.0"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_declares_the_range():
    project = _pyproject()["project"]
    spec = jax_range.SPECIFIER
    assert f"jax{spec}" in project["dependencies"] and f"jaxlib{spec}" in project["dependencies"]
    extras = project["optional-dependencies"]
    assert extras["cuda12"] == [f"jax[cuda12]{spec}"] and extras["cuda13"] == [f"jax[cuda13]{spec}"]
    low, high = re.fullmatch(r">=([\d.]+),<([\d.]+)", spec).groups()
    assert jax_range.MIN_VERSION == tuple(map(int, low.split("."))) and jax_range.TESTED[0] == low
    assert jax_range.MAX_EXCLUSIVE == tuple(map(int, high.split(".")))
    # The X-ray toolchain stays pinned (SASS counts depend on it), at the lower end.
    assert f"jax-cuda12-plugin=={low}" in extras["xray"]
    # The newest tested release is the one `make test-jax-latest` pins; the one before it `make
    # test-jax-cuda12`'s (the newest with a CUDA 12 plugin); CI runs all three (.ci/run).
    makefile = (ROOT / "Makefile").read_text()
    assert f"JAX_LATEST := {jax_range.TESTED[-1]}" in makefile
    assert f"JAX_LATEST_CUDA12 := {jax_range.TESTED[1]}" in makefile
    ci = (ROOT / ".ci" / "run").read_text().split()
    assert "test" in ci and "test-jax-latest" in ci and "test-jax-cuda12" in ci


@pytest.mark.parametrize(
    "version, inside",
    [
        ("0.11.2", True),
        ("0.12.0.1", True),
        ("0.12.1", True),
        ("0.12.9", True),
        ("0.11.1", False),
        ("0.13.0", False),
        ("0.13.0.dev20270101", False),
        ("1.0.0", False),
        ("nightly", False),
    ],
)
def test_outside_reason(version, inside):
    reason = jax_range.outside_reason(version)
    if inside:
        assert reason is None
    else:
        assert reason.startswith(
            "nybble supports jax>=0.11.2,<0.13 (tested with jax 0.11.2, 0.12.0.1 and 0.12.1) and this is jax "
            f"{version};"
        )


def test_import_warns_once_outside_the_range(monkeypatch):
    monkeypatch.setattr(jax, "__version__", OUTSIDE)
    monkeypatch.setattr(jax_range, "_warned", False)
    with pytest.warns(RuntimeWarning) as record:
        importlib.reload(nybble)  # runs nybble/__init__.py again, as an import in a fresh process would
    assert [str(w.message) for w in record] == [jax_range.outside_reason()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(nybble)  # once per process
    monkeypatch.setattr(jax, "__version__", jax_range.TESTED[0])
    monkeypatch.setattr(jax_range, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(nybble)  # inside the range: silent


def test_mosaic_gpu_refuses_outside_the_range_with_the_same_words(monkeypatch):
    qw = nybble.quantize(np.ones((128, 64), np.float32), group_size=64)
    experts = nybble.quantize(np.ones((2, 128, 64), np.float32), group_size=64)
    x = jnp.ones((8, 128), jnp.bfloat16)
    sizes = jnp.array([3, 5], jnp.int32)
    assert mosaic_gpu.is_supported(x, qw) is None
    assert mosaic_gpu.grouped_is_supported(x, experts, sizes) is None
    monkeypatch.setattr(jax, "__version__", OUTSIDE)
    reason = jax_range.outside_reason()
    assert mosaic_gpu.is_supported(x, qw) == reason
    assert mosaic_gpu.grouped_is_supported(x, experts, sizes) == reason
    with pytest.raises(NotImplementedError, match=re.escape(reason)):
        nybble.matmul(x, qw, implementation="mosaic_gpu")
    avail = nybble.kernels.available_implementations(x, qw)
    assert not avail["mosaic_gpu"] and avail["mosaic_gpu"].reason == reason
    # implementation=None takes the XLA path, without a word on a CPU.
    want = np.asarray(nybble.matmul(x, qw, implementation="xla"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(np.asarray(nybble.matmul(x, qw)), want)


def test_xray_compare_flags_changed_sass():
    """bench/xray/compare.py (the two ends' X-ray side by side): a case whose loop differs is marked
    changed, one with the same figures is not, cases in one run only are left out."""
    from bench.xray.compare import compare, table

    def row(key, ipw, regs=168, mix=(("LOP3", 8),), sass=900, peer="nybble:mosaic_gpu"):
        loop = {"instructions_per_weight": ipw, "instructions": 100, "opcode_mix": [list(m) for m in mix]}
        kernel = {"registers": regs, "spill_bytes": 0, "loop": loop, "sass_instructions": sass}
        return {"key": f"{key}/{peer}", "peer": peer, "kernel": kernel, "launches": 1}

    a = {"rows": [row("s/M1", 1.5), row("s/M16", 1.7), row("s/M64", 2.4), row("only-a/M1", 1.0)]}
    b = {"rows": [row("s/M1", 1.5), row("s/M16", 1.7, mix=(("LOP3", 9),)), row("s/M64", 2.4, sass=901)]}
    entries = compare(a, b)
    assert [(e["key"], e["changed"]) for e in entries] == [
        ("s/M1", ""),
        ("s/M16", "loop"),
        ("s/M64", "outside the loop"),
    ]
    lines = table(entries, "jax A", "jax B").splitlines()
    assert lines[2].startswith("| s/M16 | 1.700 | 1.700 | 168 | 168 |") and lines[2].endswith("| loop |")
    assert lines[3].endswith("| 900 | 901 | outside the loop |") and lines[4].endswith("| no |")
