"""Which source a result was compiled from: the commit every X-ray result file records."""

from __future__ import annotations

import subprocess
from pathlib import Path


def source_commit() -> str:
    """The checkout's short commit, ``+dirty`` when tracked files differ from it; "unknown" outside git."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, cwd=here
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=here,
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
