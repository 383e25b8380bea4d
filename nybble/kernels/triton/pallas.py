"""``pallas_call`` for nybble's Triton kernels: traced outside the GPU interpret mode that
``nybble.kernels.interpret()`` forces for the Mosaic GPU kernels.

``plgpu.force_gpu_interpret_mode`` (Mosaic GPU) sends every ``pallas_call`` traced under it to the Mosaic GPU
interpreter, Triton kernels included, which that interpreter cannot run (a Triton kernel's vector indices
fail in its memory callbacks). One program may hold both families (a decode step: the Hopper kernel's
projections beside the Triton attention kernel), so a Triton kernel traces with that mode cleared and runs
as its own ``interpret`` flag says: Pallas' interpreter under ``nybble.kernels.triton.backend.interpret()``,
Triton on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu_mosaic


def pallas_call(kernel: Callable[..., None], **kwargs: Any) -> Callable[..., Any]:
    """``pl.pallas_call(kernel, **kwargs)``, built and traced with Mosaic GPU's forced interpret mode off
    (Pallas reads the mode when the call is built)."""

    def traced(*operands: Any) -> Any:
        with plgpu_mosaic.force_gpu_interpret_mode(None):  # type: ignore[arg-type]  # None: no forced mode
            return pl.pallas_call(kernel, **kwargs)(*operands)

    return traced
