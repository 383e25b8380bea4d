"""One GpuSpec for the heuristics, the X-ray and bench; the cost model's named coefficients and rank; one tag
per TuningConfig."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble.kernels.gpu import GPUS, H100_SXM, H200, current_gpu, get_gpu, spec_for_device_kind
from nybble.kernels.mosaic_gpu import TuningConfig, cost_model, heuristics, plan


def test_specs_and_lookup():
    assert get_gpu("H200") is H200 and get_gpu("h100") is H100_SXM
    assert H200.hbm_bytes_per_s == 4.8e12 and H100_SXM.hbm_bytes_per_s == 3.35e12
    assert H200.sms == H100_SXM.sms == 132 and H200.clock_ghz == pytest.approx(1.98)
    assert spec_for_device_kind("NVIDIA H200") is H200
    assert spec_for_device_kind("NVIDIA H100 80GB HBM3") is H100_SXM
    assert spec_for_device_kind("NVIDIA H100 PCIe") is None  # other clocks and bandwidth: no spec
    with pytest.raises(ValueError, match="known"):
        get_gpu("v100")  # no spec (Volta: no nybble kernel)
    assert current_gpu() is H200  # no GPU here: the default spec
    # The X-ray's deviceless topology takes the same spec.
    from bench.kernel_xray import target

    assert target.GPUS is GPUS
    assert "core_count: 132" in target.target_config(H200)


def test_model_times_follow_the_spec():
    c = TuningConfig(tiles=2, tile_m=8, tile_k=256, slices=1, split_k=1, scales_on="accumulators")
    args = (c, 8, 4096, 4096, 128, False, 132)
    h200 = cost_model.modeled_times_us(*args)
    h100 = cost_model.modeled_times_us(*args, gpu=H100_SXM)
    assert h200 == cost_model.modeled_times_us(*args, gpu=H200)  # the default is the H200
    assert h100["hbm"] == pytest.approx(h200["hbm"] * 4.8 / 3.35)
    assert h100["issue"] == h200["issue"] and h100["tensor"] == h200["tensor"]
    # HBM time by hand: codes + x + y + scales over 4.8 TB/s with every SM busy or a share of them.
    ctas = 4096 // c.cta_rows
    nbytes = 4096 * 4096 / 2 + 2 * (8 * 4096 + 8 * 4096) + 2 * 4096 * 32
    assert h200["hbm"] == pytest.approx(nbytes / (4.8e12 * min(1.0, ctas / 132)) * 1e6)


def test_cost_model_coefficients_are_the_estimate():
    c = TuningConfig(tiles=1, tile_m=8, tile_k=128, slices=1, split_k=1, scales_on="weights")
    # One A tile, 128 deep, exact weights, refilling its own slots: (100 + 2 * 8 HGMMAs) / 64 weights a
    # thread + 0.875 + 0.125 + 1.0 (+0.03 with offsets).
    assert cost_model.estimated_instructions_per_weight(c, 128, False) == pytest.approx(
        0.875 + 0.125 + 116 / 64 + 1.0
    )
    bigger = dataclasses.replace(cost_model.COST_MODEL, step=164)
    assert cost_model.estimated_instructions_per_weight(c, 128, True, model=bigger) == pytest.approx(
        0.875 + 0.125 + 180 / 64 + 1.03
    )
    assert (cost_model.DECODE_TIE, cost_model.DECODE_IPW_GAIN) == (
        cost_model.COST_MODEL.decode_tie,
        cost_model.COST_MODEL.decode_ipw_gain,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        cost_model.COST_MODEL.step = 1  # type: ignore[misc]


def test_rank_orders_like_its_fields():
    a = heuristics.Rank(0.0, 0.0, True, -1.7, 2, 256, 4, -1.71)
    b = heuristics.Rank(0.0, 0.0, False, -1.5, 4, 512, 8, -1.5)
    assert a > b  # hidden latency first
    assert a._replace(hidden=False) < b  # then fewer instructions


def test_ties_are_relative_to_the_fastest_time(monkeypatch):
    """Modeled times tie within CostModel.tie_relative of the fastest, not within a fixed number of
    microseconds: scaling every modeled time by 1000 (a GPU 1000 times slower everywhere) leaves every pick
    as it was, decode and prefill alike. With ties to the hundredth of a microsecond it moves picks (the
    tie widens or narrows with the problem's size)."""
    problems = [
        (m, n, k, g)
        for m in (1, 16, 64, 128, 1024, 4096)
        for n, k in ((4096, 4096), (28672, 4096), (4096, 14336), (576, 576))
        for g in (128, 32)
    ]
    pick = heuristics.heuristic_config.__wrapped__
    before = [pick(m, n, k, g) for m, n, k, g in problems]
    unscaled = cost_model.modeled_times_us
    monkeypatch.setattr(
        heuristics, "modeled_times_us", lambda *a, **kw: {p: 1000 * t for p, t in unscaled(*a, **kw).items()}
    )
    assert [pick(m, n, k, g) for m, n, k, g in problems] == before
    steps_of = heuristics._steps_of
    assert steps_of(1.0004, 0.001) == steps_of(1.0, 0.001) != steps_of(1.0016, 0.001)


def test_tag_names_every_field():
    configs = [
        TuningConfig(tiles=t, tile_m=m, tile_k=k, compute_wgs=2, persistent_ctas=p, max_concurrent_steps=s)
        for t, m, k, p, s in itertools.product((1, 2), (128, 256), (64, 128), (0, 132), (2, 4))
        if not (m == 256 and t == 2)
    ]
    configs += [
        TuningConfig(tiles=1, tile_m=8, tile_k=128, slices=s, scales_on="accumulators", producer=pr)
        for s in (1, 4)
        for pr in (False, True)
    ]
    tags = [c.tag for c in configs]
    assert len(set(tags)) == len(configs)  # warp-specialized variants apart (they were all one name)
    assert all(t.isidentifier() for t in tags)
    assert TuningConfig(tiles=1, tile_m=8, tile_k=128, scales_on="accumulators", producer=True).tag == (
        "t1m8k128s1p4x1b8w1acc_tma"
    )
    assert TuningConfig(tiles=1, tile_m=256, tile_k=64, compute_wgs=2, persistent_ctas=132).tag == (
        "t1m256k64s1p4x1b8w2wt_P132"
    )


def test_plan_models_f16_as_f16():
    w = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    qw = nybble.quantize(w, group_size=128)
    assert plan(4, qw).dtype == jnp.bfloat16
    p16 = plan(4, qw, dtype=jnp.float16)
    assert p16.dtype == jnp.float16 and p16.config == plan(4, qw).config
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        plan(4, qw, dtype=jnp.float32)
