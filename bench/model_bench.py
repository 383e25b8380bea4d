"""``python -m bench.model_bench``: decode tokens per second of a whole model, float weights against int4.

    python -m bench.model_bench [--batches 1 16] [--new-tokens N] [--group-size 128] [--out DIR]

Loads SmolLM2-135M (``--model tiny-random`` for a smoke run), quantizes a copy round-to-nearest
(``nybble.models.quantize``; ``nybble.matmul`` takes the Mosaic GPU kernel on a Hopper GPU, XLA elsewhere)
and, for each batch size, runs equal-length prompts through one prefill and a jitted KV-cache decode loop
(``nybble.models.evaluate.measure.prefill_last`` / ``decode_loop``, no early stop). After a
compile-and-warm-up run,
both are timed separately; decode tokens/s = batch * decode steps / median decode-loop time. Activations
are bf16 on a GPU, float32 on the CPU (``--dtype``). Before the timings mean anything the outputs are
checked: finite logits, and the fraction of greedy tokens where int4 agrees with float is reported.

Writes ``model_bench.json`` (and ``model_bench.md`` unless ``--no-markdown``) to ``--out``, else ``$OUT``,
else ``bench/results/<device>-<date>/``. Exit status 1 when a check fails, 3 when the model cannot be loaded.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import host_samples

SCHEMA = "nybble-model-bench/1"
TOP_KEYS = ("schema", "machine", "config", "rows", "checks_ok", "notes", "elapsed_s")
ROW_KEYS = ("batch", "float", "int4", "speedup", "agreement", "prefix_agreement", "finite")
MEASURE_KEYS = (
    "batch",
    "prompt_len",
    "decode_steps",
    "prefill",
    "decode",
    "compile_s",
    "tokens_per_s",
    "prefill_tokens_per_s",
    "ms_per_step",
    "finite",
    "tokens",
)
TIME_KEYS = ("median_s", "min_s", "max_s", "samples")


def _times(fn: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Wall times of ``fn`` (which must block until its result is ready), ``repeats`` runs."""
    samples = host_samples(fn, repeats=repeats, warmup=0)
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "samples": len(samples),
    }


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def measure_decode(model: Any, prompts: np.ndarray, new_tokens: int, *, repeats: int = 3) -> dict[str, Any]:
    """Prefill and decode timings of ``model`` (a ``nybble.models.definitions.llama.Llama``) on ``prompts``
    (batch, L).

    One untimed run compiles and warms up; then ``repeats`` timed runs of the prefill (the whole prompt
    into a new cache) and, separately, of the decode loop (``new_tokens`` decode steps, one token per row
    each, no eos). Returns times, rates, whether the prefill logits are finite, and the greedy tokens
    (batch, new_tokens + 1): the prefill's token, then one per decode step.
    """
    from flax import nnx

    from nybble.models.evaluate.measure import decode_loop, prefill_last

    prompts = np.asarray(prompts, np.int32)
    if prompts.ndim != 2 or prompts.size == 0:
        raise ValueError(f"prompts must be (batch, length), got shape {prompts.shape}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    batch, length = prompts.shape
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(prompts)
    n = jnp.asarray(length, jnp.int32)
    n_new = jnp.asarray(new_tokens + 1, jnp.int32)  # the prefill's token + new_tokens decode steps
    out_len = new_tokens + 1
    max_len = _round_up(length + new_tokens + 1, 16)
    no_eos = jnp.asarray(-1, jnp.int32)

    def prefill() -> tuple[jax.Array, Any]:
        return jax.block_until_ready(prefill_last(graphdef, state, ids, n, max_len))

    t0 = time.perf_counter()
    logits, cache = prefill()
    compile_prefill = time.perf_counter() - t0

    def decode() -> tuple[jax.Array, jax.Array]:
        return jax.block_until_ready(decode_loop(graphdef, state, cache, logits, n, n_new, out_len, no_eos))

    t0 = time.perf_counter()
    tokens, count = decode()
    compile_decode = time.perf_counter() - t0
    if int(count) != out_len:
        raise RuntimeError(f"decode loop ran {int(count) - 1} steps, expected {new_tokens}")
    prefill_t = _times(prefill, repeats)
    decode_t = _times(decode, repeats)
    return {
        "batch": batch,
        "prompt_len": length,
        "decode_steps": new_tokens,
        "prefill": prefill_t,
        "decode": decode_t,
        "compile_s": {"prefill": compile_prefill, "decode": compile_decode},
        "tokens_per_s": batch * new_tokens / decode_t["median_s"],
        "prefill_tokens_per_s": batch * length / prefill_t["median_s"],
        "ms_per_step": decode_t["median_s"] / new_tokens * 1e3,
        "finite": bool(np.isfinite(np.asarray(logits)).all()),
        "tokens": np.asarray(tokens).tolist(),
    }


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> tuple[float, float]:
    """(fraction of positions where two greedy outputs agree, mean fraction of each row's common prefix)."""
    x, y = np.asarray(a), np.asarray(b)
    if x.shape != y.shape or x.size == 0:
        raise ValueError(f"token arrays differ in shape: {x.shape} vs {y.shape}")
    same = x == y
    prefix = [int(np.argmin(row)) if not row.all() else row.size for row in same]
    return float(same.mean()), float(np.mean(prefix) / x.shape[1])


def make_prompts(stream: Sequence[int], batch: int, length: int) -> np.ndarray:
    """``batch`` equal-length prompts: consecutive slices of a token stream (repeated when too short)."""
    s = np.asarray(stream, np.int32).reshape(-1)
    if s.size == 0:
        raise ValueError("empty token stream")
    return np.resize(s, batch * length).reshape(batch, length)


def compare(
    float_model: Any,
    int4_model: Any,
    stream: Sequence[int],
    *,
    batches: Sequence[int] = (1, 16),
    prompt_len: int = 32,
    new_tokens: int = 16,
    repeats: int = 3,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per batch size: float and int4 measurements, int4 speedup, token agreement, finiteness."""
    rows = []
    for batch in batches:
        prompts = make_prompts(stream, batch, prompt_len)
        m_float = measure_decode(float_model, prompts, new_tokens, repeats=repeats)
        m_int4 = measure_decode(int4_model, prompts, new_tokens, repeats=repeats)
        agree, prefix = agreement(m_float["tokens"], m_int4["tokens"])
        rows.append(
            {
                "batch": batch,
                "float": m_float,
                "int4": m_int4,
                "speedup": m_int4["tokens_per_s"] / m_float["tokens_per_s"],
                "prefill_speedup": m_int4["prefill_tokens_per_s"] / m_float["prefill_tokens_per_s"],
                "agreement": agree,
                "prefix_agreement": prefix,
                "finite": m_float["finite"] and m_int4["finite"],
            }
        )
        if log is not None:
            r = rows[-1]
            log(
                f"batch {batch}: float {m_float['tokens_per_s']:.1f} tok/s, "
                f"int4 {m_int4['tokens_per_s']:.1f} tok/s ({r['speedup']:.2f}x); greedy agreement {agree:.0%}"
            )
    return rows


def int4_paths(model: Any, batches: Sequence[int], dtype: Any) -> dict[str, dict[str, str]]:
    """For each distinct int4 layer shape and batch: the implementation ``nybble.matmul`` picks here
    (``mosaic_gpu``, or ``xla: <why not the kernel>``)."""
    from flax import nnx

    from nybble.kernels import available_implementations
    from nybble.models import QLinear

    out: dict[str, dict[str, str]] = {}
    for _, module in nnx.iter_modules(model):
        if not isinstance(module, QLinear):
            continue
        w = module.weight
        key = f"{w.shape[0]}x{w.shape[1]}"
        if key in out:
            continue
        out[key] = {}
        for b in batches:
            why = available_implementations(jnp.zeros((b, w.shape[0]), dtype), w)["mosaic_gpu"].reason
            out[key][f"M={b}"] = "mosaic_gpu" if why is None else f"xla: {why}"
    return out


def validate(result: dict[str, Any]) -> list[str]:
    """Problems with a result dict against the schema (empty when it is fine)."""
    problems = [f"missing top-level key {k!r}" for k in TOP_KEYS if k not in result]
    if result.get("schema") != SCHEMA:
        problems.append(f"schema is {result.get('schema')!r}, expected {SCHEMA!r}")
    for i, row in enumerate(result.get("rows", [])):
        problems += [f"rows[{i}] lacks {k!r}" for k in ROW_KEYS if k not in row]
        for kind in ("float", "int4"):
            m = row.get(kind, {})
            problems += [f"rows[{i}].{kind} lacks {k!r}" for k in MEASURE_KEYS if k not in m]
            for part in ("prefill", "decode"):
                problems += [
                    f"rows[{i}].{kind}.{part} lacks {k!r}" for k in TIME_KEYS if k not in m.get(part, {})
                ]
    return problems


def table(result: dict[str, Any], markdown: bool = False) -> str:
    """machine, device, dtype, batch, float tok/s, int4 tok/s, speedup (+ prefill and agreement)."""
    from bench.report import format_table

    m, cfg = result["machine"], result["config"]
    header = [
        "machine", "device", "dtype", "batch", "float tok/s", "int4 tok/s", "speedup", "prefill x",
        "agree",
    ]  # fmt: skip
    body = [
        [
            m["hostname"],
            m["device"],
            cfg["dtype"],
            str(r["batch"]),
            f"{r['float']['tokens_per_s']:.1f}",
            f"{r['int4']['tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['prefill_speedup']:.2f}x",
            f"{r['agreement']:.0%}",
        ]
        for r in result["rows"]
    ]
    return format_table(header, body, markdown)


def markdown_report(result: dict[str, Any]) -> str:
    m, cfg = result["machine"], result["config"]
    lines = [
        f"# nybble model benchmark: {cfg['model']}, float vs int4",
        "",
        f"- date: {m['date']}; device: {m['device']} ({m['backend']}); CPU: {m['cpu']} x{m['cpu_count']}",
        f"- jax {m['jax']}, jaxlib {m['jaxlib']}; activations {cfg['dtype']}; int4 RTN g{cfg['group_size']} "
        f"symmetric; prompt {cfg['prompt_len']} tokens, {cfg['new_tokens']} decode steps, median of "
        f"{cfg['repeats']} runs after a warm-up; elapsed {result['elapsed_s']:.0f} s",
        "- tok/s = batch * decode steps / decode-loop time (KV cache, greedy, jitted while_loop); "
        "prefill x = int4 prefill speed / float's; agree = fraction of greedy tokens int4 shares with float",
        "",
        table(result, markdown=True),
        "",
        "int4 matmul path per layer shape:",
        "",
    ]
    for shape, paths in result["config"]["int4_paths"].items():
        distinct = set(paths.values())
        text = distinct.pop() if len(distinct) == 1 else "; ".join(f"{m}: {v}" for m, v in paths.items())
        lines.append(f"- {shape}: {text}")
    lines += [f"- note: {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.model_bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (default), smollm2-shapes (random weights, same architecture), llama3-8b-shapes "
        "(random weights in Llama-3-8B's architecture: for a GPU) or tiny-random",
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=None, help="decode steps (default 64 on GPU, 16 on CPU)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=None, help="timed runs (default 5 on GPU, 3 on CPU)")
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="auto: bf16 on GPU, f32 on CPU",
    )
    p.add_argument(
        "--decode-attention",
        choices=["xla", "triton"],
        default="xla",
        help="both models' decode-step attention (nybble.models.set_decode_attention)",
    )
    p.add_argument("--out", type=Path, default=None, help="output folder (default: $OUT or bench/results/)")
    p.add_argument("--no-markdown", action="store_true", help="write model_bench.json only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.monotonic()
    from bench.cli import output_dir
    from bench.device import device_slug, has_gpu, machine_info
    from bench.report import write_json

    gpu = has_gpu()
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if gpu else "float32")
    dtype = jnp.dtype(dtype_name)
    new_tokens = args.new_tokens or (64 if gpu else 16)
    repeats = args.repeats or (5 if gpu else 3)
    out = output_dir(args.out, device_slug(), datetime.datetime.now(datetime.UTC))
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "model": args.model,
        "dtype": dtype_name,
        "group_size": args.group_size,
        "batches": args.batches,
        "prompt_len": args.prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "decode_attention": args.decode_attention,
    }
    result: dict[str, Any] = {"schema": SCHEMA, "machine": machine_info(), "config": config, "rows": []}
    result["notes"] = [] if gpu else ["no GPU: int4 runs through XLA on the CPU (no Mosaic kernel)"]
    try:
        from flax import nnx

        from nybble.models import eval_text, fuse_projections, quantize, set_decode_attention
        from nybble.models.evaluate.zoo import load_named

        float_model, tokenizer = load_named(args.model, dtype)
    except ImportError as e:
        print(f"model_bench: cannot load {args.model}: {e}", file=sys.stderr)
        result.update(checks_ok=False, elapsed_s=time.monotonic() - start, skipped=f"cannot load model: {e}")
        write_json(result, out / "model_bench.json")
        return 3
    # q/k/v and gate/up fused in both (nybble.models.fuse_projections): the step bench.decode predicts
    fuse_projections(float_model)
    int4_model = quantize(
        nnx.clone(float_model), group_size=args.group_size, progress=False, fuse_projections=True
    )
    for model in (float_model, int4_model):
        set_decode_attention(model, args.decode_attention)
    config["int4_paths"] = int4_paths(int4_model, args.batches, dtype)
    stream = tokenizer.encode(eval_text()).ids
    print(f"model_bench: {args.model}, {dtype_name}, {result['machine']['device']}; {new_tokens} steps")
    result["rows"] = compare(
        float_model,
        int4_model,
        stream,
        batches=args.batches,
        prompt_len=args.prompt_len,
        new_tokens=new_tokens,
        repeats=repeats,
        log=print,
    )
    result["checks_ok"] = all(r["finite"] for r in result["rows"])
    if not result["checks_ok"]:
        result["notes"].append("CHECK FAILED: non-finite logits (see rows[].float/int4.finite)")
    result["elapsed_s"] = time.monotonic() - start
    write_json(result, out / "model_bench.json")
    if not args.no_markdown:
        (out / "model_bench.md").write_text(markdown_report(result))
    print(table(result))
    for n in result["notes"]:
        print(f"note: {n}")
    print(f"model_bench: wrote {out} ({result['elapsed_s']:.0f} s)")
    return 0 if result["checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
