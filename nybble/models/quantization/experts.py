"""Quantization passes over MoE expert stacks (``nybble.models.definitions.moe``): round to nearest of
each stack the rules choose, and the stand-in that GPTQ-quantizes a stack on the tokens routed to each
expert during a calibration pass (``nybble.models.quantization.calibrate``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nybble.models.definitions.moe import Experts, QExperts, num_weights
from nybble.models.quantization.quant_plan import array_nbytes
from nybble.models.quantization.rules import check_rules, decide
from nybble.quant.gptq import gptq
from nybble.quant.qformat import QuantFormat
from nybble.quant.rtn import quantize
from nybble.quant.stacked import stack_weights


def quantize_expert_stacks(
    stacks: list[tuple[str, Any, str, Experts | QExperts]],
    rules: Any,
    *,
    format: QuantFormat,
    report: Any,
    clip_search: bool = False,
) -> None:
    """Round-to-nearest of every float :class:`Experts` in ``stacks`` the rules choose, in ``format`` as
    the rules adjust it, in place (each becomes a :class:`QExperts`), recorded in ``report`` (a
    ``QuantizationReport``)."""
    rules = check_rules(rules)
    group_size, symmetric = format.group_size, format.symmetric
    for path, parent, attr, module in stacks:
        if not isinstance(module, Experts):
            continue  # already int4
        d = decide(path, num_weights(module), rules, group_size=group_size, symmetric=symmetric)
        shape = tuple(module.kernel.shape)
        if not d.quantize:
            report.add(path, shape, d, array_nbytes(module.kernel))
            continue
        new = QExperts.from_experts(module, d.applied_to(format), clip_search=clip_search)
        setattr(parent, attr, new)
        report.add(path, shape, d, array_nbytes(module.kernel), new.weight)


class ExpertCapture:
    """Stands in for one float :class:`Experts` during a GPTQ calibration pass
    (``nybble.models.quantization.calibrate``).

    On its first call (eager: the rows and group sizes are concrete) each expert is GPTQ-quantized on the
    rows routed to it (its own Hessian); an expert no calibration token reached is rounded to nearest, in
    the same ``format``. The stack becomes a :class:`QExperts` in the model, which computes this call's
    output.
    """

    def __init__(
        self,
        path: str,
        parent: Any,
        attr: str,
        experts: Experts,
        decision: Any,
        format: QuantFormat,
        gptq_options: dict[str, Any],
    ) -> None:
        self.path, self.parent, self.attr, self.experts = path, parent, attr, experts
        self.decision, self.format, self.gptq_options = decision, format, gptq_options
        self.result: QExperts | None = None
        self.unrouted: list[int] = []

    def __call__(self, x: jax.Array, group_sizes: jax.Array, max_group: int | None = None) -> jax.Array:
        if self.result is None:
            fmt, w = self.format, self.experts.kernel[...]
            sizes = np.asarray(group_sizes)
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            weights = []
            for e, (start, size) in enumerate(zip(starts, sizes, strict=True)):
                if size == 0:
                    self.unrouted.append(e)
                    weights.append(quantize(w[e], fmt))
                    continue
                weights.append(
                    gptq(w[e], inputs=x[int(start) : int(start + size)], format=fmt, **self.gptq_options)
                )
            self.result = QExperts(stack_weights(weights))
            setattr(self.parent, self.attr, self.result)
        return self.result(x, group_sizes, max_group)


__all__ = ["ExpertCapture", "quantize_expert_stacks"]
