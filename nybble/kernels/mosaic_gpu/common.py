"""What the W4A16 kernel variants share: operand checks, SMEM tilings, the dequantize+WGMMA step, the store.

Memory order of the codes (layout "nk_int4"): byte (n, j) of the uint8 (N_pad, K_pad / 2) array holds
k = 2j in the low nibble and k = 2j + 1 in the high nibble: exactly a jnp.int4 (N_pad, K_pad) array, the
element order WGMMA_UPCAST_4X loads from an int4 SMEM ref. Two ways into registers (config.codes_as):
  * "int4": TMA the int4 view, Mosaic's upcast path (fewest instructions per weight). Viewing uint8 codes
    as int4 costs XLA a copy of the codes (its BitcastDtypesExpander), so the heuristics use this where
    the GEMM is compute-bound, or when the codes are stored as int4;
  * "uint8": TMA the stored bytes, split each byte into its even-K and odd-K nibble with i32 shifts, and
    multiply them with x whose 64-chunks the wrapper de-interleaved (even K, then odd K). Zero-copy
    weights: the decode path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nybble.kernels.mosaic_gpu.config import DEQUANT_CHUNK_K, TuningConfig, scale_rows_per_step
from nybble.packing import groups

L = plgpu.Layout
# A per-row vector in the layout of a WGMMA register tile's rows: broadcast along K it lines up with the
# tile element for element, so scaling needs no shuffles.
WGMMA_ROW = L.WGMMA.reduce(1)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Static facts about one padded problem and config, derived once and shared by the kernel bodies."""

    m_pad: int
    n_pad: int
    k_pad: int
    group: int  # K rows per scale row (K_pad for per-column)
    dtype: Any  # activations and WGMMA operands
    has_offsets: bool
    config: TuningConfig

    @property
    def out_dtype(self) -> Any:
        """f32 partials under split-K (summed outside), else the activation dtype."""
        return jnp.float32 if self.config.split_k > 1 else self.dtype

    @property
    def cta_n(self) -> int:
        """Output columns per CTA: one tile_n per compute warpgroup."""
        return self.config.tile_n * self.config.compute_wgs

    @property
    def m_tiles(self) -> int:
        return self.m_pad // self.config.tile_m

    @property
    def n_tiles(self) -> int:
        return self.n_pad // self.cta_n

    @property
    def steps_per_split(self) -> int:
        return self.k_pad // self.config.tile_k // self.config.split_k

    @property
    def scale_rows(self) -> int:
        return scale_rows_per_step(self.config, self.group)

    @property
    def ctas(self) -> int:
        return self.m_tiles * self.n_tiles * self.config.split_k

    @property
    def threads(self) -> int:
        """Threads per CTA: 128 per compute warpgroup, plus the TMA warpgroup when warp-specialized."""
        return 128 * (self.config.compute_wgs + (1 if self.config.compute_wgs > 1 else 0))

    @property
    def weight_bytes_per_step(self) -> int:
        """Code bytes one pipeline step of one CTA brings in (scales not counted)."""
        return self.cta_n * self.config.tile_k // 2

    @property
    def weight_bytes_in_flight(self) -> int:
        """Code bytes a CTA has requested ahead of the step it computes: all slots but the busy one."""
        return (self.config.max_concurrent_steps - 1) * self.weight_bytes_per_step

    @property
    def dequantized_weights(self) -> int:
        """Weights dequantized over the whole launch: every M tile dequantizes all of W again."""
        return self.m_tiles * self.n_pad * self.k_pad

    @property
    def out_shape(self) -> tuple[int, ...]:
        split_k = self.config.split_k
        return (split_k, self.m_pad, self.n_pad) if split_k > 1 else (self.m_pad, self.n_pad)


def check_operands(
    x_pad: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    group: int,
    config: TuningConfig,
) -> Problem:
    """Validates padded operands against each other and the config; returns the problem's static facts."""
    m_pad, k_pad = x_pad.shape
    n_pad = codes.shape[0]
    want = {"int4": (jnp.int4, (n_pad, k_pad)), "uint8": (jnp.uint8, (n_pad, k_pad // 2))}
    dtype, shape = want[config.codes_as]
    if codes.dtype != dtype or tuple(codes.shape) != shape:
        raise ValueError(
            f"w4a16: config.codes_as={config.codes_as!r} needs {jnp.dtype(dtype).name} codes of shape "
            f"{shape} for x of shape {x_pad.shape}, got {codes.dtype} {tuple(codes.shape)}"
        )
    num_groups = groups.num_groups(k_pad, group)  # the last group may be partial
    if scales.shape != (num_groups, n_pad):
        raise ValueError(
            f"w4a16: scales have shape {scales.shape}, expected (ceil(K_pad / G), N_pad) = "
            f"({num_groups}, {n_pad})"
        )
    if offsets is not None and offsets.shape != scales.shape:
        raise ValueError(f"w4a16: offsets shape {offsets.shape} != scales shape {scales.shape}")
    config.check_problem(m_pad, n_pad, k_pad, group)
    return Problem(m_pad, n_pad, k_pad, group, x_pad.dtype, offsets is not None, config)


def smem_transforms(minor_elems: int, bits: int, what: str) -> tuple[Any, ...]:
    """Tiling + swizzle for an SMEM tile whose minor dimension holds ``minor_elems`` values."""
    swizzle = plgpu.find_swizzle(minor_elems * bits, what)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def operand_specs(p: Problem, mi: Any, ni: Any, k_first: Any, delay_release: int) -> list[Any]:
    """BlockSpecs of one K step: codes (cta_n, tile_k) int4 or (cta_n, tile_k / 2) uint8, x (tile_m,
    tile_k), scale [and offset] rows."""
    c = p.config
    chunk = min(DEQUANT_CHUNK_K, c.tile_k)
    x_bits = jnp.finfo(p.dtype).bits
    # Codes: a (cta_n, tile_k) block is tile_k / 2 bytes per row either way; the swizzle is sized for one
    # 64-wide chunk (32 bytes) so that each chunk is whole SMEM tiles and loads without re-tiling.
    if c.codes_as == "int4":
        w_block = (p.cta_n, c.tile_k)
        w_transforms = smem_transforms(chunk, 4, "int4 codes")
        x_transforms = smem_transforms(c.tile_k, x_bits, "activations")
    else:
        w_block = (p.cta_n, c.tile_k // 2)
        w_transforms = smem_transforms(chunk // 2, 8, "uint8 codes")
        # Each WGMMA reads half a chunk of x (32 values): 64-byte swizzle tiles make those whole tiles.
        x_transforms = smem_transforms(chunk // 2, x_bits, "activations")

    def scale_block(ki):
        # Block index of the scale rows for K step ki: one row when a group spans >= tile_k (group a
        # multiple of tile_k: row k * tile_k / G), else tile_k / G rows (block index = step index).
        if p.group >= c.tile_k:
            return ((k_first + ki) * c.tile_k) // p.group, ni
        return k_first + ki, ni

    specs = [
        plgpu.BlockSpec(
            w_block,
            lambda ki: (ni, k_first + ki),
            transforms=w_transforms,
            delay_release=delay_release,
        ),
        plgpu.BlockSpec(
            (c.tile_m, c.tile_k),
            lambda ki: (mi, k_first + ki),
            transforms=x_transforms,
            delay_release=delay_release,
        ),
        plgpu.BlockSpec((p.scale_rows, p.cta_n), scale_block, delay_release=delay_release),
    ]
    if p.has_offsets:
        specs.append(plgpu.BlockSpec((p.scale_rows, p.cta_n), scale_block, delay_release=delay_release))
    return specs


def tile_indices(p: Problem, lin: Any) -> tuple[Any, Any]:
    """(M tile, N tile) of the CTA with linear index ``lin``.

    Launch order: CTAs that run together cover a band of ``grid_tile_m`` M tiles sweeping along N (a
    "planar snake"), so each wave reads a few x tiles and a run of W tiles, both reused from L2, instead
    of all of x (N fastest) or all of W (M fastest).
    """
    if p.m_tiles == 1:
        return jnp.int32(0), lin
    band = min(p.config.grid_tile_m, p.m_tiles)
    return plgpu.planar_snake(lin, (p.m_tiles, p.n_tiles), 0, band)


def _scale_rows(p: Problem, s_smem: Any, o_smem: Any | None, w: Any, k0: int, k_stride: int) -> Any:
    """w * s + o in f32 for a (rows, cols) register tile whose column j holds K = k0 + k_stride * j.

    K offsets are within the step; s_smem / o_smem hold the step's scale rows (one row when a group
    spans the step). Columns of one group form runs of G / k_stride, each scaled by its own row.
    """
    cols = w.shape[1]
    run = min(cols, p.group // k_stride)
    parts = []
    for start in range(0, cols, run):
        r = (k0 + start * k_stride) // p.group if p.group < p.config.tile_k else 0
        wp = w if run == cols else w[:, start : start + run]
        # Scale rows are loaded in the row layout of the register tile and broadcast along K
        # (`s[:, None]` would defeat Warpgroup layout inference).
        s = plgpu.load(s_smem.at[r], layout=WGMMA_ROW).astype(jnp.float32)
        wp = wp * lax.broadcast_in_dim(s, wp.shape, [0])
        if o_smem is not None:
            o = plgpu.load(o_smem.at[r], layout=WGMMA_ROW).astype(jnp.float32)
            wp = wp + lax.broadcast_in_dim(o, wp.shape, [0])
        parts.append(wp)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def dequant_wgmma_step(
    p: Problem, acc_ref: Any, w_smem: Any, x_smem: Any, s_smem: Any, o_smem: Any | None
) -> None:
    """acc (tile_n, tile_m) += dequant(codes (tile_n, tile_k)) @ x (tile_m, tile_k)^T, in 64-wide K chunks.

    ``s_smem`` / ``o_smem`` hold this step's scale / offset rows for the warpgroup's tile_n columns.
    Leaves one WGMMA in flight (its x tile must outlive the step: delay_release=1).
    """
    tile_k = p.config.tile_k
    chunk = min(DEQUANT_CHUNK_K, tile_k)
    for c in range(tile_k // chunk):
        if p.config.codes_as == "int4":
            _int4_chunk(p, acc_ref, w_smem, x_smem, s_smem, o_smem, c * chunk, chunk)
        else:
            _uint8_chunk(p, acc_ref, w_smem, x_smem, s_smem, o_smem, c * chunk, chunk)
    # Orders this step's SMEM reads before the slots are refilled by TMA (the async proxy).
    plgpu.commit_smem()


def _int4_chunk(p, acc_ref, w_smem, x_smem, s_smem, o_smem, k0: int, chunk: int) -> None:
    """K [k0, k0 + chunk) from int4 codes: hardware-friendly upcast, one WGMMA of K = chunk."""
    ks = slice(k0, k0 + chunk)
    with jax.named_scope("smem_load_codes"):
        # UPCAST_4X: each thread loads whole bytes of the int4 tile; casting through UPCAST_2X to WGMMA
        # re-distributes the nibbles to the WGMMA A-fragment owners. (Casting UPCAST_4X straight to
        # WGMMA does not lower in jax 0.11.2.)
        q = plgpu.load(w_smem.at[:, ks], layout=L.WGMMA_UPCAST_4X)
        q = plgpu.layout_cast(q, L.WGMMA_UPCAST_2X)
        q = plgpu.layout_cast(q, L.WGMMA)
    with jax.named_scope("dequant"):
        # int4 -> bf16 takes Mosaic's CUTLASS-style path (shift, prmt, lop3 into a bf16 with exponent
        # 0x43 whose mantissa is the code, then one subtract of the 136 bias: two values per register);
        # bf16 -> f32 is a 16-bit shift. Both exact. Then w = q * s + o in f32 and one rounding to
        # x.dtype: the same numbers as nybble.dequantize and the XLA path.
        qf = q.astype(jnp.bfloat16).astype(jnp.float32)
        w = _scale_rows(p, s_smem, o_smem, qf, k0, k_stride=1).astype(p.dtype)
    with jax.named_scope("wgmma"):
        plgpu.wgmma(acc_ref, w, x_smem.at[:, ks].T)
        # Keep one WGMMA in flight: the next chunk's dequantization overlaps it. (ptxas serializes
        # rather than let a write hit the A registers of an in-flight WGMMA.)
        plgpu.wgmma_wait(1)


def _uint8_chunk(p, acc_ref, w_smem, x_smem, s_smem, o_smem, k0: int, chunk: int) -> None:
    """K [k0, k0 + chunk) from uint8 codes: nibbles split in registers, two WGMMAs of K = chunk / 2.

    Byte j of the chunk holds k0 + 2j (low nibble) and k0 + 2j + 1 (high nibble). Sign-extending each
    nibble gives two (tile_n, chunk / 2) tiles: the even and the odd K of the chunk. The wrapper stored
    x with each 64-chunk's K de-interleaved (even K first, then odd K), so x_smem[:, k0 : k0 + 32] are
    exactly the even K and x_smem[:, k0 + 32 : k0 + 64] the odd K: a dot product does not care about
    the order of its K terms, only that both operands agree.
    """
    half = chunk // 2
    with jax.named_scope("smem_load_codes"):
        b = plgpu.load(w_smem.at[:, k0 // 2 : k0 // 2 + half], layout=L.WGMMA)
        # 8-bit shifts do not lower: widen to i32 first. (b << 28) >> 28 sign-extends the low nibble,
        # (b << 24) >> 28 the high one (arithmetic shifts on i32).
        b = b.astype(jnp.int32)
        even = lax.shift_right_arithmetic(lax.shift_left(b, 28), 28)
        odd = lax.shift_right_arithmetic(lax.shift_left(b, 24), 28)
    for h, q in enumerate((even, odd)):
        with jax.named_scope("dequant"):
            # Same numbers as the int4 path: exact code -> f32, f32 FMA, one rounding to x.dtype. Column
            # j of a half is K = k0 + 2j + h (G is even, so k0 + 2j picks the same group).
            w = _scale_rows(p, s_smem, o_smem, q.astype(jnp.float32), k0, k_stride=2)
            w = w.astype(p.dtype)
        with jax.named_scope("wgmma"):
            plgpu.wgmma(acc_ref, w, x_smem.at[:, k0 + h * half : k0 + (h + 1) * half].T)
            plgpu.wgmma_wait(1)


def store_tile(p: Problem, acc: Any, out_smem: Any, out_gmem: Any, mi: Any, n_start: Any) -> None:
    """Writes the (tile_n, tile_m) accumulator y^T as y[m tile, n_start : n_start + tile_n]."""
    c = p.config
    with jax.named_scope("epilogue"):
        # Storing y^T through the transposed view of a (tile_m, tile_n) SMEM tile writes y itself, so the
        # output needs no transpose pass.
        out_smem.T[...] = plgpu.layout_cast(acc.astype(p.out_dtype), L.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        dst = out_gmem
        if c.split_k > 1:
            dst = dst.at[lax.axis_index("split")]
        dst = dst.at[pl.ds(mi * c.tile_m, c.tile_m), pl.ds(n_start, c.tile_n)]
        plgpu.copy_smem_to_gmem(out_smem, dst)
        plgpu.wait_smem_to_gmem(0)
