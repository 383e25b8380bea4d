"""``python -m bench.checkpoints``: peak memory and throughput of streamed checkpoint quantization.

Writes synthetic Llama-style bf16 checkpoint directories at two sizes (the same width, so the same
largest tensor, and 6 vs 30 decoder layers: about 0.5B and 2B parameters) in 0.5 GB shards, then, each in
a child process of its own:

* ``streamed``: ``python -m nybble quantize --model DIR --method rtn --format F --output OUT`` (one tensor
  at a time, output shards written as they fill);
* ``load-all``: the baseline the anchors use: every tensor of the directory read into memory first, then
  each linear quantized (``nybble.quantize``), then the whole output written.

Reported per run: peak RSS of that child (``ru_maxrss`` from ``os.wait4``), wall time, and GB/s of bf16
read (input bytes / wall time; and per CPU second of the child, which the other jobs of a shared
machine disturb less). Each input file's page cache is dropped before each run
(``posix_fadvise(DONTNEED)`` on our own files only), so the reads come from disk. The goal (issue 35):
streamed peak RSS at most largest input shard + largest output shard + 512 MB, and equal at both sizes
within 10%.

    python -m bench.checkpoints                   # both sizes, results in bench/results/checkpoints-<date>/
    python -m bench.checkpoints --sizes 0.5B --workdir /tmp   # one size
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

# Same width at both sizes (Llama-3.2-1B-like: hidden 2048, MLP 8192, 32 heads / 8 kv heads, vocab 32000):
# the largest tensors are the same, only the depth differs.
WIDTH = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 32000,
}
SIZES = {"0.5B": 6, "2B": 30}  # decoder layers
SHARD = "500MB"
MB = 10**6


def llama_config(layers: int) -> dict[str, Any]:
    """A transformers config.json for a synthetic Llama of ``layers`` decoder layers."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": layers,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        **WIDTH,
    }


def tensor_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The HF tensors of a Llama checkpoint, in the order transformers saves them."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (q, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (f, h)),
            (f"{p}.mlp.up_proj.weight", (f, h)),
            (f"{p}.mlp.down_proj.weight", (h, f)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def write_checkpoint(path: Path, layers: int, seed: int = 0) -> dict[str, Any]:
    """A synthetic bf16 checkpoint directory (random N(0, 0.02) weights, norms at 1) in 0.5 GB shards."""
    from nybble.models.io.hf.files import ShardedWriter

    config = llama_config(layers)
    rng = np.random.default_rng(seed)
    params = 0
    with ShardedWriter(path, max_shard_bytes=SHARD) as w:
        for name, shape in tensor_shapes(config):
            if len(shape) == 1:
                a = np.ones(shape, ml_dtypes.bfloat16)
            else:
                a = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
            w.add(name, a)
            params += a.size
            del a
        w.write_config(config)
    return {"params": params, "layers": layers}


def drop_page_cache(directory: Path) -> None:
    """Drops the page cache of the files under ``directory`` (ours only; no root, nothing system-wide)."""
    for f in directory.rglob("*"):
        if f.is_file() and hasattr(os, "posix_fadvise"):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_child(argv: list[str]) -> dict[str, Any]:
    """Runs ``argv`` niced from the repository root; its own peak RSS (``os.wait4``), wall time, status."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        proc = subprocess.Popen(["nice", "-n", "10", *argv], stdout=out, stderr=err, cwd=root)
        # wait4 reaps the child and gives its rusage alone (RUSAGE_CHILDREN is the max over every run)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    rss = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024
    return {
        "rc": proc.returncode,
        "wall_s": wall,
        # CPU seconds of the child: on a shared machine wall time mostly measures the other jobs
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_bytes": int(rss),
        "stdout_tail": stdout[-2000:],
        "stderr_tail": stderr[-2000:],
    }


def load_all_then_quantize(model_dir: str, out_dir: str, fmt: str) -> None:
    """The baseline: read every tensor, quantize every linear, then write everything."""
    import nybble
    from nybble.models.io.hf.files import CheckpointDir, ShardedWriter
    from nybble.models.io.hf.stream import linear_modules, scale_dtype_for, writer_for_format

    ckpt = CheckpointDir(model_dir)
    tensors = {n: ckpt.get(n) for n in ckpt.names()}  # the whole model in memory, as the anchors do
    linears = set(linear_modules(ckpt.config, ckpt))
    scale = scale_dtype_for(fmt, ckpt.config)
    writer = writer_for_format(fmt, scale_dtype=scale)
    out: dict[str, Any] = {}
    for name, a in tensors.items():
        module = name[: -len(".weight")]
        if module in linears:
            qw = nybble.quantize(np.asarray(a.T, np.float32), group_size=128, scale_dtype=scale)
            out.update({k: np.asarray(v) for k, v in writer.write_linear(module, qw).items()})
        else:
            out[name] = a
    with ShardedWriter(out_dir, max_shard_bytes=SHARD) as w:
        w.add_all(out)
        config = dict(ckpt.config)
        config["quantization_config"] = writer.quantization_config(ignore=["lm_head"])
        w.write_config(config)


def _largest_shard(directory: Path) -> int:
    return max(f.stat().st_size for f in directory.glob("*.safetensors"))


def machine() -> dict[str, Any]:
    """This machine, in words: CPU model, cores, memory."""
    model = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu": model,
        "nproc": os.cpu_count(),
        "memory_bytes": mem,
        "python": platform.python_version(),
        "note": "shared machine: other jobs were running on its cores during the measurement",
    }


def measure(size: str, workdir: Path, fmt: str) -> dict[str, Any]:
    """Writes one synthetic checkpoint, quantizes it streamed and load-all, returns the numbers."""
    src = workdir / f"llama-{size}"
    t = time.perf_counter()
    info = write_checkpoint(src, SIZES[size])
    info["write_s"] = time.perf_counter() - t
    from nybble.models.io.hf.files import CheckpointDir

    ckpt = CheckpointDir(src)
    bf16_bytes = ckpt.total_bytes
    in_shard = _largest_shard(src)
    largest_tensor = max(ckpt.nbytes(n) for n in ckpt.names())
    del ckpt
    runs: dict[str, Any] = {}
    for kind in ("streamed", "load-all"):
        out = workdir / f"llama-{size}-{kind}-int4"
        drop_page_cache(src)
        if kind == "streamed":
            argv = [sys.executable, "-m", "nybble", "quantize", "--model", str(src), "--method", "rtn"]
            argv += ["--group-size", "128", "--format", fmt, "--output", str(out), "--max-shard-size", SHARD]
            argv += ["--no-progress"]
        else:
            argv = [sys.executable, "-m", "bench.checkpoints", "--baseline-child", str(src), str(out), fmt]
        r = run_child(argv)
        if r["rc"] != 0:
            raise RuntimeError(f"{kind} run failed ({r['rc']}): {r['stderr_tail']}")
        r["gb_per_s"] = bf16_bytes / 1e9 / r["wall_s"]
        r["gb_per_cpu_s"] = bf16_bytes / 1e9 / r["cpu_s"]
        r["largest_output_shard_bytes"] = _largest_shard(out)
        r["output_bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        runs[kind] = r
        shutil.rmtree(out)
    out_shard = runs["streamed"]["largest_output_shard_bytes"]
    bound = in_shard + out_shard + 512 * MB
    shutil.rmtree(src)
    return {
        "size": size,
        **info,
        "bf16_bytes": bf16_bytes,
        "largest_input_shard_bytes": in_shard,
        "largest_tensor_bytes": largest_tensor,
        "goal_bytes": bound,
        "streamed_within_goal": runs["streamed"]["peak_rss_bytes"] <= bound,
        "runs": runs,
    }


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# Streamed checkpoint quantization ({result['date']})",
        "",
        f"Machine: {m['cpu']}, {m['nproc']} cores (`nproc`), {m['memory_bytes'] / 2**30:.0f} GiB; "
        f"{m['note']}. Format {result['format']}, RTN g128 symmetric, {SHARD} shards in and out; page "
        "cache of the input dropped before each run. Command: `python -m bench.checkpoints`.",
        "",
        "| size | params | bf16 GB | layers | run | peak RSS MB | wall s | CPU s | GB/s bf16 read (wall) | "
        "GB per CPU s | goal MB (in shard + out shard + 512) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result["sizes"]:
        for kind, r in s["runs"].items():
            lines.append(
                f"| {s['size']} | {s['params'] / 1e9:.2f}B | {s['bf16_bytes'] / 1e9:.2f} | {s['layers']} | "
                f"{kind} | {r['peak_rss_bytes'] / MB:.0f} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                f"{r['gb_per_s']:.3f} | {r['gb_per_cpu_s']:.3f} | {s['goal_bytes'] / MB:.0f} |"
            )
    lines += ["", result["verdict"], ""]
    return "\n".join(lines)


def verdict(sizes: list[dict[str, Any]]) -> str:
    streamed = [s["runs"]["streamed"]["peak_rss_bytes"] for s in sizes]
    within = all(s["streamed_within_goal"] for s in sizes)
    text = f"Streamed peak RSS within the goal at every size: {'yes' if within else 'NO'}."
    if len(streamed) > 1:
        spread = max(streamed) / min(streamed) - 1
        text += (
            f" Largest / smallest streamed peak: {max(streamed) / MB:.0f} / {min(streamed) / MB:.0f} MB "
            f"(+{100 * spread:.1f}%; goal: within 10%: {'yes' if spread <= 0.10 else 'NO'})."
        )
        base = [s["runs"]["load-all"]["peak_rss_bytes"] for s in sizes]
        text += f" Load-all baseline peaks: {', '.join(f'{b / MB:.0f}' for b in base)} MB."
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoints", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {list(SIZES)}")
    p.add_argument("--format", default="compressed-tensors", choices=["compressed-tensors", "gptq", "nybble"])
    p.add_argument("--workdir", default=None, help="where the synthetic checkpoints go (default: a tmp dir)")
    p.add_argument("--out", default=None, help="results folder (default bench/results/checkpoints-<date>)")
    p.add_argument("--baseline-child", nargs=3, metavar=("DIR", "OUT", "FORMAT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.baseline_child:
        load_all_then_quantize(*args.baseline_child)
        return 0
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    out = Path(args.out or f"bench/results/checkpoints-{date}")
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    work = Path(tempfile.mkdtemp(prefix="nybble-ckpt-bench-", dir=args.workdir))
    try:
        free = shutil.disk_usage(work).free
        print(f"bench.checkpoints: working in {work} ({free / 1e9:.0f} GB free)", file=sys.stderr)
        results = []
        for size in sizes:
            print(f"bench.checkpoints: {size} ...", file=sys.stderr, flush=True)
            results.append(measure(size, work, args.format))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "runs"}), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "date": date,
        "format": args.format,
        "machine": machine(),
        # 1/5/15-minute load averages at the start and the end: how busy the shared machine was
        "loadavg": {"start": load_start, "end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "sizes": results,
        "verdict": verdict(results),
    }
    for s in result["sizes"]:
        for r in s["runs"].values():
            r.pop("stdout_tail", None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoints.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "checkpoints.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
