"""Pad and pack int4 nibble tensors into byte-aligned blocks and back, exactly; the layouts kernels read."""

from nybble.packing.layouts import (
    DEFAULT_LAYOUT,
    LAYOUTS,
    StoredDim,
    WeightLayout,
    get_layout,
    nk_int4_as_int4,
    register_layout,
)
from nybble.packing.nibbles import pack_int4, unpack_int4
from nybble.packing.padding import WEIGHT_TILE, pad_to, padded_weight_dims, round_up

__all__ = [
    "DEFAULT_LAYOUT",
    "LAYOUTS",
    "WEIGHT_TILE",
    "StoredDim",
    "WeightLayout",
    "get_layout",
    "nk_int4_as_int4",
    "pack_int4",
    "pad_to",
    "padded_weight_dims",
    "register_layout",
    "round_up",
    "unpack_int4",
]
