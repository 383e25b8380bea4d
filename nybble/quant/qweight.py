"""``QuantizedWeight``: packed int4 codes, group scales, an optional offset term, and static metadata."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nybble.packing import (
    DEFAULT_LAYOUT,
    WeightLayout,
    check_group_size,
    get_layout,
    group_rows,
    num_groups,
    pad_to,
    padded_weight_dims,
)

SCALE_DTYPES = ("bfloat16", "float16", "float32")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """An int4 weight of logical shape (K, N) = (in_features, out_features): a JAX pytree.

    Dequantization, for k < K and n < N, with G = ``group`` the rows of K per scale row::

        w[k, n] = q[k, n] * scales[k // G, n] + offsets[k // G, n]      (offsets = 0 when symmetric)

    computed in float32. Codes ``q`` are always signed int4 in [-8, 7]; an asymmetric weight with unsigned
    codes ``u`` and zero point ``z`` (``w = (u - z) * s``) is stored as ``q = u - 8`` and
    ``offsets = (8 - z) * s``, so every kernel does one fused multiply-add per element.

    Arrays (pytree children):
      codes: laid out as ``layout`` says (``nk_int4``: uint8 (N_pad, K_pad // 2), whose bytes viewed as a
        ``jnp.int4`` (N_pad, K_pad) array are accepted too; ``wgmma_int4``: uint32 (N_pad // 8, K_pad),
        what the Hopper kernels read; see ``nybble.packing``).
      scales: (num_groups, N_pad) in the scale dtype (bfloat16 by default).
      offsets: None when symmetric, else like ``scales``.
    Static metadata: ``shape`` (K, N), ``group_size`` (None: one group per column), ``symmetric``,
    ``layout``. Padded rows and columns hold zero codes and zero scales.

    The geometry is this class's (``padded_shape``, ``group``, ``num_groups``; the rules are in
    ``nybble.packing.padding`` and ``nybble.packing.groups``): K_pad and N_pad are K and N rounded up to
    64, and the scales have ceil(K_pad / G) rows, so the LAST group may be partial (K = 576 at g128: 5 rows,
    the last covering 64 rows of K).

    A weight checks itself on construction: group size, layout, and the shapes and dtypes of whatever
    arrays it holds (abstract ones too; leading batch axes are allowed). Build one from logical codes
    with :meth:`from_codes`, which pads and packs.
    """

    codes: jax.Array
    scales: jax.Array
    offsets: jax.Array | None
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    group_size: int | None = dataclasses.field(metadata=dict(static=True))
    symmetric: bool = dataclasses.field(metadata=dict(static=True))
    layout: str = dataclasses.field(metadata=dict(static=True), default=DEFAULT_LAYOUT)

    def __post_init__(self) -> None:
        shape = self.shape
        if (
            not isinstance(shape, tuple)
            or len(shape) != 2
            or not all(isinstance(d, int | np.integer) and d > 0 for d in shape)
        ):
            raise ValueError(f"QuantizedWeight: shape must be (K, N), two positive ints, got {shape!r}")
        check_group_size(self.group_size)
        self.weight_layout  # noqa: B018 - raises for an unknown layout, naming the known ones
        if not isinstance(self.symmetric, bool | np.bool_):
            raise TypeError(f"QuantizedWeight: symmetric must be a bool, got {self.symmetric!r}")
        # pytree leaves can be anything JAX puts there (None, object(), axis specs): arrays only.
        if _is_array(self.codes):
            self._check_codes()
        if _is_array(self.scales):
            self._check_params()

    @classmethod
    def from_codes(
        cls,
        codes: Any,
        scales: Any,
        offsets: Any = None,
        *,
        shape: tuple[int, int],
        group_size: int | None,
        layout: str = DEFAULT_LAYOUT,
    ) -> QuantizedWeight:
        """A weight from logical codes: int8 in [-8, 7], (K, N) or already padded to (K_pad, N_pad).

        Codes are zero-padded to (K_pad, N_pad) and packed into ``layout``; ``scales`` and ``offsets``
        (None: symmetric) are zero-padded to (num_groups, N_pad). Works on numpy and jax arrays, under
        ``jit`` too; the stored arrays are jax arrays.
        """
        k, n = shape
        check_group_size(group_size)
        k_pad, n_pad = padded_weight_dims(k, n)
        rows = (num_groups(k_pad, group_size), n_pad)
        packed = get_layout(layout).pack(pad_to(codes, (k_pad, n_pad)))
        return cls(
            codes=jnp.asarray(packed),
            scales=jnp.asarray(pad_to(scales, rows)),
            offsets=None if offsets is None else jnp.asarray(pad_to(offsets, rows)),
            shape=(int(k), int(n)),
            group_size=group_size,
            symmetric=offsets is None,
            layout=layout,
        )

    @property
    def padded_shape(self) -> tuple[int, int]:
        """(K_pad, N_pad): the shape the kernels see."""
        return padded_weight_dims(*self.shape)

    @property
    def group(self) -> int:
        """Rows of K per scale row: the group size, or K_pad for per-column quantization."""
        return group_rows(self.padded_shape[0], self.group_size)

    @property
    def block_k(self) -> int:
        """The same as :attr:`group` (its older name)."""
        return self.group

    @property
    def num_groups(self) -> int:
        """Scale rows: ceil(K_pad / group); the last group may be partial."""
        return num_groups(self.padded_shape[0], self.group_size)

    @property
    def weight_layout(self) -> WeightLayout:
        """The registered :class:`nybble.packing.WeightLayout` named by ``layout``."""
        return get_layout(self.layout)

    def logical_codes(self) -> jax.Array:
        """The codes as int8 (K_pad, N_pad) in [-8, 7], unpacked from the layout (exact)."""
        return self.weight_layout.unpack(self.codes, self.padded_shape[0])

    def _check_codes(self) -> None:
        k_pad, n_pad = self.padded_shape
        shape, dtype = _stored_codes(self.layout, k_pad, n_pad)
        got = np.dtype(self.codes.dtype)
        if got == np.dtype(jnp.int4) and dtype == np.uint8:  # the same bytes as int4: two values a byte
            shape = (*shape[:-1], 2 * shape[-1])
        elif got != dtype and got != jax.dtypes.float0:  # float0: a zero cotangent
            raise ValueError(
                f"QuantizedWeight: layout {self.layout!r} stores {dtype.name} codes, got dtype {got.name}"
            )
        if tuple(self.codes.shape[-len(shape) :]) != shape:
            raise ValueError(
                f"QuantizedWeight: codes of shape {tuple(self.codes.shape)} do not fit layout "
                f"{self.layout!r} for shape {self.shape} (padded {(k_pad, n_pad)}): expected {shape}"
            )

    def _check_params(self) -> None:
        rows = (self.num_groups, self.padded_shape[1])
        dtype = np.dtype(self.scales.dtype)
        if dtype.name not in SCALE_DTYPES:
            raise ValueError(f"QuantizedWeight: scales must be one of {SCALE_DTYPES}, got {dtype.name}")
        if tuple(self.scales.shape[-2:]) != rows:
            group = "per column" if self.group_size is None else f"g{self.group_size}"
            raise ValueError(
                f"QuantizedWeight: scales of shape {tuple(self.scales.shape)} do not fit shape "
                f"{self.shape} at {group}: expected (num_groups, N_pad) = {rows} (ceil(K_pad / G) rows)"
            )
        if (self.offsets is None) != bool(self.symmetric):
            raise ValueError(
                f"QuantizedWeight: symmetric={self.symmetric} but offsets are "
                f"{'missing' if self.offsets is None else 'present'}: offsets are None exactly when symmetric"
            )
        if _is_array(self.offsets) and tuple(self.offsets.shape) != tuple(self.scales.shape):
            raise ValueError(
                f"QuantizedWeight: offsets of shape {tuple(self.offsets.shape)} != scales "
                f"{tuple(self.scales.shape)}"
            )

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
        stacked = int(np.prod(self.codes.shape[:-2])) if np.ndim(self.codes) > 2 else 1  # experts
        return 8 * self.nbytes / (self.shape[0] * self.shape[1] * stacked)

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

    A stacked weight (experts on a leading axis, ``nybble.quant.stacked``) gives (E, K, N).

    Computed in float32 (one multiply-add per element) and then cast to ``dtype``: the exact values every
    nybble matmul implementation multiplies with.
    """
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"dequantize expects a QuantizedWeight, got {type(qw).__name__}")
    if np.ndim(qw.codes) > 2:  # a stack of experts (nybble.quant.stacked): each one as a plain weight
        return jax.vmap(lambda one: _dequantize(one, dtype=np.dtype(dtype), padded=padded))(qw)
    return _dequantize(qw, dtype=np.dtype(dtype), padded=padded)


# One XLA program per weight structure and dtype (eagerly, not a compile per jnp operation).
@functools.partial(jax.jit, static_argnames=("dtype", "padded"))
def _dequantize(qw: QuantizedWeight, *, dtype: np.dtype, padded: bool) -> jax.Array:
    w = scale_codes(qw.logical_codes(), qw).astype(dtype)
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
    return dataclasses.replace(qw, codes=_repacked_codes(qw, target.name), layout=layout)


@functools.partial(jax.jit, static_argnames="layout")
def _repacked_codes(qw: QuantizedWeight, layout: str) -> jax.Array:
    """``qw``'s codes unpacked and packed into ``layout``: one XLA program per weight structure."""
    return get_layout(layout).pack(qw.logical_codes())


def scale_codes(
    codes: jax.Array, qw: QuantizedWeight, *, k_axis: int = 0, dtype: Any = jnp.float32
) -> jax.Array:
    """``q * scale + offset`` for padded codes whose K runs along ``k_axis`` (0: (K_pad, N_pad), 1:
    (N_pad, K_pad)): the one definition of dequantization every path shares.

    Computed in ``dtype``: float32 (the default, ``nybble.dequantize``'s exact values) or an activation
    dtype (the XLA path, so that no float32 copy of the weight exists: the multiply then rounds as in
    float32 and rounds again to ``dtype``, which is exact for symmetric groups, q * s having at most 12
    significant bits; an offset adds a second rounding, as on the Mosaic kernel's exact-weights route)."""
    k_pad = qw.padded_shape[0]

    def per_row(a: jax.Array) -> jax.Array:
        return expand_groups(a if k_axis == 0 else a.T, qw.group, k_pad, axis=k_axis, dtype=dtype)

    w = codes.astype(dtype) * per_row(qw.scales)
    return w if qw.offsets is None else w + per_row(qw.offsets)


def expand_groups(
    per_group: jax.Array, group: int, k_pad: int, axis: int = 0, dtype: Any = jnp.float32
) -> jax.Array:
    """Repeats each group row ``group`` times along ``axis`` and cuts to ``k_pad`` rows, in ``dtype``."""
    full = jnp.repeat(per_group.astype(dtype), group, axis=axis)
    return jax.lax.slice_in_dim(full, 0, k_pad, axis=axis)


@functools.cache
def _stored_codes(layout: str, k_pad: int, n_pad: int) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of the codes ``layout`` stores for a (K_pad, N_pad) weight (traced once, cached)."""
    out = jax.eval_shape(get_layout(layout).pack, jax.ShapeDtypeStruct((k_pad, n_pad), jnp.int8))
    return tuple(out.shape), np.dtype(out.dtype)


def _is_array(x: Any) -> bool:
    """An array, tracer or ShapeDtypeStruct (not None or another object JAX put in a pytree slot)."""
    return hasattr(x, "shape") and hasattr(x, "dtype")
