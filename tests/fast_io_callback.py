"""The host side of ``jax.experimental.io_callback`` without ``jax.device_put``'s dispatch (tests only).

Mosaic GPU's interpret mode runs a kernel as an XLA program whose every memory access, barrier and
WGMMA is an io_callback into the interpreter's Python state. jax's ``callback.io_callback_impl`` first
moves the callback's arguments (numpy arrays from XLA's CPU runtime) onto the CPU device with
``jax.device_put``: its tree handling, sharding checks and dispatch cost ~1 ms a call, about a quarter of
an interpret-mode test's time (measured 2026-12-05, docs/logs/performance-log.md).

:func:`install` replaces it with the same function whose transfer is the call ``device_put`` ends in,
jaxlib's ``batched_device_put`` of each array to the CPU device (committed, as ``device_put`` to a
device makes them): the callback gets the same ``jax.Array`` values on the same device. Arguments other
than numpy arrays, and a jax whose function differs from the known one, keep jax's own. Installed by
tests/conftest.py; the ``nybble`` package never patches jax.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from typing import Any

import numpy as np

# sha256 of ``inspect.getsource(callback.io_callback_impl)`` in jax 0.11.2, whose body this reproduces (0.12
# also empties the calling thread's mesh around the callback: it keeps its own).
_KNOWN_SOURCE = "3396b676250803d9cf83d69ca8d38069575992d36644ad8799f9c0aa3afb40ee"

_original: dict[str, Any] = {}


def source_digest() -> str:
    from jax._src import callback

    impl = _original.get("impl", callback.io_callback_impl)
    return hashlib.sha256(inspect.getsource(impl).encode()).hexdigest()


@functools.cache
def _cpu() -> tuple[Any, Any]:
    from jax._src import xla_bridge
    from jax.sharding import SingleDeviceSharding

    device = xla_bridge.local_devices(backend="cpu")[0]
    return device, SingleDeviceSharding(device)


def _to_cpu_arrays(args: tuple[Any, ...]) -> list[Any] | None:
    """``jax.device_put(args, cpu)`` for a tuple of numpy arrays; None for anything else."""
    from jax._src import core
    from jax._src.lib import _jax

    if not all(type(a) is np.ndarray for a in args):
        return None
    device, sharding = _cpu()
    return [
        _jax.batched_device_put(core.ShapedArray(a.shape, a.dtype), sharding, [a], [device], True)
        for a in args
    ]


def install() -> bool:
    """Replaces ``io_callback_impl`` where jax's is the known one; True if installed (or already)."""
    from jax._src import callback as callback_lib
    from jax._src import config, tree_util

    if "impl" in _original:
        return True
    if source_digest() != _KNOWN_SOURCE:
        return False
    original = callback_lib.io_callback_impl

    def io_callback_impl(*args: Any, callback: Any, **params: Any) -> Any:
        arrays = _to_cpu_arrays(args)
        if arrays is None:
            return original(*args, callback=callback, **params)
        with config.default_device(_cpu()[0]):  # jax's body from here on
            try:
                return tree_util.tree_map(np.asarray, callback(*arrays))
            except BaseException:
                callback_lib.logger.exception("jax.io_callback failed")
                raise

    _original["impl"] = original
    callback_lib.io_callback_impl = io_callback_impl
    return True
