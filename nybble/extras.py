"""Optional dependencies: which extra of ``pip install ".[...]"`` (in a clone) brings each, and a clear error.

The core (``nybble.quantize``, ``matmul``, ``save``/``load``, GPTQ, the importers) needs only the core
dependencies (jax, numpy, ml-dtypes, tqdm, threadpoolctl). Extras: ``models`` (flax, safetensors, gguf,
tokenizers: ``nybble.models``, the ``nybble`` command line, reading GPTQ/AWQ safetensors files), ``bench``
(matplotlib: the benchmark's plot), ``test`` (pytest, hypothesis, ruff), ``cuda12`` / ``cuda13`` (jax's
CUDA plugin and CUDA libraries: the GPU kernel), ``xray`` (the kernel X-ray's toolchain, which explains
itself: ``bench.kernel_xray.toolchain`` in a nybble checkout).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Importable module -> the extra that installs it.
EXTRA_OF = {"flax": "models", "safetensors": "models", "gguf": "models", "tokenizers": "models"}


def missing_extra_message(module: str, what: str) -> str:
    """The sentence saying which extra brings ``module`` and how to install it."""
    extra = EXTRA_OF.get(module.split(".")[0], "models")
    return (
        f"{what} needs {module.split('.')[0]!r}, from nybble's {extra!r} extra: in a clone of the "
        f'repository, pip install ".[{extra}]" (nybble is not on PyPI)'
    )


def require(module: str, what: str) -> ModuleType:
    """``import module``, or ModuleNotFoundError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != module.split(".")[0]:
            raise  # something else is missing inside an installed package: not ours to explain
        raise ModuleNotFoundError(missing_extra_message(module, what), name=e.name) from None


__all__ = ["EXTRA_OF", "missing_extra_message", "require"]
