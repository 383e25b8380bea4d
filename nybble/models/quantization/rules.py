"""``QuantRule``: which layers to quantize and how, chosen by a regular expression over the module path."""

from __future__ import annotations

import dataclasses
import enum
import re
import warnings
from collections.abc import Sequence

from nybble.packing import check_group_size
from nybble.quant.qformat import QuantFormat


class _Inherit(enum.Enum):
    INHERIT = "inherit"

    def __repr__(self) -> str:
        return "INHERIT"


INHERIT = _Inherit.INHERIT
"""A rule field left at ``INHERIT`` takes the value passed to ``quantize`` (``group_size``, ``symmetric``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantRule:
    """One quantization rule; a list of rules is searched in order and the first match wins.

    Attributes:
      pattern: a regular expression, searched (``re.search``) in the dotted module path of a layer, e.g.
        ``"layers.3.attn.q_proj"`` for an NNX model or ``"params.Dense_0"`` for a params pytree. Anchor
        it (``^...$``) to match whole paths.
      group_size: rows of K sharing one scale (power of two >= 16), None for one scale per column, or
        ``INHERIT`` (the default) for the value given to ``quantize``.
      symmetric: symmetric (True) or asymmetric (False) int4, or ``INHERIT``.
      skip: keep the matched layers in float.
      min_size: keep layers with fewer than this many weights (K * N) in float.
    """

    pattern: str
    group_size: int | _Inherit | None = INHERIT
    symmetric: bool | _Inherit = INHERIT
    skip: bool = False
    min_size: int = 0

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"QuantRule: invalid regular expression {self.pattern!r}: {e}") from None
        if self.group_size is not INHERIT:
            check_group_size(self.group_size)
        if self.min_size < 0:
            raise ValueError(f"QuantRule: min_size must be >= 0, got {self.min_size}")

    def matches(self, path: str) -> bool:
        """Whether this rule applies to the dotted module path ``path``."""
        return re.search(self.pattern, path) is not None


DEFAULT_RULES: tuple[QuantRule, ...] = (
    # An untied LM head / classifier stays in float by default (it is the most sensitive layer).
    QuantRule(pattern=r"(^|\.)(lm_head|head|output|classifier)$", skip=True),
    # An MoE router (an nnx.Linear (hidden, experts) of a user's model; nybble's own is a Router, never
    # quantized) is tiny and decides which experts run: float.
    QuantRule(pattern=r"(^|\.)router$", skip=True),
)
"""Checked after the caller's rules: put a rule matching ``lm_head`` first to quantize the LM head."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do with one layer: quantize with ``group_size``/``symmetric``, or skip for ``reason``."""

    quantize: bool
    group_size: int | None = None
    symmetric: bool = True
    reason: str = ""
    rule: QuantRule | None = None

    def applied_to(self, fmt: QuantFormat) -> QuantFormat:
        """``fmt`` with this layer's group size and symmetry (a rule may change them); all else kept."""
        return fmt.replace(group_size=self.group_size, symmetric=self.symmetric)


def decide(
    path: str,
    num_weights: int,
    rules: Sequence[QuantRule],
    *,
    group_size: int | None,
    symmetric: bool,
) -> Decision:
    """The decision for one layer: the first matching rule of ``rules``, then ``DEFAULT_RULES``."""
    for rule in (*rules, *DEFAULT_RULES):
        if not rule.matches(path):
            continue
        if rule.skip:
            return Decision(False, reason=f"skipped by rule {rule.pattern!r}", rule=rule)
        if num_weights < rule.min_size:
            return Decision(
                False,
                reason=f"{num_weights} weights < min_size {rule.min_size} ({rule.pattern!r})",
                rule=rule,
            )
        gs = group_size if rule.group_size is INHERIT else rule.group_size
        sym = symmetric if rule.symmetric is INHERIT else rule.symmetric
        return Decision(True, group_size=gs, symmetric=bool(sym), rule=rule)
    return Decision(True, group_size=group_size, symmetric=symmetric)


def check_rules(rules: Sequence[QuantRule] | None) -> tuple[QuantRule, ...]:
    """The caller's rules as a tuple, each a ``QuantRule``."""
    if rules is None:
        return ()
    if isinstance(rules, QuantRule):
        rules = [rules]
    out = tuple(rules)
    for r in out:
        if not isinstance(r, QuantRule):
            raise TypeError(f"rules must be QuantRule instances, got {type(r).__name__}: {r!r}")
    return out


def warn_unmatched(rules: Sequence[QuantRule], paths: Sequence[str], what: str = "layer") -> list[QuantRule]:
    """Warns about (and returns) the caller's rules that matched none of ``paths``."""
    unmatched = [r for r in rules if not any(r.matches(p) for p in paths)]
    for r in unmatched:
        example = f"; paths look like {paths[0]!r}" if paths else ""
        warnings.warn(
            f"nybble: QuantRule(pattern={r.pattern!r}) matched no {what}{example}",
            UserWarning,
            stacklevel=3,
        )
    return unmatched


__all__ = ["DEFAULT_RULES", "INHERIT", "Decision", "QuantRule", "check_rules", "decide", "warn_unmatched"]
