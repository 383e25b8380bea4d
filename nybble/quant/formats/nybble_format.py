"""nybble's own Hugging Face format (``quant_method: nybble``): codes, scales and offsets exactly as a
``QuantizedWeight`` holds them; reader and writer."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from nybble.packing import (
    DEFAULT_LAYOUT,
    check_group_size,
    default_layout,
    get_layout,
    num_groups,
    padded_weight_dims,
)
from nybble.quant.formats._common import (
    check_shape,
)
from nybble.quant.formats.hf_base import (
    Getter,
    HFScheme,
    HFWriter,
    _check_bits,
    _get,
)
from nybble.quant.qweight import SCALE_DTYPES, QuantizedWeight, relayout

__all__ = ["NybbleScheme", "NybbleWriter"]




class NybbleScheme(HFScheme):
    """``quant_method: nybble``: ``p.codes`` (the layout's packed codes), ``p.scales``, ``p.offsets``
    (asymmetric), ``p.quant_shape`` int64 [K, N, group_size or -1]; written by ``writer_for("nybble")``."""

    quant_method = "nybble"

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        _check_bits(config.get("bits", 4), "bits")
        self.layout = config.get("layout", DEFAULT_LAYOUT)
        get_layout(self.layout)
        self.ignore = list(config.get("ignore") or [])
        self.asymmetric = set(config.get("asymmetric") or [])

    def is_quantized(self, module_name: str) -> bool:
        return module_name not in self.ignore

    def _required(self, module_name: str) -> list[str]:
        names = [f"{module_name}.{t}" for t in ("codes", "scales", "quant_shape")]
        return names + ([f"{module_name}.offsets"] if module_name in self.asymmetric else [])

    def read_linear_with_perm(
        self, module_name: str, get: Getter, *, in_features: int, out_features: int
    ) -> tuple[QuantizedWeight, np.ndarray | None]:
        p, k, n = module_name, int(in_features), int(out_features)
        meta = _get(get, f"{p}.quant_shape").reshape(-1).tolist()
        if len(meta) != 3 or meta[:2] != [k, n]:
            raise ValueError(f"{p}.quant_shape: expected [{k}, {n}, group_size or -1], got {meta}")
        group_size = None if meta[2] == -1 else int(meta[2])
        check_group_size(group_size)
        k_pad, n_pad = padded_weight_dims(k, n)
        rows = (num_groups(k_pad, group_size), n_pad)
        scales = _get(get, f"{p}.scales")
        check_shape(scales, f"{p}.scales", rows, "(num_groups, N_pad)")
        offsets = _get(get, f"{p}.offsets") if p in self.asymmetric else None
        if offsets is not None:
            check_shape(offsets, f"{p}.offsets", rows, "(num_groups, N_pad)")
        codes = _get(get, f"{p}.codes")
        for a, what in ((scales, "scales"), (offsets, "offsets")):
            if a is not None and np.dtype(a.dtype).name not in SCALE_DTYPES:
                raise ValueError(f"{p}.{what}: expected one of {SCALE_DTYPES}, got {a.dtype.name}")
        try:
            qw = QuantizedWeight(
                codes=jnp.asarray(codes), scales=jnp.asarray(scales),
                offsets=None if offsets is None else jnp.asarray(offsets),
                shape=(k, n), group_size=group_size, symmetric=offsets is None, layout=self.layout,
            )  # fmt: skip
        except ValueError as e:
            raise ValueError(f"{p}.codes: {e}") from None
        return relayout(qw, default_layout()), None  # this machine's layout, converted once here


class NybbleWriter(HFWriter):
    """nybble's own codes, scales and offsets, exactly as the QuantizedWeight holds them (any offsets)."""

    format = "nybble"

    def __init__(self, *, layout: str = DEFAULT_LAYOUT) -> None:
        super().__init__()
        get_layout(layout)
        self.layout = layout

    def write_linear(self, module_name: str, qw: QuantizedWeight) -> dict[str, np.ndarray]:
        qw = relayout(qw, self.layout)
        k, n = qw.shape
        p = module_name
        codes = np.asarray(qw.codes)
        if codes.dtype == np.dtype(jnp.int4):  # nk_int4 also accepts an int4 view: store its bytes
            codes = np.asarray(get_layout(self.layout).pack(qw.logical_codes()))
        out = {
            f"{p}.codes": codes,
            f"{p}.scales": np.asarray(qw.scales),
            f"{p}.quant_shape": np.array([k, n, -1 if qw.group_size is None else qw.group_size], np.int64),
        }
        if qw.offsets is not None:
            out[f"{p}.offsets"] = np.asarray(qw.offsets)
        self.layers[p] = (bool(qw.symmetric), qw.group_size)
        return out

    def quantization_config(self, ignore: Sequence[str]) -> dict:
        asym = sorted(name for name, (sym, _) in self.layers.items() if not sym)
        return {
            "quant_method": "nybble", "bits": 4, "layout": self.layout, "ignore": list(ignore),
            "asymmetric": asym,
        }  # fmt: skip
