"""The kernel X-ray: its parsers on hand-written SASS and HLO, its model on a hand-computed case, and the gate
on nybble's own kernels, compiled for an H200 (sm_90a) on this CPU.

The gate compiles one case of every distinct kernel config the heuristics pick at the named shapes
(bench/arg_specs) for M in the X-ray's default sweep at g128 (asymmetric where a config is picked for
both symmetric and asymmetric groups: ``bench.xray.cases.gate_cases``), and asserts 0 spill
bytes, registers within the launch's budget, and main-loop instructions per weight (within 3%) and launches
per call no worse than the committed baseline (bench/xray_baseline.json): a kernel regression fails CI, an
improvement is recorded on purpose with ``python -m bench.xray --update-baseline``. It needs the ``xray``
extra, which ``make install`` puts in .venv/nybble-xray; without it these tests fail, naming the extra.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kernel_xray import GPUS, ToolchainMissing, dumps, find_toolchain, hlo, sass, toolchain
from bench.xray import model, report
from bench.xray.cases import MOSAIC, gate_cases

REPO = Path(__file__).resolve().parents[1]
H200 = GPUS["h200"]

# ------------------------------------------------------------------------------------------- SASS parsing

# A made-up kernel: a retry path (unconditional backward branch), a main loop of 6 instructions with two
# HGMMAs closed by a conditional backward branch, an epilogue, and a wait loop without HGMMAs.
SASS_TEXT = """
kernel:
   -:-:-:Y:01        /*0000*/                   MOV R1, R2 ;
.L_x_0:
   -:-:-:Y:02        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R8 ;
   -:-:-:Y:05        /*0020*/              @!P0 BRA `(.L_x_9) ;
.L_x_1:
   -:-:1:Y:02        /*0030*/                   LDS.128 R4, [R9+0x800] ;
   1:-:-:Y:01        /*0040*/                   LOP3.LUT R5, R4, 0xf000f, RZ, 0xc0, !PT ;
   -:-:-:Y:01        /*0050*/                   HGMMA.64x8x16.F32.BF16 R24, R36, gdesc[UR8], R24 ;
   -:-:-:Y:06        /*0060*/                   HGMMA.64x8x16.F32.BF16 R24, R40, gdesc[UR16], R24, gsb0 ;
   -:-:-:Y:03        /*0070*/                   UIADD3 UR15, UR15, 0x1, URZ ;
   -:-:-:Y:05        /*0080*/               @P0 BRA `(.L_x_1) ;
   -:-:-:Y:01        /*0090*/                   STS.64 [R0], R24 ;
   1:-:-:Y:05        /*00a0*/                   EXIT ;
.L_x_9:
   -:1:3:Y:03        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R9+URZ], R8 ;
   3:-:-:Y:05        /*00c0*/              @!P0 BRA `(.L_x_9) ;
   -:-:-:Y:05        /*00d0*/                   BRA `(.L_x_0) ;
"""


def test_main_loop_is_the_conditional_branch_around_the_hgmmas():
    code = sass.parse_sass(SASS_TEXT)
    assert len(code.instructions) == 14  # offsets 0x00..0xd0
    loop = sass.main_loop(code)
    assert loop is not None
    assert [i.base_opcode for i in loop.instructions] == ["LDS", "LOP3", "HGMMA", "HGMMA", "UIADD3", "BRA"]
    assert loop.instructions[0].offset == 0x30 and loop.instructions[-1].offset == 0x80
    assert loop.stall_cycles == 2 + 1 + 1 + 6 + 3 + 5
    # Two HGMMA.64x8x16: 2 * 64 * 16 weights over 128 threads = 16 weights per thread; 6 / 16.
    assert loop.weights_per_thread == 16
    assert loop.instructions_per_weight == pytest.approx(6 / 16)
    assert loop.opcode_mix(2) == [("HGMMA", 2), ("LDS", 1)]


def test_wait_mask_on_two_scoreboards_is_an_instruction():
    """A control code waiting on two scoreboards ("2&1", as nybble's split-K kernel has in its main loop)
    is one instruction like any other: the loop keeps it (it was once dropped, one short of the offsets)."""
    text = SASS_TEXT.replace("   -:-:1:Y:02        /*0030*/", " 2&1:-:1:Y:02        /*0030*/")
    assert text != SASS_TEXT
    loop = sass.main_loop(sass.parse_sass(text))
    assert loop is not None and loop.instructions[0].offset == 0x30 and loop.size == 6


def test_hex_wait_mask_is_an_instruction():
    """A wait on many scoreboards is printed as a hex mask ("0x1e", seen in a predicated step of the
    constant-slot pipeline's loop): one instruction like any other."""
    text = SASS_TEXT.replace("   1:-:-:Y:01        /*0040*/", "0x1e:-:-:Y:01        /*0040*/")
    assert text != SASS_TEXT
    loop = sass.main_loop(sass.parse_sass(text))
    assert loop is not None and loop.size == 6 and loop.instructions[1].offset == 0x40


def test_baseline_check_flags_a_loop_it_did_not_read_whole():
    """``--check`` reports a case whose main loop's byte span holds more instructions than were parsed
    (a SASS line the parser missed, as the hex wait mask once was); a consistent case passes."""
    loop = {"start_offset": 0x30, "end_offset": 0x80, "instructions": 6, "instructions_per_weight": 0.375}
    row = {
        "key": "k/M1/g128-sym/" + MOSAIC,
        "peer": MOSAIC,
        "config": None,
        "kernel": {"registers": 64, "spill_bytes": 0, "loop": loop},
        "launches": 1,
    }
    baseline = report.baseline_entries([row])
    assert report.check_against_baseline([row], baseline) == []
    short = {**row, "kernel": {**row["kernel"], "loop": {**loop, "instructions": 5}}}
    assert any("disagree" in p for p in report.check_against_baseline([short], baseline))


def test_no_loop_without_hgmma():
    code = sass.parse_sass(SASS_TEXT.replace("HGMMA.64x8x16.F32.BF16", "FFMA"))
    assert sass.main_loop(code) is None


def test_unrolled_steps_are_measured_without_a_loop():
    """Every K step unrolled (no conditional backward branch around the HGMMAs): the stretch from the last
    barrier wait before the first weight HGMMA to the last weight HGMMA; with no weight HGMMA, None."""
    text = SASS_TEXT.replace("@P0 BRA `(.L_x_1)", "@P0 BRA `(.L_x_9)")  # now a forward branch
    code = sass.parse_sass(text)
    loop = sass.main_loop(code)
    assert loop is not None and loop.straight_line
    # From the TRYWAIT at 0x10 to the second HGMMA at 0x60: 6 instructions, 16 weights per thread.
    assert loop.instructions[0].offset == 0x10 and loop.instructions[-1].offset == 0x60
    assert loop.size == 6 and loop.weights_per_thread == 16
    assert sass.main_loop(sass.parse_sass(SASS_TEXT)).straight_line is False
    assert sass.main_loop(sass.parse_sass(text.replace("HGMMA.64x8x16.F32.BF16", "FFMA"))) is None


def test_only_register_a_hgmmas_feed_weights():
    # An HGMMA reading A from SMEM (a descriptor, e.g. nybble's all-ones tile that sums x) is not a weight.
    text = SASS_TEXT.replace(
        "   -:-:-:Y:03        /*0070*/                   UIADD3 UR15, UR15, 0x1, URZ ;",
        "   -:-:-:Y:03        /*0070*/                   HGMMA.64x8x16.F32.BF16 R40, gdesc[UR8], RZ, !UPT ;",
    )
    loop = sass.main_loop(sass.parse_sass(text))
    assert len(loop.hgmmas) == 3 and len(loop.weight_hgmmas) == 2
    assert loop.weights_per_thread == 16 and loop.instructions_per_weight == pytest.approx(6 / 16)


def test_hgmma_k_counts_in_weights():
    # An 8-bit HGMMA (K = 32 per instruction) feeds twice the weights of a bf16 one.
    code = sass.parse_sass(SASS_TEXT.replace("HGMMA.64x8x16.F32.BF16", "HGMMA.64x8x32.F32.E4M3.E4M3"))
    assert sass.main_loop(code).weights_per_thread == 32


def test_ptxas_and_ptx_facts():
    info = sass.parse_ptxas(
        "ptxas info    : Function properties for k\n"
        "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 168 registers, used 2 barriers, 1 bytes smem\n"
    )
    assert (info.registers, info.spill_bytes, info.stack_bytes) == (168, 12, 16)
    assert sass.threads_per_block(".visible .entry k(\n)\n.maxntid 384, 1, 1\n") == 384
    assert sass.smem_scratch_bytes("Resources(smem_scratch_bytes=52224, tmem_scratch_cols=0)") == 52224
    with pytest.raises(ValueError, match="no register"):
        sass.parse_ptxas("garbage")


def _printed_kernel(entry: str, registers: int) -> str:
    """One kernel's dumps as jaxlib prints them to stdout: PTX, ptxas' log, SASS with control codes."""
    return (
        f"//\n// Generated by LLVM NVPTX Back-End\n//\n\n.version 8.8\n.target sm_90a\n"
        f".visible .entry {entry}(\n\t.param .u64 p\n)\n.maxntid 128, 1, 1\n{{\n\tret;\n}}\n\n"
        f"ptxas info    : Compiling entry function '{entry}' for 'sm_90a'\n"
        f"ptxas info    : Function properties for {entry}\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        f"ptxas info    : Used {registers} registers, used 1 barriers\n\n"
        f"\t.target\tsm_90a\n\n//--------------------- .text.{entry} ----\n"
        f".text.{entry}:\n   -:-:-:Y:01        /*0000*/                   EXIT ;\n\n"
    )


def test_stdout_dumps_become_files_named_after_their_resources(tmp_path):
    printed = "a line printed by someone else\n" + "".join(
        _printed_kernel(f"{module}_mosaic_gpu_kernel", registers)
        for module, registers in (("k_b", 40), ("k_a", 32), ("k_b", 48))
    )
    other, kernels = dumps.split_stdout(printed)
    assert other == "a line printed by someone else\n"
    assert [k.module for k in kernels] == ["k_b", "k_a", "k_b"]
    # Lowered in this order by JAX's Python side, which numbers the modules: k_b twice, k_a once.
    for name in ("k_b_3", "k_a_4", "k_b_10"):
        (tmp_path / f"{name}.resources.txt").write_text(f"Resources(smem_scratch_bytes={len(name)})")
    dumps.write_dumps(kernels, tmp_path)
    registers = {p.stem: sass.parse_ptxas(p.read_text()).registers for p in tmp_path.glob("*.ptxas")}
    assert registers == {"k_b_3": 40, "k_a_4": 32, "k_b_10": 48}  # counts in numeric order, not text order
    assert sass.threads_per_block((tmp_path / "k_a_4.ptx").read_text()) == 128
    assert ".text.k_b_mosaic_gpu_kernel" in (tmp_path / "k_b_10.sass_ctrl").read_text()


def test_stdout_dumps_refuse_what_they_cannot_attribute(tmp_path):
    a, b = _printed_kernel("k_a_mosaic_gpu_kernel", 32), _printed_kernel("k_b_mosaic_gpu_kernel", 40)
    log_at = a.index("ptxas info")
    with pytest.raises(RuntimeError, match="interleaved"):  # a's PTX, then b's log and SASS
        dumps.split_stdout(a[:log_at] + b[b.index("ptxas info") :])
    with pytest.raises(RuntimeError, match="no ptxas log"):
        dumps.split_stdout(a[:log_at])
    _, kernels = dumps.split_stdout(a * 3)
    (tmp_path / "k_a_1.resources.txt").write_text("Resources(smem_scratch_bytes=1024)")
    (tmp_path / "k_a_2.resources.txt").write_text("Resources(smem_scratch_bytes=2048)")
    with pytest.raises(RuntimeError, match="3 kernels named k_a were compiled from 2 different lowerings"):
        dumps.write_dumps(kernels, tmp_path)
    (tmp_path / "k_a_2.resources.txt").unlink()  # one lowering compiled three times: its resources each
    dumps.write_dumps(kernels, tmp_path)
    resources = sorted(p.name for p in tmp_path.glob("*.resources.txt"))
    assert resources == [f"k_a_1_{i}.resources.txt" for i in range(3)]
    assert len(list(tmp_path.glob("*.ptxas"))) == 3


# -------------------------------------------------------------------------------------------- HLO launches

HLO_TEXT = """HloModule m

%fused_slice (p: f32[2,8,64]) -> bf16[1,64] {
  ROOT %s = bf16[1,64]{1,0} slice(%p)
}

ENTRY %main.3 (x.1: bf16[1,128], qw_codes.1: u8[64,64], qw_scales.1: bf16[1,64]) -> bf16[1,64] {
  %qw_scales.1 = bf16[1,64]{1,0} parameter(2), metadata={op_name="qw.scales"}
  %qw_codes.1 = u8[64,64]{1,0} parameter(1), metadata={op_name="qw.codes"}
  %x.1 = bf16[1,128]{1,0} parameter(0), metadata={op_name="x"}
  %pad_fusion = bf16[8,128]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_pad
  %bitcast.1 = bf16[8,128]{1,0} bitcast(%pad_fusion)
  %k = f32[2,8,64]{2,1,0} custom-call(%bitcast.1, %qw_codes.1, %qw_scales.1), custom_call_target="mosaic_gpu"
  ROOT %loop_slice_fusion = bf16[1,64]{1,0} fusion(%k), kind=kLoop, calls=%fused_slice
}
"""


def test_launches_and_their_bytes():
    launches = hlo.launches(HLO_TEXT)
    assert [(la.name, la.kind) for la in launches] == [
        ("pad_fusion", "fusion"),
        ("k", "mosaic_gpu"),
        ("loop_slice_fusion", "fusion"),
    ]
    pad, kernel, out = launches
    assert pad.operand_bytes == {"x": 256} and pad.result_bytes == 8 * 128 * 2
    assert kernel.operand_bytes == {"intermediate": 2048, "qw.codes": 4096, "qw.scales": 128}
    assert kernel.result_bytes == 2 * 8 * 64 * 4 and not kernel.result_is_output
    assert out.result_is_output and out.result_bytes == 128
    cats = model.byte_categories([vars(la) for la in launches])
    assert cats == {
        "codes": 4096,
        "scales": 128,
        "x": 256,
        "w": 0,
        "output": 128,
        "intermediate": 2048 + 2048 + 4096 + 4096,
    }


def test_operands_past_xlas_index_comments_are_read():
    # XLA prints "/*index=5*/" before every fifth operand of a long operand list: the sixth and later
    # operands (a kernel's second cache) count too.
    line = '  %p{0} = f32[4]{{0}} parameter({0}), metadata={{op_name="p{0}"}}\n'
    params = "".join(line.format(i) for i in range(7))
    operands = ", ".join(f"/*index=5*/%p{i}" if i == 5 else f"%p{i}" for i in range(7))
    text = f"HloModule m\n\nENTRY %main (x: f32[4]) -> f32[4] {{\n{params}"
    text += f'  ROOT %k = f32[4]{{0}} custom-call({operands}), custom_call_target="mosaic_gpu"\n}}\n'
    [kernel] = hlo.launches(text)
    assert kernel.operand_bytes == {f"p{i}": 16 for i in range(7)}


# -------------------------------------------------------------------------------------------- the model


def test_model_by_hand():
    # 64 KiB of bytes, 4 HGMMA.64x8x16 (32 weights per thread) in a 64-instruction loop, 264 CTAs.
    record = {
        "case": {"peer": MOSAIC, "k": 1024, "n": 2048, "m": 1},
        "plan": {"m_pad": 8, "ctas": 264, "dequantized_weights": 1024 * 2048, "weight_bytes_in_flight": 4096},
        "report": {
            "launches": [
                {
                    "name": "k",
                    "kind": "mosaic_gpu",
                    "detail": "",
                    "result_is_output": True,
                    "operand_bytes": {"qw.codes": 65536 - 16},
                    "result_bytes": 16,
                }
            ],
            "kernels": [
                {
                    "registers": 64,
                    "threads": 128,
                    "smem_bytes": 100_000,
                    "loop": {"instructions": 64, "weights_per_thread": 32.0},
                }
            ],
        },
    }
    ceilings = model.Ceilings(4e12, 1e15, "test")
    out = model.model_case(record, H200, ceilings)
    passes = 1024 * 2048 / (32 * 128)  # warpgroup passes through the loop
    warp_instr = passes * 64 * 4
    busiest = warp_instr / 264 * 2  # 264 CTAs on 132 SMs: two each
    assert out["t_issue_us"] == pytest.approx(busiest / (4 * 1.98e9) * 1e6)
    assert out["t_hbm_us"] == pytest.approx(65536 / 4e12 * 1e6)
    assert out["t_tc_us"] == pytest.approx(2 * 8 * 2048 * 1024 / 1e15 * 1e6)
    assert out["bound"] == "issue" and out["t_model_us"] == out["t_issue_us"]
    assert out["ctas_per_sm"] == 2  # 233472 // (100000 + 1024)
    assert out["weight_bytes_in_flight_per_sm"] == 2 * 4096
    assert out["model_pct_hbm"] == pytest.approx(100 * out["t_hbm_us"] / out["t_issue_us"])


def test_grouped_kernel_reads_only_the_active_experts_weights():
    """At decode a grouped kernel reads the weights of the experts that have rows, not the whole stack:
    4 of 128 experts' codes and scales; x and y in full; an XLA launch's operands in full."""
    kernel = {
        "name": "k",
        "kind": "mosaic_gpu",
        "result_is_output": True,
        "operand_bytes": {"qw.codes": 128 * 1000, "qw.scales": 128 * 10, "x": 64},
        "result_bytes": 32,
    }
    plan = {"experts": 128, "active_experts": 4}
    cats = model.byte_categories([kernel], plan)
    assert cats["codes"] == 4 * 1000 and cats["scales"] == 4 * 10 and cats["x"] == 64 and cats["output"] == 32
    assert model.byte_categories([kernel])["codes"] == 128 * 1000  # a dense plan: all of it
    xla = dict(kernel, kind="fusion")
    assert model.byte_categories([xla], plan)["codes"] == 128 * 1000


def test_resident_ctas_limits():
    assert model.resident_ctas(H200, smem_bytes=1000, registers=32, threads=128) == 16  # threads: 2048/128
    assert model.resident_ctas(H200, smem_bytes=1000, registers=168, threads=384) == 1  # registers
    assert model.resident_ctas(H200, smem_bytes=200_000, registers=32, threads=128) == 1  # SMEM


# -------------------------------------------------------------------------------------------- toolchain


def test_missing_toolchain_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setenv(toolchain.SITE_ENV, str(tmp_path / "nowhere"))
    monkeypatch.setattr(toolchain.sys, "prefix", str(tmp_path))
    monkeypatch.setattr(toolchain.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ToolchainMissing, match=r"nybble\[xray\]"):
        find_toolchain()


def test_cuda_root_links_the_tools(tmp_path, monkeypatch):
    site = tmp_path / "site"
    for rel in (
        "jax_plugins/xla_cuda12/__init__.py",
        "nvidia/cuda_nvcc/bin/ptxas",
        "nvidia/cu13/bin/nvdisasm",
        "nvidia/cuda_nvcc/nvvm/libdevice/libdevice.10.bc",
    ):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("")
    monkeypatch.setenv(toolchain.SITE_ENV, str(site))
    monkeypatch.setenv("NYBBLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(toolchain.importlib.util, "find_spec", lambda name: None)
    found = find_toolchain()
    assert found.site == site
    root = found.cuda_root()
    assert (root / "bin" / "ptxas").resolve() == (site / "nvidia/cuda_nvcc/bin/ptxas").resolve()
    assert (root / "nvvm" / "libdevice" / "libdevice.10.bc").exists()
    assert found.cuda_root() == root  # cached
    env = toolchain.child_environment(found, {"JAX_PLATFORMS": "cpu", "PYTHONPATH": "a"})
    assert env["PYTHONPATH"].split(":") == [str(site), "a"] and "JAX_PLATFORMS" not in env
    # The suite's fast-compile flag (tests/conftest.py) stays out of the compiles the X-ray reads.
    flags = {"XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_dump_to=/tmp/d"}
    assert toolchain.child_environment(found, flags)["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    alone = {"XLA_FLAGS": "--xla_backend_optimization_level=0"}
    assert "XLA_FLAGS" not in toolchain.child_environment(found, alone)
    assert env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "1" and env["CUDA_ROOT"] == str(root)


# -------------------------------------------------------------------- the gate: nybble's kernels on sm_90a

_CASES = gate_cases(H200.sms)


def _folded_twins() -> list[tuple]:
    """(symmetric, asymmetric) pairs: a gate case compiled asymmetric whose symmetric twin has the same
    config and folds the bias into WGMMA (other code than the asymmetric kernel's)."""
    import dataclasses

    from bench.xray.cases import kernel_key
    from nybble.kernels.mosaic_gpu.config import folds_bias

    twins = []
    for asym in _CASES:
        if asym.symmetric:
            continue
        config = kernel_key(asym, H200.sms)[0]
        sym = dataclasses.replace(asym, symmetric=True)
        if folds_bias(config, has_offsets=False) and kernel_key(sym, H200.sms)[0] == config:
            twins.append((sym, asym))
    return twins


_FOLDED_TWINS = _folded_twins()


@pytest.fixture(scope="module")
def compiled() -> dict:
    """The gate's cases and the first folded symmetric twin, in one run of the compile workers (each
    worker's start, jax and the CUDA plugin, is paid once)."""
    from bench.xray.runner import run_cases

    try:
        twin = [sym for sym, _ in _FOLDED_TWINS[:1] if sym not in _CASES]
        return run_cases([*_CASES, *twin], gpu="h200", jobs=2, progress=False)
    except ToolchainMissing as e:
        pytest.fail(f"the X-ray toolchain is missing: {e}")


@pytest.fixture(scope="module")
def baseline() -> dict:
    return report.load_baseline()


@pytest.mark.sweep
@pytest.mark.parametrize("case", _CASES, ids=lambda c: c.key.removesuffix("/" + MOSAIC))
def test_kernel_xray_gate(case, compiled, baseline):
    record = compiled[case.key]
    assert "error" not in record, record.get("traceback", record.get("error"))
    kernels = record["report"]["kernels"]
    assert len(kernels) == 1, f"expected one Mosaic GPU kernel per call, got {len(kernels)}"
    k = kernels[0]
    assert k["spill_bytes"] == 0, f"{k['spill_bytes']} spill bytes"
    assert k["registers"] <= 255 and k["registers"] * k["threads"] <= H200.registers_per_sm
    assert k["smem_bytes"] + 1024 <= H200.smem_per_block_optin
    loop = k["loop"]
    assert loop is not None, "no main loop (conditional backward branch around HGMMAs) in the SASS"
    # The loop's size read from its byte offsets (16 bytes per sm_90 instruction) agrees with the count.
    assert report.loop_read_whole(loop)
    base = baseline.get(case.key)
    assert base is not None, f"{case.key} is not in bench/xray_baseline.json: refresh it (--update-baseline)"
    limit = base["instructions_per_weight"] * (1 + report.IPW_TOLERANCE)
    assert loop["instructions_per_weight"] <= limit, (
        f"{loop['instructions_per_weight']:.3f} instructions per weight, baseline "
        f"{base['instructions_per_weight']:.3f}: a regression (or refresh the baseline on purpose)"
    )
    assert len(record["report"]["launches"]) <= base["launches"]


def test_gate_compiles_every_config_once():
    """Every config (and group structure) the heuristics pick at the sweep is in the gate, once: the
    asymmetric kernel where both are picked (its code is the symmetric one's plus the offsets: in the
    2026-12-01 sweep its loop was never shorter, and its registers at most 2 fewer; where the symmetric
    kernel folds the bias into WGMMA it saves an accumulator and an FMA a group more, see the next test)."""
    from bench.arg_specs import SHAPES
    from bench.xray.cases import DEFAULT_GROUPS, DEFAULT_MS, build_cases, distinct_kernels, kernel_key

    every = distinct_kernels(build_cases(SHAPES.values(), DEFAULT_MS, DEFAULT_GROUPS, (MOSAIC,)), H200.sms)
    keys = [kernel_key(c, H200.sms) for c in _CASES]
    assert len({k[:2] for k in keys}) == len(keys) == len({kernel_key(c, H200.sms)[:2] for c in every})
    asym = {kernel_key(c, H200.sms)[:2] for c in every if not c.symmetric}
    assert all(not sym for (*key, sym) in keys if tuple(key) in asym)


@pytest.mark.sweep
def test_folded_symmetric_loop_is_shorter_than_its_asymmetric_twin(compiled):
    """Why the gate compiles the asymmetric twin of a kernel that folds the bias when symmetric: the
    symmetric kernel (one FMA a group fewer, one accumulator) has the shorter main loop and no more
    registers. The symmetric twin of a gate case is compiled beside the gate (the ``compiled`` fixture)
    and compared with the gate's compile of the asymmetric one."""
    assert _FOLDED_TWINS, "no gate case folds the bias when symmetric"
    sym, asym = _FOLDED_TWINS[0]
    sym_record = compiled[sym.key]
    assert "error" not in sym_record, sym_record.get("traceback", sym_record.get("error"))
    sym_kernel = sym_record["report"]["kernels"][0]
    asym_kernel = compiled[asym.key]["report"]["kernels"][0]
    assert sym_kernel["loop"]["instructions"] < asym_kernel["loop"]["instructions"]
    assert sym_kernel["registers"] <= asym_kernel["registers"] and sym_kernel["spill_bytes"] == 0


def test_gate_covers_both_kernel_families():
    from bench.xray.cases import abstract_weight
    from nybble.kernels import mosaic_gpu

    configs = {mosaic_gpu.plan(c.m, abstract_weight(c), num_sms=H200.sms).config for c in _CASES}
    assert any(c.compute_wgs == 1 for c in configs) and any(c.compute_wgs == 2 for c in configs)
    assert any(not c.symmetric for c in _CASES)


def test_cli_end_to_end(tmp_path):
    """`python -m bench.xray` on one small shape with the XLA peers: table, JSON, markdown and plot."""
    out = tmp_path / "xray"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.xray",
            "--shapes",
            "smollm2-135m-qo",
            "--ms",
            "1",
            "--groups",
            "128:sym",
            "--jobs",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "xray.json").read_text())
    assert result["schema"] == report.SCHEMA
    peers = {r["peer"]: r for r in result["rows"]}
    assert set(peers) == {MOSAIC, "nybble:xla", "xla:bf16"}
    mine = peers[MOSAIC]
    assert mine["kernel"]["loop"]["instructions_per_weight"] > 0 and mine["bound"] in (
        "issue",
        "hbm",
        "tensor",
    )
    assert peers["xla:bf16"]["launches"] >= 1 and peers["xla:bf16"]["kernel"] is None
    assert (out / "xray.md").read_text().count("smollm2-135m-qo") >= 3
    assert (out / "xray.png").stat().st_size > 10_000
    assert "instr/w" in proc.stdout


# ------------------------------------------------- the gate: the grouped (MoE) kernels on sm_90a, issue 36


def _moe_gate_cases() -> list:
    from bench.xray import moe_cases

    return moe_cases.distinct_kernels(moe_cases.build_cases(), H200.sms)


_MOE_CASES = _moe_gate_cases()


def _moe_peer_cases() -> list:
    """Qwen3-30B-A3B down at one token, g128 symmetric (a gate case), and the XLA programs bench/moe.py
    times beside it (``moe_cases.XLA_PEERS``)."""
    import dataclasses

    from bench.xray import moe_cases

    (kernel,) = [
        c
        for c in moe_cases.build_cases({"qwen3-30b-a3b": moe_cases.MOE_SHAPES["qwen3-30b-a3b"]}, (1,))
        if c.shape.endswith("down") and c.symmetric
    ]
    return [kernel] + [dataclasses.replace(kernel, peer=p) for p in moe_cases.XLA_PEERS]


_MOE_PEER_CASES = _moe_peer_cases()


@pytest.fixture(scope="module")
def moe_compiled() -> dict:
    """The grouped gate's cases and the XLA peers' programs, in one run of the compile workers (their
    start is paid once, and the peers' kernel case is the gate's compile)."""
    from bench.xray.runner import run_cases

    cases = [*_MOE_CASES, *(c for c in _MOE_PEER_CASES if c not in _MOE_CASES)]
    try:
        return run_cases(cases, gpu="h200", jobs=2, progress=False, worker="bench.xray.moe_worker")
    except ToolchainMissing as e:
        pytest.fail(f"the X-ray toolchain is missing: {e}")


def instructions_per_weight_of_w(case, record) -> float:
    """Main-loop instructions per weight of W: a partial last K step's zero-filled rows
    (``TuningConfig.runs_past_k``) are dequantized too, so the loop's count per dequantized weight is
    scaled by K covered / K_pad."""
    from nybble.kernels.mosaic_gpu import TuningConfig
    from nybble.packing import padded_weight_dims

    config = TuningConfig(**record["plan"]["config"])
    k_pad = padded_weight_dims(case.k, case.n)[0]
    covered = config.k_steps(k_pad) * config.k_span()
    return record["report"]["kernels"][0]["loop"]["instructions_per_weight"] * covered / k_pad


@pytest.mark.sweep
@pytest.mark.parametrize("case", _MOE_CASES, ids=lambda c: c.key.removesuffix("/" + MOSAIC))
def test_moe_kernel_xray_gate(case, moe_compiled, baseline):
    """Each grouped kernel the heuristics pick at the MoE shapes: one launch, 0 spills, registers in budget,
    main loop no worse than the baseline; at decode (1, 8, 64 tokens) the issue's static goal, at most 2.0
    main-loop SASS instructions per weight of W."""
    from bench.xray.moe_cases import DECODE_TOKENS

    record = moe_compiled[case.key]
    assert "error" not in record, record.get("traceback", record.get("error"))
    (k,) = record["report"]["kernels"]
    assert len(record["report"]["launches"]) == 1
    assert k["spill_bytes"] == 0 and k["registers"] <= 255
    assert k["registers"] * k["threads"] <= H200.registers_per_sm
    assert report.loop_read_whole(k["loop"])
    base = baseline.get(case.key)
    assert base is not None, f"{case.key} is not in bench/xray_baseline.json (moe_cases --update-baseline)"
    limit = base["instructions_per_weight"] * (1 + report.IPW_TOLERANCE)
    assert k["loop"]["instructions_per_weight"] <= limit
    if case.tokens in DECODE_TOKENS:
        assert instructions_per_weight_of_w(case, record) <= 2.0


@pytest.mark.sweep
def test_moe_xla_peers_compile_to_launches_and_bytes(moe_compiled):
    """The XLA programs bench/moe.py times beside the grouped kernel (ragged_dot on the bf16 stack, on the
    dequantized int4 stack, nybble's XLA path) have X-ray rows: their launches and bytes, no main loop; the
    kernel reads less than any of them at decode (4 of 128 experts' weights)."""
    from bench.xray import moe_cases

    records = {c.key: moe_compiled[c.key] for c in _MOE_PEER_CASES}
    for key, record in records.items():
        assert "error" not in record, (key, record.get("traceback", record.get("error")))
    ceilings = model.ceilings_for(H200)
    rows = {
        r["peer"]: r
        for r in report.build_rows(
            records, {k: model.model_case(r, H200, ceilings) for k, r in records.items()}
        )
    }
    assert set(rows) == {MOSAIC, *moe_cases.XLA_PEERS}
    for peer in moe_cases.XLA_PEERS:
        assert rows[peer]["launches"] >= 1 and rows[peer]["t_issue_us"] is None
        assert rows[peer]["key"] == f"moe/qwen3-30b-a3b-down/T1/g128-sym/{peer}"
        assert rows[peer]["bytes"] > 4 * rows[MOSAIC]["bytes"]
    assert rows[MOSAIC]["launches"] == 1 and rows[MOSAIC]["kernel"]["loop"]["instructions_per_weight"] > 0


def test_dequantizing_loops_store_without_warpgroup_barriers():
    """The decode kernels' dequantizing loops, compiled to sm_100a SASS: a warpgroup barrier (BAR.SYNC, all 4
    warps wait) only where the kernel synchronizes (commit_smem before the A operand's arrival, the
    tensor-core-ordered arrival, the fold's TMEM load and its total's store): at most 4 a turn (a K step of
    one of the two alternating warpgroups). Mosaic's automatic barriers put two around each of the step's
    SMEM stores (10 and 11 a step at M = 1 with them, when each warpgroup stored a 64-row half every step);
    the kernel turns them off (``unsafe_no_auto_barriers``, blackwell/kernel.py says why that is safe)."""
    from bench.xray.blackwell import Case
    from bench.xray.runner import run_cases

    cases = [Case("llama3-8b-qo", 4096, 4096, m, 128, True) for m in (1, 16)]
    try:
        records = run_cases(cases, gpu="b200", jobs=2, progress=False, worker="bench.xray.blackwell_worker")
    except ToolchainMissing as e:
        pytest.fail(f"the X-ray toolchain is missing: {e}")
    for case in cases:
        record = records[case.key]
        assert "error" not in record, record.get("traceback", record.get("error"))
        assert record["report"]["kernels"][0]["spill_bytes"] == 0
        loop = record["loop"]
        assert loop["dequant_warpgroups"] == 2 and len(loop["warpgroup_barriers"]) == 2, loop
        assert loop["instructions"].endswith("(alternate steps)"), loop["instructions"]
        assert max(loop["warpgroup_barriers"]) <= 4, (case.key, loop["warpgroup_barriers"])


# ------------------------------------------------------------------------ the SwiGLU epilogue's kernel

_XRAY_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from bench.kernel_xray import xray_compile
from nybble.kernels.mosaic_gpu import swiglu
from nybble.quant import quantize
qw = jax.eval_shape(lambda w: quantize(w, group_size=128), jax.ShapeDtypeStruct((4096, 28672), jnp.float32))
fn = lambda x, qw, s: swiglu.mosaic_gpu_swiglu(x, qw, s, norm=(4096.0, 1e-5), num_sms=132)
x, s = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.float32)
config = swiglu.swiglu_plan(1, qw, num_sms=132).config.tag
print(json.dumps({"config": config, "report": xray_compile(fn, x, qw, s, gpu="h200").to_dict()}))
"""


def test_xray_the_epilogue_leaves_the_main_loop_as_it_was():
    """The SASS X-ray of the epilogue's kernel at Llama-3-8B's gate/up, M = 1 (sm_90a, compiled on this CPU):
    one launch, no spills, and the main loop within 1% of the plain kernel's committed baseline at the same
    shape and config (bench/xray_baseline.json): the epilogue runs once, after the loop."""
    import os

    from bench.kernel_xray import child_environment

    env = child_environment(find_toolchain())
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    )
    out = subprocess.run(
        [sys.executable, "-c", _XRAY_SCRIPT], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    base = json.loads((REPO / "bench" / "xray_baseline.json").read_text())["cases"]
    plain = base["llama3-8b-gate-up/M1/g128-sym/nybble:mosaic_gpu"]
    assert result["config"] == plain["config"]  # the same pick, with the epilogue or without
    (kernel,) = result["report"]["kernels"]
    assert kernel["name"].startswith(f"nybble_w4a16_{plain['config']}_swiglu")
    assert kernel["spill_bytes"] == 0 and kernel["registers"] <= 255
    ipw = kernel["loop"]["instructions_per_weight"]
    assert plain["instructions_per_weight"] * 0.99 <= ipw <= plain["instructions_per_weight"] * 1.01
    assert len(result["report"]["launches"]) == 1


_GROUPED_XRAY_SCRIPT = """
import json
import jax, jax.numpy as jnp
from bench.kernel_xray import xray_compile
from bench.xray.moe_cases import abstract_weight
from nybble.kernels.mosaic_gpu import grouped_swiglu
from nybble.kernels.mosaic_gpu.grouped import grouped_matmul
out = {}
for experts, k, n, rows in [(128, 2048, 1536, 8), (128, 4096, 3072, 8)]:
    qw = abstract_weight(experts, k, n, 128, True)
    x, g = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16), jax.ShapeDtypeStruct((experts,), jnp.int32)
    config = grouped_swiglu.grouped_swiglu_plan(rows, qw, num_sms=132)[0].config
    plain = lambda x, qw, g: grouped_matmul(x, qw, g, config=config, num_sms=132)
    fused = lambda x, qw, g: grouped_swiglu.mosaic_gpu_grouped_swiglu(x, qw, g, num_sms=132)
    out[f"{k}x{n}"] = {name: xray_compile(fn, x, qw, g, gpu="h200").to_dict() for name, fn in
                       (("plain", plain), ("swiglu", fused))}
print(json.dumps(out))
"""


def test_xray_the_grouped_epilogue_leaves_the_main_loop_as_it_was():
    """The SASS X-ray of the grouped kernel with the SwiGLU epilogue at Qwen3-30B-A3B's and
    Qwen3-235B-A22B's fused gate/up, one token (sm_90a, compiled on this CPU), beside the plain grouped
    kernel of the same config compiled in the same run: one launch each, no spills, the main loop within
    2.5% (2026-12-07: 732 -> 747 instructions at K = 2048, one K step a slice, which the plain kernel's
    schedule packs tighter; 745 -> 743 at K = 4096)."""
    import os

    from bench.kernel_xray import child_environment

    env = child_environment(find_toolchain())
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    )
    out = subprocess.run(
        [sys.executable, "-c", _GROUPED_XRAY_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    for shape, reports in json.loads(out.stdout.strip().splitlines()[-1]).items():
        (plain,), (fused,) = reports["plain"]["kernels"], reports["swiglu"]["kernels"]
        assert fused["name"].startswith(plain["name"].rsplit("_", 1)[0] + "_swiglu"), (
            plain["name"],
            fused["name"],
        )
        assert fused["spill_bytes"] == 0 and fused["registers"] <= 255, shape
        assert len(reports["swiglu"]["launches"]) == 1, shape
        before, after = plain["loop"]["instructions_per_weight"], fused["loop"]["instructions_per_weight"]
        assert after <= before * 1.025, (shape, before, after)
