"""The CUDA toolchain the X-ray compiles with, without a GPU: where it lives and the process it needs.

Compiling for sm_90a on a machine without a GPU takes JAX's CUDA PJRT plugin (its deviceless topology
API and XLA's GPU compiler), ptxas and libdevice from ``nvidia-cuda-nvcc-cu12``, and nvdisasm for the
SASS dump: the ``xray`` extra (``pip install "nybble[xray]"``). They are found either importable in this
environment, or installed apart in a separate folder (``pip install --target DIR``), so that the CUDA
plugin does not change what JAX does in the processes that don't compile for a GPU: ``make install``
puts them in ``.venv/nybble-xray``; ``NYBBLE_XRAY_SITE`` names another folder.

The compiling process must start with the plugin importable, ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (the
plugin otherwise refuses to start without a CUDA driver) and ``CUDA_ROOT`` pointing at a folder holding
``bin/ptxas``, ``bin/nvdisasm`` and ``nvvm/`` (where JAX and Mosaic GPU look for them): nybble assembles
that folder from the packages' files, as links, in its cache (``$NYBBLE_CACHE_DIR``, else
``$XDG_CACHE_HOME/nybble``, else ``~/.cache/nybble``). :func:`child_environment` gives such a process's
environment; :func:`in_compile_process` tells whether this process is one.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Set in a process started with child_environment(): the X-ray compiles in this process.
CHILD_MARKER = "NYBBLE_XRAY_CHILD"
SITE_ENV = "NYBBLE_XRAY_SITE"
DEFAULT_SITE_NAME = "nybble-xray"  # under sys.prefix (the virtual environment)
EXTRA_HINT = (
    'install the X-ray toolchain: `pip install "nybble[xray]"` (JAX\'s CUDA plugin, ptxas, nvdisasm; no '
    "GPU needed), or `make install` in a nybble checkout (puts it in .venv/nybble-xray), or point "
    f"{SITE_ENV} at a folder made with `pip install --target DIR --no-deps <the xray extra's packages>`"
)


class ToolchainMissing(RuntimeError):
    """The X-ray's toolchain (the ``xray`` extra) is not installed where nybble looks."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """Where the X-ray's pieces are. ``site`` is None when they are importable in this environment."""

    site: Path | None
    ptxas: Path
    nvdisasm: Path
    nvvm: Path

    def cuda_root(self) -> Path:
        """A CUDA root (``bin/ptxas``, ``bin/nvdisasm``, ``nvvm/``) of links into the packages, cached."""
        key = hashlib.sha256(f"{self.ptxas}|{self.nvdisasm}|{self.nvvm}".encode()).hexdigest()[:16]
        root = cache_dir() / f"cuda-root-{key}"
        if (root / "bin" / "ptxas").exists() and (root / "nvvm").exists():
            return root
        root.parent.mkdir(parents=True, exist_ok=True)
        # Built aside and renamed into place, so a concurrent X-ray never sees half a root.
        tmp = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
        (tmp / "bin").mkdir()
        (tmp / "bin" / "ptxas").symlink_to(self.ptxas)
        (tmp / "bin" / "nvdisasm").symlink_to(self.nvdisasm)
        (tmp / "nvvm").symlink_to(self.nvvm, target_is_directory=True)
        try:
            tmp.rename(root)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
        return root


def cache_dir() -> Path:
    """nybble's cache: ``$NYBBLE_CACHE_DIR``, else ``$XDG_CACHE_HOME/nybble``, else ``~/.cache/nybble``."""
    if env := os.environ.get("NYBBLE_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nybble"


def plugin_version(site: Path) -> str | None:
    """The version of jax's CUDA plugin installed in ``site`` (from its dist-info), or None."""
    found = sorted(site.glob("jax_cuda12_plugin-*.dist-info"))
    return found[-1].name.removeprefix("jax_cuda12_plugin-").removesuffix(".dist-info") if found else None


def _find_in(site: Path) -> Toolchain | None:
    plugin = site / "jax_plugins" / "xla_cuda12" / "__init__.py"
    ptxas = site / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    nvvm = site / "nvidia" / "cuda_nvcc" / "nvvm"
    nvdisasm = sorted(glob.glob(str(site / "nvidia" / "*" / "bin" / "nvdisasm")))
    if not (plugin.exists() and ptxas.exists() and nvvm.is_dir() and nvdisasm):
        return None
    return Toolchain(site=site, ptxas=ptxas, nvdisasm=Path(nvdisasm[-1]), nvvm=nvvm)


def _site_candidates() -> list[Path]:
    out = []
    if env := os.environ.get(SITE_ENV):
        out.append(Path(env))
    out.append(Path(sys.prefix) / DEFAULT_SITE_NAME)
    return out


def find_toolchain() -> Toolchain:
    """Locates the X-ray toolchain, or raises :class:`ToolchainMissing` saying how to install it."""
    # Importable here (the extra installed into this environment)?
    try:
        plugin = importlib.util.find_spec("jax_plugins.xla_cuda12")
        nvcc = importlib.util.find_spec("nvidia.cuda_nvcc")
    except (ImportError, ValueError):
        plugin = nvcc = None
    if plugin is not None and nvcc is not None and nvcc.submodule_search_locations:
        site = Path(next(iter(nvcc.submodule_search_locations))).parent.parent
        if (found := _find_in(site)) is not None:
            return dataclasses.replace(found, site=None)
    import jax

    # The plugin must be the running jax's own release (each jax of nybble's range has its toolchain: `make
    # xray` the pinned one's, `make xray-jax-latest` the newest's); another one's is passed over, named.
    other = []
    for site in _site_candidates():
        if (found := _find_in(site)) is None:
            continue
        version = plugin_version(site)
        if version in (None, jax.__version__):
            return found
        other.append(f"{site} (jax-cuda12-plugin {version})")
    looked = ", ".join(str(p) for p in _site_candidates())
    if other:
        raise ToolchainMissing(
            f"the kernel X-ray runs with jax {jax.__version__} but found only the toolchain of another jax "
            f"in {', '.join(other)}: install the xray extra's packages with jax-cuda12-plugin and "
            f"jax-cuda12-pjrt =={jax.__version__} there (`make xray-jax-latest` does, for the newest jax of "
            f"the range)"
        )
    raise ToolchainMissing(
        f"the kernel X-ray needs JAX's CUDA plugin, ptxas and nvdisasm, found neither importable nor in "
        f"{looked}: {EXTRA_HINT}"
    )


_OPT_LEVEL_FLAG = "--xla_backend_optimization_level"


def child_environment(toolchain: Toolchain, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that compiles for sm_90a without a GPU (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    if toolchain.site is not None:
        parts = [str(toolchain.site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(parts)
    env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    env["CUDA_ROOT"] = str(toolchain.cuda_root())
    env.pop("JAX_PLATFORMS", None)  # the deviceless topology needs the CUDA plugin loaded
    env.pop("JAX_PLATFORM_NAME", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = env.get("TF_CPP_MIN_LOG_LEVEL", "2")
    # What production compiles: the test suite's XLA_FLAGS lower XLA's backend optimization level on a
    # CPU-only machine (tests/conftest.py), which also reaches the Triton kernels' LLVM and ptxas (an
    # sm_89 prefill loop read 10.1 instead of 7.3 thread-instructions per weight under it).
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_OPT_LEVEL_FLAG)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    env[CHILD_MARKER] = "1"
    return env


def in_compile_process() -> bool:
    """Whether this process was started with :func:`child_environment` (or set up the same way)."""
    return (
        os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK") == "1"
        and bool(os.environ.get("CUDA_ROOT"))
        and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    )
