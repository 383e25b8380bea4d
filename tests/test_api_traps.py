"""The API's former traps (issue 38): each wrong first try gets a pointer, each silent choice a word.

* ``nybble.quantize`` on a model points at ``nybble.models.quantize``;
* frozen method configs (``RTN``, ``GPTQ``, ``AutoRound``) validated once, printed in the report, saved with
  the checkpoint and restored by ``load_model``; ``nnx.Einsum`` / ``nnx.LinearGeneral`` named as skipped;
* ``implementation=None`` on a GPU machine warns once per reason when it falls back to XLA;
* the XLA path holds no float32 copy of the weight (compiled HLO);
* ``available_implementations`` and ``explain`` read right;
* ``eval --checkpoint`` refuses another model's checkpoint before any scoring.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nybble
from nybble import device, models
from nybble.checkpoint import read_metadata
from nybble.kernels import backends
from nybble.kernels.ops.matmul.xla import xla_matmul
from nybble.models.evaluate.zoo import load_named
from nybble.models.quantization.methods import AutoRound, get_quantization
from nybble.quant.autoround import AutoRoundConfig
from tests.kernel_checks import assert_within_rounding


def _tiny():
    return load_named("tiny-random", jnp.float32)[0]


# ------------------------------------------------------------------------------------ quantize on a model


def test_nybble_quantize_on_a_model_points_at_models_quantize():
    with pytest.raises(TypeError, match=r"got Llama; .*nybble\.models\.quantize\(model"):
        nybble.quantize(_tiny())
    with pytest.raises(TypeError, match=r"params pytree: nybble\.models\.quantize_params"):
        nybble.quantize({"kernel": np.ones((64, 64), np.float32)})


# ---------------------------------------------------------------------------------------- method configs


def test_configs_validate_themselves():
    with pytest.raises(ValueError, match="power of two >= 16"):
        models.RTN(group_size=24)
    with pytest.raises(ValueError, match=r"GPTQ: damp must be a float in \(0, 1\), got 2"):
        models.GPTQ(damp=2)
    with pytest.raises(ValueError, match="unknown preset 'quick'"):
        models.AutoRound(config="quick")
    with pytest.raises(ValueError, match="start must be one of"):
        models.AutoRound(start="awq")
    with pytest.raises(dataclasses.FrozenInstanceError):
        models.RTN().group_size = 64  # type: ignore[misc]
    assert models.AutoRound(config="fast").config == AutoRoundConfig(steps=50)


def test_strings_stay_shorthand_for_the_same_configs():
    model = _tiny()
    _, report = models.quantize(
        model, "rtn", group_size=64, symmetric=False, return_report=True, progress=False
    )
    assert report.config == models.RTN(group_size=64, symmetric=False)
    with pytest.raises(TypeError, match=r"method='rtn' takes no option\(s\) \['act_order'\]"):
        models.quantize(_tiny(), "rtn", act_order=True)
    with pytest.raises(TypeError, match=r"options \['group_size'\] given beside the method config"):
        models.quantize(_tiny(), models.RTN(), group_size=32)
    with pytest.raises(ValueError, match="unknown method 'awq'"):
        models.quantize(_tiny(), "awq")
    # AutoRoundConfig's fields ride along with the shorthand, as before.
    from nybble.models.quantization.methods import method_config

    assert method_config("autoround", steps=7, start="gptq") == AutoRound(
        config=AutoRoundConfig(steps=7), start="gptq"
    )


def test_config_printed_saved_and_restored(tmp_path):
    model = _tiny()
    config = models.RTN(group_size=32, symmetric=False)
    model, report = models.quantize(model, config, return_report=True, progress=False)
    assert f"  method: {config!r}" in report.summary().splitlines()
    qw = model.layers[0].attn.q_proj.weight
    assert (qw.group_size, qw.symmetric) == (32, False)
    path = models.save_model(tmp_path / "m.safetensors", model)
    info = read_metadata(path)["info"]
    assert info == {
        "quantization": {
            "method": "rtn",
            "group_size": 32,
            "symmetric": False,
            "scale_dtype": "bfloat16",
            "zero_point": "float",
            "clip_search": False,
        }
    }
    fresh = _tiny()
    assert get_quantization(fresh) is None
    models.load_model(path, fresh)
    assert get_quantization(fresh) == config


def test_saved_info_is_under_the_checksum(tmp_path):
    model = models.quantize(_tiny(), models.RTN(group_size=64), progress=False)
    path = models.save_model(tmp_path / "m.safetensors", model)
    raw = path.read_bytes()
    tampered = raw.replace(b'\\"group_size\\":64', b'\\"group_size\\":32', 1)
    assert tampered != raw
    path.write_bytes(tampered)
    with pytest.raises(ValueError, match="sha256 checksum mismatch"):
        nybble.load(path)


class _Mixed(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.dense = nnx.Linear(64, 64, rngs=rngs)
        self.general = nnx.LinearGeneral(64, (4, 16), rngs=rngs)
        self.einsum = nnx.Einsum("bk,kn->bn", (64, 64), rngs=rngs)


def test_einsum_and_linear_general_are_reported_as_skipped():
    model, report = models.quantize(_Mixed(), group_size=32, return_report=True, progress=False)
    assert [r.path for r in report.quantized] == ["dense"]
    skipped = {r.path: r.reason for r in report.skipped}
    assert set(skipped) == {"general", "einsum"}
    assert "nnx.LinearGeneral is not swapped" in skipped["general"]
    assert "nnx.Einsum is not swapped" in skipped["einsum"]
    text = report.summary()
    assert (
        "kept general (64, 4, 16): nnx.LinearGeneral" in text and "kept einsum (64, 64): nnx.Einsum" in text
    )
    assert isinstance(model.general, nnx.LinearGeneral)  # untouched


# ------------------------------------------------------------------------------------ the silent fallback


class _FakeGpu:
    device_kind = "NVIDIA A100-SXM4-80GB"
    compute_capability = "8.0"


@pytest.fixture
def no_kernel_gpu(monkeypatch):
    """A machine whose GPU has no nybble Mosaic GPU kernel (neither Hopper nor Blackwell)."""
    monkeypatch.setattr(device, "gpu_device", lambda: _FakeGpu())
    monkeypatch.setattr(device, "hopper_device", lambda: None)
    monkeypatch.setattr(backends, "_WARNED", set())


@pytest.fixture
def cpu_machine(monkeypatch):
    """A machine with no GPU, whatever runs the test: the dispatcher's view of a CPU-only host (on a Hopper
    the same arguments would go to the kernel, which is not what these tests are about)."""
    monkeypatch.setattr(device, "gpu_device", lambda: None)
    monkeypatch.setattr(device, "hopper_device", lambda: None)
    monkeypatch.setattr(backends, "_WARNED", set())


def _weight(layout="wgmma_int4"):
    w = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    return nybble.quantize(w, group_size=64, layout=layout)


def _fallback_warnings(x, qw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nybble.matmul(x, qw)
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_fallback_warns_once_per_reason_on_a_gpu_machine(no_kernel_gpu):
    qw, x = _weight(), jnp.ones((2, 256), jnp.bfloat16)
    (first,) = _fallback_warnings(x, qw)
    assert "running the XLA path" in first and "NVIDIA A100" in first and "compute capability 8.0" in first
    assert _fallback_warnings(x, qw) == []  # once
    (f32,) = _fallback_warnings(x.astype(jnp.float32), qw)
    assert "x has dtype float32" in f32
    (nk,) = _fallback_warnings(x, _weight("nk_int4"))
    assert "layout 'nk_int4'" in nk
    assert _fallback_warnings(x, qw) == [] and nybble.matmul(x, qw, implementation="xla").shape == (2, 128)


def test_no_fallback_warning_on_a_cpu(cpu_machine):
    qw, x = _weight(), jnp.ones((2, 256), jnp.float32)
    assert _fallback_warnings(x, qw) == []


# ----------------------------------------------------------------------------- the XLA path's weight copy


@pytest.mark.parametrize("layout", ["wgmma_int4", "nk_int4"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_xla_path_holds_no_float32_weight(layout, dtype):
    """The program the XLA path hands to XLA: every (K, N)-sized value is in the activation dtype (2 bytes
    a weight, never a float32 copy at 8) and no float value is transposed; symmetric groups land
    within the float64 reference's rounding bound. (XLA's CPU backend then upcasts bf16 dots itself;
    GPUs do not.)"""
    k, n = 1024, 512
    w = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, k)), dtype)
    name = {jnp.bfloat16: "bf16", jnp.float16: "f16"}[dtype]
    for symmetric in (True, False):
        qw = nybble.quantize(w, group_size=128, symmetric=symmetric, layout=layout)
        text = jax.jit(xla_matmul).lower(x, qw).as_text()
        values = set(re.findall(r"tensor<(\d+)x(\d+)x(\w+)>", text))
        sized = {(a, b, t) for a, b, t in values if {int(a), int(b)} == {k, n}}
        assert sized and {t for _, _, t in sized} <= {name, "i4", "i8", "i32", "ui32", "ui8"}, sized
        # Unpacking wgmma_int4 moves int8 codes around; no float weight-sized value is transposed.
        moved = re.findall(r"stablehlo.transpose .*-> tensor<(\d+)x(\d+)x(bf16|f16|f32)>", text)
        assert not [m for m in moved if {int(m[0]), int(m[1])} == {k, n}], moved
        if symmetric:  # each weight rounded once to x's dtype (exactly: q * s has <= 12 bits)
            assert_within_rounding(xla_matmul(x, qw), x, qw)


# ------------------------------------------------------------------------------- what runs here, and why


def test_available_implementations_read_right(cpu_machine):
    qw, x = _weight(), jnp.ones((2, 256), jnp.bfloat16)
    avail = nybble.kernels.available_implementations(x, qw)
    assert list(avail) == list(nybble.kernels.IMPLEMENTATIONS)
    assert avail["xla"] and avail["xla"].available and repr(avail["xla"]) == "<available>"
    assert not avail["mosaic_gpu"] and "needs a Hopper GPU" in avail["mosaic_gpu"].reason
    assert repr(avail["mosaic_gpu"]).startswith("<unavailable: it needs a Hopper GPU")
    with nybble.kernels.interpret():
        assert nybble.kernels.available_implementations(x, qw)["mosaic_gpu"]


def test_explain_says_what_runs_and_why(cpu_machine):
    qw, x = _weight(), jnp.ones((16, 256), jnp.bfloat16)
    text = nybble.kernels.explain(x, qw)
    assert "runs 'xla' (implementation=None)" in text and "dequantized to x's dtype in the program" in text
    assert "not 'mosaic_gpu': it needs a Hopper GPU" in text
    with nybble.kernels.interpret():
        text = nybble.kernels.explain(x, qw)
    assert "runs 'mosaic_gpu'" in text and "kernel config for M=16 on 132 SMs: TuningConfig(" in text
    forced = nybble.kernels.explain(x.astype(jnp.float32), qw, implementation="mosaic_gpu")
    assert "forced and raises: x has dtype float32" in forced


# ------------------------------------------------------------------------ a checkpoint of another model


def test_eval_refuses_another_models_checkpoint_before_scoring(tmp_path, monkeypatch, capsys):
    from nybble import __main__ as cli

    other = models.Llama(  # tiny-random's vocabulary and depth, half its width: another model
        dataclasses.replace(load_named("tiny-random")[0].config, hidden_size=64), rngs=nnx.Rngs(0)
    )
    path = models.save_model(tmp_path / "other.safetensors", models.quantize(other, progress=False))

    def never(*args, **kwargs):
        raise AssertionError("the float model was scored before the checkpoint was checked")

    monkeypatch.setattr(models, "negative_log_likelihood", never)
    argv = ["eval", "--model", "tiny-random", "--checkpoint", str(path), "--tokens", "8", "--no-progress"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "belongs to another model" in err and "embed.embedding: saved (256, 64), this model (256, 128)" in err
    )
