"""Quantization methods as frozen configs: ``RTN(group_size=128)``, ``GPTQ(...)``, ``AutoRound(...)``.

``nybble.models.quantize(model, GPTQ(group_size=64, symmetric=False), calibration=ids)`` validates every
option once, here, when the config is built; the config is printed in the report and saved with the
checkpoint (``save_model``). The strings ``"rtn"``, ``"gptq"``, ``"autoround"`` with keyword options stay
as shorthand: :func:`method_config` turns them into the same configs.

Defaults are read from the functions that do the work (``nybble.quant.gptq.gptq``,
``nybble.models.quantization.autoround.quantize_autoround``), so a config and a direct call cannot disagree.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any, ClassVar

from nybble.models.quantization.autoround import STARTS, TARGETS
from nybble.quant.autoround import PRESETS, AutoRoundConfig, resolve_config
from nybble.quant.gptq import gptq
from nybble.quant.qformat import FIELDS, QuantFormat

_GPTQ = inspect.signature(gptq).parameters


class _Formatted:
    """A method config's weight format: the :class:`QuantFormat` built from those of its fields that are
    the format's (group size, symmetry, zero point, scale dtype...), so every field the format gains is
    carried to ``quantize`` without being named on the way."""

    name: ClassVar[str]

    @property
    def format(self) -> QuantFormat:
        """The stored format of every layer this config quantizes (before per-layer rules)."""
        return QuantFormat(**{f: getattr(self, f) for f in FIELDS if hasattr(self, f)})

    def _check_format(self) -> None:
        """Validates the format fields (errors named after the method) and stores the scale dtype by name."""
        if not isinstance(self.symmetric, bool):
            raise TypeError(f"{type(self).__name__}: symmetric must be True or False, got {self.symmetric!r}")
        try:
            fmt = self.format
        except (TypeError, ValueError) as e:
            raise type(e)(f"{type(self).__name__}: {e}") from None
        object.__setattr__(self, "scale_dtype", fmt.scale_dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RTN(_Formatted):
    """Round to nearest: no calibration data, seconds for a small LLM."""

    name: ClassVar[str] = "rtn"
    # Rows of K sharing one scale (a power of two >= 16), or None for one scale per output column.
    group_size: int | None = 128
    # Signed codes and one scale per group; False adds an offset per group.
    symmetric: bool = True
    # dtype of the stored scales (and offsets): "bfloat16", "float16" or "float32".
    scale_dtype: str = "bfloat16"
    # "float": an offset per asymmetric group; "integer": an integer zero point per group (w = (u - z) * s),
    # what compressed-tensors, GPTQ and AWQ checkpoints store (nybble.quantize's zero_point).
    zero_point: str = "float"
    # Per group, shrink the range to the least squared weight error (off: it raised SmolLM2's perplexity).
    clip_search: bool = False

    def __post_init__(self) -> None:
        self._check_format()

    def options(self) -> dict[str, Any]:
        """Keyword arguments of the method's own function beyond its ``format``."""
        return {"clip_search": self.clip_search}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTQ(_Formatted):
    """GPTQ, layer by layer on calibration data (``nybble.models.quantization.calibrate.quantize_gptq``)."""

    name: ClassVar[str] = "gptq"
    group_size: int | None = 128
    symmetric: bool = True
    scale_dtype: str = "bfloat16"
    # "float": an offset per asymmetric group; "integer": an integer zero point per group (w = (u - z) * s),
    # what compressed-tensors, GPTQ and AWQ checkpoints store (nybble.quantize's zero_point).
    zero_point: str = "float"
    # Quantize inputs by decreasing Hessian diagonal with static groups (free at run time; better on SmolLM2).
    act_order: bool = True
    # Least-squares scales for the chosen codes after GPTQ (nybble.quant.refit).
    refit_scales: bool = _GPTQ["refit_scales"].default
    # Hessian damping, as a fraction of its mean diagonal.
    damp: float = _GPTQ["damp"].default
    # Columns of K updated together (lazy batch updates).
    block_size: int = _GPTQ["block_size"].default
    # With act_order: groups fixed in natural order (None: on with act_order).
    static_groups: bool | None = _GPTQ["static_groups"].default
    clip_search: bool = _GPTQ["clip_search"].default
    # Tokens per calibration window when the calibration ids are one stream.
    seq_len: int = 256

    def __post_init__(self) -> None:
        self._check_format()
        if not (isinstance(self.damp, float | int) and 0 < self.damp < 1):
            raise ValueError(f"GPTQ: damp must be a float in (0, 1), got {self.damp!r}")
        for field in ("block_size", "seq_len"):
            value = getattr(self, field)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"GPTQ: {field} must be an int >= 1, got {value!r}")

    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``quantize_gptq`` beyond its ``format``."""
        fields = (
            "act_order",
            "refit_scales",
            "damp",
            "block_size",
            "static_groups",
            "clip_search",
            "seq_len",
        )
        return {f: getattr(self, f) for f in fields}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoRound(_Formatted):
    """Learned rounding block by block (``nybble.models.quantization.autoround.quantize_autoround``).

    ``AutoRound(start="gptq", config=AutoRoundConfig(steps=0, end_to_end_epochs=4))`` is GPTQ's codes with
    end-to-end scales (the CLI's ``--method gptq-e2e``)."""

    name: ClassVar[str] = "autoround"
    group_size: int | None = 128
    symmetric: bool = True
    scale_dtype: str = "bfloat16"
    # "float": an offset per asymmetric group; "integer": an integer zero point per group (w = (u - z) * s),
    # what compressed-tensors, GPTQ and AWQ checkpoints store (nybble.quantize's zero_point).
    zero_point: str = "float"
    # The training schedule: an AutoRoundConfig, or a preset name ("default", "fast") resolved to one.
    config: AutoRoundConfig | str = "default"
    # Starting codes: "rtn" or "gptq".
    start: str = "rtn"
    # "float": each block fits the float block's output; "own": the float block on the quantized inputs.
    target: str = "float"
    # After learning, least-squares scales, kept only if the block's calibration loss drops.
    refit_scales: bool = False
    seq_len: int = 256

    def __post_init__(self) -> None:
        self._check_format()
        if isinstance(self.config, str) and self.config not in PRESETS:
            raise ValueError(f"AutoRound: unknown preset {self.config!r}; presets are {sorted(PRESETS)}")
        object.__setattr__(self, "config", resolve_config(self.config))
        if self.start not in STARTS:
            raise ValueError(f"AutoRound: start must be one of {STARTS}, got {self.start!r}")
        if self.target not in TARGETS:
            raise ValueError(f"AutoRound: target must be one of {TARGETS}, got {self.target!r}")
        if not (isinstance(self.seq_len, int) and self.seq_len >= 1):
            raise ValueError(f"AutoRound: seq_len must be an int >= 1, got {self.seq_len!r}")

    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``quantize_autoround`` beyond its ``format``."""
        fields = ("config", "start", "target", "refit_scales", "seq_len")
        return {f: getattr(self, f) for f in fields}


Method = RTN | GPTQ | AutoRound
METHODS: dict[str, type[RTN] | type[GPTQ] | type[AutoRound]] = {
    "rtn": RTN,
    "gptq": GPTQ,
    "autoround": AutoRound,
}


def method_config(method: Method | str, **options: Any) -> Method:
    """The config for ``method``: a config as it is (no other options allowed), or a shorthand name with
    keyword options (for ``"autoround"``, ``AutoRoundConfig`` fields such as ``steps=`` override its
    ``config``). Raises ValueError / TypeError naming the option and the fields the method takes."""
    if isinstance(method, RTN | GPTQ | AutoRound):
        if options:
            raise TypeError(
                f"nybble.models.quantize: options {sorted(options)} given beside the method config "
                f"{method!r}; put them in the config (dataclasses.replace(config, ...))"
            )
        return method
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(
            f"nybble.models.quantize: unknown method {method!r}; choose one of {tuple(METHODS)} or a config "
            f"(nybble.models.RTN(...), GPTQ(...), AutoRound(...))"
        )
    cls = METHODS[method]
    fields = {f.name for f in dataclasses.fields(cls)}
    if cls is AutoRound:
        schedule = {k: options.pop(k) for k in list(options) if k in _AUTOROUND_FIELDS}
        if schedule:
            options["config"] = resolve_config(options.get("config", "default"), **schedule)
    if bad := sorted(set(options) - fields):
        raise TypeError(
            f"nybble.models.quantize: method={method!r} takes no option(s) {bad}; its options are "
            f"{sorted(fields)}"
            + (f" and AutoRoundConfig's {sorted(_AUTOROUND_FIELDS)}" if cls is AutoRound else "")
        )
    return cls(**options)


_AUTOROUND_FIELDS = frozenset(f.name for f in dataclasses.fields(AutoRoundConfig))


def describe(config: Method) -> dict[str, Any]:
    """The config as plain JSON values (``{"method": "gptq", "group_size": 128, ...}``), for checkpoints."""
    out: dict[str, Any] = {"method": config.name}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def to_json(config: Method) -> str:
    """:func:`describe` as one JSON string."""
    return json.dumps(describe(config), sort_keys=True)


def from_description(desc: dict[str, Any]) -> Method:
    """The config :func:`describe` wrote (ValueError on an unknown method)."""
    desc = dict(desc)
    name = desc.pop("method", None)
    if name not in METHODS:
        raise ValueError(f"unknown quantization method {name!r} in the description {desc!r}")
    if name == "autoround" and isinstance(desc.get("config"), dict):
        desc["config"] = AutoRoundConfig(**desc["config"])
    return METHODS[name](**desc)


# The model attribute holding the config of the last `nybble.models.quantize` pass (JSON), which
# `save_model` writes into the checkpoint and `load_model` restores.
ATTRIBUTE = "nybble_quantization"


def set_quantization(model: Any, config: Method | None) -> None:
    """Records ``config`` on ``model`` (None removes it)."""
    setattr(model, ATTRIBUTE, None if config is None else to_json(config))


def get_quantization(model: Any) -> Method | None:
    """The config recorded on ``model`` by ``nybble.models.quantize`` or ``load_model``, or None."""
    text = getattr(model, ATTRIBUTE, None)
    return None if text is None else from_description(json.loads(text))


__all__ = [
    "ATTRIBUTE",
    "GPTQ",
    "METHODS",
    "RTN",
    "AutoRound",
    "Method",
    "describe",
    "from_description",
    "get_quantization",
    "method_config",
    "set_quantization",
    "to_json",
]
