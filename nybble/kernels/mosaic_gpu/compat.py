"""Where jax releases in nybble's range (``nybble.jax_range``) differ for the Mosaic GPU kernels: one place.

Kernel bodies call these helpers instead of asking which jax they run on; each helper detects the feature
it needs (never a version number), so a release in the range that has it takes the new path.

* SMEM stores. jax 0.11.2's Pallas store (``ref[...] = value``) into an SMEM ref without tiling or
  swizzle fell back to a plain (bank-conflicting) store when Mosaic GPU had no conflict-free plan for the
  value's layout. From 0.12 a store asks for a conflict-free plan unless told otherwise
  (``plgpu.store(ref, value, optimized=False)``, new in 0.12), and layout inference fails with "Failed to
  infer a possible set of layouts" where none exists: the K-sliced kernels' f32 WGMMA accumulators into
  their (tiles, 64, WGMMA N) SMEM scratch, at WGMMA N = 64 (M = 16 with 4 K slices).
  :func:`store_unoptimized` is that old store on both (the same instructions).
* Interpret mode. From 0.12 the race detector raises inside the kernel's host callbacks on the first race
  unless ``InterpretGPUParams(on_race="warn")``; nybble reads the verdict after the kernel
  (``interpret.races_found``), as on 0.11.2: :func:`interpret_params`.

The interpret-mode patches (``interpret.py``) are private-function patches, each re-verified on every
release in the range (the docstring there says what each closes, and on which releases).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["STRICT_LAYOUT_INFERENCE", "interpret_params", "store_unoptimized"]

# plgpu.store(ref, value, *, optimized=...): jax >= 0.12.
_HAS_STORE = hasattr(plgpu, "store")
# The jax releases with plgpu.store (0.12) also infer layouts without 0.11.2's untiled-store fallback: a
# few kernel variants that lower on 0.11.2 find no layout there (grouped_config.grouped_allows names them).
STRICT_LAYOUT_INFERENCE = _HAS_STORE


def store_unoptimized(ref: Any, value: Any) -> None:
    """``ref[...] = value`` into an untiled SMEM ref, allowed to bank-conflict where Mosaic GPU has no
    conflict-free plan for ``value``'s layout (jax 0.11.2's default for such a ref; 0.12 asks for it)."""
    if _HAS_STORE:
        plgpu.store(ref, value, optimized=False)
    else:
        ref[...] = value


def interpret_params(detect_races: bool) -> Any:
    """``plgpu.InterpretGPUParams`` that flag races for :func:`interpret.races_found` to read, not raise
    from inside the kernel (jax >= 0.12 raises by default)."""
    fields = {f.name for f in dataclasses.fields(plgpu.InterpretGPUParams)}
    extra = {"on_race": "warn"} if "on_race" in fields else {}
    return plgpu.InterpretGPUParams(detect_races=detect_races, **extra)
