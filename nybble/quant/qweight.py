"""``QuantizedWeight``: packed int4 codes, group scales, an optional offset term, and static metadata."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nybble.packing import get_layout, padded_weight_dims


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """An int4 weight of logical shape (K, N) = (in_features, out_features): a JAX pytree.

    Dequantization, for k < K and n < N, with G the effective group size (``block_k``)::

        w[k, n] = q[k, n] * scales[k // G, n] + offsets[k // G, n]      (offsets = 0 when symmetric)

    computed in float32. Codes ``q`` are always signed int4 in [-8, 7]; an asymmetric weight with unsigned
    codes ``u`` and zero point ``z`` (``w = (u - z) * s``) is stored as ``q = u - 8`` and
    ``offsets = (8 - z) * s``, so every kernel does one fused multiply-add per element.

    Arrays (pytree children):
      codes: laid out as ``layout`` says (``nk_int4``: uint8 (N_pad, K_pad // 2); ``wgmma_int4``: uint32
        (N_pad // 8, K_pad), what the Hopper kernels read; see ``nybble.packing``).
      scales: (K_pad // G, N_pad) in the scale dtype (bfloat16 by default).
      offsets: None, or like ``scales``.
    Static metadata: ``shape`` (K, N), ``group_size`` (None: one group per column), ``symmetric``,
    ``layout``. Padded rows and columns hold zero codes and zero scales.

    Padding rule (``nybble.packing.padded_weight_dims``): K_pad and N_pad are K and N rounded up to 64;
    the scales have ceil(K_pad / G) rows, so the LAST group may be partial (K = 576 at g128: 5 rows, the
    last covering 64 rows of K). Row k of the codes uses scale row k // G.
    """

    codes: jax.Array
    scales: jax.Array
    offsets: jax.Array | None
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    group_size: int | None = dataclasses.field(metadata=dict(static=True))
    symmetric: bool = dataclasses.field(metadata=dict(static=True))
    layout: str = dataclasses.field(metadata=dict(static=True), default="nk_int4")

    @property
    def padded_shape(self) -> tuple[int, int]:
        """(K_pad, N_pad): the shape the kernels see."""
        return padded_weight_dims(*self.shape, self.group_size)

    @property
    def block_k(self) -> int:
        """Rows of K that share one scale: the group size, or K_pad for per-column quantization."""
        return self.padded_shape[0] if self.group_size is None else self.group_size

    @property
    def num_groups(self) -> int:
        """Scale rows: ceil(K_pad / block_k); the last group may be partial."""
        return -(-self.padded_shape[0] // self.block_k)

    @property
    def dtype(self) -> np.dtype:
        """The scale dtype (the precision of dequantized values)."""
        return np.dtype(self.scales.dtype)

    @property
    def nbytes(self) -> int:
        """Real memory footprint in bytes: codes, scales and offsets, padding included."""
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in self._arrays())

    @property
    def bits_per_weight(self) -> float:
        """Footprint in bits per logical weight (4.125 for g128 with bf16 scales, before padding)."""
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])

    def _arrays(self) -> list[Any]:
        return [a for a in (self.codes, self.scales, self.offsets) if a is not None]

    def __repr__(self) -> str:
        k, n = self.shape
        group = "per-column" if self.group_size is None else f"g{self.group_size}"
        kind = "symmetric" if self.symmetric else "asymmetric"
        arrays = ", ".join(
            f"{name}={np.dtype(a.dtype).name}{list(a.shape)}"
            for name, a in (("codes", self.codes), ("scales", self.scales), ("offsets", self.offsets))
            if a is not None
        )
        return (
            f"QuantizedWeight(shape=({k}, {n}), {group}, {kind}, layout={self.layout!r}, {arrays}, "
            f"{self.nbytes / 2**20:.3f} MiB, {self.bits_per_weight:.3f} bits/weight)"
        )


def dequantize(qw: QuantizedWeight, dtype: Any = jnp.float32, *, padded: bool = False) -> jax.Array:
    """The (K, N) float weight a ``QuantizedWeight`` stands for (``padded=True``: (K_pad, N_pad)).

    Computed in float32 (one multiply-add per element) and then cast to ``dtype``: the exact values every
    nybble matmul implementation multiplies with.
    """
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"dequantize expects a QuantizedWeight, got {type(qw).__name__}")
    k_pad = qw.padded_shape[0]
    codes = get_layout(qw.layout).unpack(jnp.asarray(qw.codes), k_pad)
    w = scale_codes(codes, qw).astype(dtype)
    if padded:
        return w
    k, n = qw.shape
    return w[:k, :n]


def relayout(qw: QuantizedWeight, layout: str) -> QuantizedWeight:
    """The same weight with its codes stored in another named layout (``nybble.packing.LAYOUTS``); exact."""
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"relayout expects a QuantizedWeight, got {type(qw).__name__}")
    target = get_layout(layout)
    if layout == qw.layout:
        return qw
    codes = get_layout(qw.layout).unpack(qw.codes, qw.padded_shape[0])
    return dataclasses.replace(qw, codes=target.pack(codes), layout=layout)


def scale_codes(codes: jax.Array, qw: QuantizedWeight, *, k_axis: int = 0) -> jax.Array:
    """``q * scale + offset`` in float32 for padded codes whose K runs along ``k_axis`` (0: (K_pad, N_pad),
    1: (N_pad, K_pad)): the one definition of dequantization every path shares."""
    k_pad = qw.padded_shape[0]

    def per_row(a: jax.Array) -> jax.Array:
        return expand_groups(a if k_axis == 0 else a.T, qw.block_k, k_pad, axis=k_axis)

    w = codes.astype(jnp.float32) * per_row(qw.scales)
    return w if qw.offsets is None else w + per_row(qw.offsets)


def expand_groups(per_group: jax.Array, block_k: int, k_pad: int, axis: int = 0) -> jax.Array:
    """Repeats each group row ``block_k`` times along ``axis`` and cuts to ``k_pad`` rows, in float32."""
    full = jnp.repeat(per_group.astype(jnp.float32), block_k, axis=axis)
    return jax.lax.slice_in_dim(full, 0, k_pad, axis=axis)
