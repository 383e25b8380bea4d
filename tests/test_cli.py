"""python -m nybble: help texts, argument errors, and tiny end-to-end runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nybble.__main__ import build_parser, main
from nybble.checkpoint import load


def test_no_args_prints_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for word in ("quantize", "eval", "generate", "usage"):
        assert word in out


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

    gen = ["generate", "--model", "tiny-random", "--prompt", "abc", "--max-new-tokens", "3", "--int4"]
    assert main(gen) == 0
    assert capsys.readouterr().out.startswith("abc")


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


def test_errors_are_reported_not_raised(tmp_path, capsys):
    missing = tmp_path / "nope.safetensors"
    argv = ["eval", "--model", "tiny-random", "--tokens", "8", "--checkpoint", str(missing), "--skip-float"]
    assert main(argv) == 2
    assert "no such file" in capsys.readouterr().err
