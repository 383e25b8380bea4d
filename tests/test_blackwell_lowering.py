"""Lowering the Blackwell W4A16 kernel for sm_100a on a CPU: Mosaic GPU's layout inference, SMEM budget, TMA
and tcgen05 rules, with no data and no GPU (``blackwell.target.target_arch`` makes Mosaic emit compute
capability 10.0 code, which a CPU device cannot tell it). Every config the B200 heuristics pick at real
model shapes is lowered (once per distinct kernel), then 40 random shapes; interpret mode checks numerics
(tests/test_blackwell_interpret.py)."""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nybble.kernels.mosaic_gpu.blackwell import blackwell_matmul, plan
from nybble.kernels.mosaic_gpu.blackwell.kernel import folds_scales
from nybble.kernels.mosaic_gpu.blackwell.target import target_arch
from nybble.quant import QuantizedWeight, quantize

# (K, N): Llama-3-8B and 70B projections, MoE experts (Mixtral 4096x14336, Qwen3-30B-A3B 2048x768,
# DeepSeek-V3 7168x2048), a small odd pair.
WEIGHT_SHAPES = [
    (4096, 4096),
    (4096, 14336),
    (14336, 4096),
    (8192, 28672),
    (28672, 8192),
    (2048, 768),
    (7168, 2048),
    (576, 1536),
    (10944, 7392),
]
BATCHES = [1, 16, 32, 64, 128, 4096]
GROUPS = [128, 32, None]


@functools.cache  # collection plans 162 problems over 27 weights (ShapeDtypeStructs, shared)
def _abstract_weight(k, n, group, symmetric, scale_dtype=jnp.bfloat16) -> QuantizedWeight:
    quant = lambda w: quantize(w, group_size=group, symmetric=symmetric, scale_dtype=scale_dtype)
    return jax.eval_shape(quant, jax.ShapeDtypeStruct((k, n), jnp.float32))


def _lower(m, qw, x_dtype=jnp.bfloat16, config=None):
    fn = lambda x, qw: blackwell_matmul(x, qw, config=config)
    x = jax.ShapeDtypeStruct((m, qw.shape[0]), x_dtype)
    with target_arch(10, 0):
        return jax.jit(fn).trace(x, qw).lower(lowering_platforms=("cuda",))


def _kernel_key(m, k, n, group, symmetric):
    qw = _abstract_weight(k, n, group, symmetric)
    p = plan(m, qw)
    route = "column" if p.per_column else ("rows" if p.scale_rows > 1 else "row")
    small = p.group < 64
    # The pipeline depth changes no code but the slot count; the symmetric kernel is the asymmetric one
    # without the offsets' operand, loads and adds: both are lowered as one (asymmetric) kernel.
    c = p.config
    return (c.tile_m, c.tile_k, c.slices), c.slices, route, small, p.n_tiles * c.cta_cols != p.n_pad


def _distinct_cases():
    """Real-model cases until every (tile_m, tile_k, slices) and every (tile_k, slices, scale route, N
    tail) of the heuristics' picks is lowered once: the tile decides the MMA, TMEM and x shapes, the route
    the dequantization's loads; they do not interact."""
    seen, cases = set(), []
    for k, n in WEIGHT_SHAPES:
        for m in BATCHES:
            for group in GROUPS:
                tiling, *rest = _kernel_key(m, k, n, group, False)
                keys = {("tile", tiling), ("route", tiling[1], *rest)}
                if keys - seen:
                    seen |= keys
                    cases.append((m, k, n, group, False))
    return cases


@pytest.mark.sweep
@pytest.mark.parametrize("m,k,n,group,symmetric", _distinct_cases())
def test_lower_every_heuristic_config(m, k, n, group, symmetric):
    text = _lower(m, _abstract_weight(k, n, group, symmetric)).as_text()
    assert "tcgen05" in text  # the sm_100a kernel, not the Hopper one


# CI lowers 8 of the 40 random shapes (each costs ~1.5 s on two cores); NYBBLE_LOWERING_SWEEP=40 all.
SWEEP = int(os.environ.get("NYBBLE_LOWERING_SWEEP", "8"))


def _random_cases(count=SWEEP, seed=45):
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        k = int(rng.choice([64, 192, 576, 1024, 2048, 4160, 10944])) + int(rng.choice([0, 0, -7]))
        n = int(rng.choice([64, 100, 192, 768, 1536, 4096, 7392, 7400]))
        m = int(rng.choice([1, 2, 5, 8, 13, 16, 24, 33, 64, 100, 128, 255, 512, 2048]))
        group = rng.choice([16, 32, 64, 128, 256, None])
        cases.append((m, k, n, None if group is None else int(group), bool(rng.integers(2))))
    return cases


@pytest.mark.parametrize("m,k,n,group,symmetric", _random_cases())
def test_random_shapes_lower(m, k, n, group, symmetric):
    """Random shapes (K and N not multiples of 64 included): the heuristics' config lowers, or the call
    is refused by name before Mosaic sees it (never a raw Mosaic error)."""
    _lower(m, _abstract_weight(k, n, group, symmetric))


def test_float16_activations_float32_scales():
    _lower(16, _abstract_weight(4096, 4096, 128, False, jnp.float32), x_dtype=jnp.float16)


def test_one_launch_and_no_copy_of_x_at_decode():
    """A decode matmul lowers to the kernel alone: no pad, transpose, reduce or slice beside it."""
    text = _lower(1, _abstract_weight(4096, 4096, 128, True)).as_text()
    ops = set(re.findall(r"= (stablehlo\.[a-z_]+)", text))
    assert text.count("stablehlo.custom_call") == 1
    assert not ops & {"stablehlo.pad", "stablehlo.transpose", "stablehlo.reduce", "stablehlo.slice"}, ops


@pytest.mark.parametrize("m,n,group", [(1, 28672, 128), (4, 1024, 64)])
def test_group_accumulator_route_lowers(m, n, group):
    """The symmetric decode route that folds scales on per-group TMEM accumulators (kernel.folds_scales),
    without K slices (a wide N) and with them; test_one_launch_and_no_copy_of_x_at_decode lowers Llama's
    q/o projection on it too."""
    qw = _abstract_weight(4096, n, group, True)
    assert folds_scales(plan(m, qw))
    assert "tcgen05" in _lower(m, qw).as_text()


def test_xray_finds_each_roles_loop():
    """The b200 X-ray's K loops, one per role of the warp-specialized kernel (the format of a
    ``.sass_ctrl`` dump): the dequantizing loop (the ``STSM`` stores), each MMA warp's (``UTCHMMA``
    without stores) and the TMA warp's unrolled copies over the steps; never the retry loop of a barrier
    wait, nor anything past an EXIT. Per step: the 4 dequantizing warps' loop plus each issue warp's once,
    over 4 x the weights a thread dequantizes; a scheduler's cycles are its dequantizing warp's loop plus
    the largest issue warp beside it, or a warp's own stall counts where larger."""
    from bench.kernel_xray import sass
    from bench.xray.blackwell import kernel_loops

    text = """
   -:-:-:Y:05        /*0000*/                   MOV R1, c[0x0][0x28] ;
   -:-:-:Y:01        /*0010*/                   UTMALDG.4D [UR8], [UR4] ;
   -:-:-:Y:01        /*0020*/                   UIADD3 UR4, UPT, UPT, UR4, 0x40, URZ ;
   -:-:-:Y:01        /*0030*/                   UTMALDG.4D [UR8], [UR4] ;
.L_x_1:
   -:-:-:Y:05        /*0040*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
   -:-:-:Y:05        /*0050*/               @!P0 BRA `(.L_x_1) ;
.L_x_2:
   -:2:-:Y:01        /*0060*/                   UTCHMMA gdesc[UR10], gdesc[UR8], tmem[UR4], UPT ;
   -:2:-:Y:01        /*0070*/                   UTCHMMA tmem[UR12], gdesc[UR8], tmem[UR4], UPT ;
   -:-:-:Y:09        /*0080*/                   BRA.U UP0, `(.L_x_2) ;
.L_x_3:
   -:-:-:Y:02        /*0090*/                   LDS.64 R4, [R5] ;
   -:-:-:Y:02        /*00a0*/                   LOP3.LUT R4, R5, 0xf000f, R6, 0x6a, !PT ;
   -:-:-:Y:03        /*00b0*/                   SHF.R.U32.HI R4, RZ, 0x4, R5 ;
   -:-:-:Y:01        /*00c0*/                   STSM.16.M88.4 [R51], R24 ;
   -:-:-:Y:04        /*00d0*/               @P1 BRA `(.L_x_3) ;
   -:-:-:Y:05        /*00e0*/                   EXIT ;
"""
    loops = kernel_loops(sass.parse_sass(text), k_steps=2)
    assert loops is not None and not loops.straight_line
    assert ([d.instructions for d in loops.dequant], [m.instructions for m in loops.mma], loops.tma) == (
        [5], [3], 1.5
    )
    step = loops.per_step(weights_per_thread=2)
    assert step["instructions"] == "5" and step["dequant_warpgroups"] == 1
    assert step["mmas"] == 2 and step["issue_instructions"] == [3, 1.5]
    assert step["instructions_per_weight"] == (5 + (3 + 1.5) / 4) / 2
    assert step["dequant_instructions_per_weight"] == 2.5
    assert step["stall_cycles"] == max(2 + 2 + 3 + 1 + 4, 1 + 1 + 9, 5 + 3)
    # Every step unrolled (no loop back): each role's stretch, from its first step's wait, over the steps.
    unrolled = text.replace("@P1 BRA `(.L_x_3)", "NOP").replace("BRA.U UP0, `(.L_x_2)", "NOP")
    loops = kernel_loops(sass.parse_sass(unrolled), k_steps=2)
    assert loops is not None and loops.straight_line
    # STSM at 12, the last TRYWAIT before it at 4: 9 instructions; UTCHMMA 6-7 after that wait: 4; TMA 1-3.
    assert (loops.dequant[0].instructions, loops.mma[0].instructions, loops.tma) == (9 / 2, 4 / 2, 3 / 2)
    # Two dequantizing warpgroups: two storing loops, one per warpgroup, their instructions summed per
    # scheduler (warp w of each runs on scheduler w % 4, beside issue warp w).
    second_loop = """
.L_x_4:
   -:-:-:Y:02        /*00e0*/                   LDS.64 R4, [R5] ;
   -:-:-:Y:02        /*00f0*/                   LOP3.LUT R4, R5, 0xf000f, R6, 0x6a, !PT ;
   -:-:-:Y:01        /*0100*/                   STSM.16.M88.4 [R51], R24 ;
   -:-:-:Y:04        /*0110*/               @P1 BRA `(.L_x_4) ;
"""
    two = kernel_loops(sass.parse_sass(text.replace(".L_x_3:", second_loop + ".L_x_3:")), k_steps=2)
    assert two is not None and [d.instructions for d in two.dequant] == [4, 5]
    step = two.per_step(weights_per_thread=2)
    assert step["instructions"] == "4 + 5" and step["dequant_warpgroups"] == 2
    assert step["instructions_per_weight"] == (9 + (3 + 1.5) / 4) / 2
    assert step["stall_cycles"] == max(2 + 2 + 3 + 1 + 4, 1 + 1 + 9, 9 + 3)



def test_xray_counts_alternating_warpgroups_one_turn_a_step():
    """Two dequantizing warpgroups taking alternate K steps (``dequant_every=2``): each step is one turn of
    one of them, so a step costs the mean of their loops (each turn dequantizes the whole step), and a
    warp's own stall counts spread over the two steps between its turns. Where the compiler unrolled one
    warpgroup's few turns, the other's loop stands for a turn; where it unrolled both, the first
    warpgroup's turns (its share of the stores, from the wait before its first) over their number, not the
    fold and epilogue after them."""
    from bench.kernel_xray import sass
    from bench.xray.blackwell import kernel_loops

    head = """
   -:-:-:Y:05        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_2:
   -:2:-:Y:01        /*0010*/                   UTCHMMA gdesc[UR10], gdesc[UR8], tmem[UR4], UPT ;
   -:-:-:Y:09        /*0020*/                   BRA.U UP0, `(.L_x_2) ;
   -:-:-:Y:01        /*0030*/                   UTMALDG.4D [UR8], [UR4] ;
"""
    first = """
.L_x_3:
   -:-:-:Y:02        /*0040*/                   LDS.64 R4, [R5] ;
   -:-:-:Y:02        /*0050*/                   LOP3.LUT R4, R5, 0xf000f, R6, 0x6a, !PT ;
   -:-:-:Y:01        /*0060*/                   STSM.16.M88.4 [R51], R24 ;
   -:-:-:Y:04        /*0070*/               @P1 BRA `(.L_x_3) ;
"""
    second = """
.L_x_4:
   -:-:-:Y:02        /*0080*/                   LDS.64 R4, [R5] ;
   -:-:-:Y:02        /*0090*/                   LOP3.LUT R4, R5, 0xf000f, R6, 0x6a, !PT ;
   -:-:-:Y:03        /*00a0*/                   SHF.R.U32.HI R4, RZ, 0x4, R5 ;
   -:-:-:Y:01        /*00b0*/                   STSM.16.M88.4 [R51], R24 ;
   -:-:-:Y:04        /*00c0*/               @P1 BRA `(.L_x_4) ;
   -:-:-:Y:05        /*00d0*/                   EXIT ;
"""
    both = kernel_loops(sass.parse_sass(head + first + second), k_steps=4, dequant_every=2)
    assert both is not None and [d.instructions for d in both.dequant] == [4, 5]
    step = both.per_step(weights_per_thread=2)
    assert step["instructions"] == "4 + 5 (alternate steps)"
    # The MMA warp's loop: 2 instructions a step; the TMA warp's one copy, over the 4 steps.
    assert step["issue_instructions"] == [2, 0.2] and step["instructions_per_weight"] == (4.5 + 2.25 / 4) / 2
    assert step["dequant_instructions_per_weight"] == 4.5 / 2
    # Own stalls (2+2+1+4 = 9 and 2+2+3+1+4 = 12) over two steps, the MMA warp's 1 + 9; the scheduler's
    # 4.5 + 2 a step.
    assert step["stall_cycles"] == max(9 / 2, 12 / 2, 1 + 9, 4.5 + 2)
    one = kernel_loops(sass.parse_sass(head + first + second.replace("@P1 BRA `(.L_x_4)", "NOP")), 4, 2)
    assert one is not None and one.per_step(2)["instructions"] == "4 (alternate steps, one unrolled)"
    assert one.per_step(2)["dequant_instructions_per_weight"] == 4 / 2
    # Both unrolled, 4 steps: the first warpgroup's 2 turns hold 2 of the 4 stores; its stretch from the
    # wait before its first store (3 instructions to the second store, then the fold's 2) is 6 over 2.
    unrolled = head + """
   -:-:-:Y:05        /*0040*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
   -:-:-:Y:01        /*0050*/                   STSM.16.M88.4 [R51], R24 ;
   -:-:-:Y:02        /*0060*/                   LOP3.LUT R4, R5, 0xf000f, R6, 0x6a, !PT ;
   -:-:-:Y:02        /*0070*/                   SHF.R.U32.HI R4, RZ, 0x4, R5 ;
   -:-:-:Y:01        /*0080*/                   LDS.64 R4, [R5] ;
   -:-:-:Y:01        /*0090*/                   STSM.16.M88.4 [R51], R24 ;
   -:-:-:Y:01        /*00a0*/                   LDTM.x16 R36, tmem[UR35] ;
   -:-:-:Y:01        /*00b0*/                   FFMA2 R4, R82.F32, R36.F32x2.HI_LO, R4.F32x2.HI_LO ;
   -:-:-:Y:05        /*00c0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R2 ;
   -:-:-:Y:01        /*00d0*/                   STSM.16.M88.4 [R51], R24 ;
   -:-:-:Y:01        /*00e0*/                   STSM.16.M88.4 [R51], R24 ;
   -:-:-:Y:05        /*00f0*/                   EXIT ;
"""
    loops = kernel_loops(sass.parse_sass(unrolled), k_steps=4, dequant_every=2)
    assert loops is not None and loops.dequant[0].instructions == 6 / 2
    assert loops.per_step(2)["instructions"] == "3 (alternate steps, unrolled)"

def test_xray_model_counts_the_busiest_sms_mmas():
    """The b200 X-ray's tensor bound is the busiest SM's MMAs, not the call's flops spread over every SM:
    Llama-3-8B's k/v projection at M = 2048 in 256-row M tiles is 64 CTAs for 148 SMs, one wave of
    2 x 128 x 256 x 4096 flops at an SM's share of the bf16 rate, 148 / 64 times the whole GPU's time for
    the call; ``% bf16`` (the call's flops at the bf16 rate over the model's time) is then 64 / 148."""
    from bench.kernel_xray import get_gpu
    from bench.xray.blackwell import model

    gpu = get_gpu("b200")
    m, n, k = 2048, 1024, 4096
    record = {
        "case": {"m": m, "n": n, "k": k},
        "report": {"launches": [{"operand_bytes": {"x": 2 * m * k}, "result_bytes": 2 * m * n}]},
        "plan": {"ctas": 64, "k_steps": 64, "m_pad": m, "cta_mma_flops": 2 * 128 * 256 * k},
        "loop": {"stall_cycles": 1},
    }
    out = model(record, gpu)
    whole_gpu_us = 2 * m * n * k / gpu.bf16_flops * 1e6
    assert out["bound"] == "tensor"
    assert out["times_us"]["tensor"] == pytest.approx(whole_gpu_us * gpu.sms / 64)
    assert out["tensor_fraction"] == pytest.approx(64 / gpu.sms)
    # 128-row tiles: 128 CTAs, still one wave, each half the MMAs.
    record["plan"] |= {"ctas": 128, "cta_mma_flops": 2 * 128 * 128 * k}
    assert model(record, gpu)["tensor_fraction"] == pytest.approx(128 / gpu.sms)
    # Past one wave the busiest SM runs two CTAs.
    record["plan"] |= {"ctas": gpu.sms + 1}
    assert model(record, gpu)["times_us"]["tensor"] == pytest.approx(2 * whole_gpu_us * gpu.sms / 128)

# ------------------------------------------------------------------------------ the grouped kernel


def _lower_grouped(rows, experts, k, n, group, symmetric, x_dtype=jnp.bfloat16):
    from nybble.kernels.mosaic_gpu.blackwell import blackwell_grouped_matmul

    quant = lambda w: quantize(w, group_size=group, symmetric=symmetric)
    qw = jax.eval_shape(quant, jax.ShapeDtypeStruct((experts, k, n), jnp.float32))
    x = jax.ShapeDtypeStruct((rows, k), x_dtype)
    sizes = jax.ShapeDtypeStruct((experts,), jnp.int32)
    fn = lambda x, qw, s: blackwell_grouped_matmul(x, qw, s)
    with target_arch(10, 0):
        return jax.jit(fn).trace(x, qw, sizes).lower(lowering_platforms=("cuda",))


def _grouped_cases():
    """MoE layers (gate and down of Qwen3-30B-A3B, DeepSeek-V3, Mixtral, Qwen3-235B-A22B) at 1..2048 tokens
    until every (tile_m, tile_k, slices) the grouped heuristics pick is lowered once, asymmetric (the kernel
    with offsets)."""
    from bench.xray.moe_cases import MOE_SHAPES
    from nybble.kernels.mosaic_gpu.blackwell.grouped import grouped_heuristic_config

    seen, cases = set(), []
    for name in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b", "qwen3-235b-a22b"):
        hidden, inter, experts, top_k = MOE_SHAPES[name]
        for k, n in ((hidden, inter), (inter, hidden)):
            for tokens in (1, 4, 8, 16, 32, 64, 512, 2048):
                c = grouped_heuristic_config(tokens * top_k, experts, n, k, 128)
                if (c.tile_m, c.tile_k, c.slices) not in seen:
                    seen.add((c.tile_m, c.tile_k, c.slices))
                    cases.append((tokens * top_k, experts, k, n))
    return cases


@pytest.mark.sweep
@pytest.mark.parametrize("rows,experts,k,n", _grouped_cases())
def test_grouped_lowers_every_heuristic_tiling(rows, experts, k, n):
    text = _lower_grouped(rows, experts, k, n, 128, False).as_text()
    assert "tcgen05" in text and "nybble_grouped_w4a16_bw_" in text
    assert text.count("stablehlo.custom_call") == 1  # one launch


def test_grouped_group_accumulator_route_lowers():
    """The grouped kernel at decode, symmetric g128: the same group-accumulator route as the dense one."""
    from nybble.kernels.mosaic_gpu.blackwell.grouped import grouped_plan

    quant = lambda w: quantize(w, group_size=128, symmetric=True)
    qw = jax.eval_shape(quant, jax.ShapeDtypeStruct((128, 2048, 768), jnp.float32))
    assert folds_scales(grouped_plan(8, qw)[0])
    text = _lower_grouped(8, 128, 2048, 768, 128, True).as_text()
    assert "tcgen05" in text and text.count("stablehlo.custom_call") == 1


def test_grouped_float16_per_column_and_odd_shapes():
    _lower_grouped(10, 4, 100, 7392, None, True, x_dtype=jnp.float16)


def test_xray_moe_rows_pair_each_kernel_case_with_its_peers():
    """The B200 X-ray's MoE rows: every (model, projection, tokens, quantization) has nybble's grouped kernel
    and the XLA path; tokamax's sm100 ragged_dot only where it can run (symmetric groups: no zero points)."""
    from bench.xray.blackwell import TOKAMAX, build_moe_cases
    from bench.xray.moe_cases import MOE_SHAPES

    cases = build_moe_cases(["qwen3-30b-a3b"], [1, 64], [(128, True), (128, False)], tokamax=True)
    hidden, inter, experts, top_k = MOE_SHAPES["qwen3-30b-a3b"]
    by_peer: dict[str, list] = {}
    for c in cases:
        by_peer.setdefault(c.peer, []).append(c)
    assert len(by_peer["nybble:blackwell"]) == len(by_peer["nybble:xla"]) == 2 * 2 * 2
    assert len(by_peer[TOKAMAX]) == 2 * 2 and all(c.symmetric for c in by_peer[TOKAMAX])
    assert {(c.k, c.n) for c in cases} == {(hidden, inter), (inter, hidden)}
    assert {c.m for c in cases} == {top_k, 64 * top_k} and {c.experts for c in cases} == {experts}
    assert len({c.key for c in cases}) == len(cases)  # one row each
