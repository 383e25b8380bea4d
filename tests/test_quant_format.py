"""Every option of a weight's format (``nybble.QuantFormat``) survives every path that quantizes a weight
(dense, 3-D expert stacks, GPTQ, calibrated and uncalibrated layers and experts of a whole model) and
every writer (``nybble.save``, ``models.save_model``, ``save_pretrained``'s compressed-tensors and GPTQ).

The bug these guard: options passed on by naming each keyword again lost ``zero_point="integer"`` for
expert stacks and for layers the calibration never reached, so a Qwen3-MoE quantized asymmetric with
integer zeros could not be written as compressed-tensors."""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nybble
from nybble import models
from nybble.models.definitions.layers import QLinear
from nybble.models.definitions.moe import QExperts
from nybble.models.io.hf.pretrained import from_pretrained
from nybble.models.io.hf.save import save_pretrained
from nybble.quant.gptq import gptq
from nybble.quant.qformat import QuantFormat
from nybble.quant.stacked import unstack_weight

MOE = Path(__file__).resolve().parent / "fixtures" / "moe" / "qwen3_moe"

# Every combination of the format's free fields (bits has one value; layouts are tested in test_packing).
FORMATS = [
    QuantFormat(group_size=g, symmetric=sym, zero_point=zp, scale_dtype=dt)
    for g, sym, zp, dt in itertools.product(
        (32, None), (True, False), ("float", "integer"), ("bfloat16", "float16", "float32")
    )
    if not (sym and zp == "integer")  # the zero-point kind is for asymmetric groups only
]


def _integer_zeros(qw: nybble.QuantizedWeight) -> bool:
    """True when every group's offset is (8 - z) * s for an integer z in 1..15 (float32, exact)."""
    s = np.asarray(qw.scales, np.float32)
    b = np.asarray(qw.offsets, np.float32)
    f = np.round(np.divide(b, s, out=np.zeros_like(b), where=s != 0))
    return bool(np.all(b == f * s) and np.all((f >= -7) & (f <= 7)) and qw.offsets.dtype == np.float32)


def check_format(qw: nybble.QuantizedWeight, fmt: QuantFormat) -> None:
    """``qw`` is stored in ``fmt``: group size, symmetry, scale dtype, layout and zero-point kind."""
    assert (qw.group_size, qw.symmetric, qw.dtype.name, qw.layout) == (
        fmt.group_size,
        fmt.symmetric,
        fmt.scale_dtype,
        fmt.layout,
    ), (qw, fmt)
    if fmt.integer_zero:
        assert _integer_zeros(qw), fmt
    elif not fmt.symmetric:  # float offsets: stored in the scale dtype, and not all integer zeros here
        assert qw.offsets.dtype == fmt.dtype and not _integer_zeros(qw), fmt


def _weights(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((3, 72, 40)).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_rtn_dense_and_stacked_keep_the_format(fmt):
    w = _weights()
    stacked = nybble.quantize(w, fmt)
    for e in range(w.shape[0]):
        one = nybble.quantize(w[e], fmt)
        check_format(one, fmt)
        check_format(unstack_weight(stacked, e), fmt)
        np.testing.assert_array_equal(np.asarray(one.codes), np.asarray(unstack_weight(stacked, e).codes))
    # The keyword API builds the same format.
    kw = dict(group_size=fmt.group_size, symmetric=fmt.symmetric, zero_point=fmt.zero_point)
    by_keywords = nybble.quantize(w, scale_dtype=fmt.scale_dtype, **kw)
    for got, want in zip(jax.tree.leaves(by_keywords), jax.tree.leaves(stacked), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    "fmt", [f for f in FORMATS if f.group_size == 32 and f.scale_dtype == "bfloat16"], ids=repr
)
def test_gptq_dense_and_stacked_keep_the_format(fmt):
    w = _weights(1)[:2]
    x = np.random.default_rng(2).standard_normal((2, 96, 72)).astype(np.float32)
    stacked = gptq(w, inputs=list(x), format=fmt, act_order=False)
    for e in range(2):
        check_format(unstack_weight(stacked, e), fmt)
    check_format(gptq(w[0], inputs=x[0], format=fmt, act_order=True), fmt)


def test_keywords_override_a_format_and_bad_ones_are_named():
    fmt = QuantFormat(group_size=64, symmetric=False, zero_point="integer")
    qw = nybble.quantize(_weights()[0], fmt, group_size=32)
    check_format(qw, fmt.replace(group_size=32))
    with pytest.raises(TypeError, match="group_sise"):
        nybble.quantize(_weights()[0], group_sise=32)
    with pytest.raises(ValueError, match="zero_point must be one of"):
        QuantFormat(zero_point="int")


def _moe_model():
    return from_pretrained(MOE, dtype=jnp.float32)


def _check_model(model, fmt: QuantFormat) -> int:
    """Every int4 layer and expert of ``model`` is in ``fmt``; returns how many weights were checked."""
    seen = 0
    for _, m in nnx.iter_modules(model):
        if isinstance(m, QLinear):
            check_format(m.weight, fmt)
            seen += 1
        elif isinstance(m, QExperts):
            for e in range(m.num_experts):
                check_format(unstack_weight(m.weight, e), fmt)
                seen += 1
    return seen


def _check_writers(model, tmp_path: Path, fmt: QuantFormat) -> None:
    """nybble.save, models.save_model and save_pretrained (compressed-tensors, GPTQ) keep every weight."""
    ids = np.load(MOE / "prompt_ids.npy")[None]
    want = np.asarray(model(ids))
    for name in ("compressed-tensors", "gptq"):
        out = save_pretrained(model, tmp_path / name, format=name, source=MOE)
        back = from_pretrained(out, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(back(ids)), want)
    models.save_model(tmp_path / "model.safetensors", model)
    again = models.load_model(tmp_path / "model.safetensors", _moe_model())
    assert _check_model(again, fmt) > 0
    np.testing.assert_array_equal(np.asarray(again(ids)), want)
    stack = model.layers[1].mlp.experts.down_proj.weight
    loaded = nybble.load(nybble.save(tmp_path / "stack.nyb", {"w": stack}))["w"]
    check_format(unstack_weight(loaded, 0), fmt)


# The fixture's int4 weights: 2 layers x 4 attention projections, layer 0's dense MLP (3), layer 1's
# 3 expert stacks of 4 experts (the router and the untied lm_head stay float).
N_INT4 = 2 * 4 + 3 + 3 * 4
ASYM_INT = QuantFormat(group_size=32, symmetric=False, zero_point="integer")


def test_rtn_moe_model_with_integer_zeros_writes_every_format(tmp_path):
    model = models.quantize(
        _moe_model(), models.RTN(group_size=32, symmetric=False, zero_point="integer"), progress=False
    )
    assert _check_model(model, ASYM_INT) == N_INT4  # attention, dense MLP, experts
    _check_writers(model, tmp_path, ASYM_INT)


def test_gptq_moe_model_uncalibrated_experts_and_layers_keep_the_format(tmp_path):
    config = models.GPTQ(group_size=32, symmetric=False, zero_point="integer", scale_dtype="float16")
    fmt = QuantFormat(group_size=32, symmetric=False, zero_point="integer", scale_dtype="float16")
    # One token reaches top_k = 2 of the 4 experts of each MoE layer: the other two get round to nearest.
    model, report = models.quantize(
        _moe_model(), config, calibration=np.array([[3]], np.int32), progress=False, return_report=True
    )
    assert any("got no calibration tokens" in r.reason for r in report.layers)
    _check_model(model, fmt)
    _check_writers(model, tmp_path, fmt)
    # A forward pass that reaches no layer: every layer and expert stack is rounded to nearest afterwards.
    model, report = models.quantize(
        _moe_model(),
        config,
        calibration=np.array([[3]], np.int32),
        forward=lambda m, ids: m.embed(ids),
        progress=False,
        return_report=True,
    )
    assert sum("not reached by the calibration" in r.reason for r in report.layers) > 10
    assert _check_model(model, fmt) == N_INT4
