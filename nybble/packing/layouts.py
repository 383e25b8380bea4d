"""Named weight layouts: how a (K, N) matrix of int4 codes is laid out in memory, with exact inverses.

A layout maps logical codes ``q`` of shape (K_pad, N_pad), int8 in [-8, 7], to the bytes the kernels read,
and back. Add a layout by registering a :class:`WeightLayout`; ``QuantizedWeight.layout`` names one.

``wgmma_int4`` (the default, what the Hopper kernels read) is described in :mod:`nybble.packing.fragments`.

``nk_int4``: W^T stored K-major, shape (N_pad, K_pad // 2) uint8. Byte (n, j) holds q[2j, n]
in its low nibble and q[2j + 1, n] in its high nibble, two's complement. That is exactly the memory of a
``jnp.int4`` array of shape (N_pad, K_pad) (:func:`nk_int4_as_int4`, whose docstring says what XLA makes of
that view), so a Mosaic GPU kernel can TMA a (tile_n, tile_k // 2) byte block and load it as an int4
(tile_n, tile_k) WGMMA operand.

Each layout also declares where N and K live in its stored array (:class:`StoredDim`: the axis, logical values
per index, and the smallest block stored apart from the rest). That is what cuts a weight into tensor-parallel
shards without unpacking it (``nybble.sharding``): a cut along N or K must fall on a multiple of that
dimension's granule, and zero stored elements are zero codes (padding), in every layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from nybble import device
from nybble.packing.fragments import pack_wgmma_int4, unpack_wgmma_int4
from nybble.packing.nibbles import pack_int4, unpack_int4
from nybble.packing.planes import (
    pack_planes_int4,
    pack_planes_nk_int4,
    unpack_planes_int4,
    unpack_planes_nk_int4,
)


@dataclasses.dataclass(frozen=True)
class StoredDim:
    """Where one logical weight dimension (N or K) lives in a layout's stored codes array."""

    axis: int  # the stored array's axis that carries this dimension
    per_index: int  # logical values per index along that axis (2 for two nibbles of K in a byte)
    # The smallest run of this dimension stored apart from the rest, in logical values: a block starting and
    # ending on multiples of it is a plain slice of the stored array along ``axis`` (indices / per_index).
    granule: int
    unit: str = ""  # what one granule is called, for error messages ("byte", "8-row band")

    def __post_init__(self) -> None:
        if self.per_index < 1 or self.granule < 1 or self.granule % self.per_index:
            raise ValueError(
                f"StoredDim: granule {self.granule} must be a positive multiple of per_index {self.per_index}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightLayout:
    name: str
    # Logical int8 codes (K_pad, N_pad) -> stored uint8 array.
    pack: Callable[[Any], Any]
    # Stored uint8 array, K_pad -> logical int8 codes (K_pad, N_pad).
    unpack: Callable[[Any, int], Any]
    # Stored shape for a (K_pad, N_pad) weight.
    stored_shape: Callable[[int, int], tuple[int, ...]]
    description: str
    # Where N (output features) and K (input features) live in the stored array: what sharding slices.
    n: StoredDim
    k: StoredDim


def _nk_int4_pack(codes_kn: Any) -> Any:
    return pack_int4(codes_kn.T, axis=-1, signed=True)


def _nk_int4_unpack(packed: Any, k_pad: int) -> Any:
    if packed.dtype == jnp.int4:  # the same bytes viewed as int4 (nk_int4_as_int4): already one per value
        return packed.astype(jnp.int8).T[:k_pad]
    return unpack_int4(packed, k_pad, axis=-1, signed=True).T


def nk_int4_as_int4(packed: jax.Array) -> jax.Array:
    """Views ``nk_int4`` bytes (N_pad, K_pad // 2) as a ``jnp.int4`` array (N_pad, K_pad): a bitcast.

    What the compiled HLO shows (jax 0.11.2): on CUDA (compiled deviceless for sm_90a by
    ``python -m bench.xray``; docs/kernel-design.md) a free ``bitcast``, no copy. On the CPU XLA's
    BitcastDtypesExpander rewrites it into a shift-and-mask loop fusion: inside the XLA matmul path that
    fusion merges into the dequantization (no s4 array is written), but where the int4 array itself must
    exist (a jit output, an operand XLA cannot fuse into) that fusion writes a fresh s4 copy of the codes.
    """
    n_pad, half_k = packed.shape
    return jax.lax.bitcast_convert_type(packed, jnp.int4).reshape(n_pad, 2 * half_k)


LAYOUTS: dict[str, WeightLayout] = {}


def register_layout(layout: WeightLayout) -> WeightLayout:
    if layout.name in LAYOUTS:
        raise ValueError(f"layout {layout.name!r} is already registered")
    LAYOUTS[layout.name] = layout
    return layout


def get_layout(name: str) -> WeightLayout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown weight layout {name!r}; known layouts: {sorted(LAYOUTS)}") from None


register_layout(
    WeightLayout(
        name="nk_int4",
        pack=_nk_int4_pack,
        unpack=_nk_int4_unpack,
        stored_shape=lambda k_pad, n_pad: (n_pad, k_pad // 2),
        description="W^T K-major, two int4 per byte along K (low nibble = even k): jnp.int4 memory order",
        n=StoredDim(axis=0, per_index=1, granule=1, unit="row"),  # one row of bytes per output feature
        k=StoredDim(axis=1, per_index=2, granule=2, unit="byte"),  # a byte holds two values of K
    )
)
register_layout(
    WeightLayout(
        name="wgmma_int4",
        pack=pack_wgmma_int4,
        unpack=unpack_wgmma_int4,
        stored_shape=lambda k_pad, n_pad: (n_pad // 8, k_pad),
        description="uint32 words in WGMMA A-fragment order: 8-row bands, 64-K chunks, one lane's nibbles "
        "per word pair (nybble.packing.fragments); what the Hopper kernels read",
        n=StoredDim(axis=0, per_index=8, granule=8, unit="8-row band"),  # a row of words: 8 output features
        k=StoredDim(axis=1, per_index=1, granule=64, unit="64-K chunk"),  # 64 words, permuted within
    )
)
register_layout(
    WeightLayout(
        name="planes_int4",
        pack=pack_planes_int4,
        unpack=unpack_planes_int4,
        stored_shape=lambda k_pad, n_pad: (k_pad // 8, n_pad),
        description="uint32 words (K_pad / 8, N_pad): nibble i of word (j, n) is q[i K_pad / 8 + j, n] + 8 "
        "(nybble.packing.planes); planes_nk_int4 transposed, read by relayout",
        n=StoredDim(axis=1, per_index=1, granule=1, unit="column"),
        # Plane i interleaves rows i K_pad / 8: no run of K short of all of it is a plain slice.
        k=StoredDim(axis=0, per_index=8, granule=1 << 40, unit="whole K (planes interleave K)"),
    )
)
register_layout(
    WeightLayout(
        name="planes_nk_int4",
        pack=pack_planes_nk_int4,
        unpack=unpack_planes_nk_int4,
        stored_shape=lambda k_pad, n_pad: (n_pad, k_pad // 8),
        description="uint32 words (N_pad, K_pad / 8): nibble i of word (n, j) is q[i K_pad / 8 + j, n] + 8 "
        "(nybble.packing.planes); what the portable Triton kernel reads",
        n=StoredDim(axis=0, per_index=1, granule=1, unit="row"),
        k=StoredDim(axis=1, per_index=8, granule=1 << 40, unit="whole K (planes interleave K)"),
    )
)
DEFAULT_LAYOUT = "wgmma_int4"
# What the portable Triton kernel (nybble.kernels.triton) reads: the default on other NVIDIA GPUs.
TRITON_LAYOUT = "planes_nk_int4"


# Compute capability majors with a nybble Mosaic GPU kernel, which reads wgmma_int4.
MOSAIC_GPU_MAJORS = ("9", "10")


def default_layout() -> str:
    """The layout ``nybble.quantize`` writes when none is named, by the local GPU: ``wgmma_int4`` where a
    nybble Mosaic GPU kernel runs (compute capability 9.x, Hopper; 10.x, datacenter Blackwell) and on a CPU
    or TPU (the XLA path reads either), else ``planes_nk_int4`` on an NVIDIA GPU (Ampere, Ada, sm_120: the
    Triton kernel's). Chosen once, when quantizing or loading: a weight is never repacked per call
    (``nybble.quant.relayout`` converts one)."""
    gpu = device.gpu_device()
    cc = str(getattr(gpu, "compute_capability", "")) if gpu is not None else ""
    return DEFAULT_LAYOUT if not cc or cc.split(".")[0] in MOSAIC_GPU_MAJORS else TRITON_LAYOUT
