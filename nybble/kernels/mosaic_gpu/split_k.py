"""Split-K summed inside the launch: the ``split_k`` CTAs sharing an output tile form one thread-block
cluster.

Each CTA of the cluster computes the f32 partial of its 1 / split_k of K. The partials never reach HBM:

    1. every warpgroup stores its f32 accumulator into slabs in its own SMEM: slab r of an A tile holds
       its y rows [r, r + 1) * rows, rows = max(8, tile_m / split_k) (accumulator columns: the batch M is
       WGMMA's N);
    2. cluster barrier (:func:`cluster_sync`: every thread of every CTA, release / acquire at cluster
       scope): every partial is in SMEM and visible to the peers;
    3. CTA q reads its share of the slabs (``config.split_k_shares``: y rows r * rows + [0, rows) of a
       run of A tiles) from every CTA of the cluster through distributed shared memory
       (``plgpu.cluster_ref``), adds them in cluster order (CTA 0 first, in f32), rounds once to y's dtype
       and TMA-stores them: the CTAs share the reduction, 1 / split_k of the tile each;
    4. cluster barrier again: no CTA exits (freeing its SMEM) while a peer still reads it.

The kernels call :func:`store_partial` from their epilogue (step 1) and :func:`reduce` once after it, in
every warpgroup (steps 2-4; the warp-specialized kernel's TMA warpgroup only joins the barriers). The
slabs (the f32 tile) are kernel scratch; the y staging slab is allocated after the pipeline, in the
SMEM its stage buffers held.

So split-K costs one launch, like split_k = 1, and no f32 partials in HBM. Slabs are whole rows of 8
(WGMMA's N granule): where tile_m / split_k would be fewer, a CTA's share is 8 rows of fewer A tiles
(tile_m = 16, split_k = 4, tiles = 2: one A tile's 8 rows each). Each slab is its own SMEM allocation,
stored and read through the same transposed view as the usual epilogue's tile: jax 0.11.2 cannot lower a
peer reference to a *slice* of an SMEM buffer (the slice's offset is lost in the type). A cluster holds at
most 8 CTAs portably, hence ``MAX_SPLIT_K`` = 8.

GPU interpret mode cannot run this as it is: it cannot read a peer's SMEM (``ClusterRefTransform`` is
unsupported), on a 2-core CPU it cannot keep 8 CTAs of a cluster running at once (XLA's CPU client runs
two such executions at a time, the others queue behind the ones waiting at the barrier: a deadlock), and
its race detector rightly flags CTAs that exchange data through GMEM without a barrier it knows. So when
interpreting, one CTA plays the whole cluster: it runs the K partitions one after another (the kernels
loop over :func:`partitions`), stores each partition's accumulator into that partition's slabs in its own
SMEM (step 1), and then does step 3 for every CTA of the cluster in turn, reading partition q's slab
where the GPU reads CTA q's (:func:`peer_slab`). Slab bounds, summation order, rounding and the y stores
are the same code on both paths; the barriers and DSMEM reads are checked by lowering for CUDA and
compiling to SASS (bench/xray), and run on a GPU in tests/test_kernel_gpu.py.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nybble.kernels.mosaic_gpu.config import split_k_shares
from nybble.kernels.mosaic_gpu.interpret import active_params
from nybble.kernels.mosaic_gpu.staging import y_staging

L = plgpu.Layout
AXIS = "split"  # the cluster axis: the CTA's K partition


def slab_rows(tile_m: int, split_k: int, tiles: int = 1) -> int:
    """y rows of one slab: tile_m / split_k, at least 8 (``config.split_k_shares`` names the rules)."""
    return split_k_shares(tile_m, split_k, tiles)[0][0]


def _row_slabs(tile_m: int, split_k: int, tiles: int) -> int:
    """Slabs per A tile: tile_m / slab rows."""
    return tile_m // slab_rows(tile_m, split_k, tiles)


def interpreting() -> bool:
    return active_params() is not None


def launch_args(split_k: int) -> dict[str, Any]:
    """``plgpu.kernel`` grid and cluster arguments added to a grid of ``mn`` CTA tiles: the K partitions
    are the cluster; one grid index when there is one partition or when interpreting (see above)."""
    if interpreting() or split_k == 1:
        return dict(grid_extra=(1,), grid_names_extra=(AXIS,), cluster=(), cluster_names=())
    return dict(grid_extra=(), grid_names_extra=(), cluster=(split_k,), cluster_names=(AXIS,))


def partitions(split_k: int) -> list[int | None]:
    """The K partitions one CTA computes: its own (None: the cluster index), or all when interpreting."""
    return list(range(split_k)) if interpreting() and split_k > 1 else [None]


def scratch_types(tile_m: int, split_k: int, tiles: int, wgs: int = 1) -> list[Any]:
    """The slabs of ``wgs`` warpgroups of ``tiles`` 64-row A tiles, f32, each its own allocation: the row
    slabs of every A tile (times split_k partitions when interpreting), warpgroup by warpgroup. (The y
    staging slab is allocated by :func:`reduce`, in the SMEM the pipeline has released.)"""
    rows = slab_rows(tile_m, split_k, tiles)
    return [plgpu.SMEM((rows, 64), jnp.float32) for _ in range(scratch_count(tile_m, split_k, tiles, wgs))]


def scratch_count(tile_m: int, split_k: int, tiles: int, wgs: int = 1) -> int:
    """Refs :func:`scratch_types` allocates."""
    return wgs * len(partitions(split_k)) * tiles * _row_slabs(tile_m, split_k, tiles)


def warpgroup_slabs(scratch: list[Any], wg: int, wgs: int = 1) -> list[Any]:
    """Warpgroup ``wg``'s slabs among :func:`scratch_types`' refs."""
    per_wg = len(scratch) // wgs
    return scratch[wg * per_wg : (wg + 1) * per_wg]


def cluster_sync() -> None:
    """A barrier over every thread of every CTA in the cluster, ordering memory at cluster scope: SMEM
    stores before it are visible to peers' DSMEM loads after it (PTX ``barrier.cluster.arrive.release`` /
    ``wait.acquire``, the pattern CUTLASS's ``cluster_sync`` uses). Nothing when interpreting (no cluster)."""
    if interpreting():
        return

    @plgpu.inline_mgpu()
    def _(ctx: Any) -> None:
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import llvm

        del ctx
        for ptx in ("barrier.cluster.arrive.release.aligned;", "barrier.cluster.wait.acquire.aligned;"):
            llvm.inline_asm(ir.Type.parse("!llvm.void"), [], ptx, "", has_side_effects=True)


def _slab(slabs: list[Any], partition: int | None, t: int, r: int, row_slabs: int, tiles: int) -> Any:
    """Slab r of A tile t of ``partition`` (None: this CTA's own, the only one on the GPU)."""
    base = 0 if partition is None else partition * tiles * row_slabs
    return slabs[base + t * row_slabs + r]


def peer_slab(slabs: list[Any], q: int, t: int, r: int, row_slabs: int, tiles: int) -> jax.Array:
    """The (64, rows) f32 accumulator slab r of A tile t of cluster CTA ``q``: read through distributed SMEM
    on the GPU; when interpreting, partition q's own copy."""
    if interpreting():
        slab = _slab(slabs, q, t, r, row_slabs, tiles)
        return plgpu.load(slab.T, layout=L.WGMMA_TRANSPOSED)
    slab = _slab(slabs, None, t, r, row_slabs, tiles)
    # No layout named: the sum's store fixes it (common._row_values says why that lowers faster).
    return plgpu.load(plgpu.cluster_ref(slab, {AXIS: q}).T)


def store_partial(accs: list[Any], slabs: list[Any], partition: int | None) -> None:
    """Step 1: the warpgroup's f32 accumulators (one (64, tile_m) per A tile) into its slabs."""
    tiles, (_, tile_m) = len(accs), accs[0].shape
    rows = slabs[0].shape[0]
    row_slabs = tile_m // rows
    with jax.named_scope("split_k_store"):
        for t, acc in enumerate(accs):
            for r in range(row_slabs):
                part = acc[:, r * rows : (r + 1) * rows]
                slab = _slab(slabs, partition, t, r, row_slabs, tiles)
                slab.T[...] = plgpu.layout_cast(part, L.WGMMA_TRANSPOSED)


def reduce(
    slabs: list[Any],
    out_gmem: Any,
    *,
    m: int,
    tile_m: int,
    tiles: int,
    split_k: int,
    any_rows: bool,
    row0: Any,
    col0: Any,
    wg: Any = None,
    wgs: int = 1,
) -> None:
    """Steps 2-4, after every warpgroup's :func:`store_partial`; called by every warpgroup of the CTA at
    the same point (``wg``: the warpgroup index of a warp-specialized kernel, whose TMA warpgroup ``wgs``
    only joins the barriers; None for one warpgroup).

    ``slabs``: :func:`scratch_types`' refs. Warpgroup w's tile is y rows ``row0 + [0, tile_m)``, columns
    ``col0 + w * 64 * tiles + [0, 64 * tiles)`` of ``out_gmem`` (M, n); rows at or past ``m`` are not
    stored. ``any_rows``: ``config.stores_any_rows`` (y staged for a y of any number of rows,
    ``staging.y_staging``).
    """
    shares = split_k_shares(tile_m, split_k, tiles)
    rows, _, _, share_tiles = shares[0]

    def scoped(y_stage: Any) -> None:
        cluster_sync()
        for w in range(wgs):
            mine = functools.partial(
                _sum_shares,
                warpgroup_slabs(slabs, w, wgs),
                y_stage.at[w],
                out_gmem,
                shares,
                m=m,
                tile_m=tile_m,
                tiles=tiles,
                row0=row0,
                col0=col0 + w * 64 * tiles,
            )
            if wg is None:
                mine()
            else:
                pl.when(wg == w)(mine)
        cluster_sync()

    with jax.named_scope("split_k_reduce"):
        y_type = y_staging((wgs, rows, 64 * share_tiles), out_gmem.dtype, any_rows=any_rows)
        pl.run_scoped(scoped, y_type, **({} if wg is None else {"collective_axes": "wg"}))


def sum_partials(slabs: list[Any], partitions: int, t: int, r: int, row_slabs: int, tiles: int) -> jax.Array:
    """Slab r of A tile t summed over the first ``partitions`` K partitions' partials, in partition order."""
    total = peer_slab(slabs, 0, t, r, row_slabs, tiles)
    for q in range(1, partitions):
        total = total + peer_slab(slabs, q, t, r, row_slabs, tiles)
    return total


def _sum_shares(
    slabs: list[Any],
    y_stage: Any,
    out_gmem: Any,
    shares: list[tuple[int, int, int, int]],
    *,
    m: int,
    tile_m: int,
    tiles: int,
    row0: Any,
    col0: Any,
) -> None:
    """Step 3: this CTA's share of the y tile (every CTA's in turn when interpreting)."""
    split_k = len(shares)
    rows = y_stage.shape[0]
    row_slabs = tile_m // rows

    def sum_share(r: int, t0: int, count: int) -> None:
        for t in range(t0, t0 + count):
            total = sum_partials(slabs, split_k, t, r, row_slabs, tiles)
            y_stage.at[:, pl.ds((t - t0) * 64, 64)].T[...] = plgpu.layout_cast(
                total.astype(y_stage.dtype), L.WGMMA_TRANSPOSED
            )
        plgpu.commit_smem()
        y0 = row0 + r * rows
        plgpu.copy_smem_to_gmem(y_stage, out_gmem.at[pl.ds(y0, rows), pl.ds(col0 + t0 * 64, 64 * count)])
        plgpu.wait_smem_to_gmem(0)

    me = None if interpreting() else lax.axis_index(AXIS)
    for q, (_, r, t0, count) in enumerate(shares):
        mine = row0 + r * rows < m
        if me is not None:
            mine = mine & (me == q)
        pl.when(mine)(lambda r=r, t0=t0, count=count: sum_share(r, t0, count))
