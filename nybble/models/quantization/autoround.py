"""Learned rounding through a whole Flax NNX model, one transformer block at a time.

``quantize_autoround`` runs the calibration tokens through the model once, eagerly, like GPTQ's
``quantize_gptq``, but the unit is a *block* (an element of an ``nnx.List`` of modules holding chosen
``nnx.Linear`` layers: ``layers.{i}`` of ``nybble.models.definitions.llama.Llama``). Each block is swapped
for a stub;
when the forward pass reaches it with its inputs ``(x, *args)`` (the outputs of the blocks before it,
already quantized), the stub

1. computes the target: the float block's output on the *float* model's hidden states (the float output of
   the block before, carried along) when the block's input is the previous block's output, else on ``x``;
2. picks starting codes: round to nearest, or GPTQ (``start="gptq"``: each Linear of the block GPTQ-quantized
   on the inputs it sees inside the block, in order, as ``quantize_gptq`` does);
3. learns codes and group parameters with :func:`nybble.quant.autoround.autoround_block` (the block as a pure
   function of its ``nnx.State``, mini-batches of calibration sequences), never worse than the start on
   the block's calibration loss;
4. puts ``QLinear`` layers into the block, the block back into the model, and returns the quantized block's
   output, which the next block receives.

With ``end_to_end_epochs`` > 0 (an ``AutoRoundConfig`` field), the float model's logits on the calibration
windows are taken first, and after the last block every group's scale (and offset) is tuned through the
whole model against them, codes fixed (``nybble.models.quantization.tune``): kept only if the whole model's
KL divergence
from the float model over the calibration tokens drops.

Memory: one block's calibration inputs, targets and parameters. A block's result is final when the next one
starts: if a later block fails, the earlier ones keep their quantized layers and the rest is restored float.
Deterministic: block i draws its mini-batches from ``seed + i``. Chosen layers outside any block (an LM head
``hidden_states`` never reaches) are quantized round to nearest and reported so.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from nybble.models.definitions.layers import QLinear
from nybble.models.quantization.calibrate import (
    _default_forward,
    calibration_batches,
    capture_pass,
    finish_report,
)
from nybble.models.quantization.quant_plan import (
    PlannedLayer,
    QuantizationReport,
    path_str,
    plan_quantization,
)
from nybble.models.quantization.rules import QuantRule
from nybble.models.quantization.tune import float_logits, tune_group_params
from nybble.quant.autoround import AutoRoundConfig, WeightSpec, autoround_block, block_loss, resolve_config
from nybble.quant.gptq import gptq, hessian_from_inputs
from nybble.quant.qformat import FIELDS, QuantFormat, with_fields
from nybble.quant.refit import refit_group_params

__all__ = ["autoround_params", "find_blocks", "quantize_autoround"]

STARTS = ("rtn", "gptq")
TARGETS = ("float", "own")
_APPLY: dict[Any, tuple[Callable[..., Any], Callable[..., Any]]] = {}


def _apply_fn(graphdef: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """One pure function (and its jit) per block structure, so that jit's cache serves every block."""
    if graphdef not in _APPLY:

        def apply(state: Any, *inputs: Any) -> Any:
            return nnx.merge(graphdef, state)(*inputs)

        _APPLY[graphdef] = (apply, jax.jit(apply))
    return _APPLY[graphdef]


@dataclasses.dataclass
class _Block:
    path: str
    parent: Any
    key: int
    module: nnx.Module
    layers: list[PlannedLayer]


def find_blocks(model: nnx.Module, chosen: Sequence[PlannedLayer]) -> list[_Block]:
    """The outermost list elements (``layers.3``) holding chosen Linear layers, in model order."""
    modules = {tuple(p): m for p, m in nnx.iter_modules(model)}
    blocks: dict[str, _Block] = {}
    for pl in chosen:
        for p, m in modules.items():
            path = path_str(p)
            if p and isinstance(p[-1], int) and pl.path.startswith(path + "."):
                if path not in blocks:
                    blocks[path] = _Block(path, modules.get(p[:-1], None), p[-1], m, [])
                blocks[path].layers.append(pl)
                break
    for b in blocks.values():
        if b.parent is None:  # a list held directly by a plain container: find the list object
            raise ValueError(f"autoround: block {b.path} is not held by an NNX module or list")
    return list(blocks.values())


class _BlockStub:
    """Stands in for one block during the calibration pass; quantizes it on its first call."""

    def __init__(self, block: _Block, run: Callable[[_Block, tuple[Any, ...]], Any]):
        self.block = block
        self.run = run
        self.done = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"autoround: block {self.block.path} was called with keyword arguments "
                f"{sorted(kwargs)}; blocks must take positional (batched) arguments only"
            )
        if self.done:
            return self.block.module(*args)
        out = self.run(self.block, args)
        self.done = True
        self.block.parent[self.block.key] = self.block.module
        return out


def quantize_autoround(
    model: nnx.Module,
    *,
    calibration: Any,
    rules: Sequence[QuantRule] | None = None,
    format: QuantFormat | None = None,
    seq_len: int = 256,
    config: AutoRoundConfig | str = "default",
    start: str = "rtn",
    target: str = "float",
    refit_scales: bool = False,
    forward: Callable[[nnx.Module, jax.Array], Any] | None = None,
    progress: bool = True,
    verbose: bool = False,
    return_report: bool = False,
    **config_options: Any,
) -> nnx.Module | tuple[nnx.Module, QuantizationReport]:
    """Learned-rounding int4 for the ``nnx.Linear`` layers of ``model``, in place (module docstring).

    Args:
      model: a Flax NNX model whose blocks sit in an ``nnx.List`` and are called as ``block(x, *args)``,
        every argument batched on axis 0 (``nybble.models.definitions.llama.Llama``).
      calibration: token ids, (batch, length) or a 1-D stream (cut into ``seq_len`` windows); every
        window is one calibration sample.
      rules: layer selection, as ``nybble.models.quantize``.
      format: the stored format (``nybble.QuantFormat``; default ``QuantFormat()``); its fields may be
        given as keywords instead (``group_size=``, ``symmetric=``, ``scale_dtype=``, ``zero_point=``:
        "integer" gives asymmetric layers integer zero points, kept through learning and refits).
      config: an ``AutoRoundConfig`` or a preset name (``"default"``, ``"fast"``); ``**config_options``
        (those not the format's) override its fields (``steps=``, ``lr=``, ``batch_size=``, ``seed=``,
        ``end_to_end_epochs=``, ...).
        ``start="gptq", steps=0, end_to_end_epochs=4``: GPTQ's codes with end-to-end scales, the most
        accurate recipe measured at g128 symmetric (README, Accuracy).
      start: starting codes, ``"rtn"`` (round to nearest) or ``"gptq"``.
      target: ``"float"``: each block fits the float model's output of that block; ``"own"``: the float
        block's output on the (quantized model's) inputs it receives.
      refit_scales: after learning, re-solve each layer's scales by least squares on the inputs it sees in
        the quantized block (``nybble.quant.refit``), kept only if the block's calibration loss drops.
      forward, progress, verbose, return_report: as ``quantize_gptq``.
    """
    if calibration is None:
        raise ValueError(
            "quantize_autoround: method='autoround' needs calibration= token ids (e.g. the calib split)"
        )
    fmt = with_fields(format, {k: v for k, v in config_options.items() if k in FIELDS}, "quantize_autoround")
    config_options = {k: v for k, v in config_options.items() if k not in FIELDS}
    if start not in STARTS:
        raise ValueError(f"quantize_autoround: start must be one of {STARTS}, got {start!r}")
    if target not in TARGETS:
        raise ValueError(f"quantize_autoround: target must be one of {TARGETS}, got {target!r}")
    config = resolve_config(config, **config_options)
    ids = calibration_batches(calibration, seq_len)
    planned, unmatched = plan_quantization(
        model, rules=rules, group_size=fmt.group_size, symmetric=fmt.symmetric
    )
    report = QuantizationReport(unmatched_rules=unmatched, method="autoround")
    chosen = [pl for pl in planned if pl.decision.quantize]
    blocks = find_blocks(model, chosen)
    bar = tqdm(
        total=len(blocks) * config.steps,
        desc="nybble: AutoRound",
        unit="step",
        disable=not progress,
        leave=False,
    )
    results: dict[str, QLinear | None] = {}
    carry: dict[str, Any] = {}  # the last block's (quantized output, float output)
    log: list[str] = []

    def run_block(block: _Block, args: tuple[Any, ...]) -> Any:
        index = blocks.index(block)
        x = args[0]
        graphdef, state = nnx.split(block.module)
        apply, apply_jit = _apply_fn(graphdef)
        x_float = carry["float"] if target == "float" and carry.get("out") is x else x
        goal = _batched(apply_jit, state, (x_float, *args[1:]))
        names = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        weights, by_leaf = {}, {}
        for pl in block.layers:
            rel = pl.path[len(block.path) + 1 :]
            leaf = next(n for n in names if n.startswith(rel + ".kernel"))
            weights[leaf] = WeightSpec.of(pl.decision.applied_to(fmt))
            by_leaf[leaf] = pl
        starts = _gptq_start(block, args, by_leaf, fmt) if start == "gptq" else None
        done = index * config.steps

        def callback(steps: int, loss: float) -> None:
            bar.n = done + steps
            bar.set_postfix_str(f"{block.path} loss {loss:.4g}", refresh=False)
            bar.refresh()

        res = autoround_block(
            apply,
            state,
            weights,
            list(args),
            goal,
            config=dataclasses.replace(config, seed=config.seed + index),
            start=starts,
            scale_dtype=fmt.scale_dtype,
            layout=fmt.layout,
            callback=callback,
        )
        chosen_weights, loss = dict(res.weights), res.loss
        if refit_scales:
            refit = _refit_in_block(block, args, by_leaf, chosen_weights, fmt.zero_point)
            refit_loss = block_loss(apply, state, refit, list(args), goal, loss=config.loss)
            if refit_loss < loss:
                chosen_weights, loss = refit, refit_loss
        log.append(
            f"{block.path}: loss {res.loss_start:.4g} -> {loss:.4g}"
            + ("" if res.learned else " (start kept)")
            + (" (least-squares scales)" if loss < res.loss else "")
        )
        for leaf, qw in chosen_weights.items():
            pl = by_leaf[leaf]
            results[pl.path] = QLinear.from_linear(pl.linear, qweight=qw)
            pl.replace(results[pl.path])
        out = block.module(*args)  # the quantized block
        carry.update(out=out, float=goal)
        return out

    # The float model's logits, before any block changes: the end-to-end stage's target.
    teacher = float_logits(model, ids) if config.end_to_end_epochs else None
    stubs = [_BlockStub(b, run_block) for b in blocks]
    t0 = time.perf_counter()
    try:
        for s in stubs:
            s.block.parent[s.block.key] = s
        jax.block_until_ready(jax.tree.leaves((forward or _default_forward)(model, ids)))
    finally:
        for s in stubs:  # blocks the pass did not finish get their float module back
            if not s.done:
                s.block.parent[s.block.key] = s.block.module
                for pl in s.block.layers:
                    pl.replace(pl.linear)
        bar.close()
    finish_report(report, planned, results, fmt, missed="outside the calibrated blocks")
    if teacher is not None:
        tuned = tune_group_params(
            model, ids, teacher, epochs=config.end_to_end_epochs, lr=config.end_to_end_lr,
            seed=config.seed, progress=progress,
        )  # fmt: skip
        log.append(
            f"end to end: KL {tuned.loss_start:.4g} -> {tuned.loss:.4g} over {tuned.steps} steps"
            + ("" if tuned.kept else " (not kept)")
        )
    elapsed = time.perf_counter() - t0
    if verbose:
        print(report.summary())
        print("\n".join("  " + line for line in log))
        print(
            f"  AutoRound calibration: {ids.size} tokens ({ids.shape[0]} x {ids.shape[1]}), {elapsed:.1f} s"
        )
    return (model, report) if return_report else model


def _batched(fn: Callable[..., Any], state: Any, inputs: tuple[Any, ...], batch: int = 4) -> Any:
    """``fn(state, *inputs)`` over the samples in chunks of ``batch`` (one compiled shape at most two)."""
    n = inputs[0].shape[0]
    parts = [fn(state, *(x[i : i + batch] for x in inputs)) for i in range(0, n, batch)]
    return jax.tree.map(lambda *p: jnp.concatenate(p), *parts)


def _refit_in_block(
    block: _Block, args: tuple[Any, ...], by_leaf: dict[str, PlannedLayer], weights: dict,
    zero_point: str = "float",
) -> dict:  # fmt: skip
    """``weights`` with least-squares scales, each layer's Hessian taken inside the quantized block."""
    path_leaf = {pl.path: leaf for leaf, pl in by_leaf.items()}
    found: dict[str, Any] = {}
    for leaf, pl in by_leaf.items():
        pl.replace(QLinear.from_linear(pl.linear, qweight=weights[leaf]))

    def refit_layer(pl: PlannedLayer, x: jax.Array) -> QLinear:
        leaf = path_leaf[pl.path]
        found[leaf] = refit_group_params(
            weights[leaf], pl.linear.kernel[...], hessian_from_inputs(x), zero_point=zero_point
        )
        return QLinear.from_linear(pl.linear, qweight=found[leaf])

    try:
        capture_pass(list(by_leaf.values()), refit_layer, lambda: block.module(*args))
    finally:
        for pl in by_leaf.values():
            pl.replace(pl.linear)
    return {leaf: found.get(leaf, qw) for leaf, qw in weights.items()}


def _gptq_start(
    block: _Block, args: tuple[Any, ...], by_leaf: dict[str, PlannedLayer], fmt: QuantFormat
) -> dict:
    """GPTQ codes for the block's Linear layers, each calibrated on its inputs inside the block."""
    found: dict[str, Any] = {}

    def quantize_layer(pl: PlannedLayer, x: jax.Array) -> QLinear:
        qw = gptq(pl.linear.kernel[...], inputs=x, format=pl.decision.applied_to(fmt), act_order=True)
        found[pl.path] = qw
        return QLinear.from_linear(pl.linear, qweight=qw)

    capture_pass(list(by_leaf.values()), quantize_layer, lambda: block.module(*args))
    for pl in by_leaf.values():  # back to float: the learned codes go in later
        pl.replace(pl.linear)
    return {leaf: found[pl.path] for leaf, pl in by_leaf.items() if pl.path in found}


def autoround_params(
    params: Any,
    apply_fn: Callable[..., Any] | None,
    calibration: Any,
    chosen: dict[str, tuple[int | None, bool]],
    *,
    scale_dtype: Any = jnp.bfloat16,
    config: AutoRoundConfig | str = "default",
    progress: bool = True,
    **config_options: Any,
) -> dict[str, Any]:
    """Learned rounding of the ``chosen`` leaves (``{leaf path: (group_size, symmetric)}``) of a params
    pytree against ``apply_fn(params, *calibration)``, the whole function as one block.

    ``calibration``: one input array or a tuple/list of them, calibration samples on axis 0. Returns
    ``{leaf path: QuantizedWeight}`` (``nybble.models.quantize_params(method="autoround")`` calls this).
    """
    if not callable(apply_fn):
        raise ValueError("quantize_params: method='autoround' needs apply_fn=, a function (params, *inputs)")
    if calibration is None:
        raise ValueError(
            "quantize_params: method='autoround' needs calibration= input array(s), samples on axis 0"
        )
    inputs = list(calibration) if isinstance(calibration, tuple | list) else [calibration]
    config = resolve_config(config, **config_options)
    if not chosen:
        return {}
    goal = apply_fn(params, *inputs)
    bar = tqdm(total=config.steps, desc="nybble: AutoRound", unit="step", disable=not progress, leave=False)

    def callback(steps: int, loss: float) -> None:
        bar.n = steps
        bar.set_postfix_str(f"loss {loss:.4g}", refresh=False)
        bar.refresh()

    weights = {name: WeightSpec(g, sym) for name, (g, sym) in chosen.items()}
    try:
        res = autoround_block(
            apply_fn, params, weights, inputs, goal, config=config, scale_dtype=scale_dtype, callback=callback
        )
    finally:
        bar.close()
    return res.weights
