"""bench.decode: a small Llama's decode step compiled for an H200 on this CPU (the X-ray toolchain), its
launches and bytes checked against independent counts: XLA's own thunk sequence, the model's parameter
bytes, and whole-model compiles for the extrapolations (3 layers, the middle one repeated; 1 layer
multiplied); and the fused step launches less."""

from __future__ import annotations

import pytest

from bench.decode.count import EMBED, FAMILIES, StepCase, active_experts, command_buffers, extrapolate, totals
from bench.decode.models import config_for
from bench.decode.predict import graph_launches, launch_seconds, needed_bytes, predict
from bench.kernel_xray import GPUS

H200 = GPUS["h200"]
CONTEXT = 128
BATCH = 2
CASES = {
    "one": StepCase("tiny-llama", "bf16", BATCH, CONTEXT, 1, fused=True, donate=True),
    "whole": StepCase("tiny-llama", "bf16", BATCH, CONTEXT, 3, fused=True, donate=True),
    "int4-base": StepCase("tiny-llama", "int4", BATCH, CONTEXT, 1),
    "int4": StepCase("tiny-llama", "int4", BATCH, CONTEXT, 1, fused=True, donate=True),
    "int4-serving": StepCase(
        "tiny-llama", "int4", BATCH, CONTEXT, 1, fused=True, donate=True, attention="triton"
    ),
    "int4-serving-whole": StepCase(
        "tiny-llama", "int4", BATCH, CONTEXT, 3, fused=True, donate=True, attention="triton"
    ),
    # 1024 positions: the attention kernel reads them in 4 splits, which its last program merges
    "int4-serving-long": StepCase(
        "tiny-llama", "int4", BATCH, 1024, 1, fused=True, donate=True, attention="triton"
    ),
    # batch 8: tiny-llama's gate/up (K = 256) takes the SwiGLU epilogue (no config of it fits batch 2)
    "int4-serving-b8": StepCase(
        "tiny-llama", "int4", 8, CONTEXT, 1, fused=True, donate=True, attention="triton"
    ),
    "moe": StepCase("tiny-moe", "int4", BATCH, CONTEXT, 1, fused=True, donate=True),
    "moe-b1": StepCase("tiny-moe", "int4", 1, CONTEXT, 1, fused=True, donate=True),
    "moe-b1-serving": StepCase(
        "tiny-moe", "int4", 1, CONTEXT, 1, fused=True, donate=True, attention="triton", routing="triton"
    ),
    # 3 layers (bench.decode's default: layer 1 repeated) against 5 compiled whole; batch 2 routes by a sort
    "moe-serving-3": StepCase(
        "tiny-moe", "int4", BATCH, CONTEXT, 3, fused=True, donate=True, attention="triton", routing="triton"
    ),
    "moe-serving-5": StepCase(
        "tiny-moe", "int4", BATCH, CONTEXT, 5, fused=True, donate=True, attention="triton", routing="triton"
    ),
    "moe-b1-bf16-serving-3": StepCase(
        "tiny-moe", "bf16", 1, CONTEXT, 3, fused=True, donate=True, attention="triton", routing="triton"
    ),
    "int4-serving-5": StepCase(
        "tiny-llama", "int4", BATCH, CONTEXT, 5, fused=True, donate=True, attention="triton"
    ),
    # the softmax's top k (not renormalized): one token's routing sorts (tiny-moe's is by ranks)
    "moe-softmax-b1": StepCase("tiny-moe-softmax", "int4", 1, CONTEXT, 1, fused=True, donate=True),
}


@pytest.fixture(scope="module")
def records():
    from bench.xray.runner import run_cases

    out = run_cases(list(CASES.values()), gpu="h200", jobs=1, progress=False, worker="bench.decode.worker")
    for key, record in out.items():
        assert "error" not in record, (key, record.get("traceback"))
    return {name: out[case.key] for name, case in CASES.items()}


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_launches_equal_xlas_thunk_sequence(records):
    # The HLO's launches (bench.kernel_xray.hlo) against the thunks XLA's runtime executes, read apart; a
    # fusion XLA runs as several thunks counted as that many launches (next test).
    for name, record in records.items():
        assert len(record["launches"]) == record["thunk_launches"] > 0, name


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_a_fusion_run_as_two_thunks_is_two_launches(records):
    # XLA runs the MoE top-k as a copy and a sort, two thunks of one fusion (the tiny model's 16 experts at
    # batch 1, not at 2; Qwen3-30B-A3B's 128 at batch 64): the second is a launch of its own, moving no
    # bytes.
    for name in ("moe-softmax-b1",):
        step = records[name]["launches"]
        second = [la for la in step if la["name"].endswith("(thunk 2)")]
        assert [la["op_name"].rsplit("/", 1)[-1] for la in second] == ["top_k"], name
        first = step[step.index(second[0]) - 1]
        assert second[0]["name"] == f"{first['name']} (thunk 2)" and first["bytes"] > 0 == second[0]["bytes"]
        assert second[0]["layer"] and second[0]["in_command_buffer"] == first["in_command_buffer"]


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_bytes_read_of_weights_and_cache(records):
    import jax

    from bench.decode.program import abstract_model

    launches = records["whole"]["launches"]
    cfg = config_for("tiny-llama")
    state = jax.tree.leaves(__import__("flax").nnx.state(abstract_model(cfg, "bf16")))
    param_bytes = sum(a.size * a.dtype.itemsize for a in state)
    embed_bytes = cfg.vocab_size * cfg.hidden_size * 2
    read = sum(
        v
        for la in launches
        for s, v in la["operand_bytes"].items()
        if s.startswith("state[") and "embed" not in s
    )
    # every weight but the embedding table read once; XLA may pass one norm weight into a fusion under
    # another value's name (its bytes still counted in that launch, not under the parameter's name)
    assert 0 <= (param_bytes - embed_bytes) - read <= cfg.hidden_size * 2
    cache = 2 * cfg.num_layers * BATCH * CONTEXT * cfg.num_kv_heads * cfg.head_dim * 2
    cache_read = sum(v for la in launches for s, v in la["operand_bytes"].items() if s.startswith("cache."))
    assert cache_read >= cache  # the attention reads each layer's keys and values at least once
    gathers = [  # the row gather, alone or fused into the first norm
        la
        for la in launches
        if any(s.startswith("state['embed']") for s in la["operand_bytes"]) and "lm_head" not in la["op_name"]
    ]
    assert gathers and all(la["family"] == EMBED and la["bytes"] < embed_bytes / 8 for la in gathers)


# XLA fuses a few elementwise ops across a layer boundary differently: 0.3% of this small model's bytes at
# batch 2; at batch 64 the one-layer compile's key cache write also computes the key's rotary embedding,
# reading the qkv output a second time (8% of this small model's bytes, 0.06% of Llama-3-8B's). With the
# Triton attention each norm's fusion sums the residual stream's parts itself, reading one more activation
# a layer deeper (0.8% here, 8 KB a layer at Llama-3-8B's batch 1: 0.2% of its step). The int4 steps no
# longer: a layer's down kernel computes its successor's norm product (the residual epilogue), which a
# one-layer compile, with no successor, cannot show (3 layers, below, are bench.decode's default).
# (The batch-64 pair, within 10%, left CI's sweeps on 2026-12-07 to save its two compiles.)
@pytest.mark.parametrize("one_layer, more, rel", [("one", "whole", 5e-3)])
@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_one_layer_extrapolates_to_the_whole_model(records, one_layer, more, rel):
    one = totals(extrapolate(records[one_layer]["launches"], 1, 3))
    whole = totals(extrapolate(records[more]["launches"], 3, 3))
    assert one["launches"] == whole["launches"]
    assert one["bytes"] == pytest.approx(whole["bytes"], rel=rel)
    for f in FAMILIES:
        assert one[f]["launches"] == whole[f]["launches"], f


# The residual stream a layer deeper re-summed from its parts by each norm's fusion (above): 0.9% of the
# 5-layer tiny-llama's bytes, which a middle layer repeated counts as a middle layer's.
@pytest.mark.parametrize(
    "three, five, rel",
    [
        # on jax 0.11.2 nybble's kernels cut the step into graphs (the step with XLA's attention, the same
        # cuts, left CI's sweeps on 2026-12-07 to save its two compiles)
        ("int4-serving-whole", "int4-serving-5", 0.01),
        ("moe-serving-3", "moe-serving-5", 1e-3),
    ],
)
@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_a_middle_layer_repeated_gives_the_whole_model(records, three, five, rel):
    # bench.decode's default: 3 layers compiled, layer 1 (read from its ops' scope, layer_1) counted for
    # every middle layer. Against the 5-layer compile: launches per family, launches inside command
    # buffers, the command buffers themselves; bytes. (The one-layer rule counted 69 launches for the bf16
    # MoE token's 5 layers, whose compile had 61, 2026-12-07: its layer boundary is fused otherwise.)
    ex = extrapolate(records[three]["launches"], 3, 5)
    whole = totals(extrapolate(records[five]["launches"], 5, 5))
    got = totals(ex)
    assert sum(la["middle"] for la in ex) > 5 and {la["layer_index"] for la in ex} >= {0, 1, 2}
    assert got["launches"] == whole["launches"] and got["in_command_buffers"] == whole["in_command_buffers"]
    for f in FAMILIES:
        assert got[f]["launches"] == whole[f]["launches"], f
    assert got["bytes"] == pytest.approx(whole["bytes"], rel=rel)
    assert graph_launches(ex) == records[five]["command_buffers"]


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_the_attention_kernel_sums_the_input_norms_row_itself(records):
    # The serving step's middle layer (batch 1 and 2, Llama and MoE): the Triton attention kernel sums the
    # squares of the input norm's row (DeferredNorm.rows), so no launch before the qkv kernel reduces: the
    # residual add and the norm's product are one elementwise launch, or fused into the one before.
    for name in ("int4-serving-whole", "moe-serving-3", "moe-b1-bf16-serving-3"):
        layer = [la for la in extrapolate(records[name]["launches"], 3, 5) if la["middle"]]
        attention = next(i for i, la in enumerate(layer) if "nybble_decode_attention" in la["op_name"])
        before = [la["op_name"] for la in layer[:attention] if la["family"] != "linear"]
        assert not any("reduce" in n.rsplit("/", 1)[-1] for n in before), (name, before)
        assert len(layer[:attention]) <= 3, name  # at most the add's launch and the q/k/v projection's


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_a_layer_hands_its_successor_the_norm_product(records):
    # The residual epilogue (nybble.kernels.residual_matmul): in the int4 serving step the down kernel of
    # layers 0 and 1 adds the residual and computes the next layer's input-norm product, so that layer's
    # q/k/v kernel follows it with no launch between (XLA's add and product launch gone); the last layer's
    # down kernel has no successor's norm to compute (the final norm is not deferred).
    launches = records["int4-serving-whole"]["launches"]
    downs = [i for i, la in enumerate(launches) if "_residual/" in la["op_name"]]
    assert len(downs) == 2
    for layer, i in enumerate(downs):
        assert f"layer_{layer}/" in launches[i]["op_name"]
        following = launches[i + 1]
        assert following["kind"] == "mosaic_gpu" and f"layer_{layer + 1}/" in following["op_name"], following


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_command_buffers_extrapolate(records):
    # the launches inside command buffers, and the command buffers, as the whole compile's thunks have them:
    # bf16, one graph on either jax end (int4 steps chain their layers through the residual epilogue, which
    # one layer cannot show: test_a_middle_layer_repeated_gives_the_whole_model checks them, 3 layers to 5)
    for one_layer, more in (("one", "whole"),):
        ex, whole_ex = extrapolate(records[one_layer]["launches"], 1, 3), records[more]["launches"]
        assert totals(ex)["in_command_buffers"] == totals(whole_ex)["in_command_buffers"], one_layer
        assert graph_launches(ex) == records[more]["command_buffers"], one_layer


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_fused_donated_step_launches_less(records):
    base, fused = records["int4-base"]["launches"], records["int4"]["launches"]
    assert len(fused) < len(base)
    assert any(la["kind"] == "copy" for la in base)  # the undonated cache is copied each step
    assert not any(la["kind"] == "copy" for la in fused)
    kernels = [la for la in fused if la["kind"] == "mosaic_gpu"]
    assert len([la for la in base if la["kind"] == "mosaic_gpu"]) == 7  # q, k, v, o, gate, up, down
    assert len(kernels) == 4  # qkv, o, gate_up, down: one launch each
    assert all(la["family"] == "linear" for la in kernels)
    assert all(la["issue_s"] is not None and la["issue_s"] > 0 for la in kernels)


@pytest.fixture(scope="module")
def b200_records():
    """The int4 dense and MoE steps compiled for a B200, in one compile worker."""
    from bench.xray.runner import run_cases

    cases = [CASES["int4"], CASES["moe"]]
    out = run_cases(cases, gpu="b200", jobs=1, progress=False, worker="bench.decode.worker")
    for case in cases:
        assert "error" not in out[case.key], out[case.key].get("traceback")
    return {"int4": out[CASES["int4"].key], "moe": out[CASES["moe"].key]}


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_b200_step_charges_the_blackwell_kernels_issue_bound(b200_records):
    # On a B200 the step's Blackwell kernels get the B200 X-ray model's issue-bound time, read from their
    # SASS in the step's compile; the same shape compiled alone by the X-ray gives the same time.
    from bench.xray import blackwell
    from bench.xray.runner import run_cases

    step = b200_records["int4"]
    kernels = [la for la in step["launches"] if la["kind"] == "mosaic_gpu"]
    assert len(kernels) == 4 and all(la["issue_s"] and la["issue_s"] > 0 for la in kernels)
    cfg = config_for("tiny-llama")
    o_proj = next(la for la in kernels if any("o_proj" in s for s in la["operand_bytes"]))
    alone = blackwell.Case("o", cfg.num_heads * cfg.head_dim, cfg.hidden_size, BATCH)
    record = run_cases([alone], gpu="b200", jobs=1, progress=False, worker="bench.xray.blackwell_worker")
    record = record[alone.key]
    assert "error" not in record, record.get("traceback")
    issue_us = blackwell.model({**record, "case": {"m": BATCH, "k": alone.k, "n": alone.n}}, GPUS["b200"])
    assert o_proj["issue_s"] * 1e6 == pytest.approx(issue_us["times_us"]["issue"])


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_grouped_kernels_charged_the_xray_models_issue_time(records, b200_records):
    # A MoE step's grouped kernels get the X-ray MoE rows' issue-bound time (the balanced grouping their
    # config is chosen for): on an H200 equal to the same shape compiled alone by the X-ray's MoE worker;
    # on a B200 read from the Blackwell grouped kernel's SASS in the step.
    from bench.xray.model import ceilings_for, model_case
    from bench.xray.moe_cases import MoeCase
    from bench.xray.runner import run_cases

    cfg = config_for("tiny-moe")
    grouped = {}
    for gpu, step in (("h200", records["moe"]), ("b200", b200_records["moe"])):
        grouped[gpu] = [la for la in step["launches"] if "nybble_grouped" in la["op_name"]]
        assert len(grouped[gpu]) == 2 and all(la["issue_s"] and la["issue_s"] > 0 for la in grouped[gpu]), gpu
    down = next(la for la in grouped["h200"] if any("down_proj" in s for s in la["operand_bytes"]))
    moe, rows = cfg.moe, BATCH * cfg.moe.top_k
    alone = MoeCase("tiny-moe-down", moe.intermediate_size, cfg.hidden_size, rows, moe.num_experts, BATCH)
    record = run_cases([alone], gpu="h200", jobs=1, progress=False, worker="bench.xray.moe_worker")[alone.key]
    assert "error" not in record, record.get("traceback")
    record = {**record, "case": {"m": rows, "k": alone.k, "n": alone.n}}
    issue_us = model_case(record, GPUS["h200"], ceilings_for(GPUS["h200"]))["t_issue_us"]
    assert down["issue_s"] * 1e6 == pytest.approx(issue_us)


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_decode_step_launch_count(records):
    # One layer of the fused int4 step: 4 nybble kernels; the attention (cache writes, scores, softmax,
    # values) and the norms in few XLA fusions: 15 launches a layer (21 before issue 46's second round:
    # no second attention block for the new token, no launch applying a norm).
    launches = extrapolate(records["int4"]["launches"], 1, 1)
    layer = [la for la in launches if la["layer"]]
    assert len([la for la in layer if la["kind"] == "mosaic_gpu"]) == 4
    assert len([la for la in layer if la["family"] == "attention"]) <= 8
    assert len([la for la in layer if "/norm/" in la["op_name"]]) == 1  # one pass per norm, none applying
    assert len(layer) <= 15
    # 3 layers: + 2 input norms (layer 0 has its fused with the gather), + the rotary cos and sin once
    assert totals(extrapolate(records["int4"]["launches"], 1, 3))["launches"] == 3 * len(layer) + 2 + 2 + 3


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_triton_attention_takes_one_launch_and_reads_the_cache_once(records):
    # set_decode_attention(model, "triton"): the kernel, from the qkv kernel's output as it is (the input
    # norm's scale, the rotary embedding, the cache write and the attention) to the o kernel's input: one
    # launch a layer for XLA's cache writes, scores, softmax, values and the sum before the o kernel; the
    # rotary factors once a step. The tiny model's 128 positions are one split (programs of several merge
    # in the launch too: tests/test_decode_attention_kernel.py): 7 launches a layer here, 5 fewer.
    fused = [la for la in extrapolate(records["int4"]["launches"], 1, 1) if la["layer"]]
    step = extrapolate(records["int4-serving"]["launches"], 1, 1)
    serving = [la for la in step if la["layer"]]
    attention = [la for la in serving if la["family"] == "attention"]
    names = [la["op_name"] for la in attention]
    assert [la["kind"] for la in attention] == ["custom-call"], names
    assert len(serving) == len(fused) - 5 == 7, [la["op_name"] for la in serving]
    assert len([la for la in step if "/rope_factors/" in la["op_name"] and not la["layer"]]) == 1
    (kernel,) = attention
    assert "/nybble_decode_attention/" in kernel["op_name"]
    cfg = config_for("tiny-llama")
    cache = BATCH * CONTEXT * cfg.num_kv_heads * cfg.head_dim * 2
    out = BATCH * cfg.num_heads * cfg.head_dim * 2  # the o kernel's bf16 input
    qkv = BATCH * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * 2
    rope = 2 * cfg.head_dim * 4
    rows = BATCH * cfg.hidden_size * 2  # the input norm's bf16 rows, whose squares the kernel sums
    # both caches read once, a row of each written (aliased: not the whole cache), the o kernel's input
    # written; the qkv output, the rotary factors, the input norm's rows and the position read
    assert kernel["bytes"] == 2 * cache + 2 * cache / CONTEXT + out + qkv + rope + rows + 4


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_split_attention_merges_in_its_launch_with_counters_from_the_norms_launch(records):
    # 1024 cached positions: 4 splits a sequence and KV head, merged by the last in the kernel's launch
    # (arrival counters, zeros of the q/k/v projection input's shape written by the launch that writes
    # that input): the same launches a layer as one split, the kernel's results now the splits' states
    # and the counters besides the o kernel's input.
    from nybble.kernels.triton.decode_attention import choose_config

    cfg = config_for("tiny-llama")
    assert choose_config(BATCH, cfg.num_kv_heads, 1024, H200.sms).splits == 4
    short = [la for la in extrapolate(records["int4-serving"]["launches"], 1, 1) if la["layer"]]
    long = [la for la in extrapolate(records["int4-serving-long"]["launches"], 1, 1) if la["layer"]]
    assert [la["kind"] for la in long] == [la["kind"] for la in short], [la["op_name"] for la in long]
    (kernel,) = [la for la in long if la["family"] == "attention"]
    (one_split,) = [la for la in short if la["family"] == "attention"]
    groups = cfg.num_heads // cfg.num_kv_heads
    states = BATCH * cfg.num_kv_heads * 4 * groups * (cfg.head_dim + 2) * 4
    counters = BATCH * cfg.hidden_size * 4
    caches = 2 * BATCH * cfg.num_kv_heads * cfg.head_dim * 2 * (1024 - CONTEXT)  # read, not written
    assert kernel["bytes"] == one_split["bytes"] + caches + states + 2 * counters  # counters read, written


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_swiglu_epilogue_takes_the_mlps_product_into_the_gate_up_kernel(records):
    # Batch 8: the gate/up kernel (its weight's columns gate and up interleaved, FusedGateUp) stores
    # silu(r gate) * (r up), r the post-attention norm's scale from its sum of squares, and the down kernel
    # reads it: nothing between the two, one launch a layer fewer than at batch 2 (no epilogue config
    # there: the product is an XLA fusion of its own).
    def mlp(record: dict) -> tuple[list[dict], list[dict]]:
        layer = [la for la in extrapolate(record["launches"], 1, 1) if la["layer"]]
        kernels = [i for i, la in enumerate(layer) if la["kind"] == "mosaic_gpu"]
        return layer, layer[kernels[2] : kernels[3] + 1]

    b2, b2_mlp = mlp(records["int4-serving"])
    b8, b8_mlp = mlp(records["int4-serving-b8"])
    assert [la["kind"] for la in b8_mlp] == ["mosaic_gpu", "mosaic_gpu"], [la["op_name"] for la in b8_mlp]
    gate_up = b8_mlp[0]
    assert "_swiglu/" in gate_up["op_name"] and "_swiglu/" not in b2_mlp[0]["op_name"]
    cfg = config_for("tiny-llama")
    assert gate_up["result_bytes"] == 8 * cfg.intermediate_size * 2  # one bf16 column per gate/up pair
    assert "intermediate" in gate_up["operand_bytes"] and len(b2_mlp) == 3
    assert len(b8) == len(b2) - 1, ([la["op_name"] for la in b2], [la["op_name"] for la in b8])


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_qk_norms_take_one_launch(records):
    # Qwen3's q/k norms (tiny-moe): one reduction for every head's sum of squares; each normalized head is
    # computed where it is read (the query's rotary fusion, the key's cache write), so between the qkv and
    # o kernels the step launches exactly one more than Llama's (tiny-llama: no q/k norms).
    def between_first_kernels(record: dict) -> list[dict]:
        layer = [la for la in extrapolate(record["launches"], 1, 1) if la["layer"]]
        kernels = [i for i, la in enumerate(layer) if la["kind"] == "mosaic_gpu"]
        return layer[kernels[0] + 1 : kernels[1]]

    llama, qwen3 = between_first_kernels(records["int4"]), between_first_kernels(records["moe"])
    assert len(qwen3) == len(llama) + 1, ([la["op_name"] for la in llama], [la["op_name"] for la in qwen3])
    assert len([la for la in qwen3 if "/norm/" in la["op_name"]]) == 1


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_moe_routing_sums_take_one_launch_with_the_group_sizes(records):
    # tiny-moe at batch 2 (8 token-expert pairs, 16 experts): between the attention's o kernel and the
    # first grouped kernel, two sums past the router's (which takes the norm's sum of squares, MoE.normed):
    # the pairs' places and the group sizes as sibling sums of one shape (one launch; sort_by_expert), and
    # the sorted order. The top-k weights' normalization is no launch of its own: the combine divides by
    # their total (route_scores).
    layer = [la for la in extrapolate(records["moe"]["launches"], 1, 1) if la["layer"]]
    kernels = [i for i, la in enumerate(layer) if la["kind"] == "mosaic_gpu"]
    routing = layer[kernels[1] + 1 : kernels[2]]
    sums = [
        la
        for la in routing
        if la["op_name"].endswith("/reduce_sum")
        and "/norm/" not in la["op_name"]
        and not any("['router']" in s for s in la["operand_bytes"])  # the router's (MoE.normed)
    ]
    assert len(sums) == 2, [la["op_name"] for la in routing]
    assert not any(la["op_name"].endswith(("/div", "/exp")) for la in layer), [la["op_name"] for la in layer]


def test_prediction_adds_the_same_overhead_per_launch():
    launches = [
        {
            "family": "linear",
            "bytes": 4.8e6,
            "flops": 0.0,
            "issue_s": None,
            "in_command_buffer": False,
            "layer": 1,
        },
        {
            "family": "attention",
            "bytes": 0.0,
            "flops": 989e6,
            "issue_s": None,
            "in_command_buffer": True,
            "layer": 1,
        },
        {
            "family": EMBED,
            "bytes": 48.0,
            "flops": 0.0,
            "issue_s": 3e-6,
            "in_command_buffer": False,
            "layer": 0,
        },
    ]
    p = predict(launches, H200, batch=2)
    assert launch_seconds(launches[0], H200) == pytest.approx(1e-6)  # 4.8 MB at 4.8 TB/s
    assert launch_seconds(launches[1], H200) == pytest.approx(1e-6)  # 989 MFLOP at 989 TFLOP/s
    assert launch_seconds(launches[2], H200) == 3e-6  # the issue bound
    # two launches the host submits, one graph's launch, and the one kernel replayed inside that graph
    step = 5e-6 + 3 * H200.launch_s + H200.graph_launch_s
    assert p["command_buffer_launches"] == 1
    assert p["step_seconds"] == pytest.approx(step)
    assert p["predicted_tokens_per_s"] == pytest.approx(2 / step)
    # the upper bound: the one launch inside a command buffer charged no overhead, the rest as above
    assert p["step_seconds_captured_free"] == pytest.approx(5e-6 + 3 * H200.launch_s)
    assert p["tokens_per_s_captured_free"] == pytest.approx(2 / (5e-6 + 3 * H200.launch_s))


def _launch(captured: bool, count: float = 1.0, inserted: bool = False) -> dict:
    return {"in_command_buffer": captured, "count": count, **({"inserted": True} if inserted else {})}


def test_graph_launches_count_each_run_of_captured_launches_as_often_as_it_runs():
    # jax 0.11.2's shape: a run holding a once-a-step launch and a layer's, then per layer (x32) two runs cut
    # by uncaptured custom calls, the step's tail; an inserted launch joins its neighbours' graph
    split = [
        _launch(True),
        _launch(True, 32),
        _launch(False, 32),
        _launch(True, 32),
        _launch(True, 32),
        _launch(False, 32),
        _launch(True, 32),
        _launch(False),
        _launch(True),
        _launch(True, 31, inserted=True),
    ]
    assert graph_launches(split) == 32 + 32 + 32 + 1
    # jax 0.12's: every compiled launch captured, so the step is one graph, inserted launches included
    whole = [_launch(True), _launch(True, 32), _launch(True), _launch(True, 31, inserted=True)]
    assert graph_launches(whole) == 1
    assert graph_launches([_launch(False), _launch(False, 32)]) == 0
    # a middle layer repeated (3 compiled layers of 32): each run counted by the launch that starts it, so a
    # run across a layer boundary (starting in layer 0, or in layer 1 and ending in layer 2) once a boundary
    middle = [
        _launch(True),  # layer 0's run, into layer 1's first launch
        {**_launch(True, 30), "middle": True},
        {**_launch(False, 30), "middle": True},
        {**_launch(True, 30), "middle": True},  # layer 1's run, into layer 2's first launch
        _launch(True),
        _launch(False),
        _launch(True),  # layer 2's last run, the step's tail
    ]
    assert graph_launches(middle) == 1 + 30 + 1


def test_a_fusion_of_no_op_as_large_as_a_cache_is_not_a_cache_copy():
    # An undonated cache is copied (kind "copy", no op): an attention launch. XLA's ragged_dot expanding bf16
    # Qwen3-30B-A3B's 512 rows of batch 64 over its 128 experts is a fusion of no op whose 268 MB are a
    # layer's cache by chance: not attention.
    from types import SimpleNamespace

    from bench.decode.count import ATTENTION, ELEMENTWISE, _family

    cache = 64 * 4096 * 4 * 128 * 2
    copy = SimpleNamespace(kind="copy", result_bytes=cache)
    expansion = SimpleNamespace(kind="fusion", result_bytes=512 * 128 * 2048 * 2)
    assert _family(copy, "", ["cache.k[3]"], cache) == ATTENTION
    assert _family(expansion, "", ["intermediate"], cache) == ELEMENTWISE


def test_needed_bytes_and_active_experts():
    cfg = config_for("llama3-8b")
    bf16, int4 = needed_bytes(cfg, "bf16", 1, 4096), needed_bytes(cfg, "int4", 1, 4096)
    # Llama-3-8B: 8.03e9 parameters, of which 0.525e9 in the embedding table (one row read) and the same in
    # the bf16 LM head; a 4096-token cache of 32 layers x 8 heads x 128 x (k, v) bf16 = 0.54 GB.
    assert bf16["weights"] == pytest.approx(2 * (8.03e9 - 0.525e9), rel=0.01)
    assert bf16["kv_cache"] == 2 * 32 * 4096 * 8 * 128 * 2
    assert int4["kv_cache"] == bf16["kv_cache"] and int4["weights"] < bf16["weights"] / 2.5
    assert active_experts(1, 128, 8) == pytest.approx(8)
    assert 125 < active_experts(64, 128, 8) < 126  # 128 (1 - (120/128)^64)


def test_command_buffer_parser():
    text = (
        "001: kCopy          [source       | next=002 (1)] kCopy\n"
        "002: kCustomCall    [prev=001 (1) | next=000 (1)] kCustomCall\n"
        "000: kCommandBuffer [prev=002 (1) | sink       ] \n"
        "    003: kCustomKernel [source       | next=004 (1)] input_reduce_fusion_7 grid: [2, 1, 1]\n"
        "    004: kCustomKernel [prev=003 (1) | sink       ] gemm_fusion_dot_5 grid: [32, 1, 1]\n"
    )
    got = command_buffers(text)
    assert got["command_buffers"] == 1
    assert got["captured"] == ["input_reduce_fusion_7", "gemm_fusion_dot_5"]
    assert got["thunk_launches"] == 4


def test_command_buffer_parser_names_custom_calls_from_the_metadata():
    # jax 0.12's XLA captures nybble's kernels (custom calls) too; the sequence names their thunks by kind
    # only, the metadata by HLO name (excerpts of a real dump's format, trimmed)
    text = (
        "000: kCommandBuffer [source | sink] \n"
        "    001: kCustomKernel [source       | next=002 (1)] input_reduce_fusion grid: [1, 1, 1]\n"
        "    002: kCustomCall   [prev=001 (1) | next=003 (1)] kCustomCall\n"
        "    003: kCustomCall   [prev=002 (1) | next=004 (1)] kCustomCall\n"
        "    004: kCustomKernel [prev=003 (1) | sink        ] sort_1_1 grid: [1, 1, 1]\n"
    )
    metadata = "".join(
        f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n  }}\n'
        f'  thunk_kind: "{kind}"\n}}\n'
        for i, name, kind in ((1, "input_reduce_fusion", "kCustomKernel"), (2, "mpmd_map.5", "kCustomCall"),
                              (3, "mpmd_map.6", "kCustomCall"), (4, "fusion.6", "kCustomKernel"))
    )  # fmt: skip
    got = command_buffers(text, metadata)
    # the top-k fusion's thunk is named by the sort kernel inside it; the metadata names the fusion
    assert got["captured"] == ["input_reduce_fusion", "mpmd_map_5", "mpmd_map_6", "fusion_6"]
    assert got["top_level"] == {"kCommandBuffer": 1} and got["thunk_launches"] == 4
    assert command_buffers(text)["captured"][1] == "kCustomCall"  # without the metadata: unnamed


def test_gathered_reads_count_the_slices_a_fusion_gathers():
    # A float expert stack at decode: the fusion gathers two (4, 6) bf16 matrices of an (8, 4, 6) stack
    # straight from its parameter 0 (a real compile's shape, trimmed); the embedding-free entry otherwise.
    from bench.kernel_xray import hlo

    text = """HloModule m

%fused_reduce.7 (param_0.5: bf16[8,4,6], param_1.5: s32[2]) -> bf16[2,6] {
  %param_0.5 = bf16[8,4,6]{2,1,0} parameter(0)
  %param_1.5 = s32[2]{0} parameter(1)
  %bitcast.1 = s32[2,1]{1,0} bitcast(%param_1.5)
  %gather.13 = bf16[2,1,4,6]{3,2,1,0} gather(%param_0.5, %bitcast.1), offset_dims={1,2,3}, slice_sizes={1,4,6}
  ROOT %r = bf16[2,6]{1,0} bitcast(%gather.13)
}

ENTRY %main (w: bf16[8,4,6], e: s32[2]) -> bf16[2,6] {
  %w = bf16[8,4,6]{2,1,0} parameter(0), metadata={op_name="experts.kernel"}
  %e = s32[2]{0} parameter(1), metadata={op_name="e"}
  ROOT %input_reduce_fusion.7 = bf16[2,6]{1,0} fusion(%w, %e), kind=kInput, calls=%fused_reduce.7
}
"""
    assert hlo.gathered_reads(text) == {"input_reduce_fusion.7": {"experts.kernel": 2 * 4 * 6 * 2}}
    launch = hlo.launches(text)[0]
    assert launch.operand_bytes["experts.kernel"] == 8 * 4 * 6 * 2  # as typed: the whole stack


def test_side_by_side_of_measured_and_predicted(tmp_path):
    import json

    from bench.decode import side

    measured = {
        "config": {"model": "smollm2"},
        "machine": {"device": "cpu"},
        "rows": [
            {"batch": 1, "float": {"tokens_per_s": 50.0}, "int4": {"tokens_per_s": 80.0}},
            {"batch": 16, "float": {"tokens_per_s": 400.0}, "int4": {"tokens_per_s": 500.0}},
        ],
    }
    predicted = {
        "meta": {"gpu": "h200", "context": 128},
        "rows": [
            {"model": "smollm2-135m", "gpu": "h200", "batch": 1, "weights": w, "predicted_tokens_per_s": t}
            for w, t in (("bf16", 100.0), ("int4", 160.0))
        ],
    }
    (tmp_path / "m.json").write_text(json.dumps(measured))
    (tmp_path / "d.json").write_text(json.dumps(predicted))
    assert side.main([str(tmp_path / "m.json"), str(tmp_path / "d.json"), "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_side.json").read_text())["rows"]
    assert [(r["batch"], r["weights"], r["measured_over_predicted"]) for r in rows] == [
        (1, "bf16", 0.5),
        (1, "int4", 0.5),
        (16, "bf16", None),
        (16, "int4", None),
    ]
    assert "measured / predicted" in (tmp_path / "decode_side.md").read_text()


def test_compare_puts_two_runs_side_by_side():
    from bench.decode.compare import compare_markdown

    def doc(launches, tok_s):
        rows = [
            {"model": "m", "batch": 1, "weights": w, "launches_per_step": n, "predicted_tokens_per_s": t,
             "pct_of_hbm_limit": t / 1000, "needed_bytes": {"total": b}}
            for w, n, t, b in (("bf16", launches + 9, tok_s, 4.0), ("int4", launches, 2 * tok_s, 1.0))
        ]  # fmt: skip
        return {"rows": rows, "meta": {"gpu": "h200", "context": 8, "launch_overhead_s": 2e-6}}

    after = doc(20, 150.0)
    after["meta"]["graph_launch_overhead_s"] = 0.875e-6
    text = compare_markdown(doc(30, 100.0), after, "t")
    assert "| m | 1 | int4 | 30 -> 20 | 200 -> 300 | 20% -> 30% |" in text
    overheads = "2 us a launch before, 2 us a launch the host submits, 0.875 us one replayed in a graph after"
    assert overheads in text
    assert "| m | 1 | 2.00x -> 2.00x | 4.00x | 50% |" in text


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_the_moe_router_is_one_launch_reading_its_weight_once(records):
    # Batch 1: the router's weight is (experts, hidden) (moe.Router), so XLA's one-token product over it
    # is a row reduction, one launch; over nnx.Linear's (hidden, experts) it wrote and reread the products
    # (two). The post-attention norm's sum of squares is a sibling reduction of the same shape in that
    # launch (MoE.normed: one launch fewer), its scale multiplying the logits after the top k.
    cfg = config_for("tiny-moe")
    layer = [la for la in extrapolate(records["moe-b1"]["launches"], 1, 1) if la["layer"]]
    router = [la for la in layer if any("['router']" in s for s in la["operand_bytes"])]
    assert len(router) == 1, [la["op_name"] for la in router]
    (weight,) = [v for s, v in router[0]["operand_bytes"].items() if "['router']" in s]
    assert weight == cfg.moe.num_experts * cfg.hidden_size * 2  # bf16, read once
    # the float32 logits and the norm's sums of squares (one a logit: the sibling reductions' one shape)
    assert router[0]["result_bytes"] == 2 * cfg.moe.num_experts * 4
    # from the o projection's kernel to the experts' gate/up kernel: the router with the norm's sum of
    # squares, then the routing by ranks (next test)
    kernels = [i for i, la in enumerate(layer) if la["kind"] == "mosaic_gpu"]
    assert layer[kernels[1] + 1] is router[0], [la["name"] for la in layer[kernels[1] : kernels[2]]]


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_one_token_is_routed_by_ranks_without_a_sort(records):
    # Batch 1 (moe.route_ranked): between the router's launch and the gate/up kernel, two launches of
    # reductions over the experts and the k rows of x (jax 0.12's XLA writes the rows in the second; 0.11.2's
    # in a launch of their own at the tiny model's size); after the down kernel, the weighted sum over the
    # experts and the next norm's sum of squares. No top k, no sort: those of the softmax's top k
    # (tiny-moe-softmax, not routed by ranks) are three launches, its top k two thunks.
    cfg = config_for("tiny-moe")
    ranked = [la for la in extrapolate(records["moe-b1"]["launches"], 1, 1) if la["layer"]]
    names = [la["op_name"] for la in ranked]
    assert not any(n.endswith(("/top_k", "/sort")) for n in names), names
    kernels = [i for i, la in enumerate(ranked) if la["kind"] == "mosaic_gpu"]
    routing = ranked[kernels[1] + 2 : kernels[2]]
    assert all(la["op_name"].rsplit("/", 1)[-1].startswith("reduce") for la in routing[:2]), names
    rows = cfg.moe.top_k * cfg.hidden_size * 2
    assert len(routing) in (2, 3), names
    assert routing[-1]["result_bytes"] >= rows and routing[0]["result_bytes"] < rows
    after = names[kernels[3] + 1 :]
    assert len(after) == 2 and after[1].endswith("/norm/reduce_sum"), names
    softmax = [la["op_name"] for la in records["moe-softmax-b1"]["launches"]]
    assert sum(n.endswith("/top_k") for n in softmax) == 2, softmax


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_one_tokens_routing_kernel_is_the_one_launch_between_router_and_experts(records):
    # set_decode_routing(model, "triton"): from the router's launch to the experts' gate/up kernel, the
    # routing kernel alone (the ranks, the group sizes, the slots' scores and the k rows, where XLA's
    # route_ranked takes two launches: previous test), reading the residual stream's two parts (x and the
    # attention's output: XLA writes their sum nowhere). After the down kernel, the slots' weighted sum is
    # k adds, no reduction over the experts: here fused into the final norm's launch (the one layer's only
    # reader; at Qwen3-30B-A3B's size XLA writes the residual stream first, a launch of its own, in a
    # 3-layer compile as in one layer's: 436 launches a step either way, on jax 0.11.2 and 0.12).
    cfg = config_for("tiny-moe")
    layer = [la for la in extrapolate(records["moe-b1-serving"]["launches"], 1, 1) if la["layer"]]
    names = [la["op_name"] for la in layer]
    kernels = [i for i, la in enumerate(layer) if la["kind"] == "mosaic_gpu"]
    assert len(kernels) == 4, names  # qkv, o, the experts' gate/up and down
    router, routing = layer[kernels[1] + 1 : kernels[2]]
    assert any("['router']" in s for s in router["operand_bytes"]), names
    assert "nybble_moe_routing" in routing["op_name"], names
    rows = cfg.moe.top_k * cfg.hidden_size * 2
    assert routing["result_bytes"] == rows + cfg.moe.num_experts * 4 + cfg.moe.top_k * 4 + 4
    after = names[kernels[3] + 1 :]
    assert len(after) == 1 and after[0].endswith("/norm/reduce_sum"), names


@pytest.mark.sweep  # compiles the decode steps of CASES (the records fixtures)
def test_the_experts_swiglu_product_is_in_the_gate_up_kernel(records):
    # The experts' gate/up stack, its columns interleaved (FusedExpertsGateUp): the grouped kernel stores
    # silu(gate) * up, (rows, intermediate), and the down kernel reads it, nothing between them (an
    # elementwise launch before, at batch 1 and 2 alike).
    cfg = config_for("tiny-moe")
    for name, tokens in (("moe-b1", 1), ("moe", BATCH)):
        layer = [la for la in extrapolate(records[name]["launches"], 1, 1) if la["layer"]]
        kernels = [i for i, la in enumerate(layer) if la["kind"] == "mosaic_gpu"]
        assert len(kernels) == 4 and kernels[3] == kernels[2] + 1, [la["op_name"] for la in layer]
        gate_up = layer[kernels[2]]
        assert "nybble_grouped_w4a16_" in gate_up["op_name"] and "_swiglu/" in gate_up["op_name"]
        assert gate_up["result_bytes"] == tokens * cfg.moe.top_k * cfg.moe.intermediate_size * 2
