"""Swap a model's dense layers for int4 ones: ``quantize`` (Flax NNX) and ``quantize_params`` (pytrees)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from nybble.models.layers import QLinear
from nybble.models.rules import Decision, QuantRule, check_rules, decide, warn_unmatched
from nybble.quant.autoround import key_path_str as path_str  # a dotted path: layers.3.attn.q_proj
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.rtn import check_group_size
from nybble.quant.rtn import quantize as quantize_weight

METHODS = ("rtn", "gptq", "autoround")
# Options of nybble.quantize that method="rtn" passes through.
RTN_OPTIONS = frozenset({"clip_search"})


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """One dense layer: ``quantized`` with its settings, or skipped for ``reason``; bytes of its weight."""

    path: str
    shape: tuple[int, int]
    quantized: bool
    group_size: int | None
    symmetric: bool | None
    reason: str
    bytes_before: int
    bytes_after: int


@dataclasses.dataclass
class QuantizationReport:
    """What ``quantize`` did: every dense layer it saw, quantized or skipped, and the weight bytes."""

    layers: list[LayerReport] = dataclasses.field(default_factory=list)
    unmatched_rules: list[QuantRule] = dataclasses.field(default_factory=list)
    method: str = "rtn"

    @property
    def quantized(self) -> list[LayerReport]:
        """The layers now held in int4."""
        return [r for r in self.layers if r.quantized]

    @property
    def skipped(self) -> list[LayerReport]:
        """The layers kept in float, each with its reason."""
        return [r for r in self.layers if not r.quantized]

    @property
    def bytes_before(self) -> int:
        """Bytes of all dense-layer weights before quantization."""
        return sum(r.bytes_before for r in self.layers)

    @property
    def bytes_after(self) -> int:
        """Bytes of all dense-layer weights after (int4 codes + scales + offsets for quantized layers)."""
        return sum(r.bytes_after for r in self.layers)

    def summary(self) -> str:
        """A short human-readable summary."""
        mib = 2**20
        lines = [
            f"nybble.models.quantize ({self.method}): {len(self.quantized)} layer(s) quantized, "
            f"{len(self.skipped)} kept in float; dense weights {self.bytes_before / mib:.2f} MiB -> "
            f"{self.bytes_after / mib:.2f} MiB"
            + (f" ({self.bytes_before / self.bytes_after:.2f}x smaller)" if self.bytes_after else "")
        ]
        settings: dict[tuple[Any, Any], int] = {}
        for r in self.quantized:
            settings[(r.group_size, r.symmetric)] = settings.get((r.group_size, r.symmetric), 0) + 1
        for (gs, sym), count in settings.items():
            group = "per-column" if gs is None else f"g{gs}"
            lines.append(f"  {count} x int4 {group} {'symmetric' if sym else 'asymmetric'}")
        for r in self.skipped:
            lines.append(f"  kept {r.path} {r.shape}: {r.reason}")
        for rule in self.unmatched_rules:
            lines.append(f"  warning: rule {rule.pattern!r} matched no layer")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


@dataclasses.dataclass
class PlannedLayer:
    """One ``nnx.Linear`` found in a model, where it lives, and the rule decision for it."""

    path: str
    parent: Any
    key: str | int
    linear: nnx.Linear
    decision: Decision

    @property
    def shape(self) -> tuple[int, int]:
        """(in_features, out_features)."""
        return tuple(self.linear.kernel.shape)  # type: ignore[return-value]

    def replace(self, new: nnx.Module) -> None:
        """Puts ``new`` where the ``nnx.Linear`` was."""
        if isinstance(self.parent, nnx.Module) and isinstance(self.key, str):
            setattr(self.parent, self.key, new)
        else:
            self.parent[self.key] = new


def _nbytes(a: Any) -> int:
    return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


def plan_quantization(
    model: nnx.Module,
    *,
    rules: Sequence[QuantRule] | None = None,
    group_size: int | None = 128,
    symmetric: bool = True,
    warn: bool = True,
) -> tuple[list[PlannedLayer], list[QuantRule]]:
    """Every ``nnx.Linear`` of ``model`` with its rule decision, and the caller's rules that matched none.

    This is the layer selection ``quantize`` uses; calibrated methods (GPTQ) use it too.
    """
    rules = check_rules(rules)
    check_group_size(group_size)
    modules = {tuple(p): m for p, m in nnx.iter_modules(model)}
    planned = []
    for p, m in modules.items():
        if not isinstance(m, nnx.Linear) or not p:
            continue
        path = path_str(p)
        k, n = m.kernel.shape
        decision = decide(path, k * n, rules, group_size=group_size, symmetric=symmetric)
        planned.append(PlannedLayer(path, modules[p[:-1]], p[-1], m, decision))
    unmatched = warn_unmatched(rules, [pl.path for pl in planned], "nnx.Linear layer") if warn else []
    return planned, unmatched


@overload
def quantize(
    model: nnx.Module,
    *,
    group_size: int | None = ...,
    symmetric: bool = ...,
    rules: Sequence[QuantRule] | None = ...,
    method: str = ...,
    calibration: Any = ...,
    scale_dtype: Any = ...,
    progress: bool = ...,
    verbose: bool = ...,
    return_report: Literal[False] = ...,
    **method_options: Any,
) -> nnx.Module: ...


@overload
def quantize(
    model: nnx.Module,
    *,
    group_size: int | None = ...,
    symmetric: bool = ...,
    rules: Sequence[QuantRule] | None = ...,
    method: str = ...,
    calibration: Any = ...,
    scale_dtype: Any = ...,
    progress: bool = ...,
    verbose: bool = ...,
    return_report: Literal[True],
    **method_options: Any,
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
        ``target``, ``seq_len`` (see ``nybble.models.autoround.quantize_autoround``).
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
        # lazy: calibrated methods are optional and heavier
        if method == "gptq":
            from nybble.models.calibrate import quantize_gptq as calibrated
        else:
            from nybble.models.autoround import quantize_autoround as calibrated

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
    planned, unmatched = plan_quantization(model, rules=rules, group_size=group_size, symmetric=symmetric)
    report = QuantizationReport(unmatched_rules=unmatched, method=method)
    for pl in tqdm(planned, desc="nybble: quantizing", unit="layer", disable=not progress, leave=False):
        before = _nbytes(pl.linear.kernel)
        d = pl.decision
        if not d.quantize:
            report.layers.append(LayerReport(pl.path, pl.shape, False, None, None, d.reason, before, before))
            continue
        qweight = quantize_weight(
            pl.linear.kernel[...],
            group_size=d.group_size,
            symmetric=d.symmetric,
            scale_dtype=scale_dtype,
            **method_options,
        )
        q = QLinear.from_linear(pl.linear, qweight=qweight)
        pl.replace(q)
        report.layers.append(
            LayerReport(pl.path, pl.shape, True, d.group_size, d.symmetric, "", before, q.weight.nbytes)
        )
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
    kernel_paths = [path_str(p[:-1]) for p, leaf in leaves if _is_kernel(p, leaf)]
    unmatched = warn_unmatched(rules, kernel_paths, "kernel")
    report = QuantizationReport(unmatched_rules=unmatched, method=method)
    decisions = {
        path_str(p): decide(path_str(p[:-1]), leaf.size, rules, group_size=group_size, symmetric=symmetric)
        for p, leaf in leaves
        if _is_kernel(p, leaf)
    }
    learned: dict[str, QuantizedWeight] = {}
    if method == "autoround":
        from nybble.models.autoround import autoround_params  # lazy: calibrated methods are heavier

        chosen = {name: (d.group_size, d.symmetric) for name, d in decisions.items() if d.quantize}
        learned = autoround_params(
            params,
            apply_fn,
            calibration,
            chosen,
            scale_dtype=scale_dtype,
            progress=progress,
            **method_options,
        )
    out = []
    for p, leaf in leaves:
        if not _is_kernel(p, leaf):
            out.append(leaf)
            continue
        path = path_str(p[:-1])
        k, n = leaf.shape
        d = decisions[path_str(p)]
        before = _nbytes(leaf)
        if d.quantize:
            leaf = learned.get(path_str(p)) or quantize_weight(
                leaf, group_size=d.group_size, symmetric=d.symmetric, scale_dtype=scale_dtype
            )
            report.layers.append(
                LayerReport(path, (k, n), True, d.group_size, d.symmetric, "", before, leaf.nbytes)
            )
        else:
            report.layers.append(LayerReport(path, (k, n), False, None, None, d.reason, before, before))
        out.append(leaf)
    new = jax.tree_util.tree_unflatten(treedef, out)
    return (new, report) if return_report else new


__all__ = [
    "METHODS",
    "LayerReport",
    "PlannedLayer",
    "QuantizationReport",
    "plan_quantization",
    "quantize",
    "quantize_params",
]
