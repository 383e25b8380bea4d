"""AutoRound's own export (``quant_method: auto-round``): GPTQ- or AWQ-packed tensors by
``packing_format``."""

from __future__ import annotations

from collections.abc import Container

import numpy as np

from nybble.quant.formats.awq_format import AWQScheme
from nybble.quant.formats.gptq_format import GPTQScheme
from nybble.quant.formats.hf_base import (
    Getter,
    HFScheme,
    _check_bits,
    _unsupported,
)
from nybble.quant.qweight import QuantizedWeight

__all__ = ["AutoRoundScheme"]


class AutoRoundScheme(HFScheme):
    """AutoRound's own export (``quant_method: auto-round``): GPTQ- or AWQ-packed tensors by
    ``packing_format``; per-layer ``extra_config`` may leave layers in float (bits >= 16)."""

    quant_method = "auto-round"

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        _check_bits(config.get("bits", 4), "bits")
        dtype = config.get("data_type", "int")
        if dtype != "int":
            raise _unsupported(f"auto-round data_type={dtype!r}")
        for key in ("act_bits",):
            if config.get(key, 16) < 16:
                raise _unsupported(f"auto-round {key}={config.get(key)!r} (activation quantization)")
        fmt = str(config.get("packing_format", "auto_round:auto_gptq"))
        inner = {**config, "checkpoint_format": "gptq"}
        if fmt in ("auto_round:auto_gptq", "auto_round:gptq", "auto_gptq"):
            self.inner: HFScheme = GPTQScheme(inner, zero_convention="v1")
            self.inner.writes_g_idx = False  # auto_round_extension's qlinear_torch_zp has no g_idx
        elif fmt in ("auto_round", "auto_round:gptqmodel", "auto_round:auto_round"):
            self.inner = GPTQScheme(inner, zero_convention="v2")
            self.inner.writes_g_idx = fmt == "auto_round:gptqmodel"  # qlinear_torch(g_idx=True)
        elif fmt in ("auto_round:auto_awq", "auto_round:awq", "auto_awq"):
            self.inner = AWQScheme(config, check_version=False)
        else:
            raise _unsupported(f"auto-round packing_format={fmt!r}")
        self.packing_format = fmt
        self.extra = dict(config.get("extra_config") or {})
        blocks = config.get("block_name_to_quantize")
        if isinstance(blocks, str):  # AutoRound writes "model.layers" or "a.layers,b.layers"
            blocks = [b.strip() for b in blocks.split(",") if b.strip()]
        self.blocks = None if not blocks else [b if isinstance(b, str) else b[0] for b in blocks]

    def is_quantized(self, module_name: str) -> bool:
        extra = self.extra.get(module_name, {})
        if "bits" in extra:
            if extra["bits"] >= 16:
                return False
            _check_bits(extra["bits"], f"extra_config[{module_name!r}].bits")
        if module_name == "lm_head" or module_name.endswith(".lm_head"):
            return bool(extra)
        if self.blocks is not None:
            return any(module_name.startswith(b.rstrip(".") + ".") for b in self.blocks)
        return True

    def tensor_names(self, module_name: str, available: Container[str] | None = None) -> list[str]:
        return self.inner.tensor_names(module_name, available)

    def optional_tensor_names(self, module_name: str) -> list[str]:
        return self.inner.optional_tensor_names(module_name)

    def read_linear_with_perm(
        self, module_name: str, get: Getter, *, in_features: int, out_features: int
    ) -> tuple[QuantizedWeight, np.ndarray | None]:
        extra = self.extra.get(module_name, {})
        if any(key in extra and extra[key] != self.config.get(key) for key in ("group_size", "sym")):
            raise ValueError(
                f"{module_name}: extra_config overrides {extra} (per-layer group size / sym) are not read yet"
            )
        return self.inner.read_linear_with_perm(
            module_name, get, in_features=in_features, out_features=out_features
        )
