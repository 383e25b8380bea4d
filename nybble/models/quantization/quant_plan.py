"""Which dense layers a quantization pass takes, and its report: shared by round to nearest and GPTQ.

:func:`plan_quantization` finds every ``nnx.Linear`` of a model with the rule decision for it;
:class:`QuantizationReport` records what each pass did. A model (or params tree) that is already int4
is refused or warned about here, once for every method (:func:`check_not_quantized`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from nybble.models.definitions.layers import QLinear
from nybble.models.definitions.moe import Router
from nybble.models.quantization.rules import Decision, QuantRule, check_rules, decide, warn_unmatched
from nybble.packing import check_group_size
from nybble.quant.autoround import key_path_str as path_str
from nybble.quant.qweight import QuantizedWeight


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
    # The method's frozen config (nybble.models.quantization.methods), set by nybble.models.quantize.
    config: Any = None

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

    def add(
        self,
        path: str,
        shape: tuple[int, int],
        decision: Decision,
        before: int,
        after: QuantizedWeight | None = None,
        reason: str = "",
    ) -> None:
        """Records one layer: kept in float when ``after`` (its new weight) is None, else quantized."""
        if after is None:
            self.layers.append(LayerReport(path, shape, False, None, None, decision.reason, before, before))
            return
        d = decision
        report = LayerReport(path, shape, True, d.group_size, d.symmetric, reason, before, after.nbytes)
        self.layers.append(report)

    def skip(self, path: str, shape: tuple[int, ...], reason: str, nbytes: int) -> None:
        """Records a layer the pass does not handle at all (not a rule's decision), kept in float."""
        self.layers.append(LayerReport(path, shape, False, None, None, reason, nbytes, nbytes))  # type: ignore[arg-type]

    def summary(self) -> str:
        """A short human-readable summary."""
        mib = 2**20
        lines = [
            f"nybble.models.quantize ({self.method}): {len(self.quantized)} layer(s) quantized, "
            f"{len(self.skipped)} kept in float; dense weights {self.bytes_before / mib:.2f} MiB -> "
            f"{self.bytes_after / mib:.2f} MiB"
            + (f" ({self.bytes_before / self.bytes_after:.2f}x smaller)" if self.bytes_after else "")
        ]
        if self.config is not None:
            lines.append(f"  method: {self.config!r}")
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

    @property
    def nbytes(self) -> int:
        """Bytes of the float kernel."""
        return array_nbytes(self.linear.kernel)

    def replace(self, new: nnx.Module) -> None:
        """Puts ``new`` where the ``nnx.Linear`` was."""
        if isinstance(self.parent, nnx.Module) and isinstance(self.key, str):
            setattr(self.parent, self.key, new)
        else:
            self.parent[self.key] = new


def array_nbytes(a: Any) -> int:
    """Bytes of an array (or an ``nnx.Variable`` holding one)."""
    return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


def check_not_quantized(already: Sequence[str], to_quantize: int, what: str) -> None:
    """Refuses a pass with nothing left to quantize on a model that is already int4; warns on a mix.

    ``already``: paths of the int4 layers found; ``to_quantize``: how many float layers the rules chose.
    """
    if not already:
        return
    how = (
        "re-quantizing with other settings (another group size, method...) starts again from the float "
        "model: load it anew (e.g. nybble.models.smollm2.load()) and quantize that"
    )
    if to_quantize == 0:
        raise ValueError(
            f"nybble.models.quantize: the model is already quantized ({len(already)} int4 {what}(s), "
            f"e.g. {already[0]!r}) and has no float layer left to quantize; {how}"
        )
    warnings.warn(
        f"nybble.models.quantize: {len(already)} {what}(s) are already int4 (e.g. {already[0]!r}) and are "
        f"kept as they are; only the {to_quantize} float layer(s) are quantized now. Note: {how}",
        UserWarning,
        stacklevel=3,
    )


def plan_quantization(
    model: nnx.Module,
    *,
    rules: Sequence[QuantRule] | None = None,
    group_size: int | None = 128,
    symmetric: bool = True,
    warn: bool = True,
) -> tuple[list[PlannedLayer], list[QuantRule]]:
    """Every ``nnx.Linear`` of ``model`` with its rule decision, and the caller's rules that matched none.

    This is the layer selection ``quantize`` uses for every method. Raises ValueError when the model is
    already int4 (``QLinear`` layers) and no float layer is left to quantize; warns when some are.
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
    already = [path_str(p) for p, m in modules.items() if isinstance(m, QLinear)]
    check_not_quantized(already, sum(pl.decision.quantize for pl in planned), "QLinear layer")
    unmatched = warn_unmatched(rules, [pl.path for pl in planned], "nnx.Linear layer") if warn else []
    return planned, unmatched


# Dense layers nybble does not swap, with the reason the report gives. Their kernels are not one (K, N)
# matrix applied as x @ W (LinearGeneral: several in/out axes; Einsum: any contraction), and QLinear computes
# exactly that product; an MoE router is tiny and decides which experts run.
GENERAL_LAYERS: tuple[tuple[type, str], ...] = (
    (nnx.LinearGeneral, "nnx.LinearGeneral is not swapped: QLinear computes x @ W with a (K, N) kernel"),
    (nnx.Einsum, "nnx.Einsum is not swapped: QLinear computes x @ W, not a general contraction"),
    (Router, "an MoE router stays float: it decides which experts run"),
)


def report_skipped_general(model: nnx.Module, report: QuantizationReport) -> None:
    """Names every layer of ``GENERAL_LAYERS`` in ``model`` in ``report`` as kept in float."""
    for p, m in nnx.iter_modules(model):
        for cls, reason in GENERAL_LAYERS:
            if isinstance(m, cls) and p:
                kernel = m.weight if isinstance(m, Router) else m.kernel
                report.skip(path_str(p), tuple(kernel.shape), reason, array_nbytes(kernel))


__all__ = [
    "GENERAL_LAYERS",
    "LayerReport",
    "PlannedLayer",
    "QuantizationReport",
    "array_nbytes",
    "check_not_quantized",
    "path_str",
    "plan_quantization",
    "report_skipped_general",
]
