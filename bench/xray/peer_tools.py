"""The peers' toolchains for the X-ray, installed on demand into nybble's cache (never into the venv).

Only ``python -m bench.xray --peers`` (and ``make xray-peers``) installs them, each into its own folder under
``<nybble cache>/peers`` (``$NYBBLE_CACHE_DIR``, else ``~/.cache/nybble``): ``make bench`` and ``make
test``'s dependencies never change.

- **CUDA 13 nvcc from PyPI wheels** (:func:`cuda_tree`): ``nvidia-cuda-nvcc`` (nvcc, cudafe++, ptxas,
  fatbinary), ``nvidia-nvvm`` (cicc, libdevice), ``nvidia-cuda-crt``, ``nvidia-cuda-runtime`` and
  ``nvidia-cuda-cccl`` unpacked by ``pip install --target`` into one tree, ``nvidia/cu13``: its
  ``bin/nvcc.profile`` names everything relative to itself, so that tree is a CUDA toolkit for device
  code, no CUDA install needed. The host compiler is the system's ``g++``.
- **vLLM's kernel sources** (:func:`vllm_source`): the pinned vLLM source distribution from PyPI
  (checked against its sha256), of which only ``csrc/`` is unpacked: Marlin (``csrc/quantization/marlin``)
  and Machete. vLLM is the server most int4 checkpoints are served with today; its sdist ships the Marlin
  it runs. Downloaded at X-ray time, never vendored.
- **tokamax** (:func:`tokamax_site`): ``tokamax`` and ``qwix`` with the pure-Python packages they import
  that nybble's venv lacks, ``--no-deps`` into a folder the X-ray's compile workers append to
  ``sys.path`` (after the venv's own packages, so jax, numpy and flax stay the venv's).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from bench.kernel_xray.toolchain import cache_dir

# Pinned: SASS counts depend on the compiler and the sources.
CUDA_WHEELS = (
    "nvidia-cuda-nvcc==13.5.37",
    "nvidia-nvvm==13.5.37",
    "nvidia-cuda-crt==13.5.37",
    "nvidia-cuda-runtime==13.5.37",
    "nvidia-cuda-cccl==13.3.5.0.6",
)
VLLM_VERSION = "0.34.0"
VLLM_SDIST_SHA256 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
TOKAMAX_PACKAGES = (
    "tokamax==0.0.17",
    "qwix==0.1.8",
    # What tokamax imports that nybble's venv does not have (tokamax declares more; these suffice to
    # import it and compile its kernels).
    "einshape==1.0",
    "jaxtyping==0.3.11",
    "wadler_lindig==0.1.8",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "immutabledict==4.3.1",
    "xprof==2.24.2",
    "tensorboardX==2.6.5",
    "fire==0.7.1",
    "termcolor==3.3.0",
    "six==1.17.0",
)


class PeerToolchainMissing(RuntimeError):
    """A peer's toolchain could not be installed (no network to PyPI, no g++, ...)."""


def peers_dir() -> Path:
    return cache_dir() / "peers"


def _key(items: tuple[str, ...]) -> str:
    return hashlib.sha256("\n".join(items).encode()).hexdigest()[:12]


def _pip_target(packages: tuple[str, ...], dest: Path) -> Path:
    """``pip install --no-deps --target`` into a fresh folder renamed to ``dest`` (so a half-finished
    install never looks finished)."""
    if (dest / ".complete").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(tmp)]
    proc = subprocess.run([*cmd, *packages], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PeerToolchainMissing(
            f"pip could not install {' '.join(packages)} into {dest}: {proc.stderr.strip()[-800:]}"
        )
    (tmp / ".complete").write_text("\n".join(packages) + "\n")
    try:
        tmp.rename(dest)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def cuda_tree() -> Path:
    """The ``nvidia/cu13`` folder of the CUDA wheels (``bin/nvcc``, ``nvvm/``, ``include/``), installed
    on first use."""
    site = _pip_target(CUDA_WHEELS, peers_dir() / f"cuda-{_key(CUDA_WHEELS)}")
    root = site / "nvidia" / "cu13"
    if not (root / "bin" / "nvcc").exists() or not (root / "nvvm" / "bin" / "cicc").exists():
        raise PeerToolchainMissing(f"{root}: the CUDA wheels gave no bin/nvcc or nvvm/bin/cicc")
    return root


def nvcc() -> Path:
    return cuda_tree() / "bin" / "nvcc"


def host_compiler() -> str:
    gxx = shutil.which("g++")
    if gxx is None:
        raise PeerToolchainMissing("nvcc needs a host C++ compiler: no g++ on PATH (apt-get install g++)")
    return gxx


def _sdist_url(name: str, version: str) -> tuple[str, str]:
    """(URL, sha256) of a project's source distribution, from PyPI's JSON API."""
    api = f"https://pypi.org/pypi/{name}/json"
    try:
        with urllib.request.urlopen(api, timeout=60) as r:
            data = json.load(r)
    except OSError as e:
        raise PeerToolchainMissing(f"cannot reach PyPI for {name}=={version}'s sdist ({api}): {e}") from None
    files = data.get("releases", {}).get(version) or (
        data["urls"] if data["info"]["version"] == version else []
    )
    for u in files:
        if u["packagetype"] == "sdist":
            return urllib.parse.urljoin(api, u["url"]), u["digests"]["sha256"]
    raise PeerToolchainMissing(f"{name}=={version} has no source distribution on PyPI")


def vllm_source() -> Path:
    """The unpacked ``csrc/`` of vLLM's pinned sdist (downloaded and checked once, then cached)."""
    dest = peers_dir() / f"vllm-{VLLM_VERSION}"
    if (dest / ".complete").exists():
        return dest / "csrc"
    url, sha = _sdist_url("vllm", VLLM_VERSION)
    if sha != VLLM_SDIST_SHA256:
        raise PeerToolchainMissing(
            f"PyPI lists sha256 {sha} for vllm {VLLM_VERSION}, pinned {VLLM_SDIST_SHA256}"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        archive = tmp / "sdist.tar.gz"
        with urllib.request.urlopen(url, timeout=300) as r, open(archive, "wb") as f:
            shutil.copyfileobj(r, f)
        got = hashlib.sha256(archive.read_bytes()).hexdigest()
        if got != VLLM_SDIST_SHA256:
            raise PeerToolchainMissing(
                f"vllm {VLLM_VERSION} sdist: sha256 {got}, expected {VLLM_SDIST_SHA256}"
            )
        prefix = f"vllm-{VLLM_VERSION}/csrc/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(f"vllm-{VLLM_VERSION}/") :]
            tar.extractall(tmp, members=members, filter="data")
        archive.unlink()
        (tmp / ".complete").write_text(f"{url}\nsha256 {VLLM_SDIST_SHA256}\n")
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if (dest / ".complete").exists():
            return dest / "csrc"
        raise
    return dest / "csrc"


def tokamax_site() -> Path:
    return _pip_target(TOKAMAX_PACKAGES, peers_dir() / f"tokamax-{_key(TOKAMAX_PACKAGES)}")


def nvcc_version(root: Path | None = None) -> str:
    exe = (root or cuda_tree()) / "bin" / "nvcc"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def gxx_version() -> str:
    out = subprocess.run([host_compiler(), "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else "unknown"


def environment_site_env() -> dict[str, str]:
    """Environment variables naming the peers' sites for the compile workers (they append them to
    ``sys.path``)."""
    return {"NYBBLE_XRAY_PEER_SITES": os.pathsep.join([str(tokamax_site())])}
