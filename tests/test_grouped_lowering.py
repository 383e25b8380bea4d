"""The grouped (mixture-of-experts) W4A16 kernel lowered for CUDA on a CPU: the hardware rules.

``jax.jit(f).trace(*ShapeDtypeStructs).lower(lowering_platforms=("cuda",))`` runs Mosaic GPU's layout
inference, SMEM budget and TMA checks (e.g. that an M tile's x window starts on a whole 8-row SMEM tile
of the x view) at production shapes with no data. Every kernel the heuristics pick at the MoE shapes of
issue 36 (bench/xray/moe_cases.py: five models x 1..4096 tokens x gate/up and down, g128 symmetric and
asymmetric), once per distinct kernel (a symmetric kernel where it is not the asymmetric one minus the
offsets: it folds the bias into WGMMA), is compiled down to SASS by the X-ray gate in tests/test_xray.py,
which lowers it first; here, the lowering of the cases the gate does not cover (256 experts).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.xray.cases import is_twin
from bench.xray.heuristic_cases import grouped_heuristic_cases
from bench.xray.moe_cases import MOE_SHAPES, TOKENS, abstract_weight, problems
from nybble.kernels.gpu import H100_SXM, H200
from nybble.kernels.mosaic_gpu.config import SMEM_BUDGET_BYTES, fits_smem, smem_bytes
from nybble.kernels.mosaic_gpu.grouped import grouped_matmul

NUM_SMS = 132


def _kernels() -> dict:
    probs = [(rows, e, k, n) for _, _, rows, e, k, n in problems(MOE_SHAPES, TOKENS)]
    cases = grouped_heuristic_cases(probs, [128], NUM_SMS)
    asymmetric = {key[:2] for key in cases if not key[2]}
    return {key: v for key, v in cases.items() if not is_twin(key, asymmetric)}


KERNELS = _kernels()


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


def test_the_xray_gate_compiles_every_moe_kernel():
    """Every grouped kernel the heuristics pick at the MoE shapes is compiled down to SASS by the X-ray gate
    (tests/test_xray.py::test_moe_kernel_xray_gate: one launch, 0 spills, <= 2.0 instructions per weight at
    decode), which lowers it for CUDA first; so it is not lowered again here. Its config fits SMEM."""
    from bench.xray.moe_cases import build_cases as moe_build_cases
    from bench.xray.moe_cases import distinct_kernels, kernel_key

    gate = {kernel_key(c, NUM_SMS) for c in distinct_kernels(moe_build_cases(), NUM_SMS)}
    assert gate == set(KERNELS)
    for config, _, symmetric in KERNELS:
        assert fits_smem(config, group=128, has_offsets=not symmetric)


# DeepSeek-V3 decode over 256 experts (not an X-ray gate case); and where the gate does not run (`make
# test-jax-cuda12`, NYBBLE_LOWER_GATE_KERNELS=1: jax 0.12, whose X-ray toolchain the gate's baseline was
# not made with) every kernel of KERNELS too.
_LOWERED = [
    (8, 256, 7168, 2048, 128, False),
    *(KERNELS.values() if os.environ.get("NYBBLE_LOWER_GATE_KERNELS") == "1" else ()),
]


@pytest.mark.parametrize(
    "rows, experts, k, n, group, symmetric",
    _LOWERED,
    ids=[f"T{r}-E{e}-K{k}-N{n}-g{g}-{'sym' if s else 'asym'}" for r, e, k, n, g, s in _LOWERED],
)
def test_lowers_in_one_launch(rows, experts, k, n, group, symmetric):
    lowered, _ = _lower(rows, experts, k, n, group, symmetric)
    _assert_one_launch(lowered)


def test_kernels_cover_both_regimes():
    """Decode picks (K slices, the accumulator route) and prefill picks (the warp-specialized kernel)."""
    configs = [key[0] for key in KERNELS]
    assert any(c.slices > 1 for c in configs) and any(c.producer for c in configs)
    assert any(c.compute_wgs == 2 for c in configs) and any(c.scales_on == "weights" for c in configs)
    assert all(c.split_k == 1 and c.persistent_ctas == 0 for c in configs)


def test_grouped_kernels_fit_the_gpus_smem():
    """The budget the heuristics prune by is the one the GPU spec states (the opt-in SMEM of one block on
    H100 and H200), and every grouped kernel picked at the MoE shapes allocates no more than that."""
    assert SMEM_BUDGET_BYTES == H200.smem_per_block_optin == H100_SXM.smem_per_block_optin
    for config, _, symmetric in KERNELS:
        used = smem_bytes(config, group=128, has_offsets=not symmetric)
        assert 0 < used <= H200.smem_per_block_optin, (config, used)


def test_on_cpu_outside_interpret_is_refused():
    """Lowered for the CPU without ``interpret``: the dense kernels' clear error, not Mosaic's."""
    qw = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_weight(2, 128, 64, 128, True))
    x = jnp.zeros((4, 128), jnp.bfloat16)
    sizes = jnp.asarray(np.array([2, 2], np.int32))
    with pytest.raises(NotImplementedError, match="interpret"):
        jax.jit(grouped_matmul)(x, qw, sizes)
