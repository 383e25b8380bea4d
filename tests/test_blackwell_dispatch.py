"""Dispatch to the Blackwell kernel family by compute capability, with faked devices (no GPU needed): the
"mosaic_gpu" backend takes 10.x (B200, GB200, B300), a forced "mosaic_gpu" on a GPU with no nybble kernel
raises naming it and the GPUs that have one, and the grouped matmul on Blackwell takes the grouped tcgen05
kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble import device
from nybble.kernels import backends
from nybble.kernels.mosaic_gpu import backend


class _Gpu:
    def __init__(self, kind: str, cc: str, sms: int) -> None:
        self.device_kind, self.compute_capability, self.core_count = kind, cc, sms


def _fake(monkeypatch, gpu):
    monkeypatch.setattr(device, "gpu_device", lambda: gpu)
    monkeypatch.setattr(
        device, "hopper_device", lambda: gpu if gpu.compute_capability.startswith("9") else None
    )
    monkeypatch.setattr(backends, "_WARNED", set())


def _weight():
    """The Mosaic GPU kernels' layout, named: on a faked A100 the default would be the Triton kernel's."""
    w = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    return nybble.quantize(w, group_size=64, layout="wgmma_int4")


@pytest.mark.parametrize(
    "kind,cc", [("NVIDIA B200", "10.0"), ("NVIDIA GB200", "10.0"), ("NVIDIA B300", "10.3")]
)
def test_blackwell_takes_the_tcgen05_kernel(monkeypatch, kind, cc):
    _fake(monkeypatch, _Gpu(kind, cc, 148))
    qw, x = _weight(), jnp.ones((2, 256), jnp.bfloat16)
    assert backend.family() == "blackwell"
    assert nybble.kernels.available_implementations(x, qw)["mosaic_gpu"]
    text = nybble.kernels.explain(x, qw)
    assert "runs 'mosaic_gpu'" in text and "Blackwell (tcgen05) kernel config for M=2 on 148 SMs" in text
    jaxpr = str(jax.make_jaxpr(lambda x: nybble.matmul(x, qw))(x))  # traced, not run: no GPU here
    assert "nybble_w4a16_bw_" in jaxpr


def test_hopper_keeps_the_wgmma_kernel(monkeypatch):
    _fake(monkeypatch, _Gpu("NVIDIA H200", "9.0", 132))
    qw, x = _weight(), jnp.ones((2, 256), jnp.bfloat16)
    assert backend.family() == "hopper"
    jaxpr = str(jax.make_jaxpr(lambda x: nybble.matmul(x, qw))(x))
    assert "nybble_w4a16" in jaxpr and "nybble_w4a16_bw_" not in jaxpr


def test_forced_on_a_gpu_without_a_kernel_names_it(monkeypatch):
    _fake(monkeypatch, _Gpu("NVIDIA A100-SXM4-80GB", "8.0", 108))
    qw, x = _weight(), jnp.ones((2, 256), jnp.bfloat16)
    match = (
        r"cannot run: .*Hopper .*H100, H200.* and Blackwell .*B200.* this GPU, NVIDIA A100-SXM4-80GB, "
        r"has compute capability 8\.0"
    )
    with pytest.raises(NotImplementedError, match=match):
        nybble.matmul(x, qw, implementation="mosaic_gpu")
    assert not nybble.kernels.available_implementations(x, qw)["mosaic_gpu"]


@pytest.mark.parametrize("kind,cc,sms", [("NVIDIA B200", "10.0", 148), ("NVIDIA GB200", "10.0", 152)])
def test_grouped_matmul_on_blackwell_takes_the_tcgen05_kernel(monkeypatch, kind, cc, sms):
    """Traced, not run (no GPU here): nybble.ragged_matmul on a 10.x GPU is the grouped tcgen05 kernel,
    planned for the device's SM count, with no warning of a fallback."""
    import warnings

    from nybble.kernels.mosaic_gpu.blackwell import grouped as blackwell_grouped

    _fake(monkeypatch, _Gpu(kind, cc, sms))
    seen = []
    real = blackwell_grouped.blackwell_grouped_matmul
    monkeypatch.setattr(
        blackwell_grouped,
        "blackwell_grouped_matmul",
        lambda *a, **kw: seen.append(kw["num_sms"]) or real(*a, **kw),
    )
    w = np.random.default_rng(1).standard_normal((2, 64, 64)).astype(np.float32)
    qw = nybble.quantize(w, group_size=32, layout="wgmma_int4")
    x, sizes = jnp.ones((4, 64), jnp.bfloat16), jnp.asarray([1, 3], jnp.int32)
    assert backend.ragged_unsupported(x, qw, sizes) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        jaxpr = str(jax.make_jaxpr(lambda x, s: nybble.ragged_matmul(x, qw, s))(x, sizes))
    assert "nybble_grouped_w4a16_bw_" in jaxpr and seen == [sms]
