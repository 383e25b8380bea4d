"""Register-level pieces of the W4A16 kernel: ``wgmma_int4`` codes to WGMMA A fragments, and the K-slice sum.

Pallas cannot relabel registers (a bitcast that changes the element width, or a shuffle-free change of
layout), so the three steps that need it are written one level down, in Mosaic GPU, inside
``plgpu.inline_mgpu``:

* :func:`dequantize_chunk`: a 64 x 64 chunk of codes (8 bands x 64 words, two words per lane, one
  ``LDS.64``; see ``nybble.packing.fragments``) becomes the bf16 WGMMA A operand. Per 32-bit word of 8
  nibbles: ``(w >> 4u) & 0x000F000F`` puts nibbles u and u + 4 at the bottom of the two 16-bit halves; the
  same LOP3 XORs in 0x4308 in each half, which sets the exponent of 2^7 (so the 7-bit mantissa counts
  units: 128 + m) and flips the nibble's sign bit (two's-complement q -> q + 8): one instruction turns
  two codes q into two bf16 values 136 + q, exactly. With ``exact=True`` one ``sub.bf16x2`` of 136 more
  gives q itself. The four resulting bf16x2 registers are, with no data movement, the fragment registers
  (column tile 4q' + u, row half h) of WGMMA's layout. Per 8 weights: 3 SHF + 4 LOP3 (+ 4 HSUB2).
* :func:`slot_rows`: per-row values (group scales) for the A rows of a K-sliced tile (see below), gathered
  from SMEM by each lane for its own two rows.
* :func:`sum_slices`: the epilogue of a K-sliced tile.

**K slices in WGMMA's N.** A decode step has M <= 8 rows of x, but WGMMA's N is at least 8: the padding
columns would multiply zeros. With S slices, K is cut into S equal slices and x is viewed as (M * S, K / S):
B row c = m * S + j holds x[m] over slice j. The 64 A rows of a tile are 8 slots (8 rows each) taken from
8 / S bands x S slices: slot b = band * S + j, so A row r works on slice j(r) = (r // 8) % S for output row
n(r) = 8 * (r // (8 S)) + r % 8. acc[r, c] is useful where c % S == j(r), and y[m, n] is the sum over the S
slices: one warpgroup covers 64 / S output rows over all of K, so a decode GEMM needs no split-K.

In GPU interpret mode ``inline_mgpu`` cannot run; each function then computes the same values with
jax.numpy on the logical arrays (the interpreter keeps arrays, not registers). The bit operations of the
GPU path are modelled exactly by :func:`reference_dequantize_words`, tested exhaustively on the CPU; the
GPU path itself runs in tests/test_kernel_gpu.py.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from nybble.kernels.epilogue import residual_norm, swiglu
from nybble.kernels.mosaic_gpu.interpret import active_params
from nybble.packing.gate_up import GATE_UP_BLOCK

L = plgpu.Layout
# Words of one 64 x 64 chunk: SMEM (8 slots, 64 words). Lane l of warp w loads words (2l, 2l + 1) of slots
# 2w and 2w + 1 (its two row halves): tiling (8, 64) -> (2, 64) -> (2,), warps over the 4 slot pairs, lanes
# over the 32 word pairs, a vector of 2 words (LDS.64).
CHUNK = 64
# Per 16-bit half: the exponent that makes the low mantissa bits count units, XORed with 8 (the nibble's
# flipped sign bit), and the value of that pattern at nibble 0: bf16 2^7 + 8 = 136, f16 2^10 + 8 = 1032.
MAGIC = {"bfloat16": 0x4308, "float16": 0x6408}
BIAS = {"bfloat16": 136, "float16": 1032}


def _name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    if name not in MAGIC:
        raise ValueError(f"int4 codes dequantize to bfloat16 or float16, not {name}")
    return name


def words_layout(slots: int = 8) -> Any:
    """How a chunk's words load: ``slots`` (8: a 64-row tile, WGMMA's rows; 16: two tiles, tcgen05's 128
    rows) x 64 words, warp w taking slots (slots / 4) w .. (slots / 4) (w + 1) - 1 (its rows), lane l words
    (2l, 2l + 1) of each (one ``LDS.64``)."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    tiling = fa.Tiling(((slots, 64), (slots // 4, 64), (2,)))
    return L.TILED(tiling, warp_dims=(-5,), lane_dims=(-2,), vector_dim=-1)


# --------------------------------------------------------------------------- the bit operations, modelled


def reference_dequantize_words(words: np.ndarray, exact: bool, dtype: Any = "bfloat16") -> np.ndarray:
    """The GPU's bit operations on uint32 words, in numpy: (..., 4 [u]) uint32 of two 16-bit patterns.

    Element [..., u] is ``((w >> 4u) & 0x000F000F) ^ MAGIC`` (MAGIC in both halves), and with ``exact``
    the 16-bit-pair difference with MAGIC (136.0 or 1032.0), both halves exact. Bit patterns, so that
    tests can compare bit for bit.
    """
    name = _name(dtype)
    magic = np.uint32(MAGIC[name] * 0x10001)
    w = np.asarray(words, np.uint32)[..., None]
    t = ((w >> (4 * np.arange(4, dtype=np.uint32))) & np.uint32(0x000F000F)) ^ magic
    if not exact:
        return t
    halves = t.view(np.uint16).reshape(*t.shape, 2)
    values = halves.view(np.dtype(name)).astype(np.float32) - np.float32(BIAS[name])  # exact: small ints
    bits = values.astype(np.dtype(name)).view(np.uint16).astype(np.uint32)
    return bits[..., 0] | (bits[..., 1] << 16)


def _twin_dequantize(words: jax.Array, exact: bool, dtype: Any) -> jax.Array:
    """Interpret-mode twin: (8 slots, 64 words) uint32 -> (64, 64) bf16/f16, the same values and places."""
    name = _name(dtype)
    w = words.astype(jnp.uint32)[..., None] >> (4 * jnp.arange(4, dtype=jnp.uint32))
    t = (w & jnp.uint32(0x000F000F)) ^ jnp.uint32(MAGIC[name] * 0x10001)  # (slot, word, u)
    halves = jax.lax.bitcast_convert_type(t, jnp.uint16)  # (slot, word, u, e)
    values = jax.lax.bitcast_convert_type(halves, jnp.dtype(name))
    if exact:
        values = values - jnp.asarray(BIAS[name], jnp.dtype(name))
    # word = 2 * lane + q, lane = 4 * r8 + c4; row = 8 * slot + r8, column = 32 q + 8 u + 2 c4 + e.
    v = values.reshape(8, 8, 4, 2, 4, 2)  # (slot, r8, c4, q, u, e)
    return v.transpose(0, 1, 3, 4, 2, 5).reshape(64, 64)


# --------------------------------------------------------------------------------------- A fragments


def dequantize_chunk(words: jax.Array, *, exact: bool, dtype: Any = jnp.bfloat16) -> jax.Array:
    """(8 slots, 64 words) uint32 loaded with :func:`words_layout` -> (64, 64) ``dtype`` (bf16 or f16) in
    the WGMMA layout: values BIAS + q (``exact=False``; the bias is removed later on the f32
    accumulators) or q."""
    if active_params() is not None:
        return _twin_dequantize(words, exact, dtype)
    return _gpu_dequantize(exact, _name(dtype))(words)


def dequantize_rows(words: jax.Array, *, exact: bool, dtype: Any = jnp.bfloat16) -> jax.Array:
    """(16 slots, 64 words) uint32, two 64-row tiles' chunk loaded with ``words_layout(16)`` -> (128, 64)
    ``dtype`` in tcgen05's register layout (``TCGEN05``: WGMMA's, each warp 32 rows), what a TMEM store
    of an A operand takes: the same bit operations as :func:`dequantize_chunk`, warp w's four slots
    4w .. 4w + 3 its four 8-row groups."""
    if active_params() is not None:
        return jnp.concatenate([_twin_dequantize(words[8 * t : 8 * t + 8], exact, dtype) for t in range(2)])
    return _gpu_dequantize(exact, _name(dtype), slots=16)(words)


def _gpu_dequantize(exact: bool, name: str, slots: int = 8) -> Any:
    rows = 8 * slots
    layout = L.WGMMA if slots == 8 else L.TCGEN05

    @plgpu.inline_mgpu(
        arg_types=(words_layout(slots),),
        return_type=plgpu.ShapeDtypeStruct((rows, CHUNK), jnp.dtype(name), layout=layout),
    )
    def relabel(ctx: Any, words: Any) -> Any:
        from jax.experimental.mosaic.gpu import fragmented_array as fa
        from jax.experimental.mosaic.gpu import utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, llvm, vector

        del ctx
        i32 = ir.IntegerType.get_signless(32)
        elem = ir.BF16Type.get() if name == "bfloat16" else ir.F16Type.get()
        pair = ir.VectorType.get((2,), elem)
        magic = f"0x{MAGIC[name] * 0x10001:08X}"
        ptx_type = "bf16x2" if name == "bfloat16" else "f16x2"
        # One LOP3: (x & 0x000F000F) ^ magic (lut (a & b) ^ c = 0x6A); exact adds the 16-bit-pair subtract.
        asm = f"lop3.b32 $0, $1, 0x000F000F, {magic}, 0x6A;"
        if exact:
            asm = (
                f"{{ .reg .b32 t, c; lop3.b32 t, $1, 0x000F000F, {magic}, 0x6A; "
                f"mov.b32 c, {magic}; sub.{ptx_type} $0, t, c; }}"
            )
        fa_layout = fa.WGMMA_LAYOUT if slots == 8 else fa.TCGEN05_LAYOUT
        out = np.empty(fa_layout.registers_shape((rows, CHUNK)), dtype=object)
        for h in range(slots // 4):  # the warp's 8-row group: slot (slots / 4) w + h
            vec = words.registers[0, 0, 0, 0, h, 0, 0]
            for q in range(2):
                w = vector.extract(vec, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([q]))
                for u in range(4):
                    src = w if u == 0 else arith.shrui(w, arith.constant(i32, 4 * u))
                    bits = llvm.inline_asm(i32, [src], asm, "=r,r")
                    # Register (column tile 4q + u, row group h) of the WGMMA (TCGEN05) layout: no data
                    # movement.
                    out[0, 4 * q + u, 0, 0, h, 0, 0, 0, 0] = utils.bitcast(bits, pair)
        return fa.FragmentedArray(_registers=out, _layout=fa_layout, _is_signed=None)

    return relabel


# ------------------------------------------------------------------------------------- K-sliced tiles


def slot_row_index(slices: int) -> np.ndarray:
    """For each of a tile's 64 A rows: (slice j, output row n within the tile's 64 / S rows)."""
    r = np.arange(64)
    j = (r // 8) % slices
    n = 8 * (r // (8 * slices)) + r % 8
    return np.stack([j, n], axis=1)


def slot_rows(ref: Any, g: int, t: int, ref_slices: int, slices: int) -> jax.Array:
    """(64,) f32 per-row values (group scales) of A tile ``t``'s rows under ``slices`` K slices.

    ``ref`` is an SMEM block (ref_slices, rows, CTA rows) of per-slice group rows (``ref_slices`` 1: one
    row shared by all slices). A row r takes ``ref[j(r) % ref_slices, g, t * 64 / S + n(r)]``, in the WGMMA
    row layout (each lane gathers its own two rows).
    """
    if active_params() is not None:
        width = 64 // slices
        v = ref[:, g, t * width : (t + 1) * width].astype(jnp.float32)  # (ref_slices, bands * 8)
        v = jnp.broadcast_to(v, (slices, width)).reshape(slices, width // 8, 8)  # (j, band, r8)
        return v.transpose(1, 0, 2).reshape(64)  # row r = 8 * (band * S + j) + r8
    return _gpu_slot_rows(g, t, ref_slices, slices)(ref)


def _slot_row_value(
    ref: Any, g: int, slot: Any, r8: Any, start: Any, ref_slices: int, slices: int
) -> Any:
    """f32 value of A row ``r8`` of 8-row slot ``slot`` (index values) in a 64-row tile whose output rows
    begin at ``start``: ``ref[j % ref_slices, g, start + n]`` for the slot's slice j = slot % S and output
    row n = 8 (slot // S) + r8 (the K-slice view, module docstring)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref

    c = lambda v: arith.constant(ir.IndexType.get(), v)
    j = arith.remui(arith.remui(slot, c(slices)), c(ref_slices))
    n = arith.addi(arith.muli(arith.divui(slot, c(slices)), c(8)), r8)
    v = memref.load(ref, [j, c(g), arith.addi(n, start)])
    f32 = ir.F32Type.get()
    return v if v.type == f32 else arith.extf(f32, v)


def _gpu_slot_rows(g: int, t: int, ref_slices: int, slices: int) -> Any:
    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct((64,), jnp.float32, layout=L.WGMMA.reduce(1)),
    )
    def gather(ctx: Any, ref: Any) -> Any:
        from jax.experimental.mosaic.gpu import fragmented_array as fa
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, gpu, vector

        del ctx
        index = ir.IndexType.get()
        f32 = ir.F32Type.get()
        c = lambda v: arith.constant(index, v)
        tid = arith.remui(gpu.thread_id(gpu.Dimension.x), c(128))
        warp, lane = arith.divui(tid, c(32)), arith.remui(tid, c(32))
        width = 64 // slices
        regs = np.empty(fa.WGMMA_ROW_LAYOUT.registers_shape((64,)), dtype=object)
        for h in range(2):
            slot = arith.addi(arith.muli(warp, c(2)), c(h))  # 2w + h
            v = _slot_row_value(ref, g, slot, arith.divui(lane, c(4)), c(t * width), ref_slices, slices)
            regs[0, 0, h, 0, 0] = vector.broadcast(ir.VectorType.get((1,), f32), v)
        return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_ROW_LAYOUT, _is_signed=None)

    return gather


def tmem_rows(ref: Any, g: int, ref_slices: int, slices: int) -> jax.Array:
    """(128,) f32 per-row values (group scales) of a 128-row tcgen05 A operand under ``slices`` K slices,
    in the row layout of TMEM's native load (thread 32 w + l of the warpgroup holds row 32 w + l): row r
    of 64-row tile t = r // 64 takes :func:`slot_rows`' value for its tile row r % 64."""
    if active_params() is not None:
        return jnp.concatenate([slot_rows(ref, g, t, ref_slices, slices) for t in range(2)])
    return _gpu_tmem_rows(g, ref_slices, slices)(ref)


def _gpu_tmem_rows(g: int, ref_slices: int, slices: int) -> Any:
    layout = plgpu.Layout.TCGEN05_TMEM_NATIVE.reduce(1)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct((128,), jnp.float32, layout=layout),
    )
    def gather(ctx: Any, ref: Any) -> Any:
        from jax.experimental.mosaic.gpu import fragmented_array as fa
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, gpu, vector

        del ctx
        index = ir.IndexType.get()
        f32 = ir.F32Type.get()
        c = lambda v: arith.constant(index, v)
        row = arith.remui(gpu.thread_id(gpu.Dimension.x), c(128))  # thread 32 w + l holds row 32 w + l
        tile, r64 = arith.divui(row, c(64)), arith.remui(row, c(64))
        start = arith.muli(tile, c(64 // slices))
        v = _slot_row_value(ref, g, arith.divui(r64, c(8)), arith.remui(r64, c(8)), start, ref_slices, slices)
        mgpu_layout = layout.to_mgpu()
        regs = np.empty(mgpu_layout.registers_shape((128,)), dtype=object)
        regs.flat[0] = vector.broadcast(ir.VectorType.get((1,), f32), v)
        return fa.FragmentedArray(_registers=regs, _layout=mgpu_layout, _is_signed=None)

    return gather


def sum_slices(
    acc_ref: Any,
    out_ref: Any,
    *,
    slices: int,
    tiles: int,
    rows: int,
    swiglu_pairs: bool = False,
    row_norm_ref: Any = None,
    norm: tuple[float, float] | None = None,
    residual_ref: Any = None,
    norm_weight_ref: Any = None,
    normed_ref: Any = None,
) -> None:
    """y tile (rows, tiles * 64 / S) in ``out_ref`` (bf16/f16 SMEM) from ``acc_ref`` (tiles, 64, S rows) f32.

    acc[t, r, m * S + j(r)] summed over the S slices of output row t * 64 / S + n(r); the rest of acc (other
    slices' columns) is not read.

    With ``swiglu_pairs`` (the SwiGLU epilogue) the tile's columns are gate and up interleaved in blocks of
    ``GATE_UP_BLOCK`` (``nybble.packing.gate_up``), and ``out_ref`` (rows, tiles * 32 / S) receives
    ``silu(r g) * (r u)`` of each pair in f32, rounded once, where the row's scale r = rsqrt(s / dim + eps)
    comes from its entry s of ``row_norm_ref`` ((rows,) f32 SMEM) and ``norm`` = (dim, eps): an RMSNorm's
    sum of squares, its scale computed here (XLA would spend a launch on the rsqrt of a reduction's
    result); ``norm`` None (``Problem.norm``'s no row scale: no ``row_norm_ref``), r = 1.

    With ``residual_ref`` (the residual epilogue: ``residual_ref`` (rows, tile columns) and
    ``norm_weight_ref`` (1, tile columns) SMEM, any float dtypes) ``out_ref`` receives x = residual + y and
    ``normed_ref`` h = x * w, rounded as ``nybble.kernels.epilogue.residual_norm`` rounds them.
    """
    width = 64 // slices
    if active_params() is not None:
        # acc rows r = 8 * (band * S + j) + r8, columns m * S + j': keep j == j', sum over j.
        acc = acc_ref[...].reshape(tiles, width // 8, slices, 8, rows, slices)
        y = jnp.einsum("tbjrmk,jk->mtbr", acc, jnp.eye(slices, dtype=jnp.float32))
        y = y.reshape(rows, tiles * width)
        if swiglu_pairs:
            y = swiglu(y, None if norm is None else row_norm_ref[...], norm)
        if residual_ref is not None:
            y, h = residual_norm(y, residual_ref[...], norm_weight_ref[...], out_ref.dtype)
            normed_ref[...] = h
        out_ref[...] = y.astype(out_ref.dtype)
        return
    if residual_ref is not None:
        _gpu_residual_slices(slices, tiles, rows)(acc_ref, out_ref, residual_ref, norm_weight_ref, normed_ref)
        return
    if swiglu_pairs:
        refs = (acc_ref, out_ref) if norm is None else (acc_ref, out_ref, row_norm_ref)
        _gpu_swiglu_slices(slices, tiles, rows, norm)(*refs)
        return
    _gpu_sum_slices(slices, tiles, rows)(acc_ref, out_ref)


def _slice_total(acc: Any, t: Any, n: Any, m: Any, slices: int) -> Any:
    """acc[t, r(j), m * S + j] summed over the S slices j of output row n of A tile t (f32, MLIR values)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref

    index = ir.IndexType.get()
    c = lambda v: arith.constant(index, v)
    band, r8 = arith.divui(n, c(8)), arith.remui(n, c(8))
    total = None
    for j in range(slices):
        # A row r = 8 * (band * S + j) + r8 holds slice j of output row n; its column m * S + j.
        r = arith.addi(arith.muli(arith.addi(arith.muli(band, c(slices)), c(j)), c(8)), r8)
        col_j = arith.addi(arith.muli(m, c(slices)), c(j))
        v = memref.load(acc, [t, r, col_j])
        total = v if total is None else arith.addf(total, v)
    return total


def _column_total(acc: Any, col: Any, m: Any, width: int, slices: int) -> Any:
    """:func:`_slice_total` of tile column ``col`` (A tile col // width, its output row col % width)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith

    c = lambda v: arith.constant(ir.IndexType.get(), v)
    return _slice_total(acc, arith.divui(col, c(width)), arith.remui(col, c(width)), m, slices)


def _for_each_output(outputs: int, body: Any) -> None:
    """``body(i)`` for every i in [0, outputs): thread t of the warpgroup takes i = t, t + 128, ... (MLIR, in
    an ``inline_mgpu`` body)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, gpu, scf

    c = lambda v: arith.constant(ir.IndexType.get(), v)
    tid = arith.remui(gpu.thread_id(gpu.Dimension.x), c(128))
    for base in range(0, outputs, 128):
        i = arith.addi(tid, c(base))
        branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, i, c(outputs)))
        with ir.InsertionPoint(branch.then_block):
            body(i)
            scf.yield_([])


def _gpu_sum_slices(slices: int, tiles: int, rows: int) -> Any:
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def reduce(ctx: Any, acc: Any, out: Any) -> None:
        from jax.experimental.mosaic.gpu import utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, memref

        del ctx
        c = lambda v: arith.constant(ir.IndexType.get(), v)
        width = 64 // slices
        out_ty = ir.MemRefType(out.type).element_type

        def output(i: Any) -> None:
            # i -> (m, col): output row-major over (m, t * width + n), A tile t's output row n.
            m, col = arith.divui(i, c(tiles * width)), arith.remui(i, c(tiles * width))
            memref.store(arith.truncf(out_ty, _column_total(acc, col, m, width, slices)), out, [m, col])

        _for_each_output(rows * tiles * width, output)
        utils.warpgroup_barrier()

    return reduce


def _gpu_swiglu_slices(slices: int, tiles: int, rows: int, norm: tuple[float, float] | None) -> Any:
    """The SwiGLU pass over (acc, out[, row_norm]): with ``norm`` None there is no row_norm ref, r = 1."""
    refs = 2 if norm is None else 3

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * refs)
    def swiglu(ctx: Any, acc: Any, out: Any, *row_norm: Any) -> None:  # row_norm: () or (ref,)
        from jax.experimental.mosaic.gpu import utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, math, memref

        del ctx
        f32 = ir.F32Type.get()
        c = lambda v: arith.constant(ir.IndexType.get(), v)
        one = arith.constant(f32, 1.0)
        width = 64 // slices
        half = tiles * width // 2  # output columns: one per gate/up pair
        if norm is not None:
            dim, eps = (arith.constant(f32, float(v)) for v in norm)
        out_ty = ir.MemRefType(out.type).element_type

        def output(i: Any) -> None:
            # i -> (m, o): output row-major; o's gate is tile column 16 (o // 8) + o % 8, its up 8 on.
            m, o = arith.divui(i, c(half)), arith.remui(i, c(half))
            block, lane = arith.divui(o, c(GATE_UP_BLOCK)), arith.remui(o, c(GATE_UP_BLOCK))
            gate_col = arith.addi(arith.muli(block, c(2 * GATE_UP_BLOCK)), lane)
            up_col = arith.addi(gate_col, c(GATE_UP_BLOCK))
            total = lambda col: _column_total(acc, col, m, width, slices)
            z_gate, z_up = total(gate_col), total(up_col)
            if norm is not None:
                r = math.rsqrt(arith.addf(arith.divf(memref.load(row_norm[0], [m]), dim), eps))
                z_gate, z_up = arith.mulf(z_gate, r), arith.mulf(z_up, r)
            sigmoid = arith.divf(one, arith.addf(one, math.exp(arith.negf(z_gate))))
            memref.store(arith.truncf(out_ty, arith.mulf(arith.mulf(z_gate, sigmoid), z_up)), out, [m, o])

        _for_each_output(rows * half, output)
        utils.warpgroup_barrier()

    return swiglu


def _gpu_residual_slices(slices: int, tiles: int, rows: int) -> Any:
    """The residual pass over (acc, out, residual, norm_weight, normed): per output, the slices' total
    rounded to y's dtype, x = residual + y and h = x * w in f32, each rounded to y's dtype."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 5)
    def residual(ctx: Any, acc: Any, out: Any, res: Any, weight: Any, normed: Any) -> None:
        from jax.experimental.mosaic.gpu import utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, memref

        del ctx
        f32 = ir.F32Type.get()
        c = lambda v: arith.constant(ir.IndexType.get(), v)
        width = 64 // slices
        columns = tiles * width
        out_ty = ir.MemRefType(out.type).element_type

        def wide(v: Any) -> Any:  # an SMEM value in f32 (the residual's and the weight's own dtypes)
            return v if v.type == f32 else arith.extf(f32, v)

        def output(i: Any) -> None:
            m, col = arith.divui(i, c(columns)), arith.remui(i, c(columns))
            y = arith.extf(f32, arith.truncf(out_ty, _column_total(acc, col, m, width, slices)))
            x = arith.truncf(out_ty, arith.addf(wide(memref.load(res, [m, col])), y))
            memref.store(x, out, [m, col])
            h = arith.mulf(arith.extf(f32, x), wide(memref.load(weight, [c(0), col])))
            memref.store(arith.truncf(out_ty, h), normed, [m, col])

        _for_each_output(rows * columns, output)
        utils.warpgroup_barrier()

    return residual
