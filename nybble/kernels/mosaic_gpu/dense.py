"""The Mosaic GPU W4A16 kernel as an op: argument checks, padding, config choice, split-K sum, gradient.

``mosaic_gpu_matmul(x2d, qw)``; ``backend.py`` hands ``nybble.matmul``'s calls to ``matmul_supported``. The
SM count is a parameter (resolved once by the backend; a CPU device has none), so tracing never touches a
device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from nybble.device import DEFAULT_NUM_SMS
from nybble.jax_range import outside_reason
from nybble.kernels.mosaic_gpu.common import Problem
from nybble.kernels.mosaic_gpu.config import TuningConfig, stores_any_rows, x_rows
from nybble.kernels.mosaic_gpu.heuristics import heuristic_config
from nybble.kernels.mosaic_gpu.interpret import active_params
from nybble.kernels.mosaic_gpu.kernel import w4a16
from nybble.quant.qweight import QuantizedWeight, dequantize

SUPPORTED_LAYOUTS = ("wgmma_int4",)
KERNEL_X_DTYPES = ("bfloat16", "float16")


def is_interpret_active() -> bool:
    """Whether kernels traced now run in GPU interpret mode (inside ``nybble.kernels.interpret()``)."""
    return active_params() is not None


def is_supported(x: Any, qw: QuantizedWeight) -> str | None:
    """None when the kernel can compute ``x @ dequantize(qw)``, else the reason it cannot (one sentence).

    Says nothing about the device: the dispatcher checks for a Hopper GPU (or interpret mode). Refuses
    every argument under a jax outside nybble's range (``nybble.jax_range``).
    """
    return outside_reason() or weight_reason(qw) or x_reason(x, qw)


def weight_reason(qw: Any) -> str | None:
    """Why the kernels (dense and grouped) cannot read ``qw``: not nybble's, or another layout; or None.

    Group sizes, padding to 64 and the codes' dtype need no check: a QuantizedWeight validates them on
    construction (for its layout), and every group it allows (a power of two >= 16, or K_pad) divides or
    is a multiple of the kernel's 64-wide dequantization chunk."""
    if not isinstance(qw, QuantizedWeight):
        return f"the weight is a {type(qw).__name__}, not a nybble.QuantizedWeight"
    if qw.layout not in SUPPORTED_LAYOUTS:
        return (
            f"the weight layout {qw.layout!r} is not one the kernel reads {SUPPORTED_LAYOUTS}: repack it "
            f"once with nybble.quant.relayout(qw, 'wgmma_int4') (exact), or quantize with that layout "
            f"(the default)"
        )
    return None


def x_reason(x: Any, qw: QuantizedWeight) -> str | None:
    """Why the kernels cannot multiply this x (its dtype, its K) by ``qw``, or None."""
    x_dtype = np.dtype(x.dtype).name
    if x_dtype not in KERNEL_X_DTYPES:
        return (
            f"x has dtype {x_dtype}; the kernel multiplies in {KERNEL_X_DTYPES} "
            f"(cast x, or use implementation='xla' for float32)"
        )
    if x.shape[-1] != qw.shape[0]:
        return f"x has K={x.shape[-1]} but the weight has K={qw.shape[0]}"
    return None


# --- A guard so that running on a CPU outside interpret() fails with a clear message. ------------------
# Identity on CUDA (no code emitted), an error on any other platform at lowering time: it is lowered
# before the kernel's own "Only interpret mode is supported on CPU backend", and lowering for CUDA from
# a CPU machine (`.lower(lowering_platforms=("cuda",))`) still works.
_requires_gpu_p = Primitive("nybble_mosaic_gpu_requires_cuda")
_requires_gpu_p.def_abstract_eval(lambda aval: aval)


# Eager calls run the primitive through one cached jit (lowered, and so checked, for the default backend).
_requires_gpu_jit = jax.jit(lambda x: _requires_gpu_p.bind(x))


def _requires_gpu_impl(x: Any) -> Any:
    return _requires_gpu_jit(x)


def _requires_gpu_lowering_error(ctx: Any, x: Any) -> Any:
    raise NotImplementedError(
        "nybble's Mosaic GPU W4A16 kernel runs only on an NVIDIA Hopper GPU (CUDA); this computation "
        "was lowered for another platform. On a CPU, run it inside `with nybble.kernels.interpret():` "
        "(GPU interpret mode), or use nybble.matmul(..., implementation='xla')."
    )


_requires_gpu_p.def_impl(_requires_gpu_impl)
mlir.register_lowering(_requires_gpu_p, _requires_gpu_lowering_error)
mlir.register_lowering(_requires_gpu_p, lambda ctx, x: [x], platform="cuda")
batching.primitive_batchers[_requires_gpu_p] = lambda args, dims: (_requires_gpu_p.bind(*args), dims[0])


def plan(
    m: int,
    qw: QuantizedWeight,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    config: TuningConfig | None = None,
    dtype: Any = jnp.bfloat16,
    allow: Callable[[TuningConfig], bool] | None = None,
    extra_smem: Callable[[TuningConfig], int] | None = None,
) -> Problem:
    """The kernel launch one ``nybble.matmul`` of M rows against ``qw`` makes: config, padding, grid.

    ``config`` None takes :func:`heuristic_config`'s choice for a GPU of ``num_sms`` SMs (among the configs
    ``allow`` accepts: on a real GPU, those that passed the hardware check, ``hardware.py``; with an
    epilogue's ``extra_smem`` bytes); ``dtype`` is
    the activations' (bf16 or f16: both 2 bytes, so the same config). What the X-ray (``bench.xray``) reads
    to model a call, and what the wrapper itself runs.
    """
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"plan: activations must be bfloat16 or float16, got {jnp.dtype(dtype)}")
    k_pad, n_pad = qw.padded_shape
    m = max(m, 1)
    if config is None:
        config = heuristic_config(
            m, n_pad, k_pad, qw.group_size, num_sms, allow=allow, extra_smem=extra_smem, **weight_options(qw)
        )
    config.check_problem(m, n_pad, k_pad, qw.group)
    return problem(m, qw, config, dtype)


def weight_options(qw: QuantizedWeight) -> dict[str, Any]:
    """What the heuristics ask of a weight besides its shape and group: offsets, and the scales' bytes."""
    return dict(has_offsets=qw.offsets is not None, scale_bytes=np.dtype(qw.scales.dtype).itemsize)


def problem(m: int, qw: QuantizedWeight, config: TuningConfig, dtype: Any) -> Problem:
    """The kernels' facts of M rows of x against ``qw`` (one expert's, for a stack) under ``config``."""
    k_pad, n_pad = qw.padded_shape
    n = qw.shape[1]
    # y is stored straight into (M, N) when N is a multiple of 64, else into (M, N_pad) and sliced (a copy):
    # Mosaic tiles the GMEM side of a TMA store like its SMEM tile, whose 128-byte swizzle is 64 columns
    # of bf16, and refuses a GMEM dimension that is not a multiple of it (N = 7392: "dimension 1 must have
    # size smaller or a multiple of its tiling 64"), whatever the row stride.
    n_out = n if n % 64 == 0 else n_pad
    has_offsets = qw.offsets is not None
    return Problem(m, n_out, n_pad, k_pad, qw.group, jnp.dtype(dtype), has_offsets, config, x_rows(m, config))


def kernel_x(x2d: jax.Array, p: Problem) -> jax.Array:
    """x as the kernels read it: behind the guard that refuses a platform other than CUDA outside
    ``interpret()``, and padded where the problem says."""
    if not is_interpret_active():
        x2d = _requires_gpu_p.bind(x2d)
    m, k = x2d.shape
    if k != p.k_pad or p.x_rows != m:
        # Zero columns meet zero codes; only when K is not a multiple of 64 (no real model's is not). Zero
        # rows: when M rows (times the K slices) would not fill whole 8-row SMEM tiles of x (Mosaic applies
        # the tiling to the whole GMEM array: config.x_rows). y keeps M rows: its TMA stores clip the rest.
        x2d = jnp.pad(x2d, ((0, p.x_rows - m), (0, p.k_pad - k)))
    return x2d


def _forward(x2d: jax.Array, qw: QuantizedWeight, config: TuningConfig | None, num_sms: int) -> jax.Array:
    m = x2d.shape[0]
    n = qw.shape[1]
    if m == 0:
        return jnp.zeros((0, n), x2d.dtype)
    p = plan(m, qw, num_sms=num_sms, config=config, dtype=x2d.dtype)
    x2d = kernel_x(x2d, p)
    # Scales and offsets go in as stored (bf16/f16/f32): the kernel converts them itself.
    # Split-K partials are summed in f32 inside the launch (split_k.py) and rounded once.
    # y rows: M where one TMA store reaches any number of rows (config.stores_any_rows), else x's rows,
    # sliced (a copy).
    m_y = m if stores_any_rows(p.config) else p.x_rows
    y = w4a16(x2d, qw.codes, qw.scales, qw.offsets, n=p.n, group=qw.group, config=p.config, m=m_y)
    return y if (p.n, m_y) == (n, m) else y[:m, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x2d: jax.Array, qw: QuantizedWeight, config: TuningConfig | None, num_sms: int) -> jax.Array:
    return _forward(x2d, qw, config, num_sms)


def _matmul_fwd(x2d, qw, config, num_sms):
    return _forward(x2d, qw, config, num_sms), qw


def _matmul_bwd(config, num_sms, qw, g):
    return x_gradient(qw, g)


def x_gradient(qw: QuantizedWeight, g: jax.Array) -> tuple[jax.Array, Any]:
    """The backward pass of every Mosaic GPU kernel: dx = g @ dequant(W)^T through XLA with f32
    accumulation (the weight rounded once to g's dtype, nybble.dequantize's values, contracted over N);
    the weights get no gradient (zero cotangents)."""
    w = dequantize(qw, g.dtype)  # (K, N)
    dims = (((g.ndim - 1,), (1,)), ((), ()))
    dx = jax.lax.dot_general(g, w, dims, preferred_element_type=jnp.float32).astype(g.dtype)
    return dx, jax.tree.map(_zero_cotangent, qw)


def _zero_cotangent(a: Any) -> Any:
    if jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, dtype=jax.dtypes.float0)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def mosaic_gpu_matmul(
    x2d: jax.Array,
    qw: QuantizedWeight,
    *,
    config: TuningConfig | None = None,
    num_sms: int = DEFAULT_NUM_SMS,
) -> jax.Array:
    """``x2d @ dequantize(qw)`` with the Hopper W4A16 kernel: (M, K) bf16/f16 -> (M, N) in x's dtype.

    Args:
      x2d: (M, K) activations, K the weight's logical K (padded to K_pad inside).
      qw: a ``wgmma_int4`` QuantizedWeight (``nybble.quant.relayout`` converts others).
      config: a TuningConfig; None lets :func:`heuristic_config` choose from M, the shapes and num_sms.
      num_sms: SMs of the target GPU (the dispatcher asks the device once; 132 on H100/H200).

    Differentiable with respect to ``x2d`` (the backward pass is an XLA matmul with the dequantized
    weight). Outside ``nybble.kernels.interpret()`` it must be lowered for CUDA; lowering for another
    platform raises NotImplementedError.
    """
    check_call("mosaic_gpu_matmul", x2d, qw, config, TuningConfig, num_sms, is_supported)
    return _matmul(x2d, qw, config, int(num_sms))


def check_call(
    what: str,
    x2d: Any,
    qw: Any,
    config: Any,
    config_type: type,
    num_sms: int,
    supported: Callable[[Any, Any], str | None],
) -> None:
    """The argument rules of a Mosaic GPU kernel's public entry (Hopper's and Blackwell's alike): x2d is
    (M, K), the kernel serves the arguments (``supported`` says why not), the config is the kernel's type
    and the SM count is positive. Raises naming the rule and the fix."""
    if getattr(x2d, "ndim", None) != 2:
        raise ValueError(
            f"{what}: x2d must be 2-D (M, K), got shape {getattr(x2d, 'shape', None)}; "
            "reshape to (-1, K) first"
        )
    if (reason := supported(x2d, qw)) is not None:
        raise NotImplementedError(f"{what} cannot run these arguments: {reason}")
    if config is not None and not isinstance(config, config_type):
        raise TypeError(f"{what}: config must be a {config_type.__name__}, got {type(config).__name__}")
    if num_sms < 1:
        raise ValueError(f"{what}: num_sms={num_sms} must be positive")


def matmul_supported(
    x2d: jax.Array, qw: QuantizedWeight, *, num_sms: int, config: TuningConfig | None = None
) -> jax.Array:
    """:func:`mosaic_gpu_matmul` (``config`` None: the heuristic config), for arguments
    :func:`is_supported` already accepted: what ``nybble.matmul`` calls, so that one call checks its
    arguments once."""
    return _matmul(x2d, qw, config, int(num_sms))
