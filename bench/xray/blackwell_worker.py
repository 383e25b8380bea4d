"""The compiling side of ``python -m bench.xray --gpu b200`` (``bench.xray.worker``'s protocol)."""

from __future__ import annotations

import sys


def main() -> int:
    from bench.xray.blackwell import Case, compile_case
    from bench.xray.worker import serve

    return serve(lambda d: Case(**d), compile_case)


if __name__ == "__main__":
    sys.exit(main())
