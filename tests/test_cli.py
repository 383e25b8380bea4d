"""python -m nybble: help texts, argument errors, and tiny end-to-end runs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from nybble.__main__ import build_parser, main
from nybble.checkpoint import load


def test_no_args_prints_help_and_fails(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    for word in ("quantize", "eval", "generate", "usage", "a command is required"):
        assert word in err


def test_module_entry_point_help():
    res = subprocess.run(
        [sys.executable, "-m", "nybble", "--help"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and "python -m nybble" in res.stdout


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("quantize", ["--model", "--group-size", "--asymmetric", "--output", "--dtype"]),
        ("eval", ["--model", "--group-size", "--asymmetric", "--tokens", "--window", "--checkpoint"]),
        ("generate", ["--prompt", "--max-new-tokens", "--int4"]),
    ],
)
def test_subcommand_help_explains_flags(capsys, command, flags):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in flags:
        assert flag in out


def test_bad_arguments(capsys):
    for argv in (
        ["quantize", "--group-size", "100", "--output", "x"],
        ["quantize", "--model", "gpt5", "--output", "x"],
        ["quantize"],  # --output is required
        ["eval", "--tokens", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    assert build_parser().parse_args(["eval", "--group-size", "none"]).group_size is None


@pytest.mark.parametrize("value", ["abc", "0", "-3", "1.5"])
def test_positive_flags_say_what_they_expect(capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--tokens", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --tokens: expected a positive integer, got {value!r}" in err and "_positive" not in err


def test_one_eval_window_default():
    """`nybble eval`, nybble.models.perplexity and the README's accuracy table use one window."""
    import inspect
    from pathlib import Path

    from nybble.models.evaluate.measure import DEFAULT_WINDOW, perplexity

    assert build_parser().parse_args(["eval"]).window == DEFAULT_WINDOW == 256
    assert inspect.signature(perplexity).parameters["window"].default == DEFAULT_WINDOW
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f"window {DEFAULT_WINDOW})" in readme and f"`--window` {DEFAULT_WINDOW}" in readme


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["quantize", "--output", "{tmp}/missing/dir/x.safetensors"], "does not exist"),
        (["quantize", "--output", "{tmp}"], "is a directory"),
        (["quantize", "--method", "gptq", "--calib-tokens", "100", "--output", "{tmp}/x"], "one calibration"),
        (["eval", "--checkpoint", "{tmp}/missing.safetensors"], "no such file"),
        (["eval", "--checkpoint", "{tmp}/notes.txt"], "not a safetensors file"),
        (["generate", "--prompt", "a", "--checkpoint", "{tmp}/notes.txt"], "not a safetensors file"),
        (["generate", "--prompt", "a", "--int4", "--checkpoint", "{tmp}/notes.txt"], "exclude each other"),
    ],
)
def test_paths_and_arguments_checked_before_any_work(tmp_path, capsys, monkeypatch, argv, message):
    import nybble.__main__ as cli

    def never(args):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(cli, "_load", never)
    (tmp_path / "notes.txt").write_text("not a checkpoint\n" * 50)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([*argv, "--model", "tiny-random"]) == 2
    assert message in capsys.readouterr().err


def test_library_only_install_names_the_extra(tmp_path):
    """Without flax (a plain `pip install nybble`): the CLI and nybble.models say which extra to install,
    while the core still quantizes and multiplies."""
    code = (
        "import sys; sys.modules['flax'] = None\n"  # import flax -> ModuleNotFoundError
        "import numpy as np, nybble\n"
        "qw = nybble.quantize(np.full((64, 64), 7.0, np.float32), group_size=32)\n"  # scale 1, code 7
        "assert float(nybble.matmul(np.ones((1, 64), np.float32), qw)[0, 0]) == 448.0\n"
        "try:\n    from nybble import models\nexcept ModuleNotFoundError as e:\n    print('MODELS:', e)\n"
        "from nybble.__main__ import main\n"
        "sys.exit(main(['eval']))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    hint = 'pip install ".[models]"'  # works in a clone (nybble is not on PyPI)
    assert "MODELS: nybble.models needs 'flax'" in res.stdout and hint in res.stdout
    assert res.stderr.startswith("nybble: ") and hint in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("argv", [["--help"], ["quantize", "--help"], ["eval", "--help"]])
def test_help_prints_on_a_core_install(argv):
    """`python -m nybble --help` needs no flax: the parser is built without importing nybble.models."""
    code = (
        "import sys; sys.modules['flax'] = None\n"
        f"from nybble.__main__ import main\nmain({argv!r})\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "usage: python -m nybble" in res.stdout and "--help" in res.stdout


def test_tiny_quantize_eval_generate(tmp_path, capsys):
    out = tmp_path / "tiny.safetensors"
    assert (
        main(
            ["quantize", "--model", "tiny-random", "--group-size", "64", "--asymmetric", "--output", str(out)]
        )
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    tree = load(out)
    qw = tree["layers"][0]["attn"]["q_proj"]["qweight"]
    assert (qw.group_size, qw.symmetric) == (64, False)

    args = ["eval", "--model", "tiny-random", "--tokens", "64", "--window", "32", "--no-progress"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "64 tokens" in text and "float (float32)" in text and "int4 g128 sym" in text
    assert "int4 / float perplexity" in text

    assert main([*args, "--checkpoint", str(out), "--skip-float"]) == 0
    text = capsys.readouterr().out
    assert "tiny.safetensors" in text and "float (" not in text

    gen = ["generate", "--model", "tiny-random", "--prompt", "abc", "--max-new-tokens", "8"]
    assert main([*gen, "--int4", "--group-size", "64", "--asymmetric"]) == 0
    fresh = capsys.readouterr().out
    assert fresh.startswith("abc")
    # The saved checkpoint generates exactly what the same quantization in memory generates.
    assert main([*gen, "--checkpoint", str(out)]) == 0
    assert capsys.readouterr().out == fresh


def test_gptq_method(tmp_path, capsys):
    out = tmp_path / "gptq.safetensors"
    argv = ["quantize", "--model", "tiny-random", "--method", "gptq", "--calib-tokens", "256"]
    assert main([*argv, "--output", str(out), "--no-progress"]) == 0
    assert "nybble.models.quantize (gptq)" in capsys.readouterr().err
    qw = load(out)["layers"][1]["mlp"]["down_proj"]["qweight"]
    assert (qw.group_size, qw.symmetric) == (128, True)
    args = ["eval", "--model", "tiny-random", "--method", "gptq", "--calib-tokens", "256", "--tokens", "64"]
    assert main([*args, "--window", "32", "--no-progress", "--skip-float"]) == 0
    assert "int4 g128 sym gptq" in capsys.readouterr().out


def test_autoround_fast_method(tmp_path, capsys):
    """--method autoround-fast runs AutoRound's fast preset on the calibration split and saves its codes."""
    out = tmp_path / "ar.safetensors"
    argv = ["quantize", "--model", "tiny-random", "--method", "autoround-fast", "--calib-tokens", "256"]
    assert main([*argv, "--output", str(out), "--no-progress"]) == 0
    assert "nybble.models.quantize (autoround)" in capsys.readouterr().err
    qw = load(out)["layers"][1]["mlp"]["down_proj"]["qweight"]
    assert (qw.group_size, qw.symmetric) == (128, True)
    rtn = tmp_path / "rtn.safetensors"
    assert main(["quantize", "--model", "tiny-random", "--output", str(rtn), "--no-progress"]) == 0
    plain = load(rtn)["layers"][1]["mlp"]["down_proj"]["qweight"]
    assert (np.asarray(qw.codes) != np.asarray(plain.codes)).any()  # learned, not round to nearest


def test_gptq_e2e_method(tmp_path, monkeypatch):
    """--method gptq-e2e is models.quantize(method="autoround") with GPTQ's codes, no block steps and four
    end-to-end epochs (that path runs for real in tests/test_autoround_model.py and tests/test_tune.py)."""
    import nybble.models as nm

    seen = {}
    rtn = nm.quantize

    def spy(model, *, method="rtn", calibration=None, **options):
        seen.update(options, method=method, calibration=calibration)
        extra = ("start", "steps", "end_to_end_epochs", "seq_len")
        return rtn(model, **{k: v for k, v in options.items() if k not in extra})

    monkeypatch.setattr(nm, "quantize", spy)
    argv = ["quantize", "--model", "tiny-random", "--method", "gptq-e2e", "--calib-tokens", "256"]
    assert main([*argv, "--output", str(tmp_path / "q.safetensors"), "--no-progress"]) == 0
    assert seen["method"] == "autoround" and len(seen["calibration"]) == 256
    assert (seen["start"], seen["steps"], seen["end_to_end_epochs"]) == ("gptq", 0, 4)


def test_errors_are_reported_not_raised(tmp_path, capsys):
    missing = tmp_path / "nope.safetensors"
    argv = ["eval", "--model", "tiny-random", "--tokens", "8", "--checkpoint", str(missing), "--skip-float"]
    assert main(argv) == 2
    assert "no such file" in capsys.readouterr().err


def test_help_names_on_a_core_install_match_the_zoo():
    """``--help`` without the models extra lists the named models from a literal: it must be the zoo's."""
    from nybble.__main__ import _NAMED_MODELS
    from nybble.models.evaluate.zoo import MODELS

    assert _NAMED_MODELS == sorted(MODELS)
