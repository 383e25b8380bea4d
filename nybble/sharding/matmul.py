"""``x @ W`` for a :class:`ShardedWeight`: one ``nybble.matmul`` per shard under ``jax.shard_map``.

Column-parallel: x is whole on every shard of the tensor-parallel axis, each shard returns its columns of y
(y stays sharded along N: the next row-parallel layer takes it as is). Row-parallel: x is cut along K like
the weight, each shard returns a partial y in x's dtype and ``psum`` (XLA's all-reduce) adds them, so y is
whole on every shard. The rows of x are split over the mesh's other axes when they divide M (data
parallelism; the weight is replicated over those axes), else every device takes all of them. On a mesh
with ``Explicit`` axes (``jax.make_mesh``'s default) x is resharded to that placement first.

Inside, each device runs ``nybble.kernels.matmul`` on its shard's ``QuantizedWeight`` with the implementation
asked for: the Mosaic GPU kernel once per shard on Hopper (or under ``nybble.kernels.interpret()``), the XLA
path elsewhere.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from nybble.kernels.ops.matmul.api import matmul
from nybble.sharding.weight import ShardedWeight


def row_axes(sw: ShardedWeight, m: int) -> tuple[str, ...] | None:
    """The mesh axes that split x's M rows: the non-tensor-parallel axes, when their sizes divide M."""
    axes = sw.parallel.batch_axes
    size = math.prod(sw.parallel.mesh.shape[a] for a in axes)
    return axes if axes and m % size == 0 else None


def sharded_matmul(x: Any, sw: ShardedWeight, *, implementation: str | None = None) -> jax.Array:
    """``x @ W`` for x of shape (..., K): one ``nybble.matmul`` per shard; the result is (..., N) in x.dtype.

    Row-parallel partial outputs are rounded to x.dtype before the all-reduce (half the bytes of a float32
    reduction, as Megatron-LM does), so their sum may differ from the unsharded product in the last bit.
    """
    k, n = sw.shape
    p = sw.parallel
    x2d = x.reshape(-1, k)
    rows = row_axes(sw, x2d.shape[0])
    codes_spec, scales_spec = sw.partition_specs()
    if p.split == "column":
        x_spec, out_spec = PartitionSpec(rows, None), PartitionSpec(rows, p.axis)
    else:
        x_spec, out_spec = PartitionSpec(rows, p.axis), PartitionSpec(rows, None)
    if any(t == AxisType.Explicit for t in getattr(p.mesh, "axis_types", ())):
        # Explicit mesh axes: shard_map takes x only as its in_spec says; move it there first.
        x2d = jax.reshard(x2d, NamedSharding(p.mesh, x_spec))
    arrays = (sw.codes, sw.scales) + (() if sw.offsets is None else (sw.offsets,))
    specs = (codes_spec, scales_spec) + (() if sw.offsets is None else (scales_spec,))

    def per_shard(x_local: jax.Array, *local: jax.Array) -> jax.Array:
        qw = sw.local(local[0], local[1], local[2] if len(local) > 2 else None)
        y = matmul(x_local, qw, implementation=implementation)  # type: ignore[arg-type]
        return jax.lax.psum(y, p.axis) if p.split == "row" else y

    y = jax.shard_map(per_shard, mesh=p.mesh, in_specs=(x_spec, *specs), out_specs=out_spec)(x2d, *arrays)
    return y.reshape(*x.shape[:-1], n)


__all__ = ["row_axes", "sharded_matmul"]
