"""Run nybble's Mosaic GPU kernels on the CPU, in Pallas' GPU interpret mode (for tests and debugging).

Under ``with interpret():`` every nybble Mosaic GPU kernel traced in that context is built with
``interpret=plgpu.InterpretGPUParams(...)``: the CPU simulates the GPU's memories, warpgroups, barriers and
TMA copies, and with ``detect_races=True`` it flags a missing barrier wait or ``commit_smem``. Interpret mode
checks numerics only; the hardware rules (layouts, SMEM budget, TMA alignment) are checked by lowering for
CUDA (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``).

The interpreters of jax 0.11.2 and 0.12.0.1 (in nybble's range, ``nybble.jax_range``) cannot run
``plgpu.wgmma`` with its A operand in registers ("Expected shape (6,) but got (64, 128)"), which is exactly
how the W4A16 kernel feeds the dequantized weights. ``interpret()`` closes that gap with a small patch of
``jax._src.pallas.mosaic_gpu.interpret``, applied only while the context is active, and only under a jax
of the range whose interpreter has every function the patches touch (:func:`check_jax_version`; they are
private and may change).

Under ``jax.shard_map`` on several CPU devices (``nybble.sharding``) every device interprets its own kernel
at the same time, in one shared simulated memory. The interpreter then checks, as each device finishes, that
no barrier is left allocated *on any device*, and fails when another device is still mid-kernel. The same
patch makes that check wait until every device of the kernel reached it. And there a kernel operand of a
4-bit type deadlocked: the host callback that copies it into the simulated memory waits for a CPU device
busy running callbacks. The patch hands such values to the host widened to 8 bits (exact) and narrows them
back there.

jax 0.12.1's interpreter runs the register-A WGMMA itself (its ``gpu_callbacks.wgmma`` takes ``a_is_value``),
and has no ``_remove_noop_transforms`` (the patch's host side called it): there the WGMMA patch is not
applied, and the other two are (their functions unchanged, 2026-12-06).

Re-verified on 0.12.0.1 (2026-12-04): the register-A WGMMA still fails there without its patch (the same
error, ``JaxprInterpreter._interpret_wgmma_ref_p`` unchanged); the end-of-kernel barrier check and the
allocation callbacks are unchanged too, so both patches stay. (No kernel operand is 4-bit today: the codes
are uint32 words of the ``wgmma_int4`` layout, so the widening never triggers on either version.) 0.12's
race detector raises inside the kernel unless told to warn: ``compat.interpret_params``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from nybble.jax_range import TESTED, outside_reason
from nybble.kernels.mosaic_gpu.compat import interpret_params

__all__ = [
    "active_params",
    "check_jax_version",
    "check_warpgroup_threads",
    "host_threads",
    "interpret",
    "races_found",
    "reset_state",
]

# The InterpretGPUParams of the innermost active `interpret()` context, or None.
_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("nybble_mgpu_interpret", default=None)
# The GPU whose kernels run under interpret(gpu=...): "h200" the Hopper family, "b200" the Blackwell one.
_ACTIVE_GPU: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "nybble_mgpu_interpret_gpu", default=None
)
INTERPRET_GPUS = {"h200": "9.0", "h100": "9.0", "b200": "10.0"}  # name -> compute capability
_patch_lock = threading.Lock()
_patch_depth = 0
_saved_method: Any = None
_saved_barrier_check: Any = None
_saved_allocators: dict[str, Any] = {}
_FOUR_BIT = {"int4": "int8", "uint4": "uint8"}
# Whether an interpret() context without race detection was entered since the last reset_state().
_undetected_since_reset = False


def active_params() -> Any:
    """The ``plgpu.InterpretGPUParams`` to build kernels with, or None outside ``interpret()``."""
    return _ACTIVE.get()


def active_gpu() -> str | None:
    """The GPU the active ``interpret(gpu=...)`` context runs the kernels of ("h200", "b200"), else None."""
    return _ACTIVE_GPU.get() if _ACTIVE.get() is not None else None


def host_threads() -> int:
    """Threads of XLA's CPU client pool, which runs the interpreted kernels' warpgroups: ``PJRT_NPROC`` or
    ``NPROC`` when set (XLA reads them once, when jax starts its CPU backend), else one a schedulable core."""
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_warpgroup_threads(warpgroups: int, kernel: str) -> None:
    """Refuses, in interpret mode, a kernel of more warpgroups than :func:`host_threads`.

    Each warpgroup runs on a thread of XLA's CPU client pool and holds it while it waits at a barrier, so
    with fewer threads than warpgroups the kernel never finishes (a silent hang, not an error)."""
    threads = host_threads()
    if warpgroups > threads:
        raise RuntimeError(
            f"{kernel}: GPU interpret mode runs each of this kernel's {warpgroups} warpgroups on a thread of "
            f"XLA's CPU client, whose pool has {threads} here (one a core unless NPROC says more); a "
            f"warpgroup waiting at a barrier holds its thread, so the kernel would never finish. Set "
            f"NPROC={max(warpgroups, 4)} in the environment before jax starts (e.g. `NPROC=4 python ...`)."
        )


def _patched_wgmma_ref_p(self: Any, eqn: Any, token: Any, get_invals: Any) -> Any:
    """``wgmma_ref_p`` that also accepts an A operand held in registers (a value, not an SMEM ref)."""
    from jax._src import callback
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
    from jax._src.state import types as state_types

    if isinstance(eqn.invars[1].aval, state_types.AbstractRef):
        return _saved_method(self, eqn, token, get_invals)
    acc, a, b, *leaves = get_invals()
    empty = jax.tree.structure([])
    acc_transforms, _, b_transforms = jax.tree.unflatten(
        jax.tree_util.treedef_tuple(
            tuple(
                eqn.params[name] or empty
                for name in ("acc_transforms_tree", "a_transforms_tree", "b_transforms_tree")
            )
        ),
        leaves,
    )
    acc, acc_transforms = jaxpr_interpret.resolve_ref(eqn.invars[0].aval, acc, acc_transforms)
    b, b_transforms = jaxpr_interpret.resolve_ref(eqn.invars[2].aval, b, b_transforms)
    return (
        callback.io_callback(
            functools.partial(_wgmma_register_a, source_info=eqn.source_info),
            gpu_callbacks.TOKEN_SHAPE_DTYPE,
            token=token,
            mesh_location=self.mesh_location,
            thread=self.thread,
            acc_allocation_key_as_array=acc,
            acc_transforms=acc_transforms,
            a_value=a,
            b_allocation_key_as_array=b,
            b_transforms=b_transforms,
        ),
        [],
    )


def _wgmma_register_a(
    *,
    token: Any,
    mesh_location: Any,
    thread: Any,
    acc_allocation_key_as_array: Any,
    acc_transforms: Any,
    a_value: Any,
    b_allocation_key_as_array: Any,
    b_transforms: Any,
    source_info: Any = None,
) -> Any:
    """Host side of a register-A wgmma: acc += a @ b, like jax's own SMEM-operand callback."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory as memory

    @gpu_callbacks.fail_on_exception
    def run(*, token: Any) -> Any:
        shared = gpu_callbacks._get_shared_memory()
        info = memory.GPULoggingInfo(mesh_location, thread, source_info)
        b_key = gpu_callbacks.HostAllocationKey.from_array(b_allocation_key_as_array)
        acc_key = gpu_callbacks.HostAllocationKey.from_array(acc_allocation_key_as_array)
        b_tr = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(b_transforms))
        acc_tr = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(acc_transforms))
        b, _, _ = shared.get_buffer_content(b_key, shared.access(b_key, b_tr), thread, logging_info=info)
        acc_range = shared.access(acc_key, acc_tr)
        acc, _, _ = shared.get_buffer_content(acc_key, acc_range, thread, logging_info=info)
        res = acc + np.matmul(np.asarray(a_value), b, dtype=acc.dtype)
        shared.store_buffer_content(acc_key, acc_range, res, thread, logging_info=info)
        return token

    return run(token=token)


def _assert_no_barriers_allocated_all_devices(token: Any) -> Any:
    """jax's end-of-kernel barrier check, run once every device of the kernel has arrived at it."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    @gpu_callbacks.fail_on_exception
    def run(token: Any) -> Any:
        shared = gpu_callbacks._get_shared_memory()
        with _patch_lock:
            arrived = getattr(shared, "_nybble_all_arrived", None)
            if arrived is None:  # one per simulated memory, i.e. per kernel launch
                arrived = shared._nybble_all_arrived = threading.Barrier(shared.barrier.parties)
        arrived.wait()
        shared.assert_no_barriers_allocated()
        return token

    return run(token)


def _widening(call: Any, host_fn: Any) -> Any:
    """``gpu_callbacks.call_allocate_*`` passing a 4-bit ``value`` to the host as 8 bits, narrowed there."""
    from jax._src import callback
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    signature = inspect.signature(call)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        *operands, value, source_info = bound.arguments.values()  # (token, where..., request), value, info
        name = np.dtype(value.dtype).name
        if name not in _FOUR_BIT:
            return call(*args, **kwargs)
        narrow = np.dtype(value.dtype)

        def host(*host_args: Any, **host_kwargs: Any) -> Any:
            *head, wide = host_args
            return host_fn(*head, np.asarray(wide).astype(narrow), **host_kwargs)

        return callback.io_callback(
            functools.partial(host, source_info=source_info),
            (gpu_callbacks.TOKEN_SHAPE_DTYPE, gpu_callbacks.HostAllocationKey.shape_and_dtype()),
            *operands,
            value.astype(_FOUR_BIT[name]),
        )

    return wrapped


# What the patches below replace or call, by module: checked before patching, so that a jax in the range
# whose interpreter moved one of them fails here, by name, not inside a kernel.
_PATCH_TARGETS = {
    "gpu_callbacks": (
        "_assert_no_barriers_allocated",
        "call_allocate_buffer_for_all_threads",
        "_allocate_buffer_for_all_threads",
        "call_allocate_buffer",
        "_allocate_buffer",
        "_get_shared_memory",
        "fail_on_exception",
        "HostAllocationKey",
        "TOKEN_SHAPE_DTYPE",
    ),
}
# The register-A WGMMA patch's own, where the interpreter needs it (:func:`native_register_a`).
_REGISTER_A_TARGETS = {
    "jaxpr_interpret": ("JaxprInterpreter._interpret_wgmma_ref_p", "resolve_ref"),
    "gpu_callbacks": ("_remove_noop_transforms",),
}


def native_register_a() -> bool:
    """Whether this jax's interpreter runs a WGMMA whose A operand is in registers by itself (jax 0.12.1's
    ``gpu_callbacks.wgmma`` takes ``a_is_value``); 0.11.2's and 0.12.0.1's do not, and take the patch."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    wgmma = getattr(gpu_callbacks, "wgmma", None)
    return wgmma is not None and "a_is_value" in inspect.signature(wgmma).parameters


def check_jax_version(version: str | None = None) -> None:
    """Refuses to patch a jax outside nybble's range (``nybble.jax_range``), or one whose interpreter lacks
    what the patches replace.

    The patches replace private functions of ``jax._src.pallas.mosaic_gpu.interpret``, re-verified on each
    tested release of the range (``nybble.jax_range.TESTED``); on another jax they could silently change
    what the interpreter checks. Raises RuntimeError naming the range (or the missing function) and the
    fix."""
    reason = outside_reason(version)
    if reason is not None:
        raise RuntimeError(
            f"nybble.kernels.interpret() patches private functions of jax's Pallas GPU interpreter: {reason}"
        )
    import importlib

    missing = []
    targets = [*_PATCH_TARGETS.items(), *(() if native_register_a() else _REGISTER_A_TARGETS.items())]
    for module, names in targets:
        mod = importlib.import_module(f"jax._src.pallas.mosaic_gpu.interpret.{module}")
        for name in names:
            obj = mod
            for part in name.split("."):
                obj = getattr(obj, part, None)
            if obj is None:
                missing.append(f"{module}.{name}")
    if missing:
        raise RuntimeError(
            f"nybble.kernels.interpret() patches private functions of jax's Pallas GPU interpreter, and this "
            f"jax {jax.__version__} lacks {', '.join(missing)}: install one of the tested releases "
            f"({', '.join(TESTED)})"
        )


@contextlib.contextmanager
def _patched_interpreter() -> Iterator[None]:
    global _patch_depth, _saved_method, _saved_barrier_check
    check_jax_version()
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret

    cls = jaxpr_interpret.JaxprInterpreter
    with _patch_lock:
        if _patch_depth == 0:
            _saved_method = cls._interpret_wgmma_ref_p
            if not native_register_a():
                cls._interpret_wgmma_ref_p = _patched_wgmma_ref_p
            _saved_barrier_check = gpu_callbacks._assert_no_barriers_allocated
            gpu_callbacks._assert_no_barriers_allocated = _assert_no_barriers_allocated_all_devices
            for call, host_fn in (
                ("call_allocate_buffer_for_all_threads", "_allocate_buffer_for_all_threads"),
                ("call_allocate_buffer", "_allocate_buffer"),
            ):
                _saved_allocators[call] = getattr(gpu_callbacks, call)
                setattr(
                    gpu_callbacks, call, _widening(_saved_allocators[call], getattr(gpu_callbacks, host_fn))
                )
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                cls._interpret_wgmma_ref_p = _saved_method
                gpu_callbacks._assert_no_barriers_allocated = _saved_barrier_check
                for call, saved in _saved_allocators.items():
                    setattr(gpu_callbacks, call, saved)
                _saved_allocators.clear()
                _saved_method = _saved_barrier_check = None


@contextlib.contextmanager
def interpret(detect_races: bool = False, gpu: str = "h200") -> Iterator[Any]:
    """Runs nybble's Mosaic GPU kernels on the CPU in GPU interpret mode inside this context.

    Args:
      detect_races: have the interpreter track every SMEM/GMEM access and flag data races; read the
        verdict with :func:`races_found` after the kernel ran (call :func:`reset_state` before).
      gpu: the GPU whose kernels run: "h200" / "h100" (the Hopper kernels, WGMMA) or "b200" (the Blackwell
        kernels, tcgen05 and TMEM).

    Yields:
      The ``plgpu.InterpretGPUParams`` kernels are built with.

    The interpret parameters are part of jit's cache key, so jitted functions retrace on entry.

    Each warpgroup of an interpreted kernel runs on a thread of XLA's CPU client pool (one a core unless
    ``NPROC`` says more, read when jax starts its CPU backend), held while it waits at a barrier. The
    Blackwell kernel's decode tiles run three warpgroups: on a machine of fewer cores set ``NPROC=4`` before
    jax starts; with too few threads the kernel raises (:func:`check_warpgroup_threads`) rather than hang.
    """
    global _undetected_since_reset
    params = interpret_params(detect_races)
    if not detect_races:
        _undetected_since_reset = True
    if gpu.lower() not in INTERPRET_GPUS:
        raise ValueError(
            f"interpret(gpu={gpu!r}): nybble's Mosaic GPU kernels exist for {sorted(INTERPRET_GPUS)}; "
            f"pick one of those"
        )
    token = _ACTIVE.set(params)
    gpu_token = _ACTIVE_GPU.set(gpu.lower())
    try:
        # force_gpu_interpret_mode sets a jax config value that is part of jit's cache key, so a function
        # jitted outside the context is retraced inside it (and vice versa) instead of reusing a kernel
        # built for the other mode.
        with _patched_interpreter(), plgpu.force_gpu_interpret_mode(params):
            yield params
    finally:
        _ACTIVE.reset(token)
        _ACTIVE_GPU.reset(gpu_token)


def reset_state() -> None:
    """Clears the interpreter's global state (race verdicts, leftover buffers after an exception)."""
    global _undetected_since_reset
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    interpret_pallas_call.reset_gpu_interpret_mode_state()
    _undetected_since_reset = False


def races_found() -> bool:
    """Whether the race detector flagged a race since the last :func:`reset_state`.

    Raises:
      RuntimeError: no kernel ran since the last :func:`reset_state`, or an ``interpret()`` context
        without ``detect_races=True`` was entered since then: either way there is no verdict to give.
    """
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    if _undetected_since_reset:
        raise RuntimeError(
            "races_found: an interpret() context without detect_races=True was entered since "
            "reset_state(), so its kernels were not checked for races; use interpret(detect_races=True)"
        )
    # The interpreter creates its race state when the first kernel after a reset starts.
    races = gpu_callbacks._races
    if races is None:
        raise RuntimeError("races_found: no kernel ran in interpret mode since reset_state()")
    return bool(races.races_found)
