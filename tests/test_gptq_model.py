"""GPTQ through a whole (tiny, random) NNX Llama: layers replaced, sequential calibration, reports."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import nybble.models as nm
from nybble.models.definitions.layers import QLinear
from nybble.models.definitions.llama import Llama, LlamaConfig
from nybble.models.quantization.calibrate import calibration_batches, quantize_gptq

CFG = LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
    tie_embeddings=False,
)  # fmt: skip


def tiny_model() -> Llama:
    return Llama(CFG, rngs=nnx.Rngs(0))


def test_quantize_gptq_whole_model():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, (4, 48))
    ref = np.asarray(tiny_model().hidden_states(ids))
    rtn = nm.quantize(tiny_model(), group_size=32, progress=False)
    err_rtn = np.linalg.norm(np.asarray(rtn.hidden_states(ids)) - ref)
    model, report = nm.quantize(
        tiny_model(), method="gptq", calibration=ids, group_size=32, return_report=True, progress=False,
        rules=[nm.QuantRule(pattern=r"layers\.1\.mlp\.down_proj$", skip=True),
               nm.QuantRule(pattern=r"lm_head$")],
    )  # fmt: skip
    for i, block in enumerate(model.layers):
        for lin in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj, block.attn.o_proj,
                    block.mlp.gate_proj, block.mlp.up_proj):  # fmt: skip
            assert isinstance(lin, QLinear) and lin.weight.group_size == 32
        assert isinstance(block.mlp.down_proj, QLinear) == (i == 0)
    # The LM head is chosen by a rule but hidden_states() never reaches it: round-to-nearest, reported.
    assert isinstance(model.lm_head, QLinear)
    head = next(r for r in report.layers if r.path == "lm_head")
    assert head.quantized and "round-to-nearest" in head.reason
    assert len(report.quantized) == 14 and len(report.skipped) == 1 and report.method == "gptq"
    # Calibrated on these tokens, GPTQ tracks the float model closer than round-to-nearest.
    err_gptq = np.linalg.norm(np.asarray(model.hidden_states(ids)) - ref)
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)
    assert np.isfinite(np.asarray(model(ids))).all()


def test_refit_scales_passes_through():
    """refit_scales=False is the paper's GPTQ: same codes as the default, other scales, larger error."""
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, (4, 48))
    ref = np.asarray(tiny_model().hidden_states(ids))
    plain = nm.quantize(tiny_model(), method="gptq", calibration=ids, group_size=32, refit_scales=False,
                        progress=False)  # fmt: skip
    refit = nm.quantize(tiny_model(), method="gptq", calibration=ids, group_size=32, progress=False)
    a, b = plain.layers[0].attn.q_proj.weight, refit.layers[0].attn.q_proj.weight
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))  # first layer: same inputs
    assert not np.array_equal(np.asarray(a.scales), np.asarray(b.scales))
    err = [np.linalg.norm(np.asarray(m.hidden_states(ids)) - ref) for m in (plain, refit)]
    assert err[1] < err[0], err


def test_errors_restore_the_model():
    model = tiny_model()
    with pytest.raises(ValueError, match="calibration"):
        nm.quantize(model, method="gptq", progress=False)
    with pytest.raises(TypeError, match="unexpected keyword"):
        quantize_gptq(model, calibration=np.zeros((1, 8), np.int32), bogus=1)

    def broken_forward(m, ids):
        m.layers[0].attn.q_proj(np.zeros((1, 4, CFG.hidden_size), np.float32))
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        quantize_gptq(model, calibration=np.zeros((1, 8), np.int32), forward=broken_forward, progress=False)
    # The layer reached was quantized; every other one is back to its nnx.Linear.
    assert isinstance(model.layers[0].attn.q_proj, QLinear)
    assert isinstance(model.layers[0].attn.k_proj, nnx.Linear)
    assert isinstance(model.layers[1].mlp.down_proj, nnx.Linear)


def test_calibration_batches():
    assert calibration_batches(np.arange(1000), seq_len=256).shape == (3, 256)
    assert calibration_batches(np.zeros((2, 5), np.int64)).shape == (2, 5)
    with pytest.raises(ValueError, match="fewer than one window"):
        calibration_batches(np.arange(10), seq_len=256)
    with pytest.raises(ValueError, match="integer token ids"):
        calibration_batches(np.zeros((2, 5), np.float32))
