"""The X-ray's peers: Marlin's launch choice and hot-path rule on hand-written SASS, and one small compile per
peer family (Marlin with nvcc from PyPI wheels, tokamax's sm90 int4 ragged_dot, JAX's int8 example).

The compiles install the peers' toolchains into nybble's cache on first use (``bench.xray.peer_tools``);
they are skipped, with the reason, only when that install cannot happen (no PyPI, no g++).
"""

from __future__ import annotations

import pytest

from bench.arg_specs import Shape
from bench.kernel_xray import sass
from bench.xray import marlin
from bench.xray.cases import JAX_MIXED, MARLIN, TOKAMAX, Case, build_cases, moe_cases

# ------------------------------------------------------------------------ Marlin's host-side choice


def test_marlin_small_batch_takes_128_by_64_tiles_when_the_grid_is_short():
    # marlin.cu: M = 1 -> thread_m_blocks 1, m_block_size_8; small-batch list's first valid tile is
    # 128 x 128 x 256 threads; N / 128 * 1 * 4 = 128 <= 132 SMs switches to 128 x 64 x 128 threads.
    ((kernel, rows),) = marlin.marlin_launches(1, 4096, 4096, 128, True)
    assert rows == 1
    assert (kernel.threads, kernel.thread_m_blocks, kernel.thread_n_blocks, kernel.thread_k_blocks) == (
        128,
        1,
        4,
        8,
    )
    assert kernel.m_block_size_8 and kernel.group_blocks == 8 and kernel.b_type == "kU4B8"
    # N = 14336: 112 * 4 = 448 > 132 keeps 128 x 128 x 256.
    ((kernel, _),) = marlin.marlin_launches(16, 4096, 14336, 128, False)
    assert (kernel.threads, kernel.thread_n_blocks, kernel.thread_k_blocks) == (256, 8, 8)
    assert not kernel.m_block_size_8 and kernel.b_type == "kU4"


def test_marlin_splits_large_m_by_max_par():
    # N > 4096: max_par 16, so 2048 rows go as 16 x 64 = 1024 rows twice; N <= 4096: max_par 128, one.
    launches = marlin.marlin_launches(2048, 4096, 14336, 128, True)
    assert [rows for _, rows in launches] == [1024, 1024]
    assert {(k.threads, k.thread_m_blocks, k.thread_n_blocks, k.thread_k_blocks) for k, _ in launches} == {
        (256, 4, 16, 4)
    }
    assert [rows for _, rows in marlin.marlin_launches(2048, 4096, 4096, 128, True)] == [2048]
    assert sum(rows for _, rows in marlin.marlin_launches(70, 4096, 4096, 128, True)) == 70


def test_marlin_refuses_what_it_has_no_kernel_for():
    with pytest.raises(ValueError, match="group sizes 32, 64, 128"):
        marlin.marlin_launches(1, 4096, 4096, 256, True)
    with pytest.raises(ValueError, match="no kernel"):
        marlin.marlin_launches(1, 4096, 4000, 128, True)  # N % 64 != 0


def test_marlin_weights_per_hmma():
    m8 = marlin.MarlinKernel("kU4B8", 128, 1, 4, 8, True, 8)
    assert m8.weights_per_hmma == 8.0  # mma_trans: the weights are the 16 x 16 A operand
    assert marlin.MarlinKernel("kU4B8", 256, 4, 16, 4, False, 8).weights_per_hmma == 1.0  # 4 / 4 m-blocks
    assert "Marlin<vllm::kBFloat16.id(), vllm::kU4B8.id()" in m8.instantiation()


# -------------------------------------------------------------------------------- the hot-path rule
# A loop (.L_x_1 .. the @P0 BRA) of 10 instructions, 2 HMMAs; inside it one forward branch skips 4
# instructions without an MMA (a slice epilogue), another skips one HMMA (not a candidate: it holds an
# MMA). Hot path: 10 - 4 = 6.
HOT_SASS = """
        -:-:-:Y:01        /*0000*/                   MOV R1, R2 ;
.L_x_1:
        -:-:-:Y:01        /*0010*/                   LDS R4, [R3] ;
        -:-:-:Y:01        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        -:-:-:Y:01        /*0030*/              @P1 BRA `(.L_x_2) ;
        -:-:-:Y:01        /*0040*/                   STG.E [R10], R8 ;
        -:-:-:Y:01        /*0050*/                   STG.E [R12], R9 ;
        -:-:-:Y:01        /*0060*/                   RED.E.ADD [R14], R8 ;
        -:-:-:Y:01        /*0070*/                   BAR.SYNC 0x0 ;
.L_x_2:
        -:-:-:Y:01        /*0080*/              @P2 BRA `(.L_x_3) ;
        -:-:-:Y:01        /*0090*/                   HMMA.16816.F32.BF16 R8, R4, R7, R8 ;
.L_x_3:
        -:-:-:Y:01        /*00a0*/              @P0 BRA `(.L_x_1) ;
        -:-:-:Y:01        /*00b0*/                   EXIT ;
"""


def test_hot_path_drops_the_largest_forward_skip_without_mma():
    loop = marlin.hot_path(sass.parse_sass(HOT_SASS))
    assert loop is not None
    assert loop.span.size == 10 and loop.hmmas == 2
    assert loop.skipped == 4  # the STG/STG/RED/BAR region; the skip over an HMMA does not count
    assert loop.hot_instructions == 6


def test_control_codes_decoded_from_the_hex_listing():
    # stall 5, yield bit 0, write scoreboard 7 (none), read 7 (none), wait mask 0b000010 -> bits 41..
    ctrl = 5 | (0 << 4) | (7 << 5) | (7 << 8) | (0b10 << 11)
    hi = ctrl << 41
    listing = (
        "        /*0180*/                   @!P0 BRA `(.L_x_0) ;        /* 0x0000000000008947 */\n"
        f"                                                               /* 0x{hi:016x} */\n"
        ".L_x_0:\n"
    )
    text = marlin.control_code_sass(listing)
    assert text.splitlines() == ["0x2:-:-:Y:05   /*0180*/   @!P0 BRA `(.L_x_0) ;", ".L_x_0:"]
    code = sass.parse_sass(text)
    assert code.instructions[0].stall == 5 and code.instructions[0].predicate == "@!P0"


def test_peer_cases():
    cases = build_cases(
        [Shape("s", 256, 256)], [1], [(128, True), (128, False)], [MARLIN, TOKAMAX, JAX_MIXED]
    )
    assert sorted(c.key for c in cases) == [
        "s/M1/g128-asym/vllm:marlin",
        "s/M1/g128-sym/tokamax:ragged_dot",  # no zero points in tokamax: no asym case
        "s/M1/g128-sym/vllm:marlin",
        "s/M1/jax:mixed-int8",
    ]
    (moe,) = moe_cases(["qwen3-30b-a3b"], [4])
    assert (moe.k, moe.n, moe.experts, moe.top_k, moe.rows) == (2048, 1536, 128, 8, 32)


# --------------------------------------------------------------------- one compile per peer family


def _install(what):
    from bench.xray import peer_tools

    try:
        return what()
    except peer_tools.PeerToolchainMissing as e:
        pytest.skip(f"the peer toolchain cannot install here: {e}")


def test_marlin_compiles_with_nvcc_from_wheels():
    from bench.kernel_xray import find_toolchain
    from bench.xray import peer_tools

    _install(peer_tools.cuda_tree)
    _install(peer_tools.vllm_source)
    case = Case(MARLIN, "tiny", 256, 256, 1, 128, True)
    record = marlin.marlin_record(case, find_toolchain().nvdisasm)
    assert "error" not in record, record.get("error")
    (kernel,) = record["report"]["kernels"]
    loop = kernel["loop"]
    assert kernel["spill_bytes"] == 0 and 32 <= kernel["registers"] <= 255
    assert loop["hgmma_shape"] == "HMMA.16816.F32.BF16"
    # The hot path is the span less a non-empty skipped region, and its count per weight is the same
    # arithmetic the module documents.
    assert 0 < loop["skipped_instructions"] < loop["span_instructions"]
    assert loop["instructions"] == loop["span_instructions"] - loop["skipped_instructions"]
    assert loop["instructions_per_weight"] == pytest.approx(loop["instructions"] / (8 * loop["hgmmas"]))
    assert len(record["report"]["launches"]) == 1


def test_tokamax_and_jax_int8_compile_in_the_workers():
    from bench.xray import peer_tools
    from bench.xray.runner import run_cases

    site = _install(peer_tools.tokamax_site)
    cases = [
        Case(TOKAMAX, "tiny", 512, 256, 1, 128, True),
        Case(TOKAMAX, "tiny-moe", 512, 256, 2, 128, True, experts=4, top_k=2),
        Case(JAX_MIXED, "tiny", 512, 256, 1),
    ]
    records = run_cases(cases, jobs=1, progress=False, extra_env={"NYBBLE_XRAY_PEER_SITES": str(site)})
    for case in cases:
        rec = records[case.key]
        assert "error" not in rec, (case.key, rec.get("error"), rec.get("traceback"))
        kernels = [k for k in rec["report"]["kernels"] if k["loop"]]
        assert kernels, case.key
        loop = kernels[0]["loop"]
        assert kernels[0]["spill_bytes"] == 0
        # Both peers feed the weights to WGMMA from registers (the dequantized int4 / int8 tile).
        assert loop["weight_hgmmas"] > 0 and loop["instructions_per_weight"] > 1.0
        assert any(la["kind"] == "mosaic_gpu" for la in rec["report"]["launches"])


def test_bench_report_quotes_the_peers_xray(tmp_path):
    import json

    from bench.report import xray_peers_section

    loop = {"instructions": 733, "instructions_per_weight": 2.863}
    rows = [
        {"shape": "s", "m": 1, "peer": MARLIN, "quant": "g128-sym", "launches": 1,
         "kernel": {"registers": 96, "spill_bytes": 0, "loop": loop}},
        {"shape": "s", "m": 2, "peer": MARLIN, "quant": "g128-sym", "launches": 1, "kernel": None},
    ]  # fmt: skip
    path = tmp_path / "results" / "xray-peers" / "xray.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"commit": "abc", "rows": rows}))
    text = "\n".join(xray_peers_section([{"shape": "s", "m": 1}], path))
    assert "| s | 1 | vllm:marlin | g128-sym | 96 | 0 | 733 | 2.86 | 1 |" in text.splitlines()
    assert "| s | 2 |" not in text  # M = 2 was not timed
    assert xray_peers_section([{"shape": "other", "m": 1}], path) == []
    assert xray_peers_section([{"shape": "s", "m": 1}], tmp_path / "missing.json") == []
