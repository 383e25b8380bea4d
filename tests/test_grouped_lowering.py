"""The grouped (mixture-of-experts) W4A16 kernel lowered for CUDA on a CPU: the hardware rules.

``jax.jit(f).trace(*ShapeDtypeStructs).lower(lowering_platforms=("cuda",))`` runs Mosaic GPU's layout
inference, SMEM budget and TMA checks (e.g. that an M tile's x window starts on a whole 8-row SMEM tile
of the x view) at production shapes with no data. Every kernel the heuristics pick at the MoE shapes of
issue 36 (bench/xray/moe_cases.py: five models x 1..4096 tokens x gate/up and down, g128 symmetric and
asymmetric) is lowered here, once per distinct kernel; a symmetric kernel is lowered where it is not the
asymmetric one minus the offsets (it folds the bias into WGMMA). ``python -m bench.xray.moe_cases``
compiles the same kernels down to SASS.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.xray.cases import is_twin
from bench.xray.heuristic_cases import grouped_heuristic_cases
from bench.xray.moe_cases import MOE_SHAPES, TOKENS, abstract_weight, problems
from nybble.kernels.mosaic_gpu.config import SMEM_BUDGET_BYTES, fits_smem
from nybble.kernels.mosaic_gpu.grouped import grouped_matmul, grouped_plan

NUM_SMS = 132


def _kernels() -> dict:
    probs = [(rows, e, k, n) for _, _, rows, e, k, n in problems(MOE_SHAPES, TOKENS)]
    cases = grouped_heuristic_cases(probs, [128], NUM_SMS)
    asymmetric = {key[:2] for key in cases if not key[2]}
    return {key: v for key, v in cases.items() if not is_twin(key, asymmetric)}


KERNELS = _kernels()


def _label(key) -> str:
    config, _, symmetric = key
    return f"{config.tag}-{'sym' if symmetric else 'asym'}"


def _lower(rows, experts, k, n, group, symmetric, config=None):
    qw = abstract_weight(experts, k, n, group, symmetric)
    x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((experts,), jnp.int32)
    fn = lambda x, qw, sizes: grouped_matmul(x, qw, sizes, config=config, num_sms=NUM_SMS)
    return jax.jit(fn).trace(x, qw, sizes).lower(lowering_platforms=("cuda",)), qw


def _assert_one_launch(lowered) -> None:
    text = lowered.as_text()
    # One kernel, and nothing else that moves data: no pad of x, no slice of y, no zeroing of y.
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1, text[:2000]
    for op in (
        "stablehlo.pad",
        "stablehlo.slice",
        "stablehlo.dynamic_update_slice",
        "stablehlo.broadcast_in_dim",
    ):
        assert op not in text, f"{op} in the lowered module: a second launch"


@pytest.mark.parametrize("key", list(KERNELS), ids=_label)
def test_every_moe_kernel_lowers_for_cuda(key):
    """At the production K, N and rows, with the heuristic's config; over at most 16 experts (the
    experts change only the length of the unrolled group scan, ~1.7 s of lowering at 256: lowered once,
    below)."""
    rows, experts, k, n, group, symmetric = KERNELS[key]
    p, _ = grouped_plan(rows, abstract_weight(experts, k, n, group, symmetric), num_sms=NUM_SMS)
    assert p.config == key[0]
    assert fits_smem(p.config, group=p.group, has_offsets=not symmetric)
    lowered, _ = _lower(rows, min(experts, 16), k, n, group, symmetric, config=p.config)
    _assert_one_launch(lowered)


def test_deepseek_v3_decode_lowers_over_256_experts():
    lowered, _ = _lower(8, 256, 7168, 2048, 128, False)
    _assert_one_launch(lowered)


def test_kernels_cover_both_regimes():
    """Decode picks (K slices, the accumulator route) and prefill picks (the warp-specialized kernel)."""
    configs = [key[0] for key in KERNELS]
    assert any(c.slices > 1 for c in configs) and any(c.producer for c in configs)
    assert any(c.compute_wgs == 2 for c in configs) and any(c.scales_on == "weights" for c in configs)
    assert all(c.split_k == 1 and c.persistent_ctas == 0 for c in configs)


def test_smem_budget_is_the_dense_one():
    assert SMEM_BUDGET_BYTES == 232448


def test_on_cpu_outside_interpret_is_refused():
    """Lowered for the CPU without ``interpret``: the dense kernels' clear error, not Mosaic's."""
    qw = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_weight(2, 128, 64, 128, True))
    x = jnp.zeros((4, 128), jnp.bfloat16)
    sizes = jnp.asarray(np.array([2, 2], np.int32))
    with pytest.raises(NotImplementedError, match="interpret"):
        jax.jit(grouped_matmul)(x, qw, sizes)
