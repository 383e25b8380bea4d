"""``python -m bench.xray.moe_worker GPU``: compiles grouped-kernel X-ray cases (bench/xray/moe_cases.py)."""

from __future__ import annotations

import sys

from bench.xray.moe_cases import worker_main

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "--worker", *sys.argv[1:]]
    sys.exit(worker_main())
