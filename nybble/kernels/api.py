"""``nybble.matmul``: one call, the best implementation this backend can run, the same numbers everywhere."""

from __future__ import annotations

from typing import Any, Literal

import jax
import numpy as np

from nybble.kernels.device import hopper_device, num_sms
from nybble.kernels.xla import xla_matmul
from nybble.quant.qweight import QuantizedWeight

Implementation = Literal["mosaic_gpu", "xla"]
# Tried in this order by implementation=None; XLA runs everywhere and comes last.
IMPLEMENTATIONS: tuple[str, ...] = ("mosaic_gpu", "xla")
SUPPORTED_X_DTYPES = ("bfloat16", "float16", "float32")


def _check_args(x: Any, qw: Any) -> None:
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(
            f"nybble.matmul: the weight must be a nybble.QuantizedWeight (from nybble.quantize), got "
            f"{type(qw).__name__}"
        )
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"nybble.matmul: x must be an array of shape (..., K), got {type(x).__name__}")
    k, n = qw.shape
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(
            f"nybble.matmul: x has shape {tuple(x.shape)} but the weight has shape (K, N) = ({k}, {n}); "
            f"x.shape[-1] must equal K = {k}"
        )
    if np.dtype(x.dtype).name not in SUPPORTED_X_DTYPES:
        raise TypeError(
            f"nybble.matmul: x has dtype {np.dtype(x.dtype).name}; supported: {SUPPORTED_X_DTYPES} "
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
    return (
        f"it needs a Hopper GPU (compute capability 9.x) and the default backend is "
        f"{jax.default_backend()!r}; on a CPU run it inside `with nybble.kernels.interpret():`"
    )


def matmul(x: Any, qw: QuantizedWeight, *, implementation: Implementation | None = None) -> jax.Array:
    """``x @ dequantize(qw)``: x of shape (..., K) in bf16/f16/f32, result (..., N) in ``x.dtype``.

    Accumulates in float32. Works under ``jit``, ``vmap`` and ``grad`` (with respect to ``x``).

    Args:
      x: activations, any leading batch dims.
      qw: the weight, from :func:`nybble.quantize`.
      implementation: None picks the best that can run here: the Mosaic GPU kernel on a Hopper GPU
        (or inside ``nybble.kernels.interpret()``), else XLA. ``"mosaic_gpu"`` or ``"xla"`` forces one.
        A forced ``"mosaic_gpu"`` raises ``NotImplementedError`` saying why when the kernel cannot take
        these arguments, and when the computation is run on a platform other than a CUDA GPU outside
        ``interpret()`` (tracing and lowering for CUDA work anywhere).
    """
    _check_args(x, qw)
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"nybble.matmul: unknown implementation {implementation!r}; choose one of {IMPLEMENTATIONS} "
            "or None"
        )
    if implementation == "xla":
        return xla_matmul(x, qw)
    unsupported = _mosaic_gpu_unsupported(x, qw)  # the one check of the arguments against the kernel
    if implementation is None and (unsupported is not None or _mosaic_gpu_not_here() is not None):
        return xla_matmul(x, qw)
    # Forced: only the argument rules are checked here. The device is checked when the computation is
    # lowered (a guard that is a no-op on CUDA and a clear error elsewhere), so tracing and lowering for
    # CUDA work on a CPU-only machine, and running on a CPU outside interpret() fails clearly.
    if unsupported is not None:
        raise NotImplementedError(f"nybble.matmul(implementation='mosaic_gpu') cannot run: {unsupported}")
    from nybble.kernels.mosaic_gpu.api import matmul_supported

    y = matmul_supported(x.reshape(-1, x.shape[-1]), qw, num_sms=num_sms())
    return y.reshape(*x.shape[:-1], qw.shape[1])


def available_implementations(x: Any, qw: QuantizedWeight) -> dict[str, str | None]:
    """Each implementation mapped to None (it can run these arguments here) or the reason it cannot."""
    _check_args(x, qw)
    return {"mosaic_gpu": _mosaic_gpu_unsupported(x, qw) or _mosaic_gpu_not_here(), "xla": None}


__all__ = ["IMPLEMENTATIONS", "available_implementations", "hopper_device", "matmul", "num_sms"]
