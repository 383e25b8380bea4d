"""The Mosaic GPU backend: nybble's Mosaic GPU kernels as the functions ``nybble.kernels.backends`` calls.

Two families, chosen by the GPU's compute capability: Hopper (9.x: ``dense.py``'s WGMMA kernel and
``grouped.py``'s mixture-of-experts one) and Blackwell (10.x, B200/GB200 and B300: ``blackwell/``'s tcgen05
kernels, dense and grouped). Inside
``nybble.kernels.interpret(gpu=...)`` the family of that GPU runs on any machine. With no GPU and no
interpreter (lowering for CUDA on a CPU) the Hopper kernels are traced. The SM count their heuristics plan
for is asked of the device once per call, never at trace time inside a kernel.

On a real Hopper GPU the heuristics choose among the configs that passed the hardware check
(``hardware.py``), forced or not; where none fits, ``implementation=None`` passes the kernel over
(:func:`unverified`) and a forced call runs the heuristics' own pick.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nybble import device
from nybble.kernels.mosaic_gpu import dense, grouped, grouped_swiglu, hardware, residual, swiglu
from nybble.kernels.mosaic_gpu.config import TuningConfig
from nybble.kernels.mosaic_gpu.dense import is_interpret_active
from nybble.kernels.mosaic_gpu.grouped_config import grouped_heuristic_config
from nybble.kernels.mosaic_gpu.interpret import active_gpu
from nybble.quant.qweight import QuantizedWeight

# GPUs with a nybble Mosaic GPU kernel, by family: what an error on any other GPU names.
FAMILIES = {
    "hopper": "Hopper (compute capability 9.x: H100, H200)",
    "blackwell": "Blackwell (10.x: B200, GB200, B300)",
}


def family() -> str | None:
    """The kernel family that runs here: "hopper", "blackwell", or None (a GPU with no nybble kernel, or
    no GPU and no interpreter)."""
    if is_interpret_active():
        return "blackwell" if active_gpu() == "b200" else "hopper"
    gpu = device.gpu_device()
    cc = str(getattr(gpu, "compute_capability", "")) if gpu is not None else ""
    if cc.startswith("9."):
        return "hopper"
    if cc.startswith("10."):
        return "blackwell"
    return None


def no_kernel_here() -> str | None:
    """On a GPU with no nybble kernel: the sentence naming it and the GPUs that have one; else None."""
    gpu = device.gpu_device()
    if gpu is None or family() is not None:
        return None
    cc = getattr(gpu, "compute_capability", "unknown")
    return (
        f"nybble's Mosaic GPU kernels run on {' and '.join(FAMILIES.values())} GPUs, and this GPU, "
        f"{gpu.device_kind}, has compute capability {cc}"
    )


def _num_sms(default: int) -> int:
    gpu = device.gpu_device()
    sms = getattr(gpu, "core_count", None) if gpu is not None and not is_interpret_active() else None
    return int(sms) if sms else default


def on_hopper_hardware() -> bool:
    """Whether the Hopper kernels run on a real GPU here (not interpreted, not lowered on a CPU)."""
    return not is_interpret_active() and family() == "hopper"


def _dense_config(m: int, qw: QuantizedWeight) -> tuple[TuningConfig, bool]:
    """The Hopper kernel's config for M rows on this GPU, and whether it is hardware-verified: on a real
    GPU the heuristics' pick among verified configs where one fits, else their own pick."""
    sms = device.num_sms()
    if on_hopper_hardware():
        try:
            return dense.plan(m, qw, num_sms=sms, allow=hardware.verified).config, True
        except ValueError:
            pass
    config = dense.plan(m, qw, num_sms=sms).config
    return config, hardware.verified(config)


def _grouped_config(rows: int, qw: QuantizedWeight) -> tuple[TuningConfig, bool]:
    """The grouped kernel's config, as :func:`_dense_config` chooses the dense one."""
    k_pad, n_pad = qw.padded_shape
    args = (rows, int(qw.codes.shape[0]), n_pad, k_pad, qw.group_size, device.num_sms())
    options = dense.weight_options(qw)
    if on_hopper_hardware():
        try:
            return grouped_heuristic_config(*args, allow=hardware.verified, **options), True
        except ValueError:
            pass
    config = grouped_heuristic_config(*args, **options)
    return config, hardware.verified(config)


def unverified(x: Any, qw: QuantizedWeight) -> str | None:
    """Why ``implementation=None`` passes the dense kernel over although it could run: on a real Hopper GPU,
    no config that passed the hardware check fits these arguments. None elsewhere."""
    if not on_hopper_hardware():
        return None
    config, ok = _dense_config(int(np.prod(x.shape[:-1])), qw)
    return None if ok else hardware.unverified_reason(config)


def ragged_unverified(x: Any, qw: QuantizedWeight, group_sizes: Any) -> str | None:
    """:func:`unverified` for the grouped kernel."""
    del group_sizes
    if not on_hopper_hardware():
        return None
    config, ok = _grouped_config(int(x.shape[0]), qw)
    return None if ok else hardware.unverified_reason(config)


def unsupported(x: Any, qw: QuantizedWeight) -> str | None:
    """Why the dense kernel cannot compute ``x @ dequantize(qw)`` at all (dtype, layout), or None."""
    return dense.is_supported(x, qw)


def not_here() -> str | None:
    """Why the kernels cannot run on this machine now (a GPU with no nybble kernel; no GPU and not
    interpreting), or None."""
    if family() is not None:
        return None
    if (why := no_kernel_here()) is not None:
        return why
    return (
        f"it needs a Hopper GPU (compute capability 9.x) or a Blackwell one (10.x) and the default "
        f"backend is {jax.default_backend()!r}; on a CPU run it inside `with nybble.kernels.interpret():`"
    )


def matmul(x2d: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """The dense kernel of this machine's family with its heuristic config, for arguments
    :func:`unsupported` accepted. Forced on a GPU with no nybble kernel: NotImplementedError naming it."""
    if (why := no_kernel_here()) is not None:
        raise NotImplementedError(f"nybble.matmul(implementation='mosaic_gpu') cannot run: {why}")
    if family() == "blackwell":
        from nybble.kernels.mosaic_gpu.blackwell import api as blackwell

        return blackwell.matmul_supported(x2d, qw, num_sms=_num_sms(blackwell.DEFAULT_NUM_SMS))
    config = _dense_config(x2d.shape[0], qw)[0] if on_hopper_hardware() else None
    return dense.matmul_supported(x2d, qw, num_sms=device.num_sms(), config=config)


def describe(m: int, qw: QuantizedWeight) -> str:
    """The config the dense kernel's heuristics pick for M rows on this GPU's SM count."""
    if family() == "blackwell":
        from nybble.kernels.mosaic_gpu.blackwell import api as blackwell

        sms = _num_sms(blackwell.DEFAULT_NUM_SMS)
        config = blackwell.plan(m, qw, num_sms=sms).config
        return f"Blackwell (tcgen05) kernel config for M={m} on {sms} SMs: {config}"
    config, ok = _dense_config(m, qw)
    checked = ""
    if on_hopper_hardware():
        checked = " (a structure that passed the hardware check)" if ok else " (NOT hardware-checked)"
    return f"kernel config for M={m} on {device.num_sms()} SMs: {config}{checked}"


def swiglu_unsupported(x: Any, qw: QuantizedWeight, *, forced: bool) -> str | None:
    """Why the kernel's SwiGLU epilogue (swiglu.py; Blackwell's: blackwell/swiglu.py) cannot compute
    ``nybble.kernels.swiglu_matmul``'s call here, or None: a family with a kernel here (a Hopper or Blackwell
    GPU, interpreted as one, or Hopper's lowered on a machine with no GPU), arguments it reads, a config that
    fits; on a real GPU, unless ``forced``, only once a hardware check has run it
    (``hardware.SWIGLU_VERIFIED``)."""
    if (why := no_kernel_here()) is not None:
        return why
    if (why := swiglu.unsupported(x, qw) or _swiglu_unverified(forced)) is not None:
        return why
    if not swiglu.fits(x.shape[0], qw, _swiglu_sms(), family=_swiglu_family()):
        return f"no config with the SwiGLU epilogue fits M={x.shape[0]} (K-sliced decode configs)"
    return None


def _swiglu_unverified(forced: bool) -> str | None:
    """On a real Hopper or Blackwell GPU, unless ``forced``: the SwiGLU epilogues (dense and grouped) wait for
    a hardware check (``hardware.SWIGLU_VERIFIED``)."""
    on_hardware = on_hopper_hardware() or (not is_interpret_active() and family() == "blackwell")
    if not forced and on_hardware and not hardware.SWIGLU_VERIFIED:
        return "the SwiGLU epilogue has not run on a GPU yet (hardware.SWIGLU_VERIFIED)"
    return None


def _swiglu_family() -> str:
    """The kernel family whose epilogue runs here: Blackwell's on 10.x (or interpreted as a B200), else
    Hopper's (also lowered for CUDA on a machine with no GPU)."""
    return "blackwell" if family() == "blackwell" else "hopper"


def _swiglu_sms() -> int:
    """SMs the epilogue's heuristics plan for, as the family's plain kernel asks them."""
    if family() == "blackwell":
        from nybble.kernels.mosaic_gpu.blackwell import api as blackwell

        return _num_sms(blackwell.DEFAULT_NUM_SMS)
    return device.num_sms()


def swiglu_matmul(
    x: jax.Array, qw: QuantizedWeight, sum_of_squares: Any, norm: tuple[float, float]
) -> jax.Array:
    """The kernel of this family with the SwiGLU epilogue, for a call :func:`swiglu_unsupported` accepted."""
    sms, family_name = _swiglu_sms(), _swiglu_family()
    return swiglu.mosaic_gpu_swiglu(x, qw, sum_of_squares, norm=norm, num_sms=sms, family=family_name)


def residual_unsupported(x: Any, qw: QuantizedWeight, *, forced: bool) -> str | None:
    """Why the Hopper kernel's residual epilogue (residual.py) cannot compute
    ``nybble.kernels.residual_matmul``'s call here, or None: Hopper's kernel here (a Hopper GPU, interpreted
    as one, or lowered on a machine with no GPU; Blackwell's kernel has no such epilogue yet), arguments it
    reads, a config that fits; on a real GPU, unless ``forced``, only once a hardware check has run it
    (``hardware.RESIDUAL_VERIFIED``)."""
    if (why := no_kernel_here()) is not None:
        return why
    if family() == "blackwell":
        return "the residual epilogue runs on the Hopper kernel only (the Blackwell kernel has none yet)"
    if (why := residual.unsupported(x, qw)) is not None:
        return why
    if not forced and on_hopper_hardware() and not hardware.RESIDUAL_VERIFIED:
        return "the residual epilogue has not run on a GPU yet (hardware.RESIDUAL_VERIFIED)"
    if not residual.fits(x.shape[0], qw, device.num_sms()):
        return f"no config with the residual epilogue fits M={x.shape[0]} (K-sliced decode configs)"
    return None


def residual_matmul(
    x: jax.Array, qw: QuantizedWeight, residual_rows: jax.Array, norm_weight: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The Hopper kernel with the residual epilogue, for a call :func:`residual_unsupported` accepted."""
    return residual.mosaic_gpu_residual(x, qw, residual_rows, norm_weight, num_sms=device.num_sms())


def ragged_swiglu_unsupported(x: Any, qw: QuantizedWeight, group_sizes: Any, *, forced: bool) -> str | None:
    """:func:`swiglu_unsupported` for the grouped kernels' epilogue (grouped_swiglu.py), gated by the same
    hardware check."""
    if (why := no_kernel_here()) is not None:
        return why
    if (why := grouped_swiglu.unsupported(x, qw, group_sizes) or _swiglu_unverified(forced)) is not None:
        return why
    if not grouped_swiglu.fits(x.shape[0], qw, _grouped_sms(), family=_swiglu_family()):
        return f"no grouped config with the SwiGLU epilogue fits {x.shape[0]} rows (K-sliced decode configs)"
    return None


def ragged_swiglu_matmul(x: jax.Array, qw: QuantizedWeight, group_sizes: jax.Array) -> jax.Array:
    """The grouped kernel of this family with the SwiGLU epilogue, for a call
    :func:`ragged_swiglu_unsupported` accepted."""
    return grouped_swiglu.mosaic_gpu_grouped_swiglu(
        x, qw, group_sizes, num_sms=_grouped_sms(), family=_swiglu_family()
    )


def _grouped_sms() -> int:
    """SMs the grouped kernels' heuristics plan for, as :func:`ragged_matmul` asks them."""
    if family() == "blackwell":
        from nybble.kernels.mosaic_gpu.blackwell import grouped as blackwell_grouped

        return _num_sms(blackwell_grouped.DEFAULT_NUM_SMS)
    return device.num_sms()


def ragged_unsupported(x: Any, qw: Any, group_sizes: Any) -> str | None:
    """Why the grouped kernel cannot compute these arguments (shapes, dtypes, layout), or None: the
    Hopper and Blackwell grouped kernels accept the same ones."""
    return grouped.grouped_is_supported(x, qw, group_sizes)


def ragged_matmul(x: jax.Array, qw: QuantizedWeight, group_sizes: jax.Array) -> jax.Array:
    """The grouped kernel. Traced group sizes (unchecked) are clamped by the kernel's own scan of them, as
    the XLA path clamps them (``group_bounds``): a negative size counts as zero, rows past x's are dropped;
    clamping them here too would cost a decode step two launches a MoE layer (a cumsum and its shift)."""
    if (why := no_kernel_here()) is not None:
        raise NotImplementedError(f"nybble.ragged_matmul(implementation='mosaic_gpu') cannot run: {why}")
    if family() == "blackwell":
        from nybble.kernels.mosaic_gpu.blackwell import grouped as blackwell_grouped

        sms = _num_sms(blackwell_grouped.DEFAULT_NUM_SMS)
        return blackwell_grouped.blackwell_grouped_matmul(x, qw, group_sizes, num_sms=sms)
    config = _grouped_config(int(x.shape[0]), qw)[0] if on_hopper_hardware() else None
    return grouped.grouped_matmul(x, qw, group_sizes, config=config, num_sms=device.num_sms())


__all__ = [
    "FAMILIES",
    "describe",
    "family",
    "matmul",
    "no_kernel_here",
    "not_here",
    "on_hopper_hardware",
    "ragged_matmul",
    "ragged_swiglu_matmul",
    "ragged_swiglu_unsupported",
    "ragged_unsupported",
    "ragged_unverified",
    "residual_matmul",
    "residual_unsupported",
    "swiglu_matmul",
    "swiglu_unsupported",
    "unsupported",
    "unverified",
]
