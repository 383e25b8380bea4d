"""Swap a model's dense layers for int4 ones: ``quantize`` (Flax NNX) and ``quantize_params`` (pytrees)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from nybble.models.autoround import autoround_params, quantize_autoround
from nybble.models.calibrate import quantize_gptq
from nybble.models.layers import QLinear
from nybble.models.moe import expert_stacks, quantize_expert_stacks
from nybble.models.plan import (
    LayerReport,
    QuantizationReport,
    array_nbytes,
    check_not_quantized,
    path_str,
    plan_quantization,
)
from nybble.models.rules import Decision, QuantRule, check_rules, decide, warn_unmatched
from nybble.packing import check_group_size
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.rtn import quantize as quantize_weight

METHODS = ("rtn", "gptq", "autoround")
# Options of nybble.quantize that method="rtn" passes through.
RTN_OPTIONS = frozenset({"clip_search", "zero_point"})


@overload
def quantize(model: nnx.Module, *, return_report: Literal[False] = ..., **options: Any) -> nnx.Module: ...


@overload
def quantize(
    model: nnx.Module, *, return_report: Literal[True], **options: Any
) -> tuple[nnx.Module, QuantizationReport]: ...


def quantize(
    model: nnx.Module,
    *,
    group_size: int | None = 128,
    symmetric: bool = True,
    rules: Sequence[QuantRule] | None = None,
    method: str = "rtn",
    calibration: Any = None,
    scale_dtype: Any = jnp.bfloat16,
    progress: bool = True,
    verbose: bool = False,
    return_report: bool = False,
    **method_options: Any,
) -> nnx.Module | tuple[nnx.Module, QuantizationReport]:
    """Replaces the ``nnx.Linear`` layers of a Flax NNX model by int4 :class:`QLinear` layers, in place.

    Only ``nnx.Linear`` is swapped: embeddings (and an LM head tied to them), norms and other layers stay
    in float. An untied LM head (a Linear named ``lm_head``/``head``/``output``/``classifier``) stays in
    float too, unless a rule of the caller matches it first.

    Args:
      model: the NNX model; modified in place and returned.
      group_size, symmetric: defaults for every layer (see :func:`nybble.quantize`).
      rules: ``QuantRule`` list over dotted module paths (``"layers.0.mlp.up_proj"``), first match wins;
        searched before ``DEFAULT_RULES``. A rule that matches no layer is reported with a warning.
      method: ``"rtn"`` (round to nearest) or a calibrated method, ``"gptq"`` or ``"autoround"``
        (learned rounding, block by block), delegated to ``nybble.models.calibrate.quantize_gptq`` or
        ``nybble.models.autoround.quantize_autoround`` with ``calibration`` data.
      scale_dtype: dtype of the stored scales (bf16 by default).
      progress: show a tqdm progress bar over layers.
      verbose: print the :class:`QuantizationReport` summary at the end.
      return_report: return ``(model, report)`` instead of the model alone.
      **method_options: ``clip_search`` (both methods: per group, the range shrink with the least
        squared error), and for GPTQ ``act_order``, ``refit_scales``, ``damp``, ``block_size``,
        ``static_groups``, ``seq_len`` (see ``nybble.models.calibrate.quantize_gptq``); for AutoRound
        ``config`` (a preset name or ``AutoRoundConfig``), its fields (``steps``, ``lr``, ...), ``start``,
        ``target``, ``refit_scales``, ``seq_len`` (see ``nybble.models.autoround.quantize_autoround``).
    """
    if method not in METHODS:
        raise ValueError(f"nybble.models.quantize: unknown method {method!r}; choose one of {METHODS}")
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"nybble.models.quantize expects a flax.nnx.Module, got {type(model).__name__}; "
            f"for a params pytree use nybble.models.quantize_params"
        )
    if isinstance(model, nnx.Linear):
        raise TypeError(
            "nybble.models.quantize: got a bare nnx.Linear; use QLinear.from_linear(linear) to quantize "
            "a single layer"
        )
    if method != "rtn":
        calibrated = quantize_gptq if method == "gptq" else quantize_autoround
        return calibrated(
            model,
            calibration=calibration,
            rules=rules,
            group_size=group_size,
            symmetric=symmetric,
            scale_dtype=scale_dtype,
            progress=progress,
            verbose=verbose,
            return_report=return_report,
            **method_options,
        )
    if calibration is not None:
        raise ValueError(
            "nybble.models.quantize: calibration data is only used by the calibrated methods "
            "('gptq', 'autoround')"
        )
    if bad := sorted(set(method_options) - RTN_OPTIONS):
        raise TypeError(
            f"nybble.models.quantize: options {bad} belong to calibrated methods; method='rtn' takes "
            f"{sorted(RTN_OPTIONS)}"
        )
    planned, _ = plan_quantization(
        model, rules=rules, group_size=group_size, symmetric=symmetric, warn=False
    )
    stacks = expert_stacks(model)  # MoE expert stacks (nybble.models.moe): quantized per expert, stacked
    unmatched = warn_unmatched(
        check_rules(rules),
        [pl.path for pl in planned] + [s[0] for s in stacks],
        "nnx.Linear layer or expert stack" if stacks else "nnx.Linear layer",
    )
    report = QuantizationReport(unmatched_rules=unmatched, method=method)
    quantize_expert_stacks(
        stacks, rules, group_size=group_size, symmetric=symmetric, scale_dtype=scale_dtype, report=report,
        **method_options,
    )
    for pl in tqdm(planned, desc="nybble: quantizing", unit="layer", disable=not progress, leave=False):
        d = pl.decision
        if not d.quantize:
            report.add(pl.path, pl.shape, d, pl.nbytes)
            continue
        qweight = quantize_weight(
            pl.linear.kernel[...],
            group_size=d.group_size,
            symmetric=d.symmetric,
            scale_dtype=scale_dtype,
            **method_options,
        )
        pl.replace(QLinear.from_linear(pl.linear, qweight=qweight))
        report.add(pl.path, pl.shape, d, pl.nbytes, qweight)
    if verbose:
        print(report.summary())
    return (model, report) if return_report else model


def _is_kernel(path: Sequence[Any], leaf: Any) -> bool:
    if not path or path_str(path[-1:]) != "kernel" or isinstance(leaf, QuantizedWeight):
        return False
    return getattr(leaf, "ndim", 0) == 2 and jnp.issubdtype(leaf.dtype, jnp.floating)


def quantize_params(
    params: Any,
    *,
    rules: Sequence[QuantRule] | None = None,
    group_size: int | None = 128,
    symmetric: bool = True,
    scale_dtype: Any = jnp.bfloat16,
    return_report: bool = False,
    method: str = "rtn",
    calibration: Any = None,
    apply_fn: Callable[..., Any] | None = None,
    progress: bool = True,
    **method_options: Any,
) -> Any:
    """Quantizes the 2-D float ``kernel`` leaves of a params pytree (Linen or hand-written).

    Rules match the dotted path of the kernel's parent (``"params.Dense_0"`` for
    ``params["params"]["Dense_0"]["kernel"]``). Quantized kernels become ``QuantizedWeight`` leaves, which
    :func:`dense` and :class:`QDense` multiply with; every other leaf is kept. Returns a new pytree (and a
    :class:`QuantizationReport` when ``return_report``).

    ``method="rtn"`` rounds to nearest. ``method="autoround"`` learns the rounding of every chosen kernel
    at once against the output of ``apply_fn(params, *calibration)`` (``calibration``: one input array or
    a tuple of them, samples on axis 0), treating the whole function as one block (memory: all of it;
    see ``nybble.models.autoround.autoround_params``); ``**method_options`` are ``AutoRoundConfig``
    fields or ``config=``.
    """
    if method not in ("rtn", "autoround"):
        raise ValueError(f"quantize_params: method must be 'rtn' or 'autoround', got {method!r}")
    if method == "rtn" and (calibration is not None or apply_fn is not None or method_options):
        raise ValueError(
            "quantize_params: calibration=, apply_fn= and options are only used by method='autoround'"
        )
    rules = check_rules(rules)
    check_group_size(group_size)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )
    decisions: dict[int, tuple[str, Decision]] = {}  # leaf index -> (path of the kernel's parent, decision)
    for i, (p, leaf) in enumerate(leaves):
        if _is_kernel(p, leaf):
            path = path_str(p[:-1])
            decisions[i] = (path, decide(path, leaf.size, rules, group_size=group_size, symmetric=symmetric))
    already = [path_str(p[:-1]) for p, leaf in leaves if isinstance(leaf, QuantizedWeight)]
    check_not_quantized(already, sum(d.quantize for _, d in decisions.values()), "kernel")
    unmatched = warn_unmatched(rules, [path for path, _ in decisions.values()], "kernel")
    report = QuantizationReport(unmatched_rules=unmatched, method=method)
    learned: dict[str, QuantizedWeight] = {}
    if method == "autoround":  # keyed by the kernel leaf's own path ("params.Dense_0.kernel")
        chosen = {
            path_str(leaves[i][0]): (d.group_size, d.symmetric)
            for i, (_, d) in decisions.items()
            if d.quantize
        }
        learned = autoround_params(
            params,
            apply_fn,
            calibration,
            chosen,
            scale_dtype=scale_dtype,
            progress=progress,
            **method_options,
        )
    out = [leaf for _, leaf in leaves]
    for i, (path, d) in decisions.items():
        leaf = out[i]
        if d.quantize:
            qw = learned.get(path_str(leaves[i][0]))
            out[i] = (
                qw
                if qw is not None
                else quantize_weight(
                    leaf, group_size=d.group_size, symmetric=d.symmetric, scale_dtype=scale_dtype
                )
            )
        report.add(path, leaf.shape, d, array_nbytes(leaf), out[i] if d.quantize else None)
    new = jax.tree_util.tree_unflatten(treedef, out)
    return (new, report) if return_report else new


__all__ = ["METHODS", "LayerReport", "QuantizationReport", "plan_quantization", "quantize", "quantize_params"]
