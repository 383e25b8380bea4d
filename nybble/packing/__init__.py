"""Pad and pack int4 nibble tensors into byte-aligned blocks and back, exactly; the layouts kernels read;
the group geometry (which rows of K share a scale row)."""

from nybble.packing.groups import MIN_GROUP_SIZE, check_group_size, group_rows, num_groups
from nybble.packing.layouts import (
    DEFAULT_LAYOUT,
    LAYOUTS,
    TRITON_LAYOUT,
    StoredDim,
    WeightLayout,
    default_layout,
    get_layout,
    nk_int4_as_int4,
    register_layout,
)
from nybble.packing.nibbles import pack_int4, unpack_int4
from nybble.packing.padding import WEIGHT_TILE, pad_to, padded_weight_dims, round_up

__all__ = [
    "DEFAULT_LAYOUT",
    "LAYOUTS",
    "MIN_GROUP_SIZE",
    "TRITON_LAYOUT",
    "WEIGHT_TILE",
    "StoredDim",
    "WeightLayout",
    "check_group_size",
    "default_layout",
    "get_layout",
    "group_rows",
    "nk_int4_as_int4",
    "num_groups",
    "pack_int4",
    "pad_to",
    "padded_weight_dims",
    "register_layout",
    "round_up",
    "unpack_int4",
]
