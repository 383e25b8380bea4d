"""GPTQ through a whole Flax NNX model: every ``nnx.Linear`` calibrated on the inputs it really sees.

``quantize_gptq`` runs the calibration tokens through the model once, eagerly. Each ``nnx.Linear`` chosen
by the rules is first swapped for a capture stub; when the forward pass reaches it, the stub receives the
layer's whole calibration input ``x`` (all sequences at once), computes the Hessian ``2 X^T X / n``, runs
:func:`nybble.quant.gptq.gptq` on the layer's kernel, puts the resulting ``QLinear`` in the stub's place
and returns ``QLinear(x)``. Later layers therefore see the outputs of already-quantized layers, within a
block too (q/k/v, then o; gate/up, then down): the "true sequential" order of the GPTQ paper, for the
cost of one forward pass. Memory is one layer's activations plus one (K, K) Hessian; nothing is cached
across layers.

Requirements: the model's forward must run eagerly (not under ``nnx.jit``) and call its Linear modules
through their attributes, as ``nybble.models.definitions.llama.Llama`` does. A chosen layer the forward never
reaches (e.g. an LM head the ``forward`` skips) is quantized round-to-nearest and reported as such.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from nybble.models.definitions.layers import QLinear
from nybble.models.definitions.moe import Experts, QExperts, expert_stacks, num_weights
from nybble.models.quantization.experts import ExpertCapture
from nybble.models.quantization.quant_plan import (
    PlannedLayer,
    QuantizationReport,
    array_nbytes,
    plan_quantization,
)
from nybble.models.quantization.rules import QuantRule, check_rules, decide
from nybble.quant.gptq import gptq
from nybble.quant.qformat import FIELDS, QuantFormat, with_fields
from nybble.quant.rtn import quantize


def calibration_batches(calibration: Any, seq_len: int = 256) -> jax.Array:
    """Token ids as a (batch, length) int32 array: 2-D kept, 1-D cut into ``seq_len`` windows."""
    ids = np.asarray(calibration)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"calibration: expected integer token ids, got dtype {ids.dtype.name}")
    if ids.ndim == 1:
        n = ids.size // seq_len
        if n == 0:
            raise ValueError(f"calibration: {ids.size} tokens are fewer than one window of seq_len={seq_len}")
        ids = ids[: n * seq_len].reshape(n, seq_len)
    if ids.ndim != 2 or ids.size == 0:
        raise ValueError(f"calibration: expected (batch, length) or a 1-D token stream, got {ids.shape}")
    return jnp.asarray(ids, jnp.int32)


def _default_forward(model: nnx.Module, ids: jax.Array) -> Any:
    # The final hidden states are enough to reach every block; skipping the (tied) LM head saves a
    # (tokens x vocab) logits array.
    fn = getattr(model, "hidden_states", None)
    return fn(ids) if callable(fn) else model(ids)


class _Capture:
    """Stands in for one ``nnx.Linear`` during the calibration pass; GPTQ-quantizes it on first call."""

    def __init__(self, planned: PlannedLayer, quantize_fn: Callable[[PlannedLayer, jax.Array], QLinear]):
        self.planned = planned
        self.quantize_fn = quantize_fn
        self.result: QLinear | None = None

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.result is None:
            self.result = self.quantize_fn(self.planned, x)
            self.planned.replace(self.result)
        return self.result(x)


def capture_pass(
    chosen: Sequence[PlannedLayer],
    quantize_fn: Callable[[PlannedLayer, jax.Array], QLinear],
    run: Callable[[], Any],
) -> list[_Capture]:
    """Runs ``run()`` (a forward pass) with each chosen ``nnx.Linear`` replaced by a capture stub that
    quantizes it with ``quantize_fn(planned, x)`` on its first call; returns the captures (``.result``:
    the new ``QLinear``, or None for a layer the pass never reached, which is left as it was). On an
    error, the layers already quantized stay quantized and every other one gets its ``nnx.Linear`` back.
    """
    captures = [_Capture(pl, quantize_fn) for pl in chosen]
    try:
        for c in captures:
            c.planned.replace(c)
        jax.block_until_ready(jax.tree.leaves(run()))
    finally:
        for c in captures:  # put back whatever the pass did not reach (or all of it, on an error)
            if c.result is None:
                c.planned.replace(c.planned.linear)
    return captures


def finish_report(
    report: QuantizationReport,
    planned: Sequence[PlannedLayer],
    results: dict[str, QLinear | None],
    format: QuantFormat,
    missed: str = "not reached by the calibration forward pass",
) -> None:
    """Appends every planned layer to ``report``; a chosen layer whose result is None (never calibrated)
    is quantized round-to-nearest in place now, in ``format`` as its rules adjust it, and reported with the
    reason ``missed``."""
    for pl in planned:
        d = pl.decision
        if not d.quantize:
            report.add(pl.path, pl.shape, d, pl.nbytes)
            continue
        result, reason = results.get(pl.path), ""
        if result is None:
            qweight = quantize(pl.linear.kernel[...], d.applied_to(format))
            result = QLinear.from_linear(pl.linear, qweight=qweight)
            pl.replace(result)
            reason = f"{missed}: round-to-nearest"
        report.add(pl.path, pl.shape, d, pl.nbytes, result.weight, reason)


def quantize_gptq(
    model: nnx.Module,
    *,
    calibration: Any,
    rules: Sequence[QuantRule] | None = None,
    format: QuantFormat | None = None,
    seq_len: int = 256,
    act_order: bool = True,
    forward: Callable[[nnx.Module, jax.Array], Any] | None = None,
    progress: bool = True,
    verbose: bool = False,
    return_report: bool = False,
    **options: Any,
) -> nnx.Module | tuple[nnx.Module, QuantizationReport]:
    """GPTQ-quantizes the ``nnx.Linear`` layers of ``model`` in place (see the module docstring).

    Args:
      model: a Flax NNX model; its chosen ``nnx.Linear`` layers become ``QLinear``.
      calibration: token ids, (batch, length) or a 1-D stream (cut into ``seq_len`` windows). All of
        it goes through the model in one eager forward pass: a few thousand tokens is typical.
      rules: layer selection, as ``nybble.models.quantize``.
      format: the stored format (``nybble.QuantFormat``; default ``QuantFormat()``); its fields may be
        given as keywords instead (``group_size=``, ``symmetric=``, ``scale_dtype=``, ``zero_point=``...),
        overriding ``format``'s. Every layer and expert gets it, calibrated or not, as the rules adjust it.
      seq_len: window length when ``calibration`` is a 1-D stream.
      act_order: quantize each layer's inputs by decreasing Hessian diagonal, with static groups (see
        ``nybble.quant.gptq``): free at run time (a natural-order ``QuantizedWeight``) and clearly
        better on SmolLM2-135M (g128 sym eval perplexity 61.7 vs 66.5 in natural order, both without
        scale refit; float 46.8, round-to-nearest 75.4), hence the default.
      forward: ``forward(model, ids)`` runs the model (default: ``model.hidden_states(ids)`` if the
        model has it, else ``model(ids)``).
      progress: a tqdm bar over the layers as they are quantized.
      verbose: print the report summary.
      return_report: return ``(model, report)``.
      **options: the format's fields (above), and options of :func:`nybble.quant.gptq.gptq`
        (``refit_scales``, on by default: least-squares scales for the chosen codes; ``damp``,
        ``block_size``, ``static_groups``, ``clip_search``).
    """
    if calibration is None:
        raise ValueError("quantize_gptq: method='gptq' needs calibration= token ids (e.g. the calib split)")
    allowed = {"damp", "block_size", "static_groups", "clip_search", "refit_scales", *FIELDS}
    bad = set(options) - allowed
    if bad:
        raise TypeError(f"quantize_gptq: unexpected keyword argument(s) {sorted(bad)}")
    fmt = with_fields(format, {k: v for k, v in options.items() if k in FIELDS}, "quantize_gptq")
    gptq_kwargs = {k: v for k, v in options.items() if k not in FIELDS}
    gptq_kwargs["act_order"] = act_order
    ids = calibration_batches(calibration, seq_len)
    planned, unmatched = plan_quantization(
        model, rules=rules, group_size=fmt.group_size, symmetric=fmt.symmetric
    )
    report = QuantizationReport(unmatched_rules=unmatched, method="gptq")
    chosen = [pl for pl in planned if pl.decision.quantize]
    bar = tqdm(total=len(chosen), desc="nybble: GPTQ", unit="layer", disable=not progress, leave=False)
    tokens = int(ids.size)

    def quantize_layer(pl: PlannedLayer, x: jax.Array) -> QLinear:
        d = pl.decision
        qw = gptq(pl.linear.kernel[...], inputs=x, format=d.applied_to(fmt), **gptq_kwargs)
        bar.set_postfix_str(pl.path, refresh=False)
        bar.update()
        return QLinear.from_linear(pl.linear, qweight=qw)

    # MoE expert stacks (nybble.models.definitions.moe): GPTQ per expert on the tokens routed to it, in the
    # same pass.
    expert_captures = _install_expert_captures(model, rules, fmt, gptq_kwargs)
    start = time.perf_counter()
    try:
        captures = capture_pass(chosen, quantize_layer, lambda: (forward or _default_forward)(model, ids))
    finally:
        bar.close()
        for c in expert_captures:  # a stack the pass never reached gets its float Experts back
            if c.result is None:
                setattr(c.parent, c.attr, c.experts)
    elapsed = time.perf_counter() - start

    _report_experts(report, expert_captures)
    finish_report(report, planned, {c.planned.path: c.result for c in captures}, fmt)
    if verbose:
        print(report.summary())
        print(f"  GPTQ calibration: {tokens} tokens ({ids.shape[0]} x {ids.shape[1]}), {elapsed:.1f} s")
    return (model, report) if return_report else model


def _install_expert_captures(
    model: nnx.Module, rules: Any, fmt: QuantFormat, gptq_kwargs: dict[str, Any]
) -> list[Any]:
    """An ``ExpertCapture`` in place of every float expert stack the rules choose; the others' decisions
    are recorded on the returned list (``.result`` None and ``.decision.quantize`` False)."""
    out = []
    for path, parent, attr, module in expert_stacks(model):
        if not isinstance(module, Experts):
            continue
        d = decide(
            path, num_weights(module), check_rules(rules), group_size=fmt.group_size, symmetric=fmt.symmetric
        )
        c = ExpertCapture(path, parent, attr, module, d, d.applied_to(fmt), gptq_kwargs)
        if d.quantize:
            setattr(parent, attr, c)
        out.append(c)
    return out


def _report_experts(report: QuantizationReport, captures: Sequence[Any]) -> None:
    """Records each expert stack; one the pass never reached is rounded to nearest now."""
    for c in captures:
        shape, before = tuple(c.experts.kernel.shape), array_nbytes(c.experts.kernel)
        if not c.decision.quantize:
            report.add(c.path, shape, c.decision, before)
            continue
        reason = ""
        if c.result is None:
            c.result = QExperts.from_experts(c.experts, c.format)
            setattr(c.parent, c.attr, c.result)
            reason = "not reached by the calibration forward pass: round-to-nearest"
        elif c.unrouted:
            reason = f"experts {c.unrouted} got no calibration tokens: round-to-nearest for them"
        report.add(c.path, shape, c.decision, before, c.result.weight, reason)


__all__ = ["calibration_batches", "capture_pass", "finish_report", "quantize_gptq"]
