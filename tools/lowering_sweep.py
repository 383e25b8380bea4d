"""Lower the heuristics' pick for random problems for CUDA, on whichever jax runs this (no GPU needed).

    python tools/lowering_sweep.py --shapes 40 --seed 0

Each problem: M log-uniform in 1..4096, K and N uniform in 16..16384 (any value: the op pads), a group size
(16..256 or per column) and symmetric or not, at random; the dense Mosaic GPU kernel's heuristic config for
it lowered with ``.lower(lowering_platforms=("cuda",))`` (Mosaic GPU's layout inference, SMEM budget, TMA
rules). One line per problem; exit status 1 if any failed. tests/test_kernel_lowering.py lowers every config
the heuristics pick at real models' shapes; this looks between them (run it on each jax of the range).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUPS = (16, 32, 64, 128, 256, None)


def problems(count: int, seed: int) -> list[tuple[int, int, int, int | None, bool]]:
    """``count`` random (M, K, N, group, symmetric), the same for the same seed."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        m = round(float(2 ** rng.uniform(0, 12)))
        k, n = (int(v) for v in rng.integers(16, 16385, 2))
        group = GROUPS[int(rng.integers(len(GROUPS)))]
        out.append((m, k, n, group, bool(rng.integers(2))))
    return out


def lower(m: int, k: int, n: int, group: int | None, symmetric: bool) -> str:
    """The config lowered, or raises what lowering raised."""
    import jax
    import jax.numpy as jnp

    import nybble.kernels.mosaic_gpu as mg
    from nybble.quant import quantize

    quant = lambda w: quantize(w, group_size=group, symmetric=symmetric)
    qw = jax.eval_shape(quant, jax.ShapeDtypeStruct((k, n), jnp.float32))
    config = mg.plan(m, qw).config
    fn = lambda x, qw: mg.mosaic_gpu_matmul(x, qw)
    jax.jit(fn).trace(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), qw).lower(lowering_platforms=("cuda",))
    return str(config)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=int, default=40, help="how many random problems")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import jax

    print(f"jax {jax.__version__}: lowering the heuristic pick of {args.shapes} random problems for CUDA")
    failed = 0
    for m, k, n, group, symmetric in problems(args.shapes, args.seed):
        label = f"M={m} K={k} N={n} g{group or 'col'} {'sym' if symmetric else 'asym'}"
        start = time.perf_counter()
        try:
            config = lower(m, k, n, group, symmetric)
        except Exception as e:  # any failure is the finding: report it and go on
            failed += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        print(f"ok   {label} ({time.perf_counter() - start:.1f} s): {config}")
    print(f"{args.shapes - failed} of {args.shapes} lowered")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
