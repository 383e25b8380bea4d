"""Every grouped kernel the heuristics pick at the MoE shapes of issue 36, in GPU interpret mode on a small
problem with the same config: bit for bit against the exact reference of tests/test_grouped_interpret.py
(which runs its kernels under the race detector; these run without it, for time).

Kernels: ``bench.xray.heuristic_cases.grouped_heuristic_cases`` over bench/xray/moe_cases.py's problems (five
models x 1..4096 tokens x gate/up and down, g128, symmetric and asymmetric); a symmetric kernel is run
where it is not the asymmetric one minus the offsets (it folds the bias into WGMMA).
"""

from __future__ import annotations

import numpy as np
import pytest

import nybble.kernels.mosaic_gpu as mg
from bench.xray.heuristic_cases import grouped_heuristic_cases
from bench.xray.moe_cases import MOE_SHAPES, TOKENS, problems
from nybble.kernels.mosaic_gpu.config import folds_bias
from tests.kernel_checks import activations
from tests.test_grouped_interpret import assert_exact, reference, run, stacked


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    mg.reset_state()


def _moe_kernels() -> dict:
    probs = [(rows, e, k, n) for _, _, rows, e, k, n in problems(MOE_SHAPES, TOKENS)]
    cases = grouped_heuristic_cases(probs, [128])
    # A symmetric kernel is the asymmetric one minus the offsets unless it folds the bias (other code).
    return {key: v for key, v in cases.items() if not key[2] or folds_bias(key[0], has_offsets=False)}


MOE_KERNELS = _moe_kernels()


def _label(key) -> str:
    c, _, sym = key
    route = "acc" if c.scales_on == "accumulators" else "wt"
    return (
        f"t{c.tiles}m{c.tile_m}k{c.tile_k}s{c.slices}p{c.max_concurrent_steps}w{c.compute_wgs}"
        f"{'tma' if c.producer else ''}{route}-{'sym' if sym else 'asym'}"
    )


@pytest.mark.sweep
@pytest.mark.parametrize("key", list(MOE_KERNELS), ids=_label)
def test_every_moe_kernel_reduced(key):
    """Each kernel picked at the MoE shapes (issue 36's five models x 1..4096 tokens x gate/up and down,
    g128), at the same config on a small problem: K of one pipeline step (two where a step is 128 deep),
    N of one CTA, 3 experts (one empty), rows past the sum."""
    config, _, symmetric = key
    rng = np.random.default_rng(7)
    k = config.k_span() * (2 if config.tile_k <= 128 else 1)
    rows = min(config.tile_m + 3, 19)
    sizes = [rows // 2, 0, rows - rows // 2 - 1]
    qw, ws = stacked(rng, 3, k, config.cta_rows, symmetric=symmetric)
    x = activations(rng, rows, k, exact=True)
    assert_exact(run(x, qw, sizes, config, races=False), reference(x, ws, sizes))
