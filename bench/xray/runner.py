"""Runs X-ray cases in worker processes set up for deviceless CUDA compiles, with a progress bar."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.kernel_xray import child_environment, find_toolchain
from bench.xray.cases import Case

REPO = Path(__file__).resolve().parents[2]


def default_jobs() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def run_cases(
    cases: Sequence[Case],
    *,
    gpu: str = "h200",
    jobs: int | None = None,
    progress: bool = True,
    worker: str = "bench.xray.worker",
    extra_env: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Compiles every case in ``jobs`` worker processes; returns the worker's record per case key.

    ``worker`` is the module run as ``python -m WORKER GPU``: one JSON case a line on stdin (a dataclass
    with ``key``, ``k``, ``n``, ``m``), one JSON record a line on stdout (``bench.xray.worker``'s protocol).

    ``extra_env``: more environment for the workers (the peers' sites, ``bench.xray.peer_tools``).

    Raises ``ToolchainMissing`` (naming the ``xray`` extra) when the toolchain is not installed.
    """
    from tqdm import tqdm

    toolchain = find_toolchain()
    env = child_environment(toolchain)
    path = [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(extra_env or {})
    jobs = max(1, min(jobs or default_jobs(), len(cases) or 1))
    # Heaviest first (large M and wide shapes compile longest), dealt round-robin to the workers.
    ordered = sorted(cases, key=lambda c: -(c.k * c.n) * max(c.m, 1) ** 0.25)
    shares = [ordered[i::jobs] for i in range(jobs)]
    results: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()
    bar = tqdm(total=len(cases), desc="X-ray compiles", unit="case", disable=not progress, file=sys.stderr)
    procs = []

    def drain(proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            with lock:
                results[record["key"]] = record
                bar.update(1)
                if "error" in record:
                    bar.write(f"X-ray: {record['key']}: {record['error']}")

    threads = []
    logs = []
    for share in shares:
        if not share:
            continue
        # stderr to a file: a pipe nobody reads would block a chatty worker.
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        proc = subprocess.Popen(
            [sys.executable, "-m", worker, gpu],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            cwd=REPO,
        )
        assert proc.stdin is not None
        proc.stdin.write("".join(json.dumps(dataclasses.asdict(c)) + "\n" for c in share))
        proc.stdin.close()
        t = threading.Thread(target=drain, args=(proc,), daemon=True)
        t.start()
        procs.append(proc)
        threads.append(t)
    stderr_tails = []
    for proc, t, log in zip(procs, threads, logs, strict=True):
        t.join()
        if proc.wait() != 0:
            log.seek(0)
            stderr_tails.append(log.read()[-3000:])
        log.close()
    bar.close()
    missing = [c.key for c in cases if c.key not in results]
    if missing:
        detail = "\n".join(stderr_tails)
        raise RuntimeError(
            f"X-ray workers produced no record for {len(missing)} case(s), e.g. {missing[:3]}:\n{detail}"
        )
    return results
