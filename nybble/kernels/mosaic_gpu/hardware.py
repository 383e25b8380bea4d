"""What the Hopper kernel has shown on a real GPU, and the gate ``implementation=None`` applies there.

Interpret mode proves a kernel's arithmetic and synchronization as the interpreter models them, lowering and
the SASS X-ray prove its program; neither runs the hardware. The first hardware check (``make gpu-check`` on
an H200 with jax 0.11.2, 2026-12-04; log: bench/results/gpu-check-2026-12-04/tests.log.gz) ran every config
the heuristics pick on its smallest problem: many passed bit-exact, and others crashed ("unspecified launch
failure") or returned wrong outputs, among them split-K (the thread-block-cluster reduction, which interpret
mode cannot run: split_k.py) and several two-A-tile configs. The benchmark then crashed at M = 16 on a
Llama-3-8B projection with a split-K config whose small problem had passed.

Until the failures are understood and a check passes, on a real Hopper GPU ``implementation=None`` runs
the kernel only with a config of a :data:`HOPPER_VERIFIED` structure (a clean pass, no clean failure, no
split-K; ``tools/hardware_verdicts.py`` derives the set from the log), chosen by the heuristics among those;
where none fits, it takes the next backend and ``nybble.kernels.explain`` says why. A forced
``implementation="mosaic_gpu"`` is not gated (it runs the heuristics' pick), nor are interpret mode and
lowering on a CPU.
"""

from __future__ import annotations

from typing import Any

from nybble.kernels.mosaic_gpu.config import TuningConfig

# Where the verdicts come from (named in messages).
HARDWARE_CHECK = "the hardware check of 2026-12-04 (H200, jax 0.11.2: bench/results/gpu-check-2026-12-04)"

# (tiles, tile_m, tile_k, slices, split_k, compute_wgs, scales_on, producer) that passed on the H200 and
# never failed there, split-K left out: `python tools/hardware_verdicts.py <that log>` prints this set.
HOPPER_VERIFIED: frozenset[tuple[Any, ...]] = frozenset({
    (1, 1, 64, 8, 1, 1, 'accumulators', False),
    (1, 128, 128, 1, 1, 2, 'weights', False),
    (1, 128, 64, 1, 1, 1, 'weights', False),
    (1, 128, 64, 1, 1, 2, 'weights', False),
    (1, 16, 128, 1, 1, 1, 'accumulators', False),
    (1, 16, 128, 1, 1, 1, 'weights', False),
    (1, 16, 128, 4, 1, 1, 'weights', False),
    (1, 16, 256, 1, 1, 1, 'accumulators', False),
    (1, 16, 256, 1, 1, 1, 'weights', True),
    (1, 16, 256, 2, 1, 1, 'accumulators', False),
    (1, 16, 256, 4, 1, 1, 'weights', False),
    (1, 16, 64, 1, 1, 1, 'accumulators', True),
    (1, 2, 128, 4, 1, 1, 'accumulators', False),
    (1, 2, 256, 8, 1, 1, 'accumulators', False),
    (1, 2, 64, 8, 1, 1, 'accumulators', False),
    (1, 256, 64, 1, 1, 2, 'weights', False),
    (1, 32, 128, 1, 1, 1, 'accumulators', False),
    (1, 32, 128, 1, 1, 1, 'weights', False),
    (1, 32, 256, 1, 1, 1, 'accumulators', False),
    (1, 32, 256, 1, 1, 1, 'weights', True),
    (1, 32, 64, 1, 1, 1, 'accumulators', True),
    (1, 4, 128, 4, 1, 1, 'accumulators', False),
    (1, 4, 256, 2, 1, 1, 'accumulators', False),
    (1, 4, 256, 4, 1, 1, 'accumulators', False),
    (1, 4, 256, 4, 1, 1, 'accumulators', True),
    (1, 4, 256, 8, 1, 1, 'accumulators', False),
    (1, 4, 512, 4, 1, 1, 'accumulators', False),
    (1, 4, 512, 4, 1, 1, 'accumulators', True),
    (1, 4, 64, 8, 1, 1, 'accumulators', False),
    (1, 64, 128, 1, 1, 1, 'weights', False),
    (1, 64, 256, 1, 1, 1, 'weights', True),
    (1, 64, 64, 1, 1, 1, 'weights', True),
    (1, 8, 128, 1, 1, 1, 'accumulators', False),
    (1, 8, 128, 1, 1, 1, 'weights', False),
    (1, 8, 128, 4, 1, 1, 'accumulators', False),
    (1, 8, 256, 1, 1, 1, 'accumulators', False),
    (1, 8, 256, 1, 1, 1, 'weights', False),
    (1, 8, 256, 1, 1, 1, 'weights', True),
    (1, 8, 256, 2, 1, 1, 'accumulators', False),
    (1, 8, 256, 2, 1, 1, 'accumulators', True),
    (1, 8, 256, 8, 1, 1, 'weights', False),
    (1, 8, 512, 1, 1, 1, 'accumulators', False),
    (1, 8, 512, 2, 1, 1, 'accumulators', False),
    (1, 8, 512, 2, 1, 1, 'accumulators', True),
    (1, 8, 64, 1, 1, 1, 'accumulators', True),
    (1, 8, 64, 8, 1, 1, 'weights', False),
    (2, 1, 256, 8, 1, 1, 'accumulators', False),
    (2, 16, 512, 2, 1, 1, 'accumulators', True),
    (2, 2, 256, 8, 1, 1, 'accumulators', False),
    (2, 2, 512, 4, 1, 1, 'accumulators', False),
    (2, 2, 512, 4, 1, 1, 'accumulators', True),
    (2, 4, 256, 4, 1, 1, 'accumulators', False),
    (2, 4, 256, 4, 1, 1, 'accumulators', True),
    (2, 4, 256, 8, 1, 1, 'accumulators', False),
    (2, 4, 256, 8, 1, 1, 'accumulators', True),
    (2, 4, 512, 2, 1, 1, 'accumulators', False),
    (2, 4, 512, 4, 1, 1, 'accumulators', False),
    (2, 4, 512, 4, 1, 1, 'accumulators', True),
    (2, 8, 512, 2, 1, 1, 'accumulators', False),
    (2, 8, 512, 4, 1, 1, 'accumulators', False),
    (4, 1, 256, 8, 1, 1, 'accumulators', False),
    (4, 1, 256, 8, 1, 1, 'accumulators', True),
    (4, 2, 256, 4, 1, 1, 'accumulators', True),
    (4, 2, 256, 8, 1, 1, 'accumulators', False),
    (4, 2, 256, 8, 1, 1, 'accumulators', True),
    (4, 4, 256, 2, 1, 1, 'accumulators', True),
    (4, 4, 256, 4, 1, 1, 'accumulators', False),
    (4, 64, 256, 1, 1, 1, 'weights', True),
    (4, 8, 256, 2, 1, 1, 'accumulators', True),
})


# The SwiGLU epilogue (swiglu.py) has run in interpret mode, lowered and compiled (X-ray), never on a GPU:
# on a real Hopper GPU implementation=None leaves it out (nybble.kernels.swiglu_matmul then runs the
# product as nybble.matmul does and the SiLU product after it) until a hardware check passes
# tests/test_swiglu.py (bench/gpu_check.sh runs it) and this says True.
SWIGLU_VERIFIED = False
# The residual epilogue (residual.py), likewise: left out by implementation=None on a real Hopper GPU (the
# op then adds and multiplies after nybble.matmul) until a hardware check passes tests/test_residual.py.
RESIDUAL_VERIFIED = False


def structure(config: TuningConfig) -> tuple[Any, ...]:
    """The fields of a config that decide its code path; pipeline depth, grid order and a persistent grid
    left out."""
    return (
        config.tiles, config.tile_m, config.tile_k, config.slices, config.split_k, config.compute_wgs,
        config.scales_on, config.producer,
    )  # fmt: skip


def verified(config: TuningConfig) -> bool:
    """Whether ``config``'s structure passed the hardware check and never failed it."""
    return config.split_k == 1 and structure(config) in HOPPER_VERIFIED


def unverified_reason(config: TuningConfig | None) -> str:
    """The sentence ``explain`` gives when no verified config fits a problem."""
    picked = f" (the heuristics' pick: {config})" if config is not None else ""
    return (
        f"on this GPU implementation=None runs nybble's Hopper kernel only with configs that passed "
        f"{HARDWARE_CHECK}, and none fits this problem{picked}; pass implementation='mosaic_gpu' to run "
        f"the heuristics' pick anyway"
    )


__all__ = [
    "HARDWARE_CHECK", "HOPPER_VERIFIED", "RESIDUAL_VERIFIED", "SWIGLU_VERIFIED", "structure",
    "unverified_reason", "verified",
]  # fmt: skip
