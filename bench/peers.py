"""The implementations timed side by side: nybble's own, and every peer that can run here.

A peer says why it cannot run (``unavailable``) or builds a :class:`Prepared` for one case: a call that
runs the op once per rotated input set, a way to wait for it, and a way to read back set 0's output for
the correctness check. Every peer is compared against the float64 reference of the weight it multiplies
with (``reference``): nybble's grouped weight, the per-column int4 weight, or the bf16 weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

import nybble
from nybble.kernels import available_implementations
from nybble.packing import nk_int4_as_int4, pad_to, padded_weight_dims
from nybble.quant import QuantizedWeight, relayout, to_torch_uint8_codes
from nybble.quant.formats.torch_int4pack import TORCH_GROUP_SIZES

# Which weight's float64 reference a peer must match.
REF_GROUPED = "grouped"  # nybble.quantize(w, group_size=G): nybble, torch, tokamax
REF_PER_COLUMN = "per-column"  # nybble.quantize(w, group_size=None): XLA's own int4 path
REF_BF16 = "bf16"  # w rounded to bf16: the dense baseline

BF16_BASELINE = "xla:bf16"


@dataclasses.dataclass
class Case:
    """One point of the sweep: a weight (K, N) in its variants and S sets of x (M, K), all on device."""

    name: str
    k: int
    n: int
    m: int
    group_size: int | None
    w: jax.Array  # (K, N) float32
    weights: dict[str, Any]  # REF_* -> QuantizedWeight or bf16 array, made once per shape
    xs: list[jax.Array]  # rotated input sets, bf16 (M, K)

    def x_sets(self, count: int) -> list[jax.Array]:
        return self.xs[: max(1, min(count, len(self.xs)))]


@dataclasses.dataclass
class Prepared:
    """A peer made ready for one case."""

    call: Callable[[], Any]  # runs the op once per input set; returns the outputs
    sync: Callable[[Any], None]  # waits until those outputs are computed
    output_rows: Callable[[Any, np.ndarray], np.ndarray]  # set 0's output rows, as float64 numpy
    n_sets: int
    weight_bytes: int  # bytes of one weight as this peer stores it
    cleanup: Callable[[], None] = lambda: None
    # A call that runs the S ops ``reps`` times in one launch (None: the peer has no such mode).
    repeat: Callable[[int], Callable[[], Any]] | None = None
    # Whether set 0's whole output is finite (the reference check reads a subset of rows).
    all_finite: Callable[[Any], bool] | None = None
    # Extra facts for the result row (e.g. a cross-check of a converter).
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Peer(Protocol):
    name: str
    reference: str
    description: str

    def unavailable(self, case: Case) -> str | None: ...

    def weight_bytes(self, case: Case) -> int: ...

    def prepare(self, case: Case, n_sets: int) -> Prepared: ...


def _copy_tree(tree: Any) -> Any:
    """A copy in fresh device buffers: the same values at other addresses (defeats cache reuse)."""
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def _jax_prepared(
    op: Callable[[jax.Array, Any], jax.Array], xs: Sequence[jax.Array], w: Any, weight_bytes: int
) -> Prepared:
    """One jitted program running ``op`` on every (x, weight copy) pair back to back.

    ``op`` is jitted on its own first, so the program calls one lowered function S times (one Mosaic GPU
    compilation, one autotuning per shape). ``repeat(r)`` gives a program that runs the S ops r times in a
    ``fori_loop`` for when launching the program costs the host more than the device's work: the inputs
    pass through an optimization barrier with the previous outputs each iteration, so XLA can neither
    hoist the ops out of the loop nor merge iterations.
    """
    ws = [w] + [_copy_tree(w) for _ in range(len(xs) - 1)]
    xs = list(xs)
    one = jax.jit(op)

    def all_sets(xs_: list[jax.Array], ws_: list[Any]) -> tuple[jax.Array, ...]:
        return tuple(one(x, wi) for x, wi in zip(xs_, ws_, strict=True))

    fn = jax.jit(all_sets)

    def output_rows(out: Any, rows: np.ndarray) -> np.ndarray:
        return np.asarray(out[0][jnp.asarray(rows)], dtype=np.float64)

    def repeat(reps: int) -> Callable[[], Any]:
        def looped(xs_: list[jax.Array], ws_: list[Any]) -> tuple[jax.Array, ...]:
            def body(_: Any, carry: Any) -> Any:
                xs_c, ws_c, ys = carry
                # The ops read the inputs through a barrier that also holds the previous outputs; the
                # inputs themselves pass through unchanged, so XLA carries them without copies.
                xs_b, ws_b, _ = jax.lax.optimization_barrier((xs_c, ws_c, ys))
                return xs_c, ws_c, all_sets(xs_b, ws_b)

            first = all_sets(xs_, ws_)
            return jax.lax.fori_loop(1, reps, body, (xs_, ws_, first))[2]

        fn_r = jax.jit(looped)
        return lambda: fn_r(xs, ws)

    return Prepared(
        call=lambda: fn(xs, ws),
        sync=jax.block_until_ready,
        output_rows=output_rows,
        n_sets=len(xs),
        weight_bytes=weight_bytes,
        repeat=repeat,
        all_finite=lambda out: bool(jnp.isfinite(out[0]).all()),
    )


@dataclasses.dataclass
class NybblePeer:
    """``nybble.matmul(x, qw, implementation=...)`` for one implementation."""

    implementation: str
    reference: str = REF_GROUPED
    # The layout this implementation reads (the Triton kernel: planes_nk_int4); the benchmark's weight is
    # converted once, outside the timing, as a user quantizing for that GPU would store it.
    layout: str | None = None

    @property
    def name(self) -> str:
        return f"nybble:{self.implementation}"

    def _weight(self, case: Case) -> QuantizedWeight:
        qw = case.weights[REF_GROUPED]
        if self.layout is None or qw.layout == self.layout:
            return qw
        key = f"{REF_GROUPED}@{self.layout}"
        if key not in case.weights:
            case.weights[key] = relayout(qw, self.layout)
        return case.weights[key]

    @property
    def description(self) -> str:
        return f"nybble.matmul(x, qw, implementation={self.implementation!r})"

    def unavailable(self, case: Case) -> str | None:
        try:
            avail = available_implementations(case.xs[0], self._weight(case))
            return avail[self.implementation].reason
        except KeyError:
            return f"nybble has no implementation {self.implementation!r}"

    def weight_bytes(self, case: Case) -> int:
        return case.weights[REF_GROUPED].nbytes

    def prepare(self, case: Case, n_sets: int) -> Prepared:
        impl = self.implementation
        qw = self._weight(case)
        return _jax_prepared(
            lambda x, w: nybble.matmul(x, w, implementation=impl),
            case.x_sets(n_sets),
            qw,
            qw.nbytes,
        )


@dataclasses.dataclass
class XlaBf16Peer:
    """The dense baseline: ``jnp.dot`` of bf16 x and bf16 w with float32 accumulation."""

    name: str = BF16_BASELINE
    reference: str = REF_BF16
    description: str = "jnp.dot(x_bf16, w_bf16, preferred_element_type=f32) -> bf16"

    def unavailable(self, case: Case) -> str | None:
        return None

    def weight_bytes(self, case: Case) -> int:
        return case.k * case.n * 2

    def prepare(self, case: Case, n_sets: int) -> Prepared:
        def op(x: jax.Array, w: jax.Array) -> jax.Array:
            return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

        return _jax_prepared(op, case.x_sets(n_sets), case.weights[REF_BF16], self.weight_bytes(case))


def xla_int4_matmul(x: jax.Array, w4: jax.Array, scale: jax.Array, n: int) -> jax.Array:
    """XLA's own int4 path: ``(x @ int4 W^T as bf16) * per-column scale`` (XLA fuses it into one GEMM).

    ``w4`` is a ``jnp.int4`` array (N_pad, K_pad), ``scale`` is (N_pad,); x is padded to K_pad.
    """
    x = pad_to(x, (*x.shape[:-1], w4.shape[1]))
    y = jax.lax.dot_general(
        x,
        w4.astype(x.dtype),
        dimension_numbers=(((x.ndim - 1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return (y * scale.astype(jnp.float32))[..., :n].astype(x.dtype)


@dataclasses.dataclass
class XlaInt4Peer:
    """``jnp.int4`` weights with per-column scales: the int4 GEMM XLA fuses into its Triton GEMM on GPU."""

    name: str = "xla:int4-col"
    reference: str = REF_PER_COLUMN
    description: str = "dot(x, jnp.int4 W^T -> bf16) * per-column scale (XLA's fused int4 path)"

    def unavailable(self, case: Case) -> str | None:
        return None

    def weight_bytes(self, case: Case) -> int:
        return case.weights[REF_PER_COLUMN].nbytes

    def prepare(self, case: Case, n_sets: int) -> Prepared:
        qw: QuantizedWeight = case.weights[REF_PER_COLUMN]
        w4 = nk_int4_as_int4(relayout(qw, "nk_int4").codes)  # a real jnp.int4 array (N_pad, K_pad)
        scale = qw.scales[0]
        n = case.n
        return _jax_prepared(
            lambda x, w: xla_int4_matmul(x, w[0], w[1], n),
            case.x_sets(n_sets),
            (w4, scale),
            qw.nbytes,
        )


def xla_int4_group_matmul(
    x: jax.Array, q: jax.Array, scales: jax.Array, offsets: jax.Array | None, group: int
) -> jax.Array:
    """XLA's own int4 with group scales, as a user writes it: ``jnp.int4`` codes (K, N) turned into
    ``x.dtype`` and scaled per group in the dot's operand, then one dot with f32 accumulation.

    ``scales``/``offsets`` are (ceil(K / group), N). When ``group`` divides K the scale is broadcast over
    a (K / group, group, N) view; otherwise (a partial last group) it is repeated along K and cut to K.
    """
    k, n = q.shape

    def per_group(a: jax.Array) -> jax.Array:
        a = a.astype(x.dtype)
        return a[:, None, :] if k % group == 0 else jnp.repeat(a, group, axis=0)[:k]

    w = q.astype(x.dtype)
    if k % group == 0:
        w = w.reshape(k // group, group, n)
    w = w * per_group(scales)
    if offsets is not None:
        w = w + per_group(offsets)
    y = jnp.dot(x, w.reshape(k, n), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


@dataclasses.dataclass
class XlaInt4GroupPeer:
    """``jnp.int4`` codes (K, N) dequantized with nybble's group scales (and offsets) in the dot's operand:
    XLA's own int4 with group scales, the bar nybble's XLA path must meet (the X-ray's ``xla:int4``)."""

    name: str = "xla:int4-group"
    reference: str = REF_GROUPED
    description: str = "dot(x, jnp.int4 W -> bf16 * group scale (+ offset)) (XLA's int4, group scales)"

    def unavailable(self, case: Case) -> str | None:
        return None

    def weight_bytes(self, case: Case) -> int:
        qw: QuantizedWeight = case.weights[REF_GROUPED]
        groups = -(-case.k // qw.group)
        terms = 1 if qw.offsets is None else 2
        return case.k * case.n // 2 + terms * groups * case.n * qw.scales.dtype.itemsize

    def prepare(self, case: Case, n_sets: int) -> Prepared:
        qw: QuantizedWeight = case.weights[REF_GROUPED]
        k, n, group = case.k, case.n, qw.group
        groups = -(-k // group)
        q = qw.logical_codes()[:k, :n].astype(jnp.int4)
        offsets = None if qw.offsets is None else qw.offsets[:groups, :n]
        return _jax_prepared(
            lambda x, w: xla_int4_group_matmul(x, w[0], w[1], w[2], group),
            case.x_sets(n_sets),
            (q, qw.scales[:groups, :n], offsets),
            self.weight_bytes(case),
        )


def torch_unavailable() -> str | None:
    """Why torch's int4 kernel cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (its int4pack mm is CUDA-only here)"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        return f"torch {torch.__version__} has no aten._weight_int4pack_mm"
    return None


def torch_inner_k_tiles(k: int) -> int | None:
    """The largest innerKTiles (8, 4, 2) whose K tile (16 * innerKTiles) divides K, else None."""
    for tiles in (8, 4, 2):
        if k % (16 * tiles) == 0:
            return tiles
    return None


def torch_shape_unavailable(k: int, n: int, group_size: int | None) -> str | None:
    """Shape limits of torch's tinygemm for nybble's padded (K_pad, N_pad) weight (no torch needed)."""
    k_pad, _ = padded_weight_dims(k, n)
    if group_size is None:
        return f"tinygemm has no per-column mode (group sizes {TORCH_GROUP_SIZES})"
    if group_size not in TORCH_GROUP_SIZES:
        return f"tinygemm supports group sizes {TORCH_GROUP_SIZES}, not {group_size}"
    if k_pad % group_size:
        return f"tinygemm needs K % group_size == 0 (K={k}, padded {k_pad}, group {group_size})"
    return None


@dataclasses.dataclass
class TorchInt4Peer:
    """torch's tinygemm: ``torch.ops.aten._weight_int4pack_mm`` on the same codes and scales as nybble.

    The weight is converted with torch's own ``_convert_weight_to_int4pack`` from the uint8 codes of
    ``nybble.quant.to_torch_uint8_codes`` (nybble's padded (K_pad, N_pad) weight); x is the same bf16 data,
    zero-padded to K_pad, and the N_pad output columns are cut to N. Timed by replaying a CUDA graph of
    the rotated calls (falls back to plain launches if capture fails).
    """

    name: str = "torch:int4pack"
    reference: str = REF_GROUPED
    description: str = "torch.ops.aten._weight_int4pack_mm (tinygemm), CUDA graph replay"

    def unavailable(self, case: Case) -> str | None:
        return torch_unavailable() or torch_shape_unavailable(case.k, case.n, case.group_size)

    def weight_bytes(self, case: Case) -> int:
        qw = case.weights[REF_GROUPED]
        k_pad, n_pad = qw.padded_shape
        return k_pad * n_pad // 2 + qw.num_groups * n_pad * 2 * 2  # codes + bf16 scale_and_zero

    def prepare(self, case: Case, n_sets: int) -> Prepared:
        import torch

        qw = case.weights[REF_GROUPED]
        ops = to_torch_uint8_codes(qw)
        k_pad = qw.padded_shape[0]
        dev = torch.device("cuda")
        tiles = torch_inner_k_tiles(k_pad)
        w_pack = torch.ops.aten._convert_weight_to_int4pack(torch.from_numpy(ops.codes).to(dev), tiles)
        # bf16 -> f32 -> bf16 is exact: the same scale_and_zero torch would be handed directly.
        saz_t = torch.from_numpy(ops.scale_and_zero.astype(np.float32)).to(dev).to(torch.bfloat16)
        extra = {"torch_int4pack_converter": _check_nybble_converter(qw, w_pack, tiles)}
        g = ops.group_size
        xs = [_jax_to_torch_bf16(pad_to(x, (x.shape[0], k_pad)), dev) for x in case.x_sets(n_sets)]
        ws = [(w_pack, saz_t)] + [(w_pack.clone(), saz_t.clone()) for _ in range(len(xs) - 1)]

        def run_all() -> list[Any]:
            return [torch.ops.aten._weight_int4pack_mm(x, w, g, s) for x, (w, s) in zip(xs, ws, strict=True)]

        call: Callable[[], Any] = run_all
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run_all()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = run_all()

            def call() -> Any:
                graph.replay()
                return outs

        except Exception:  # graph capture is an optimization of the launch gaps only
            call = run_all

        def output_rows(out: Any, rows: np.ndarray) -> np.ndarray:
            y = out[0][torch.as_tensor(rows, device=dev)][:, : case.n]  # N_pad columns -> N
            return y.float().cpu().numpy().astype(np.float64)

        return Prepared(
            call=call,
            sync=lambda _: torch.cuda.synchronize(),
            output_rows=output_rows,
            n_sets=len(xs),
            weight_bytes=int(w_pack.numel() * w_pack.element_size() + saz_t.numel() * 2),
            extra=extra,
        )


def _check_nybble_converter(qw: QuantizedWeight, w_pack: Any, tiles: int | None) -> str:
    """Whether ``nybble.quant.formats.to_torch_int4pack`` (numpy) equals torch's own conversion."""
    import torch

    if tiles != 8:
        return "not checked (needs innerKTiles 8)"
    try:
        from nybble.quant.formats import to_torch_int4pack

        ours = to_torch_int4pack(qw)
        same = torch.equal(torch.from_numpy(np.ascontiguousarray(ours.packed)).to(w_pack.device), w_pack)
    except Exception as e:  # a cross-check only: never stops the peer
        return f"not checked ({type(e).__name__}: {e})"[:200]
    return "matches torch" if same else "DIFFERS from torch's _convert_weight_to_int4pack"


def _jax_to_torch_bf16(x: jax.Array, device: Any) -> Any:
    """A bf16 jax array as a bf16 torch tensor on ``device`` (through host memory: exact)."""
    import torch

    host = np.asarray(x).view(np.uint16)
    return torch.from_numpy(host.astype(np.int16, copy=True)).to(device).view(torch.bfloat16)


def tokamax_unavailable() -> str | None:
    try:
        import qwix  # noqa: F401
        import tokamax  # noqa: F401
    except ImportError as e:
        return f"tokamax is not importable ({e})"
    if jax.default_backend() != "gpu":
        return "tokamax's int4 ragged_dot kernel needs a Hopper GPU"
    return None


@dataclasses.dataclass
class TokamaxPeer:
    """tokamax int4 ``ragged_dot`` with one group (a dense GEMM), weights as a qwix QArray.

    The qwix QArray holds the same codes and scales as nybble's symmetric weight (tokamax has no zero
    point). Any API mismatch surfaces as an error row with the reason, never as a timed result.
    """

    name: str = "tokamax:int4"
    reference: str = REF_GROUPED
    description: str = "tokamax.ragged_dot(x, QArray int4 rhs, group_sizes=[M])"

    def unavailable(self, case: Case) -> str | None:
        if not case.weights[REF_GROUPED].symmetric:
            return "tokamax's int4 path has no zero point (symmetric weights only)"
        if case.group_size is None:
            return "tokamax int4 peer is wired for grouped scales only"
        return tokamax_unavailable()

    def weight_bytes(self, case: Case) -> int:
        return case.weights[REF_GROUPED].nbytes

    def prepare(self, case: Case, n_sets: int) -> Prepared:  # pragma: no cover - needs tokamax + GPU
        import qwix
        import tokamax

        qw: QuantizedWeight = case.weights[REF_GROUPED]
        k, n = qw.shape
        q = nk_int4_as_int4(relayout(qw, "nk_int4").codes)[:n, :k].T[None]  # (1, K, N) int4
        scale = qw.scales[: -(-k // qw.group), :n][None]  # (1, ceil(K / G), N)
        rhs = qwix.QArray(qvalue=q, scale=scale, zero_point=None, qtype=jnp.int4)

        def op(x: jax.Array, w: Any) -> jax.Array:
            sizes = jnp.array([x.shape[0]], jnp.int32)
            return tokamax.ragged_dot(x, w, group_sizes=sizes).astype(x.dtype)

        return _jax_prepared(op, case.x_sets(n_sets), rhs, qw.nbytes)


def all_peers(include: Sequence[str] | None = None) -> list[Peer]:
    """Every nybble implementation, then the peers; ``include`` keeps the names (or prefixes) given."""
    from nybble.kernels import IMPLEMENTATIONS
    from nybble.kernels.triton.backend import LAYOUT as TRITON_LAYOUT

    layouts = {"triton": TRITON_LAYOUT}
    peers: list[Peer] = [NybblePeer(impl, layout=layouts.get(impl)) for impl in IMPLEMENTATIONS]
    peers += [XlaBf16Peer(), XlaInt4Peer(), XlaInt4GroupPeer(), TorchInt4Peer(), TokamaxPeer()]
    if include:
        peers = [p for p in peers if any(p.name == s or p.name.startswith(s) for s in include)]
    return peers
