"""Swap a model's dense layers for int4 ones: ``quantize`` (Flax NNX) and ``quantize_params`` (pytrees)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from nybble.models.definitions.fuse import fuse_projections as fuse
from nybble.models.definitions.fuse import unfuse_projections as unfuse
from nybble.models.definitions.layers import QLinear
from nybble.models.definitions.moe import expert_stacks
from nybble.models.quantization.autoround import autoround_params, quantize_autoround
from nybble.models.quantization.calibrate import quantize_gptq
from nybble.models.quantization.experts import quantize_expert_stacks
from nybble.models.quantization.methods import GPTQ, AutoRound, Method, method_config, set_quantization
from nybble.models.quantization.quant_plan import (
    LayerReport,
    QuantizationReport,
    array_nbytes,
    check_not_quantized,
    path_str,
    plan_quantization,
    report_skipped_general,
)
from nybble.models.quantization.rules import Decision, QuantRule, check_rules, decide, warn_unmatched
from nybble.quant.qformat import QuantFormat
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.rtn import quantize as quantize_weight

METHODS = ("rtn", "gptq", "autoround")


# "Not given": group_size=None means per-column, so the defaults of `quantize` need their own marker.
_UNSET: Any = type("_Unset", (), {"__repr__": lambda self: "<default>"})()


@overload
def quantize(
    model: nnx.Module, method: Method | str = ..., *, return_report: Literal[False] = ..., **options: Any
) -> nnx.Module: ...


@overload
def quantize(
    model: nnx.Module, method: Method | str = ..., *, return_report: Literal[True], **options: Any
) -> tuple[nnx.Module, QuantizationReport]: ...


def quantize(
    model: nnx.Module,
    method: Method | str = "rtn",
    *,
    group_size: int | None = _UNSET,
    symmetric: bool = _UNSET,
    rules: Sequence[QuantRule] | None = None,
    calibration: Any = None,
    forward: Callable[[nnx.Module, jax.Array], Any] | None = None,
    scale_dtype: Any = _UNSET,
    progress: bool = True,
    verbose: bool = False,
    return_report: bool = False,
    fuse_projections: bool = False,
    **method_options: Any,
) -> nnx.Module | tuple[nnx.Module, QuantizationReport]:
    """Replaces the dense layers of a Flax NNX model by int4 :class:`QLinear` layers, in place.

    ``nnx.Linear`` layers are swapped; ``nnx.LinearGeneral`` and ``nnx.Einsum`` layers are left in float
    and named in the report as skipped, with the reason. Embeddings (and an LM head tied to them), norms
    and other layers stay in float. An untied LM head (a Linear named ``lm_head``/``head``/``output``/
    ``classifier``) stays in float too, unless a rule of the caller matches it first.

    Args:
      model: the NNX model; modified in place and returned.
      method: a frozen config, ``RTN(group_size=128)``, ``GPTQ(...)`` or ``AutoRound(...)``
        (``nybble.models.quantization.methods``), validated when built, printed in the report and saved
        with the
        checkpoint by ``save_model``; or the shorthand ``"rtn"``, ``"gptq"``, ``"autoround"`` with the
        config's fields as keyword arguments (``group_size=64, symmetric=False, act_order=...``; for
        AutoRound also ``AutoRoundConfig`` fields such as ``steps=``).
      group_size, symmetric, scale_dtype: with a shorthand name, the format of every layer (defaults:
        128, True, bf16; see :func:`nybble.quantize`); with a config, give them in the config.
      rules: ``QuantRule`` list over dotted module paths (``"layers.0.mlp.up_proj"``), first match wins;
        searched before ``DEFAULT_RULES``. A rule that matches no layer is reported with a warning.
      calibration: token ids for GPTQ and AutoRound (a 1-D stream or (batch, length)).
      forward: for GPTQ and AutoRound, ``forward(model, ids)`` runs the model on one calibration batch
        (default: ``model(ids)``); not part of the method config (a function is not saved).
      progress: show a tqdm progress bar.
      verbose: print the :class:`QuantizationReport` summary at the end.
      return_report: return ``(model, report)`` instead of the model alone.
      fuse_projections: then fuse q/k/v and gate/up into one int4 layer each (opt-in, for serving:
        ``models.definitions.fuse``, one launch each in a decode step, the same numbers; ``attn.q_proj``
        still reads and checkpoints still hold them one by one). Off by default, so the model keeps the
        modules it had (the names fine-tuning rules and adapters target). A model fused before is split
        back first, so rules, calibration and the report see q/k/v and gate/up one by one.
    """
    common = {
        k: v
        for k, v in (("group_size", group_size), ("symmetric", symmetric), ("scale_dtype", scale_dtype))
        if v is not _UNSET
    }
    config = method_config(method, **common, **method_options)
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
    fmt = config.format
    with _parts_apart(model):  # rules and calibration name q/k/v and gate/up one by one
        if isinstance(config, GPTQ | AutoRound):
            calibrated = quantize_gptq if isinstance(config, GPTQ) else quantize_autoround
            model, report = calibrated(
                model,
                calibration=calibration,
                rules=rules,
                forward=forward,
                progress=progress,
                verbose=False,
                return_report=True,
                format=fmt,
                **config.options(),
            )
        else:
            if calibration is not None or forward is not None:
                raise ValueError(
                    "nybble.models.quantize: calibration data and forward are used by the calibrated "
                    "methods only (GPTQ, AutoRound)"
                )
            planned, _ = plan_quantization(
                model, rules=rules, group_size=fmt.group_size, symmetric=fmt.symmetric, warn=False
            )
            # MoE expert stacks (nybble.models.definitions.moe): quantized per expert, stacked
            stacks = expert_stacks(model)
            unmatched = warn_unmatched(
                check_rules(rules),
                [pl.path for pl in planned] + [s[0] for s in stacks],
                "nnx.Linear layer or expert stack" if stacks else "nnx.Linear layer",
            )
            report = QuantizationReport(unmatched_rules=unmatched, method=config.name)
            quantize_expert_stacks(stacks, rules, format=fmt, report=report, **config.options())
            bar = {"desc": "nybble: quantizing", "unit": "layer", "disable": not progress, "leave": False}
            for pl in tqdm(planned, **bar):
                d = pl.decision
                if not d.quantize:
                    report.add(pl.path, pl.shape, d, pl.nbytes)
                    continue
                qweight = quantize_weight(pl.linear.kernel[...], d.applied_to(fmt), **config.options())
                pl.replace(QLinear.from_linear(pl.linear, qweight=qweight))
                report.add(pl.path, pl.shape, d, pl.nbytes, qweight)
    report.config = config
    report_skipped_general(model, report)
    set_quantization(model, config)
    if fuse_projections:
        fuse(model)
    if verbose:
        print(report.summary())
    return (model, report) if return_report else model


@contextlib.contextmanager
def _parts_apart(model: nnx.Module) -> Iterator[None]:
    """Inside: ``model``'s fused projections split back (exact); on an error, fused again as they were."""
    split = unfuse(model)
    try:
        yield
    except BaseException:
        if split:
            fuse(model)
        raise


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
    see ``nybble.models.quantization.autoround.autoround_params``); ``**method_options`` are
    ``AutoRoundConfig``
    fields or ``config=``.
    """
    if method not in ("rtn", "autoround"):
        raise ValueError(f"quantize_params: method must be 'rtn' or 'autoround', got {method!r}")
    if method == "rtn" and (calibration is not None or apply_fn is not None or method_options):
        raise ValueError(
            "quantize_params: calibration=, apply_fn= and options are only used by method='autoround'"
        )
    rules = check_rules(rules)
    fmt = QuantFormat(group_size=group_size, symmetric=symmetric, scale_dtype=scale_dtype)
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
            scale_dtype=fmt.scale_dtype,
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
                else quantize_weight(leaf, d.applied_to(fmt))
            )
        report.add(path, leaf.shape, d, array_nbytes(leaf), out[i] if d.quantize else None)
    new = jax.tree_util.tree_unflatten(treedef, out)
    return (new, report) if return_report else new


__all__ = ["METHODS", "LayerReport", "QuantizationReport", "plan_quantization", "quantize", "quantize_params"]
