"""The kernels' K pipelines, with their SMEM slots unrolled: every slot index is a constant.

Drop-in for ``plgpu.emit_pipeline`` (with ``delay_release=1``) and ``plgpu.emit_pipeline_warp_specialized``
as nybble calls them. Pallas' pipelines compute each step's slot as ``step % slots`` at run time, so
every step recomputes its stage buffers' addresses, WGMMA descriptors and barrier parities from that
index (more when ``slots`` is not a power of two): in the X-ray a step of the warp-specialized kernel
at tiles=1 went from 200 instructions to 163 without that. Here the loop runs over rounds of ``slots``
steps and the slots are a Python loop: step ``r * slots + j`` uses slot ``j``, so all of that folds into
constants, for any number of slots.
When ``slots`` does not divide the steps, the last round's missing steps are skipped by a predicate
(the loop body stays ``slots`` steps long; Mosaic's layout inference takes superlinear time in it).

    TMA warpgroup:      for step s: wait consumed[s % slots] (s >= slots), TMA the operand blocks of
                        step s into slot s % slots, arriving on produced[s % slots] (a plain loop:
                        slots computed at run time, off the critical path).
    compute warpgroups: for step s: wait produced[s % slots], run the step (which fences its SMEM reads,
                        common.exact_weights_step), then release step s - 1's slot (consumed: one arrival
                        per compute warpgroup). The release is one step late because a step leaves its
                        last WGMMA in flight, reading x from the slot; the last step's slot is released
                        once its WGMMAs are done in a persistent CTA (in a CTA of one tile, never).

A persistent CTA (:class:`OutputTiles` with a count) runs these K steps once per output tile it owns, each
tile from slot 0 again: the TMA warpgroup goes on to the next tile's first steps as soon as their slots
are released, while the compute warpgroups still store the tile before (the epilogue overlaps the next
tile's loads). Every use of a slot but a CTA's first is preceded by a wait for its release; the TMA
warpgroup ends by taking each slot's last release.

The one-warpgroup kernel issues its own copies (:func:`emit_pipeline`): the first round fills
every slot, and after step s (whose body fences its SMEM reads) the warpgroup refills step s - 1's slot
with step s + slots - 1, as ``plgpu.emit_pipeline`` does with ``delay_release=1``.

In the warp-specialized pipeline the two roles are the two sides of one ``lax.cond``: with two
``pl.when`` blocks instead, ptxas spills (the X-ray: 48 bytes at tiles=1, split_k=4), as code after the
first block must fit the TMA warpgroup's 40 registers.

:func:`constant_slots` says where the kernels use these: the warp-specialized kernel always, the
one-warpgroup kernel with one A tile and groups of whole 64-wide chunks. With groups of 16 or 32 a
one-warpgroup step has 4-16 times the operations, and compiling its unrolled steps took 52-132 s per
kernel (X-ray, K = N = 4096, M = 1 and 16) for 0.15-0.27 fewer instructions per weight; the warp-specialized
kernel's took 7-19 s for 0.8-1.0 fewer (M = 128 and 2048, groups of 32: 3.53 -> 2.70 and 3.81 -> 2.84).
Two A tiles in one warpgroup need too many registers. The accumulator route (scales on the accumulators)
keeps Pallas' pipeline: unrolled, ptxas interleaved consecutive steps' group accumulators and spilled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nybble.kernels.mosaic_gpu.config import CHUNK_K, TuningConfig

# Registers per thread of the SM's 64K that one warpgroup could use alone (65536 / 128).
_REGISTER_FILE_PER_THREAD = 512
# Registers per thread the memory warpgroup keeps (the producer of the one-warpgroup kernel, the TMA
# warpgroup of the warp-specialized one): it only issues copies and waits on barriers.
MEMORY_REGISTERS = 40


def constant_slots(config: TuningConfig, group: int) -> bool:
    """Whether the exact-weights kernel of ``config`` pipelines with constant slots (this module), for
    groups of ``group`` K rows, rather than with Pallas' pipelines: the warp-specialized kernel always; the
    one-warpgroup kernel with one A tile and groups of at least one 64-wide chunk (two A tiles of 256-wide
    steps, unrolled over 4 slots, need more than 255 registers: 128 bytes spilled in the X-ray of
    Llama-3-70B gate-up at M = 64; smaller groups compile for minutes, see the module docstring)."""
    return config.compute_wgs > 1 or (config.tiles == 1 and group >= CHUNK_K)


def compute_registers(memory_registers: int, compute_wgs: int) -> int:
    """Registers per thread the compute warpgroups raise themselves to: what the TMA warpgroup leaves,
    shared evenly, a multiple of 8, at most 256 (``setmaxnreg``'s range)."""
    per_wg = min(256, (_REGISTER_FILE_PER_THREAD - memory_registers) // compute_wgs)
    return per_wg // 8 * 8


def _block(gmem: Any, spec: Any, step: Any) -> Any:
    """The GMEM block of ``spec`` for K step ``step``: its index map counts blocks, not elements."""
    index = spec.index_map(step)
    return gmem.at[tuple(pl.ds(i * b, b) for i, b in zip(index, spec.block_shape, strict=True))]


def _stage_types(gmem: Sequence[Any], specs: Sequence[Any], slots: int) -> list[Any]:
    """One SMEM buffer of ``slots`` blocks per operand (with the spec's tiling and swizzle)."""
    return [
        plgpu.SMEM((slots, *spec.block_shape), src.dtype, transforms=tuple(spec.transforms or ()))
        for src, spec in zip(gmem, specs, strict=True)
    ]


def _fetch(
    gmem: Sequence[Any], specs: Sequence[Any], bufs: Sequence[Any], produced: Any, step: Any, slot: Any
):
    """TMA of every operand's block of K step ``step`` into ``slot``, arriving on produced[slot]."""
    for src, spec, buf in zip(gmem, specs, bufs, strict=True):
        plgpu.copy_gmem_to_smem(_block(src, spec, step), buf.at[slot], produced.at[slot])


def _steps(grid: Sequence[int], slots: int) -> int:
    if len(grid) != 1 or grid[0] < 1 or slots < 2:
        raise ValueError(f"pipeline: a grid of one axis of >= 1 steps and >= 2 slots, got {grid}, {slots}")
    return int(grid[0])


def _when(predicate: Any, fn: Callable[[], None]) -> None:
    """``fn()`` if ``predicate``: a Python bool decided now, or a traced one."""
    if predicate is True:
        fn()
    elif predicate is not False:
        pl.when(predicate)(fn)


def _for_each_step(steps: int, slots: int, one: Callable[[Any, int], None]) -> None:
    """``one(step, slot)`` for steps 0 .. steps - 1: rounds of ``slots`` steps, slot a constant in each
    copy; the last round's steps past the end are skipped by a predicate. One round runs unrolled."""
    full, partial = divmod(steps, slots)
    rounds = full + (partial > 0)

    def round_body(r: Any, carry: None = None) -> None:
        for slot in range(slots):
            valid = True if partial == 0 or slot < partial else r < full
            _when(valid, lambda slot=slot: one(r * slots + slot, slot))

    if rounds == 1:
        round_body(0)
    else:
        lax.fori_loop(0, rounds, round_body, None)


def emit_pipeline(
    body: Callable[..., None], *, grid: Sequence[int], in_specs: Sequence[Any], max_concurrent_steps: int
) -> Callable[..., None]:
    """``plgpu.emit_pipeline(..., delay_release=1)`` for one warpgroup, with constant slots.

    ``body((step,), *slot_refs)`` must fence its SMEM reads before it returns (``plgpu.commit_smem``): the
    warpgroup then refills the slot of the step before.
    """
    slots = max_concurrent_steps
    steps = _steps(grid, slots)

    def pipeline(*gmem: Any) -> None:
        def scoped(*refs: Any) -> None:
            *bufs, produced = refs
            for step in range(min(slots, steps)):  # the first round fills every slot
                _fetch(gmem, in_specs, bufs, produced, step, step)

            def one(step: Any, slot: int) -> None:
                plgpu.barrier_wait(produced.at[slot])
                body((step,), *(b.at[slot] for b in bufs))
                refill = step + slots - 1  # into step - 1's slot (step 0 has none; slot >= 1 is never step 0)
                _when(
                    (slot >= 1 or step >= 1) & (refill < steps),
                    lambda: _fetch(gmem, in_specs, bufs, produced, refill, (slot - 1) % slots),
                )

            _for_each_step(steps, slots, one)

        types = _stage_types(gmem, in_specs, slots)
        types.append(plgpu.Barrier(num_arrivals=len(in_specs), num_barriers=slots))
        pl.run_scoped(scoped, *types)

    return pipeline


@dataclasses.dataclass(frozen=True)
class OutputTiles:
    """The output tiles a CTA runs: its own (``count`` None: the tile of index ``lax.axis_index(axis)``), or
    a persistent grid's share of ``count`` tiles: the CTAs along grid axis ``axis`` take tiles cta, cta +
    CTAs, cta + 2 * CTAs, ... in turn (``plgpu.nd_loop``)."""

    axis: str
    count: int | None = None

    def run(self, fn: Callable[[Any, Any], None]) -> None:
        """``fn(tile, local)`` for each of this CTA's tiles; ``local`` counts the CTA's tiles before it (a
        Python 0 for a CTA of one tile)."""
        if self.count is None:
            fn(lax.axis_index(self.axis), 0)
            return

        @plgpu.nd_loop((self.count,), collective_axes=self.axis)
        def _(info: Any) -> None:
            fn(info.index[0], info.local_index)


def emit_pipeline_warp_specialized(
    body: Callable[..., Any],
    *,
    grid: Sequence[int],
    memory_registers: int,
    in_specs: Callable[[Any], Sequence[Any]],
    wg_axis: str,
    num_compute_wgs: int,
    max_concurrent_steps: int,
    compute_context: Callable[[Callable[[Any], Any], Any], None],
    output_tiles: OutputTiles,
) -> Callable[..., None]:
    """``plgpu.emit_pipeline_warp_specialized`` as nybble calls it, with constant slots and, optionally, a
    persistent grid: warpgroup ``num_compute_wgs`` issues the copies, the others compute.

    For each output tile of ``output_tiles``: ``in_specs(tile)`` are its operands' BlockSpecs (their block
    shapes and transforms must not depend on the tile); ``compute_context(run_pipeline, tile)`` runs in
    every compute warpgroup; ``run_pipeline(carry)`` runs the tile's K loop there, ``body((step,),
    *slot_refs, carry)`` each step. The carry must be a ref (the accumulator), returned unchanged: steps
    past the end of the last round are skipped under a predicate.
    """
    slots, wgs = max_concurrent_steps, num_compute_wgs
    steps = _steps(grid, slots)
    persistent = output_tiles.count is not None
    # After the pipeline every warpgroup returns to an even share, the launch's own, so that the code
    # after it (the split-K reduction, run by all warpgroups) is compiled for that many registers, not for
    # the TMA warpgroup's few (ptxas spilled there: 16-64 bytes in the X-ray at tiles=1, split_k=4).
    even = _REGISTER_FILE_PER_THREAD // (wgs + 1) // 8 * 8

    def pipeline(*gmem: Any) -> None:
        def scoped(*refs: Any) -> None:
            *bufs, produced, consumed = refs

            def memory() -> None:
                plgpu.set_max_registers(memory_registers, action="decrease")

                def tile_copies(tile: Any, local: Any) -> None:
                    specs = in_specs(tile)

                    # A plain loop here: the copies are not on the critical path, and unrolled slots would
                    # need more than the 40 registers this warpgroup keeps (ptxas then spills values that
                    # live across the pipeline, e.g. the split-K epilogue's tile indices).
                    @pl.loop(0, steps)
                    def _(step: Any) -> None:
                        slot = lax.rem(step, slots)
                        # The CTA's first round finds every slot free; later uses wait for a release.
                        used = step >= slots if isinstance(local, int) else (local > 0) | (step >= slots)
                        pl.when(used)(lambda: plgpu.barrier_wait(consumed.at[slot]))
                        _fetch(gmem, specs, bufs, produced, step, slot)

                output_tiles.run(tile_copies)
                # Take the releases nobody waited for, so that no arrival is left pending on a barrier when
                # the scope ends: each slot's last one (a persistent CTA), or those of steps - slots ..
                # steps - 2 (the last step's slot is never released in a CTA of one tile).
                last = range(min(slots, steps)) if persistent else range(max(0, steps - slots), steps - 1)
                for step in last:
                    plgpu.barrier_wait(consumed.at[step % slots])
                plgpu.set_max_registers(even, action="increase")

            def run_pipeline(carry: Any) -> Any:
                def one(step: Any, slot: int) -> None:
                    plgpu.barrier_wait(produced.at[slot])
                    body((step,), *(b.at[slot] for b in bufs), carry)
                    # Release step - 1's slot (step 0 has none; slot >= 1 is never step 0).
                    _when(
                        slot >= 1 or step >= 1, lambda: plgpu.barrier_arrive(consumed.at[(slot - 1) % slots])
                    )

                _for_each_step(steps, slots, one)
                if persistent:  # the next tile reuses the slots: release the last step's once its WGMMAs
                    # (which read x from it) are done
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[(steps - 1) % slots])
                return carry

            def compute() -> None:
                plgpu.set_max_registers(compute_registers(memory_registers, wgs), action="increase")
                output_tiles.run(lambda tile, local: compute_context(run_pipeline, tile))
                plgpu.set_max_registers(even, action="decrease")

            lax.cond(lax.axis_index(wg_axis) < wgs, compute, memory)

        specs = in_specs(0)  # the stage buffers' shapes and transforms: the same for every tile
        types = _stage_types(gmem, specs, slots)
        types.append(plgpu.Barrier(num_arrivals=len(specs), num_barriers=slots))
        types.append(plgpu.Barrier(num_arrivals=wgs, num_barriers=slots))
        pl.run_scoped(scoped, *types, collective_axes=wg_axis)

    return pipeline
