"""The static model of one decode step: time per launch, tokens/s, and the HBM limit. A model, not a timing.

Per launch: ``max(bytes / HBM rate, flops / tensor rate, issue-bound time)`` (the issue bound of nybble's
kernels from the X-ray model, ``bench.xray.model``; none for XLA's launches), plus its launch overhead, the
same constants for bf16 and int4 steps alike: ``GpuSpec.launch_s`` for a launch the host submits on its own,
``GpuSpec.graph_launch_s`` for one replayed inside a command buffer (a CUDA graph), and ``launch_s`` once
for each command buffer's own launch (:func:`graph_launches`). The step's time is the sum over its launches
(they run one after another on one stream); tokens/s is ``batch / step time``. Beside it, an upper bound:
the same sum with the captured launches charged no overhead at all (``tokens_per_s_captured_free``).

The HBM limit is what no implementation can beat: ``(weights + KV cache + activations read) / HBM rate``
per step, with the bytes a step must read (:func:`needed_bytes`), not the bytes the compiled program moves.
"""

from __future__ import annotations

from typing import Any

from bench.decode.count import ATTENTION, EMBED, FAMILIES, active_experts, totals

OVERHEAD = "launch overhead"
INT4_BYTES_PER_WEIGHT = 0.5 + 2 / 128  # codes + one bf16 scale per 128 weights (g128, symmetric)


def launch_seconds(launch: dict[str, Any], gpu: Any) -> float:
    """The launch's bound (without overhead): bytes, flops or (nybble's kernels) instruction issue."""
    t = max(launch["bytes"] / gpu.hbm_bytes_per_s, launch["flops"] / gpu.bf16_flops)
    return max(t, launch["issue_s"] or 0.0)


def predict(launches: list[dict[str, Any]], gpu: Any, batch: int) -> dict[str, Any]:
    """Breakdown by family (launches, bytes, seconds), overhead, step time and predicted tokens/s."""
    counted = totals(launches)
    breakdown: dict[str, Any] = {}
    for family in FAMILIES:
        seconds = sum(
            la.get("count", 1.0) * launch_seconds(la, gpu) for la in launches if la["family"] == family
        )
        breakdown[family] = {**counted[family], "seconds": seconds}
    n, captured, graphs = counted["launches"], counted["in_command_buffers"], graph_launches(launches)
    breakdown[OVERHEAD] = {
        "launches": n,
        "seconds": (n - captured + graphs) * gpu.launch_s + captured * gpu.graph_launch_s,
        "per_launch_s": gpu.launch_s,
        "per_graph_launch_s": gpu.graph_launch_s,
        "graph_launches": graphs,
    }
    step = sum(v["seconds"] for v in breakdown.values())
    # The bound the other way: a launch inside a command buffer charged nothing (the GPU's own gap between
    # kernels left out), every other launch and each graph's own launch as above.
    captured_free = step - captured * gpu.graph_launch_s
    issue_bound = sum(
        la.get("count", 1.0) for la in launches if la["issue_s"] and launch_seconds(la, gpu) == la["issue_s"]
    )
    return {
        "breakdown": breakdown,
        "bytes_per_step": counted["bytes"],
        "launches_per_step": n,
        "launches_in_command_buffers": captured,
        "command_buffer_launches": graphs,
        "issue_bound_launches": issue_bound,
        "step_seconds": step,
        "predicted_tokens_per_s": batch / step,
        "step_seconds_captured_free": captured_free,
        "tokens_per_s_captured_free": batch / captured_free,
    }


def graph_launches(launches: list[dict[str, Any]]) -> float:
    """Command buffers the host launches per step: each run of consecutive captured launches in program order
    is one graph, as often as the most frequent launch in it runs (a run inside a layer repeats with the
    layer; a launch computed once for all layers rides in one of its runs; with a middle layer repeated,
    each run as often as the launch that starts it). Launches a one-layer compile
    lacks (``inserted``, ``count.extrapolate``) join their neighbours' graph where captured; where every
    compiled launch is captured (jax 0.12) the step is one graph."""
    compiled = [la for la in launches if not la.get("inserted")]
    if compiled and all(la["in_command_buffer"] for la in compiled):
        return 1.0
    if any(la.get("middle") for la in compiled):
        # A middle layer repeated (count.extrapolate): each graph counted by the launch that starts it, as
        # often as that launch runs: a run across a layer boundary starts in one layer and ends in the next.
        starts = (
            la.get("count", 1.0)
            for i, la in enumerate(compiled)
            if la["in_command_buffer"] and (i == 0 or not compiled[i - 1]["in_command_buffer"])
        )
        return float(sum(starts))
    graphs, run = 0.0, None
    for la in compiled:
        if la["in_command_buffer"]:
            run = max(run or 0.0, la.get("count", 1.0))
        elif run is not None:
            graphs, run = graphs + run, None
    return graphs + (run or 0.0)


def needed_bytes(cfg: Any, weights: str, batch: int, context: int, *, int4_lm_head: bool = False) -> dict:
    """Bytes one decode step must read at least: weights (a MoE layer: the experts its tokens reach),
    the KV cache, the activations each projection reads, the embedding rows."""
    per_weight = 2.0 if weights == "bf16" else INT4_BYTES_PER_WEIGHT
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    weight_bytes = act_bytes = 0.0
    for layer in range(cfg.num_layers):
        weight_bytes += (h * (q + 2 * kv) + q * h) * per_weight + 2 * h * 2  # projections + 2 norms
        act_bytes += batch * 2 * (3 * h + q)
        if cfg.is_moe_layer(layer):
            m = cfg.moe
            active = active_experts(batch, m.num_experts, m.top_k)
            weight_bytes += active * 3 * h * m.intermediate_size * per_weight + h * m.num_experts * 2
            act_bytes += batch * 2 * (h + m.top_k * (2 * h + m.intermediate_size))
        else:
            weight_bytes += 3 * h * cfg.intermediate_size * per_weight
            act_bytes += batch * 2 * (2 * h + cfg.intermediate_size)
    head_per_weight = per_weight if int4_lm_head else 2.0
    lm_head = cfg.vocab_size * h * head_per_weight
    embed = batch * h * 2 if not cfg.tie_embeddings else 0.0
    cache = 2.0 * cfg.num_layers * batch * context * kv * 2
    total = weight_bytes + lm_head + embed + cache + act_bytes
    return {
        "weights": weight_bytes + lm_head + embed,
        "kv_cache": cache,
        "activations": act_bytes,
        "total": total,
    }


def hbm_limit(needed: dict[str, float], gpu: Any, batch: int) -> float:
    """Tokens/s at the HBM limit: ``batch / (needed bytes / HBM rate)``."""
    return batch / (needed["total"] / gpu.hbm_bytes_per_s)


__all__ = [
    "ATTENTION",
    "EMBED",
    "OVERHEAD",
    "graph_launches",
    "hbm_limit",
    "launch_seconds",
    "needed_bytes",
    "predict",
]
