"""``QuantFormat``: the storage format of one int4 weight, as one frozen object.

Bits, group size, symmetry, zero-point kind, scale dtype and code layout travel together from a method
config (``nybble.models.RTN(...)``, ``GPTQ(...)``, ``AutoRound(...)``) down to the function that rounds a
weight (``nybble.quantize``, ``nybble.quant.gptq.gptq``), so that no layer on the way re-lists the options
by hand and none can be dropped on the way (a dropped ``zero_point="integer"`` once made expert stacks
unwritable as compressed-tensors). A rule that changes a layer's group size or symmetry gives a new
format (:meth:`QuantFormat.replace`); everything else is carried as it was.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypedDict

import numpy as np

from nybble.packing import DEFAULT_LAYOUT, check_group_size, get_layout
from nybble.quant.qweight import SCALE_DTYPES

# How asymmetric groups store their zero: "float" (offset = group minimum + 8 s, nybble's default) or
# "integer" (w = (u - z) * s with an integer z in 1..15: what compressed-tensors, GPTQ and AWQ store).
ZERO_POINTS = ("float", "integer")

# The only code width the kernels and the packing hold.
BITS = (4,)


def check_zero_point(zero_point: str, what: str = "quantize") -> None:
    """Raises unless ``zero_point`` is one of ``ZERO_POINTS``."""
    if zero_point not in ZERO_POINTS:
        raise ValueError(f"{what}: zero_point must be one of {ZERO_POINTS}, got {zero_point!r}")


def check_scale_dtype(scale_dtype: Any, what: str = "quantize") -> None:
    """Raises unless ``scale_dtype`` is one a ``QuantizedWeight`` stores (``SCALE_DTYPES``)."""
    try:
        name = np.dtype(scale_dtype).name
    except TypeError:
        name = None
    if name not in SCALE_DTYPES:
        raise ValueError(f"{what}: scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantFormat:
    """How one int4 weight is stored; validated when built, hashable (a static argument under ``jax.jit``).

    Fields:
      bits: code width (4: the only one).
      group_size: rows of K sharing one scale (a power of two >= 16), or None for one scale per column.
      symmetric: signed codes and one scale per group; False adds an offset (zero point) per group.
      zero_point: asymmetric groups only: "float" (an offset mapping code -8 to the group minimum) or
        "integer" (``w = (u - z) * s`` with an integer z, what compressed-tensors, GPTQ and AWQ store).
      scale_dtype: dtype name of the stored scales ("bfloat16", "float16" or "float32"; any dtype-like is
        accepted and stored by name).
      layout: memory layout of the codes (``nybble.packing.LAYOUTS``).
    """

    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = True
    zero_point: str = "float"
    scale_dtype: str = "bfloat16"
    layout: str = DEFAULT_LAYOUT

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"QuantFormat: bits must be one of {BITS}, got {self.bits!r}")
        check_group_size(self.group_size)
        if not isinstance(self.symmetric, bool | np.bool_):
            raise TypeError(f"QuantFormat: symmetric must be True or False, got {self.symmetric!r}")
        object.__setattr__(self, "symmetric", bool(self.symmetric))
        check_zero_point(self.zero_point, "QuantFormat")
        check_scale_dtype(self.scale_dtype, "QuantFormat")
        object.__setattr__(self, "scale_dtype", np.dtype(self.scale_dtype).name)
        get_layout(self.layout)  # raises naming the registered layouts

    @property
    def dtype(self) -> np.dtype:
        """The scale dtype as a numpy dtype."""
        return np.dtype(self.scale_dtype)

    @property
    def integer_zero(self) -> bool:
        """True when groups have integer zero points (asymmetric with ``zero_point="integer"``)."""
        return self.zero_point == "integer" and not self.symmetric

    def replace(self, **changes: Any) -> QuantFormat:
        """This format with ``changes`` (field names as keywords), validated again."""
        return with_fields(self, changes, "QuantFormat.replace")


class FormatFields(TypedDict, total=False):
    """The keyword arguments that build or override a :class:`QuantFormat` (``nybble.quantize(w, ...)``)."""

    bits: int
    group_size: int | None
    symmetric: bool
    zero_point: str
    scale_dtype: Any
    layout: str


FIELDS = tuple(f.name for f in dataclasses.fields(QuantFormat))


def with_fields(format: QuantFormat | None, fields: dict[str, Any], what: str) -> QuantFormat:
    """``format`` (default: ``QuantFormat()``) with ``fields`` replaced; unknown names raise TypeError."""
    if format is not None and not isinstance(format, QuantFormat):
        raise TypeError(f"{what}: format must be a nybble.QuantFormat, got {type(format).__name__}")
    if bad := sorted(set(fields) - set(FIELDS)):
        raise TypeError(f"{what}: unexpected keyword argument(s) {bad}; the format's fields are {FIELDS}")
    base = QuantFormat() if format is None else format
    return dataclasses.replace(base, **fields) if fields else base


__all__ = [
    "BITS",
    "FIELDS",
    "ZERO_POINTS",
    "FormatFields",
    "QuantFormat",
    "check_scale_dtype",
    "check_zero_point",
    "with_fields",
]
