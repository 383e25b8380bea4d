"""The compiling side of ``python -m bench.xray --gpu b200`` (``bench.xray.worker``'s protocol)."""

from __future__ import annotations

import os
import sys


def main() -> int:
    from bench.xray.blackwell import Case, compile_case
    from bench.xray.worker import serve

    # The peers' packages (bench.xray.peer_tools), after the venv's own: jax and numpy stay the venv's.
    sys.path.extend(p for p in os.environ.get("NYBBLE_XRAY_PEER_SITES", "").split(os.pathsep) if p)
    return serve(lambda d: Case(**d), compile_case)


if __name__ == "__main__":
    sys.exit(main())
