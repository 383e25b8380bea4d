"""Lowering for a Blackwell GPU (sm_100a) on a machine without one.

Mosaic GPU emits code for the architecture it infers from the default device when a kernel is lowered
(``jax.experimental.mosaic.gpu.utils._infer_arch``): a CPU has no compute capability, and jax 0.11.2 then
assumes 9.0 (Hopper), where tcgen05 and TMEM do not exist. :func:`target_arch` makes that inference answer
a given compute capability while the context is active, so that
``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` (and the X-ray's deviceless compile) build
the sm_100a kernel on a CPU. It changes which code is emitted, not what is checked: on a real B200 the
device answers 10.0 itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_lock = threading.Lock()


@contextlib.contextmanager
def target_arch(major: int = 10, minor: int = 0) -> Iterator[None]:
    """Inside the context, Mosaic GPU lowers kernels for compute capability ``major.minor``."""
    from jax.experimental.mosaic.gpu import utils

    with _lock:
        saved = utils._infer_arch
        utils._infer_arch = lambda: (major, minor)
    try:
        yield
    finally:
        with _lock:
            utils._infer_arch = saved
