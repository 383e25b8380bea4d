"""implementation="triton" and implementation=None's choice of the Triton kernel, on faked GPUs (the
dispatcher asks nybble.device), and nybble.quantize's default layout by GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble import device
from nybble.kernels import backends
from nybble.kernels.triton import backend as triton_backend
from nybble.packing import default_layout
from tests.kernel_checks import activations


class _Gpu:
    def __init__(self, kind: str, cc: str) -> None:
        self.device_kind, self.compute_capability = kind, cc


A100 = _Gpu("NVIDIA A100-SXM4-80GB", "8.0")
RTX5090 = _Gpu("NVIDIA GeForce RTX 5090", "12.0")
H100 = _Gpu("NVIDIA H100 80GB HBM3", "9.0")
B200 = _Gpu("NVIDIA B200", "10.0")


@pytest.fixture
def gpu(monkeypatch):
    """Fakes the local GPU: ``gpu(A100)``; the Hopper check follows the compute capability."""

    def fake(dev):
        monkeypatch.setattr(device, "gpu_device", lambda: dev)
        hopper = dev if dev is not None and dev.compute_capability.startswith("9") else None
        monkeypatch.setattr(device, "hopper_device", lambda: hopper)
        monkeypatch.setattr(backends, "_WARNED", set())

    return fake


def _weight(layout):
    w = np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32)
    return nybble.quantize(w, group_size=128, layout=layout)


def test_default_layout_follows_the_gpu(gpu):
    gpu(None)
    assert default_layout() == "wgmma_int4" and _weight(None).layout == "wgmma_int4"
    gpu(A100)
    assert default_layout() == "planes_nk_int4" and _weight(None).layout == "planes_nk_int4"
    gpu(RTX5090)
    assert default_layout() == "planes_nk_int4"
    gpu(H100)
    assert default_layout() == "wgmma_int4"
    gpu(B200)  # the Blackwell Mosaic GPU kernel reads the Hopper kernels' layout
    assert default_layout() == "wgmma_int4" and _weight(None).layout == "wgmma_int4"


@pytest.mark.parametrize("dev", [A100, RTX5090], ids=lambda d: d.device_kind)
def test_none_passes_triton_over_on_a_gpu_until_a_hardware_check_passes(gpu, dev):
    gpu(dev)
    x = jax.ShapeDtypeStruct((4, 512), jnp.bfloat16)
    text = nybble.kernels.explain(x, _weight("planes_nk_int4"))
    assert "runs 'xla' (implementation=None)" in text
    assert "not 'triton': the Triton kernels returned wrong outputs on their first real GPU" in text
    assert "not 'mosaic_gpu'" in text
    forced = nybble.kernels.explain(x, _weight("planes_nk_int4"), implementation="triton")
    assert "runs 'triton' (forced)" in forced and "Triton kernel config for M=4 on" in forced
    out = jax.eval_shape(lambda x: nybble.matmul(x, _weight("planes_nk_int4"), implementation="triton"), x)
    assert out.shape == (4, 256) and out.dtype == jnp.bfloat16  # traced through the kernel
    with triton_backend.interpret("rtx5090" if dev is RTX5090 else "a100"):  # no gate in interpret mode
        assert "runs 'triton' (implementation=None)" in nybble.kernels.explain(x, _weight("planes_nk_int4"))


def test_hopper_takes_mosaic_and_f32_x_goes_to_xla_naming_triton(gpu):
    gpu(H100)
    assert "runs 'mosaic_gpu'" in nybble.kernels.explain(
        jnp.zeros((4, 512), jnp.bfloat16), _weight("wgmma_int4")
    )
    text = nybble.kernels.explain(jnp.zeros((4, 512), jnp.float32), _weight("planes_nk_int4"))
    assert "runs 'xla'" in text and "not 'mosaic_gpu'" in text and "not 'triton': the Triton" in text


def test_cpu_takes_xla_and_says_why_not_triton(gpu):
    gpu(None)
    text = nybble.kernels.explain(jnp.zeros((4, 512), jnp.bfloat16), _weight("planes_nk_int4"))
    assert "runs 'xla'" in text and "not 'triton': it needs an NVIDIA GPU" in text


def test_hopper_layout_on_ampere_falls_back_naming_the_fix(gpu):
    gpu(A100)
    x = jnp.zeros((4, 512), jnp.bfloat16)
    text = nybble.kernels.explain(x, _weight("wgmma_int4"))
    assert "runs 'xla'" in text and "relayout(qw, 'planes_nk_int4')" in text
    with pytest.raises(NotImplementedError, match="planes_nk_int4"):
        nybble.matmul(x, _weight("wgmma_int4"), implementation="triton")


def test_forced_triton_runs_in_interpret_mode_and_matches_the_reference():
    rng = np.random.default_rng(1)
    qw = _weight("planes_nk_int4")
    x = activations(rng, 3, 512)
    with triton_backend.interpret("a100"):
        y = nybble.matmul(x, qw)  # implementation=None: the Triton kernel is the first that can run
        yr = nybble.ragged_matmul(
            x,
            nybble.quantize(
                np.stack([np.asarray(nybble.dequantize(qw))] * 2), group_size=128, layout="planes_nk_int4"
            ),
            jnp.asarray([1, 2], jnp.int32),
            implementation="triton",
        )
    ref = nybble.kernels.reference_matmul(x, qw)
    assert nybble.kernels.relative_error(y, ref) < 2**-7
    assert nybble.kernels.relative_error(yr, ref) < 2**-6
