"""The implementation registry for one ``QuantizedWeight``: the Mosaic GPU kernel, then XLA.

``nybble.matmul`` (``nybble/ops.py``) sends a plain weight here and a ``ShardedWeight`` to
``nybble.sharding``, which calls :func:`matmul` once per shard: this package never imports the sharding
one. :func:`available_implementations` and :func:`explain` also take a sharded weight, by its
``local_problem(x)`` (each shard's product), without importing its type."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Literal

import jax
import numpy as np

from nybble.kernels.device import gpu_device, hopper_device, num_sms
from nybble.kernels.xla import xla_matmul
from nybble.quant.qweight import QuantizedWeight

Implementation = Literal["mosaic_gpu", "xla"]
# Tried in this order by implementation=None; XLA runs everywhere and comes last.
IMPLEMENTATIONS: tuple[str, ...] = ("mosaic_gpu", "xla")
MATMUL_X_DTYPES = ("bfloat16", "float16", "float32")


def _is_sharded(qw: Any) -> bool:
    """A weight split over a mesh (``nybble.sharding.ShardedWeight``), known by its per-shard problem."""
    return callable(getattr(qw, "local_problem", None))


def check_args(x: Any, qw: Any) -> None:
    """The argument rules of ``nybble.matmul``: a weight of nybble's, x of shape (..., K) in a supported
    dtype. Raises TypeError / ValueError naming the shape or dtype and the fix."""
    if not (isinstance(qw, QuantizedWeight) or _is_sharded(qw)):
        raise TypeError(
            f"nybble.matmul: the weight must be a nybble.QuantizedWeight (from nybble.quantize) or a "
            f"nybble.sharding.ShardedWeight, got {type(qw).__name__}"
        )
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"nybble.matmul: x must be an array of shape (..., K), got {type(x).__name__}")
    k, n = qw.shape
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(
            f"nybble.matmul: x has shape {tuple(x.shape)} but the weight has shape (K, N) = ({k}, {n}); "
            f"x.shape[-1] must equal K = {k}"
        )
    if np.dtype(x.dtype).name not in MATMUL_X_DTYPES:
        raise TypeError(
            f"nybble.matmul: x has dtype {np.dtype(x.dtype).name}; supported: {MATMUL_X_DTYPES} "
            f"(cast x first, e.g. x.astype(jnp.bfloat16))"
        )


def _mosaic_gpu_unsupported(x: Any, qw: QuantizedWeight) -> str | None:
    """Why the Mosaic GPU kernel cannot compute these arguments at all (dtype, layout, group), or None."""
    try:
        from nybble.kernels import mosaic_gpu
    except ImportError as e:  # only while the kernel package is broken
        return f"the Mosaic GPU kernel failed to import ({e})"
    return mosaic_gpu.is_supported(x, qw)


def _mosaic_gpu_not_here() -> str | None:
    """Why the Mosaic GPU kernel cannot run on this machine now (no Hopper GPU, not interpreting), or None."""
    from nybble.kernels.mosaic_gpu import is_interpret_active

    if is_interpret_active() or hopper_device() is not None:
        return None
    gpu = gpu_device()
    if gpu is not None:  # Ampere, Ada, Blackwell: no sm_90a WGMMA
        cc = getattr(gpu, "compute_capability", "unknown")
        return (
            f"it needs a Hopper GPU (compute capability 9.x, WGMMA) and this GPU, {gpu.device_kind}, has "
            f"compute capability {cc}"
        )
    return (
        f"it needs a Hopper GPU (compute capability 9.x) and the default backend is "
        f"{jax.default_backend()!r}; on a CPU run it inside `with nybble.kernels.interpret():`"
    )


# Reasons already warned about by implementation=None on a GPU machine (once per reason and process).
_WARNED: set[str] = set()


def _warn_fallback(reason: str) -> None:
    """On a machine with a GPU, says once per reason that ``implementation=None`` runs the XLA path: there
    the user expects the kernel, and XLA's dequantize-and-dot streams 2 bytes a weight instead of 0.5. On
    a CPU the XLA path is the expected one and nothing is said."""
    if reason in _WARNED or gpu_device() is None:
        return
    _WARNED.add(reason)
    warnings.warn(
        f"nybble.matmul: running the XLA path (dequantize, then dot), not the Mosaic GPU kernel: {reason}. "
        f"Pass implementation='xla' to silence this, or see nybble.kernels.explain(x, qw).",
        RuntimeWarning,
        stacklevel=3,
    )


def check_implementation(implementation: Any) -> None:
    """Refuses an implementation name that is not one of :data:`IMPLEMENTATIONS` (or None)."""
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"nybble.matmul: unknown implementation {implementation!r}; choose one of {IMPLEMENTATIONS} "
            "or None"
        )


def matmul(x: Any, qw: QuantizedWeight, *, implementation: Implementation | None = None) -> jax.Array:
    """``x @ dequantize(qw)``: x of shape (..., K) in bf16/f16/f32, result (..., N) in ``x.dtype``.

    Accumulates in float32. Works under ``jit``, ``vmap`` and ``grad`` (with respect to ``x``).

    Args:
      x: activations, any leading batch dims.
      qw: the weight, from :func:`nybble.quantize` (a ``ShardedWeight`` goes through ``nybble.matmul``).
      implementation: None picks the best that can run here: the Mosaic GPU kernel on a Hopper GPU
        (or inside ``nybble.kernels.interpret()``), else XLA. ``"mosaic_gpu"`` or ``"xla"`` forces one.
        A forced ``"mosaic_gpu"`` raises ``NotImplementedError`` saying why when the kernel cannot take
        these arguments, and when the computation is run on a platform other than a CUDA GPU outside
        ``interpret()`` (tracing and lowering for CUDA work anywhere).
    """
    check_args(x, qw)
    check_implementation(implementation)
    if _is_sharded(qw):
        raise TypeError(
            "nybble.kernels.matmul multiplies one QuantizedWeight; a ShardedWeight goes through "
            "nybble.matmul (nybble/ops.py), which runs this once per shard"
        )
    if implementation == "xla":
        return xla_matmul(x, qw)
    unsupported = _mosaic_gpu_unsupported(x, qw)  # the one check of the arguments against the kernel
    if implementation is None:
        reason = unsupported or _mosaic_gpu_not_here()
        if reason is not None:
            _warn_fallback(reason)
            return xla_matmul(x, qw)
    # Forced: only the argument rules are checked here. The device is checked when the computation is
    # lowered (a guard that is a no-op on CUDA and a clear error elsewhere), so tracing and lowering for
    # CUDA work on a CPU-only machine, and running on a CPU outside interpret() fails clearly.
    if unsupported is not None:
        raise NotImplementedError(f"nybble.matmul(implementation='mosaic_gpu') cannot run: {unsupported}")
    from nybble.kernels.mosaic_gpu.api import matmul_supported

    y = matmul_supported(x.reshape(-1, x.shape[-1]), qw, num_sms=num_sms())
    return y.reshape(*x.shape[:-1], qw.shape[1])


@dataclasses.dataclass(frozen=True)
class Availability:
    """Whether an implementation can run given arguments here; ``reason`` says why not. Truthy when it can:
    ``if available_implementations(x, qw)["mosaic_gpu"]: ...``."""

    available: bool
    # Why it cannot run (None when it can).
    reason: str | None = None

    def __bool__(self) -> bool:
        return self.available

    def __repr__(self) -> str:
        return "<available>" if self.available else f"<unavailable: {self.reason}>"


def available_implementations(x: Any, qw: Any) -> dict[str, Availability]:
    """Each implementation, in dispatch order, and whether it can run these arguments here (with the reason
    when it cannot): ``{'mosaic_gpu': unavailable: it needs a Hopper GPU ..., 'xla': available}``.

    For a ``ShardedWeight``: whether it can run each shard's product (x cut like the weight).
    """
    check_args(x, qw)
    if _is_sharded(qw):
        x, qw = qw.local_problem(x)
    reason = _mosaic_gpu_unsupported(x, qw) or _mosaic_gpu_not_here()
    return {"mosaic_gpu": Availability(reason is None, reason), "xla": Availability(True)}


def explain(
    x: Any, qw: Any, *, implementation: Implementation | None = None
) -> str:
    """What ``nybble.matmul(x, qw, implementation=...)`` runs here, and why, in a few lines.

    Names the implementation chosen, why the others were passed over, and for the Mosaic GPU kernel the
    ``TuningConfig`` its heuristics pick for this shape (on this GPU's SM count).
    """
    avail = available_implementations(x, qw)
    sharded = _is_sharded(qw)
    if sharded:
        x, qw = qw.local_problem(x)
    dtype = np.dtype(x.dtype).name
    head = (
        f"nybble.matmul(x: {dtype}{list(x.shape)}, {'each shard: ' if sharded else ''}{qw.shape[0]}x"
        f"{qw.shape[1]} int4, {'per-column' if qw.group_size is None else f'g{qw.group_size}'} "
        f"{'symmetric' if qw.symmetric else 'asymmetric'}, layout {qw.layout!r})"
    )
    chosen = implementation or next(name for name in IMPLEMENTATIONS if avail[name])
    lines = [head]
    if implementation is not None and not avail[implementation]:
        why = avail[implementation].reason
        lines.append(f"  implementation={implementation!r} is forced and raises: {why}")
        return "\n".join(lines)
    lines.append(f"  runs {chosen!r}" + (" (forced)" if implementation else " (implementation=None)"))
    if chosen == "mosaic_gpu":
        from nybble.kernels.mosaic_gpu.api import plan

        m = int(np.prod(x.shape[:-1]))
        lines.append(f"  kernel config for M={m} on {num_sms()} SMs: {plan(m, qw, num_sms=num_sms()).config}")
    else:
        lines.append(
            f"  XLA: each weight dequantized to {dtype} in the program, then one dot, f32 accumulation"
        )
    for name in IMPLEMENTATIONS:
        if name != chosen and not avail[name]:
            lines.append(f"  not {name!r}: {avail[name].reason}")
    return "\n".join(lines)


__all__ = [
    "IMPLEMENTATIONS",
    "Availability",
    "available_implementations",
    "check_args",
    "check_implementation",
    "explain",
    "hopper_device",
    "matmul",
    "num_sms",
]
