"""What one compiled decode step costs, launch by launch: op family, bytes, flops, issue time, graphs.

Families (``FAMILIES``), read off each launch's scope (``nybble.models.definitions.llama`` names its parts
with ``jax.named_scope``) and the parameters it reads: ``embedding/lm_head`` (the embedding row gather, the
LM head, and the final norm's parameter), ``attention`` (the KV-cache write, scores, softmax, values; any
launch reading the cache), ``linear`` (the projections: nybble's kernels, XLA's GEMMs and every launch that
reads a projection's weights), ``norm/rope/elementwise`` (the rest). Launches of the first family are the
step's non-layer part; every other launch belongs to a layer, so a model compiled with 3 layers gives the
whole step as ``the 3 layers' step + (layers - 3) x layer 1's launches`` (:func:`extrapolate`; the tests
check it against a whole compile of a small model).

Bytes are each launch's operands and result as XLA types them (``bench.kernel_xray.hlo``), except where the
type is not the traffic: a grouped (MoE) kernel's weight stack, of which it reads the experts that have rows
(the expected number of distinct experts ``batch`` tokens routed uniformly to their top k reach,
``active_experts``); the embedding gather, which reads one table row per token (also where XLA fuses it
into the first norm); any other fusion gathering straight from an operand (a float expert stack at
decode, ``moe.Experts``), which reads the slices it gathers (``hlo.gathered_reads``); the in-place
KV-cache update, which reads and writes the new row only; and the Triton decode attention kernel, whose
results include the caches it updates in place, of which it writes the new row.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from typing import Any

LINEAR, ATTENTION, ELEMENTWISE, EMBED = "linear", "attention", "norm/rope/elementwise", "embedding/lm_head"
FAMILIES = (LINEAR, ATTENTION, ELEMENTWISE, EMBED)
_GEMM_KINDS = ("mosaic_gpu", "cublas", "cublasLt", "triton_gemm")
_NON_LAYER_PARAMS = ("state['embed']", "state['norm']", "state['lm_head']")


@dataclasses.dataclass(frozen=True)
class StepCase:
    """One compile: ``model`` (``bench.decode.models``) cut to ``layers`` layers, at ``batch``."""

    model: str
    weights: str  # "bf16" | "int4"
    batch: int
    context: int
    layers: int  # layers compiled (the model's own count when equal)
    fused: bool = False  # nybble.models.fuse_projections applied
    donate: bool = False  # the cache donated to the step
    int4_lm_head: bool = False  # int4 weights: the LM head int4 too (a QuantRule)
    attention: str = "xla"  # the decode step's attention (nybble.models.set_decode_attention)
    routing: str = "xla"  # an MoE decode token's routing (nybble.models.set_decode_routing)

    @property
    def key(self) -> str:
        tag = ("-fused" if self.fused else "") + ("-donated" if self.donate else "")
        tag += "-int4head" if self.int4_lm_head else ""
        tag += f"-{self.attention}attn" if self.attention != "xla" else ""
        tag += f"-{self.routing}route" if self.routing != "xla" and self.config().moe is not None else ""
        return f"{self.model}/{self.weights}/B{self.batch}/ctx{self.context}/L{self.layers}{tag}"

    # bench.xray.runner orders work by k * n * m (heaviest first)
    @property
    def k(self) -> int:
        from bench.decode.models import config_for

        return config_for(self.model).hidden_size

    @property
    def n(self) -> int:
        return self.layers

    @property
    def m(self) -> int:
        return self.batch

    def config(self) -> Any:
        from bench.decode.models import config_for

        return config_for(self.model, self.layers)

    def program(self) -> Any:
        from bench.decode.program import abstract_step

        return abstract_step(
            self.config(),
            self.weights,
            self.batch,
            self.context,
            fused=self.fused,
            donate=self.donate,
            int4_lm_head=self.int4_lm_head and self.weights == "int4",
            attention=self.attention,
            routing=self.routing,
        )


def active_experts(batch: int, experts: int, top_k: int) -> float:
    """Expected distinct experts ``batch`` tokens reach, each routed to ``top_k`` of ``experts`` uniformly."""
    return experts * (1.0 - (1.0 - top_k / experts) ** batch)


_THUNK = re.compile(r"^(?P<indent>\s*)(?P<id>\d+):\s+(?P<kind>k\w+)\s+\[[^\]]*\]\s*(?P<name>\S*)")


_METADATA = re.compile(r'profile_annotation: "(?P<name>[^"]*)"\s*thunk_id: (?P<id>\d+)')


def thunk_names(metadata: str) -> dict[int, str]:
    """Thunk id -> HLO name (``.`` written ``_``) from XLA's ``*.thunk_metadata.txt``. The thunk sequence
    names a custom call's thunk by its kind only (``kCustomCall``); the metadata names every thunk."""
    return {int(m["id"]): m["name"].replace(".", "_") for m in _METADATA.finditer(metadata)}


def command_buffers(thunks: str, metadata: str = "") -> dict[str, Any]:
    """XLA's thunk sequence (``*.thunk_sequence_after_thunk_passes.txt``): command buffers (CUDA graphs)
    and the launches inside them, by HLO name (``.`` written ``_`` as the thunks do): the name ``metadata``
    gives the thunk's id where it gives one (the sequence names a custom call's thunk by its kind alone, and
    a fusion's by the kernel inside it: ``sort_1_1`` for the top-k fusion ``fusion.6``), else the
    sequence's own."""
    names = thunk_names(metadata)
    captured: list[str] = []
    launched: list[str] = []  # every launch thunk's name, in or outside a command buffer
    top: dict[str, int] = {}
    for line in thunks.splitlines():
        m = _THUNK.match(line)
        if not m:
            continue
        name = names.get(int(m["id"]), m["name"])
        if m["indent"]:
            captured.append(name)
        else:
            top[m["kind"]] = top.get(m["kind"], 0) + 1
        if m["indent"] or m["kind"] != "kCommandBuffer":
            launched.append(name)
    return {
        "command_buffers": top.get("kCommandBuffer", 0),
        "captured": captured,
        "launched": launched,
        "top_level": top,
        "thunk_launches": len(launched),
    }


def _family(launch: Any, op_name: str, sources: list[str], cache_bytes: int) -> str:
    scopes = op_name.split("/")
    if not op_name and launch.kind == "copy" and launch.result_bytes % cache_bytes == 0:
        # copies of cache buffers (the cache not donated: the step returns new ones); not a fusion of no op
        # whose result is as large by chance (bf16 Qwen3-30B-A3B at batch 64: XLA's ragged_dot expanding the
        # rows over the experts, 268 MB, a layer's cache)
        return ATTENTION
    if "embedding" in scopes or "lm_head" in scopes or any(_reads_non_layer(s, sources) for s in sources):
        return EMBED
    if "attention" in scopes or any(s.startswith("cache.") for s in sources):
        return ATTENTION
    if launch.kind in _GEMM_KINDS or "dot_general" in scopes[-1] or any(_is_projection(s) for s in sources):
        return LINEAR
    return ELEMENTWISE


def _reads_non_layer(source: str, sources: list[str]) -> bool:
    """Whether reading ``source`` makes a launch part of the step's non-layer work: the final norm's and the
    LM head's parameters, and the embedding table where the gather is fused with layer 0's input norm. XLA
    may fuse the gather into another of layer 0's launches too (a residual add at batch 64): in a deeper
    layer that launch reads the residual stream instead, so it is a layer launch."""
    if source.startswith("state['embed']"):
        # layer 0's norm; a deeper one's residual add may re-read the gather too (batch 2: XLA recomputes the
        # residual stream from its parts where it fuses), a layer launch
        return any(s.startswith("state['layers'][0]['input_norm']") for s in sources)
    return source.startswith(_NON_LAYER_PARAMS)


def _is_projection(source: str) -> bool:
    """A projection's weight: a linear's kernel, an int4 weight, or the MoE router's (experts, hidden) weight
    (its product a reduction XLA names after its sum, with the norm's sum of squares: MoE.normed)."""
    weights = ("['kernel']", "['qweight']", "['router']['weight']")
    return source.startswith("state[") and any(w in source for w in weights)


def step_record(
    case: StepCase,
    program: Any,
    report: Any,
    thunks: str,
    gpu: Any,
    thunk_metadata: str = "",
    sass_by_kernel: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The worker's record of one compiled step: every launch with family, bytes, flops, issue time."""
    from bench.decode.program import param_leaves
    from bench.kernel_xray import hlo
    from nybble.quant.qweight import QuantizedWeight

    cfg = case.config()
    leaves = param_leaves(program.state)
    qweights = {name: w for name, w in leaves.items() if isinstance(w, QuantizedWeight)}
    values = hlo.entry_values(report.hlo_text)
    gathered = {
        name: {src.replace("\\'", "'"): size for src, size in reads.items()}
        for name, reads in hlo.gathered_reads(report.hlo_text).items()
    }
    graphs = command_buffers(thunks, thunk_metadata)
    captured = set(graphs["captured"])
    groups = cfg.num_heads // cfg.num_kv_heads
    moe = cfg.moe
    active = active_experts(case.batch, moe.num_experts, moe.top_k) if moe is not None else 0.0
    launches = []
    cache_bytes = case.batch * case.context * cfg.num_kv_heads * cfg.head_dim * 2
    for launch in report.launches:
        op_name = values[launch.name].op_name
        # parameter names as XLA prints them: state[\'layers\'][0]... -> state['layers'][0]...
        operands = {s.replace("\\'", "'"): v for s, v in launch.operand_bytes.items()}
        launch = dataclasses.replace(launch, operand_bytes=operands)
        sources = list(operands)
        scopes = op_name.split("/")
        bytes_, flops, issue_s = float(launch.result_bytes), 0.0, None
        if "nybble_decode_attention" in scopes:
            # its results include the caches it updates in place (aliased): it writes one row of each
            caches = sum(size for source, size in operands.items() if source.startswith("cache."))
            bytes_ += 2.0 * cache_bytes / case.context - caches
        if "dynamic_update_slice" in scopes[-1]:
            # In place: the result is the cache buffer, untouched but for the new row (read and written).
            update = sum(operands.values()) - max(operands.values())
            launches.append(_record(launch, op_name, sources, 2.0 * update, 0.0, None, captured, cache_bytes))
            continue
        for source, size in operands.items():
            gathered_rows = False
            if source.startswith("state['embed']") and "lm_head" not in scopes:
                # a gather (alone or fused into the first norm) reads one row per token, not the table
                size = size * case.batch / cfg.vocab_size
            elif source in gathered.get(launch.name, {}):
                # a fusion gathering from the operand (a float expert stack at decode: each row's
                # expert's matrix) reads the slices it gathers
                size, gathered_rows = min(size, gathered[launch.name][source]), True
            qw_name, _, part = source.rpartition(".")
            qw = qweights.get(qw_name)
            stacked = qw is not None and len(qw.codes.shape) == 3
            read = size * active / moe.num_experts if stacked and launch.kind == "mosaic_gpu" else size
            bytes_ += read
            if qw is not None and part == "codes":
                weights = 2.0 * read  # 4 bits a weight
                rows = case.batch * moe.top_k / active if stacked else case.batch
                flops += 2.0 * rows * weights
                if launch.kind == "mosaic_gpu":
                    m = case.batch * moe.top_k if stacked else case.batch
                    sass = sass_by_kernel or {}
                    issue_s = _issue_seconds(launch, op_name, qw, m, report.kernels, gpu, sass)
            elif (
                _is_projection(source) and not source.endswith(".scales") and not source.endswith(".offsets")
            ):
                leaf = leaves.get(source.removesuffix(".value"))
                stacked_f = leaf is not None and len(getattr(leaf, "shape", ())) == 3
                rows = case.batch * moe.top_k / moe.num_experts if stacked_f and moe else case.batch
                rows = 1 if gathered_rows else rows  # each gathered matrix meets its one row
                flops += 2.0 * rows * size / 2
            elif source.startswith("cache."):
                flops += 2.0 * groups * size / 2
        launches.append(_record(launch, op_name, sources, bytes_, flops, issue_s, captured, cache_bytes))
    launches = _with_further_thunks(launches, graphs["launched"])
    return {
        "launches": launches,
        "command_buffers": graphs["command_buffers"],
        "thunks_top_level": graphs["top_level"],
        "thunk_launches": graphs["thunk_launches"],
        "kernels": len(report.kernels),
    }


def _record(
    launch: Any,
    op_name: str,
    sources: list[str],
    bytes_: float,
    flops: float,
    issue_s: Any,
    captured: set,
    cache_bytes: int,
) -> dict[str, Any]:
    family = _family(launch, op_name, sources, cache_bytes)
    return {
        "name": launch.name,
        "kind": launch.kind,
        "family": family,
        "layer": family != EMBED and not _shared(op_name, sources),
        "bytes": bytes_,
        "flops": flops,
        "issue_s": issue_s,
        "in_command_buffer": launch.name.replace(".", "_") in captured,
        "op_name": op_name,
        "operand_bytes": launch.operand_bytes,
        "result_bytes": launch.result_bytes,
    }


def _with_further_thunks(launches: list[dict[str, Any]], launched: list[str]) -> list[dict[str, Any]]:
    """``launches`` with a launch more after each HLO launch XLA runs as several thunks (``launched``: the
    thunk sequence's names): a top-k over Qwen3-30B-A3B's 128 experts at batch 1 or 64 is a copy and a sort,
    two thunks of one fusion. Each further thunk costs a launch and is charged no bytes (its operands listed
    at size 0)."""
    times = Counter(launched)
    out = []
    for la in launches:
        out.append(la)
        for i in range(2, times.get(la["name"].replace(".", "_"), 1) + 1):
            zero = {source: 0 for source in la["operand_bytes"]}
            out.append(
                {**la, "name": f"{la['name']} (thunk {i})", "bytes": 0.0, "flops": 0.0, "issue_s": None,
                 "operand_bytes": zero, "result_bytes": 0}
            )  # fmt: skip
    return out


def _shared(op_name: str, sources: list[str]) -> bool:
    """Work on the position alone, computed once per step and shared by every layer: the rotary angles'
    cos and sin (XLA computes them once for all layers), and the Triton decode attention kernel's rotary
    factors (scope ``rope_factors``)."""
    scopes = op_name.split("/")
    rotary = "rope" in scopes and scopes[-1] in ("cos", "sin")
    return set(sources) <= {"position"} or rotary or "rope_factors" in scopes


def _issue_seconds(
    launch: Any, op_name: str, qw: Any, m: int, kernels: list[Any], gpu: Any, sass_by_kernel: dict[str, Any]
) -> float | None:
    """The X-ray model's issue-bound time of one nybble kernel launch of ``m`` rows: the Hopper kernel's
    (``bench.xray.model.model_case``), or on a B200 the Blackwell kernel's (``bench.xray.blackwell``: each
    role's loop read from the kernel's SASS, ``sass_by_kernel``). A stacked ``qw`` is a grouped launch, taken
    for the balanced grouping its config is chosen for, as the X-ray's MoE rows (``bench.xray.moe_cases``)."""
    from bench.xray import blackwell
    from bench.xray.launch import dense_launch
    from bench.xray.model import ceilings_for, model_case
    from bench.xray.moe_cases import MoeCase, kernel_plan
    from nybble.kernels import mosaic_gpu
    from nybble.kernels.mosaic_gpu import swiglu

    name = next((s for s in op_name.split("/") if s.startswith("nybble_")), None)
    experts = qw.codes.shape[0] if len(qw.codes.shape) == 3 else 0
    group = qw.group if qw.group < qw.padded_shape[0] else None  # None: one scale row per column
    symmetric = qw.offsets is None
    k, n = qw.shape
    launched = [dataclasses.asdict(launch)]
    if gpu.name == "b200":
        code = next((c for stem, c in sass_by_kernel.items() if name and name in stem), None)
        if code is None:
            return None
        if experts:
            case = blackwell.Case("decode", k, n, m, group, symmetric, experts=experts, tokens=m)
            plan = blackwell.grouped_plan_record(case, qw)
        else:
            plan = blackwell.dense_plan_record(blackwell.Case("decode", k, n, m), qw)
        loops = blackwell.kernel_loops(code, plan["k_steps"], plan["dequant_every"])
        if loops is None:
            return None
        record = {"case": {"m": m, "k": k, "n": n}, "report": {"launches": launched}, "plan": plan,
                  "loop": loops.per_step(plan["weights_per_thread"])}  # fmt: skip
        return blackwell.model(record, gpu)["times_us"]["issue"] * 1e-6
    kernel = next((kn for kn in kernels if name and name in kn.name and kn.loop is not None), None)
    if kernel is None:
        return None
    if experts:
        swiglu_epilogue = bool(name and name.endswith("_swiglu"))
        plan = kernel_plan(
            MoeCase("decode", k, n, m, experts, m, group, symmetric), gpu.sms, swiglu=swiglu_epilogue
        )
    else:
        # As the X-ray reads a launch; the SwiGLU epilogue's kernel from its own heuristics' pick.
        planner = swiglu.swiglu_plan if name and name.endswith("_swiglu") else mosaic_gpu.plan
        plan = dense_launch(planner(m, qw, num_sms=gpu.sms))
        k, n = qw.padded_shape
    report = {"launches": launched, "kernels": [dataclasses.asdict(kernel)]}
    t = model_case({"case": {"m": m, "k": k, "n": n}, "report": report, "plan": plan}, gpu, ceilings_for(gpu))
    return None if t["t_issue_us"] is None else t["t_issue_us"] * 1e-6


MIDDLE_LAYER = 1  # the layer a compile of 3 or more layers repeats: it has a layer before it and one after


def extrapolate(launches: list[dict[str, Any]], compiled_layers: int, layers: int) -> list[dict[str, Any]]:
    """The whole model's launches from a compile of ``compiled_layers`` layers (field ``count``: how often
    each runs a step; non-layer launches once).

    - 3 or more layers: layer 1's launches (:func:`layer_indices`) ``layers - compiled_layers + 1`` times,
      every other launch once. Layer 1 stands for every middle layer: like them it reads a residual stream a
      layer wrote and writes one a layer reads, so the fusions XLA makes across a layer boundary (the
      residual add with the next norm's sum of squares, the attention kernel summing its row) are its.
    - 1 layer: each layer launch ``layers`` times, plus the launches a one-layer compile fuses away
      (``_one_layer_missing``, read off whole compiles of small models).
    - 2 layers: each layer launch ``layers / 2`` times."""
    if compiled_layers > layers:
        raise ValueError(f"compiled {compiled_layers} layers of a {layers}-layer model")
    indices = layer_indices(launches)
    middle = compiled_layers >= 3 and compiled_layers < layers
    out = []
    for la, index in zip(launches, indices, strict=True):
        layer = la["family"] != EMBED and not _shared(la["op_name"], list(la["operand_bytes"]))
        if middle:
            repeated = layer and index == MIDDLE_LAYER
            count = float(layers - compiled_layers + 1) if repeated else 1.0
            out.append({**la, "layer": layer, "layer_index": index, "middle": repeated, "count": count})
        else:
            scale = layers / compiled_layers if layer else 1.0
            out.append({**la, "layer": layer, "layer_index": index, "count": scale})
    if compiled_layers == 1 and layers > 1:
        out += _one_layer_missing(out, layers)
    return out


_LAYER_SCOPE = re.compile(r"^layer_(\d+)$")  # Llama.hidden_states_cached's scope of each layer
_LAYER_SOURCE = re.compile(r"^(?:state\['layers'\]\[(\d+)\]|cache\.[kv]\[(\d+)\])")


def layer_indices(launches: list[dict[str, Any]]) -> list[int | None]:
    """Each launch's layer: its op's scope (``layer_i``), else the one layer whose parameters or cache it
    reads (XLA names some fusions after no op: a GEMM's, a copy's), else its predecessor's in program order
    (an op-less launch of no parameter, such as a broadcast of zeros the next launch fills); None before the
    first layer."""
    out: list[int | None] = []
    for la in launches:
        scoped = [int(m[1]) for s in la["op_name"].split("/") if (m := _LAYER_SCOPE.match(s))]
        read = {int(m[1] or m[2]) for s in la["operand_bytes"] if (m := _LAYER_SOURCE.match(s))}
        if scoped:
            out.append(scoped[-1])
        elif len(read) == 1:
            out.append(read.pop())
        else:
            out.append(out[-1] if out else None)
    return out


def _one_layer_missing(launches: list[dict[str, Any]], layers: int) -> list[dict[str, Any]]:
    """Launches a deeper model has that a one-layer compile fuses away (checked against whole compiles):

    - the next layer's input norm: layer 0's is fused with the embedding gather; each later one is a
      launch at the layer boundary, like the post-attention norm. When no layer launch follows the last
      projection (the final norm fused whole into one non-layer launch), the post-attention norm's
      launches stand for the layers - 1 boundaries: the norm, and the residual add before it where XLA
      launches that apart (at batch 64);
    - the rotary angles' cos and sin, computed once for all layers when more than one layer reads them,
      fused into their one reader otherwise.

    Each is inside a command buffer where its neighbours in a whole compile are: the input norm where the
    layer's last launch is, the angles where the step's first launch is (checked against whole compiles)."""
    extra = []
    last = max((i for i, la in enumerate(launches) if la["family"] == LINEAR and la["layer"]), default=-1)
    if not any(la["layer"] for la in launches[last + 1 :]):
        reads_post_norm = (any("['post_norm']" in s for s in la["operand_bytes"]) for la in launches)
        norm = next((i for i, reads in enumerate(reads_post_norm) if reads), None)
        if norm is not None:
            # the post-attention boundary: the launches after the attention's output projection, to its norm
            start = max((i for i in range(norm) if launches[i]["family"] == LINEAR), default=norm - 1) + 1
            # at the layer boundary, beside the layer's last launch: in a graph where that launch is
            tail = launches[max(i for i, la in enumerate(launches) if la["layer"])]
            for i in range(start, norm + 1):
                name = "input_norm" if i == norm else launches[i]["name"]
                extra.append(
                    {**launches[i], "name": f"{name} (layers 1..)", "count": float(layers - 1),
                     "inserted": True, "in_command_buffer": tail["in_command_buffer"]}
                )  # fmt: skip
    if not any(_shared(la["op_name"], list(la["operand_bytes"])) for la in launches):
        for fn in ("cos", "sin"):  # at the step's start, in a graph where its first launch is
            extra.append(
                {"name": f"rope {fn} (shared)", "kind": "fusion", "family": ELEMENTWISE, "layer": False,
                 "bytes": 0.0, "flops": 0.0, "issue_s": None,
                 "in_command_buffer": bool(launches) and launches[0]["in_command_buffer"],
                 "op_name": f"rope/{fn}", "operand_bytes": {}, "result_bytes": 0, "count": 1.0,
                 "inserted": True}
            )  # fmt: skip
    return extra


def totals(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """Launches and bytes per step, by family and in all (weighted by ``count``)."""
    out: dict[str, Any] = {f: {"launches": 0.0, "bytes": 0.0} for f in FAMILIES}
    for la in launches:
        c = la.get("count", 1.0)
        out[la["family"]]["launches"] += c
        out[la["family"]]["bytes"] += c * la["bytes"]
    out["launches"] = sum(out[f]["launches"] for f in FAMILIES)
    out["bytes"] = sum(out[f]["bytes"] for f in FAMILIES)
    out["in_command_buffers"] = sum(la.get("count", 1.0) for la in launches if la["in_command_buffer"])
    return out


def round_count(x: float) -> int:
    """A launch count from a weighted sum (whole numbers when the layers scale exactly)."""
    return math.floor(x + 0.5)
