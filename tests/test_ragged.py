"""Stacked expert weights and nybble.ragged_matmul: exact small-integer references, HLO buffers, refusals."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble import device
from nybble.kernels import backends, reference_dequantize, reference_ragged_matmul
from nybble.kernels.ops.ragged_matmul.xla import row_window, xla_ragged_matmul
from nybble.ops import available_ragged_implementations
from nybble.packing import get_layout
from nybble.quant.stacked import num_experts, stack_weights, unstack_weight

LAYOUTS = ("wgmma_int4", "nk_int4")


def _small_int_stack(e, k, n, *, layout="wgmma_int4", group_size=32, symmetric=False, seed=0):
    """Experts with codes in [-8, 7], scales in {1, 2}, offsets in {-1, 0, 1}: integer weights, exact."""
    rng = np.random.default_rng(seed)
    k_pad, n_pad = -(-k // 64) * 64, -(-n // 64) * 64
    groups = -(-k_pad // group_size)
    out = []
    for _ in range(e):
        q = np.zeros((k_pad, n_pad), np.int8)
        q[:k, :n] = rng.integers(-8, 8, (k, n))
        scales = np.zeros((groups, n_pad), np.float32)
        scales[:, :n] = rng.integers(1, 3, (groups, n))
        offsets = None if symmetric else np.where(scales != 0, rng.integers(-1, 2, scales.shape), 0)
        out.append(
            nybble.QuantizedWeight(
                jnp.asarray(get_layout(layout).pack(q)),
                jnp.asarray(scales, jnp.bfloat16),
                None if offsets is None else jnp.asarray(offsets, jnp.bfloat16),
                (k, n),
                group_size,
                symmetric,
                layout,
            )
        )
    return stack_weights(out)


def _sparse_x(m, k, *, nonzeros=6, seed=1, dtype=jnp.float32):
    """x in {-1, 0, 1}, ``nonzeros`` a row: |x @ W| <= 6 * 17, an integer, exact even in bf16."""
    rng = np.random.default_rng(seed)
    x = np.zeros((m, k), np.float32)
    for row in x:
        row[rng.choice(k, nonzeros, replace=False)] = rng.choice([-1.0, 1.0], nonzeros)
    return jnp.asarray(x, dtype)


def _reference(x, qw, sizes):
    """float64 on the host: each expert dequantized by the dense op's reference (numpy only), row by row."""
    return reference_ragged_matmul(x, qw, sizes)


def test_the_reference_multiplies_each_group_by_its_expert():
    """reference_ragged_matmul: rows 0-1 times expert 0, none for expert 1, rows 2-4 times expert 2 (each
    dequantized by the dense reference), row 5 past the groups zero; bad sizes are refused."""
    qw = _small_int_stack(3, 64, 64, seed=16)
    w = [reference_dequantize(unstack_weight(qw, e)) for e in range(3)]
    x = np.arange(6 * 64, dtype=np.float64).reshape(6, 64) % 5 - 2
    y = reference_ragged_matmul(x, qw, [2, 0, 3])
    np.testing.assert_array_equal(y, np.concatenate([x[:2] @ w[0], x[2:5] @ w[2], np.zeros((1, 64))]))
    with pytest.raises(ValueError, match="must be >= 0 and sum to <= 6"):
        reference_ragged_matmul(x, qw, [4, 3, 0])


# Group sizes: zeros among them, one expert holding every row, rows not a multiple of any tile (13, 37),
# groups summing below the rows (the tail must come back zero), every expert empty.
CASES = {
    "zeros": (13, [3, 0, 9, 0, 1]),
    "one_expert_all_rows": (37, [0, 0, 37, 0, 0]),
    "below_rows": (37, [5, 0, 2, 11, 0]),
    "all_empty": (8, [0, 0, 0, 0, 0]),
    "last_expert": (21, [0, 0, 0, 0, 21]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_ragged_exact_small_integers(case, layout):
    rows, sizes = CASES[case]
    qw = _small_int_stack(5, 100, 72, layout=layout, symmetric=case != "zeros", seed=len(case))
    for dtype in (jnp.float32, jnp.bfloat16):
        x = _sparse_x(rows, 100, dtype=dtype, seed=rows)
        gs = jnp.asarray(sizes, jnp.int32)
        ref = _reference(x, qw, sizes)
        y = nybble.ragged_matmul(x, qw, gs)
        assert y.dtype == dtype and y.shape == (rows, 72)
        np.testing.assert_array_equal(np.asarray(y, np.float64), ref)
        # The same numbers as XLA's ragged_dot on the dequantized stack, rows past the sum included.
        rd = jax.lax.ragged_dot(x, nybble.dequantize(qw, dtype), gs, preferred_element_type=jnp.float32)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(rd.astype(dtype), np.float32))
        if sum(sizes):
            assert np.abs(ref).max() > 10  # not a trivially zero product
        assert not np.asarray(y[sum(sizes) :]).any()


@pytest.mark.parametrize("window", [8, 16])
def test_windows_span_experts(window):
    # Small windows: several per expert, windows straddling two experts' rows (the second keeps its own).
    qw = _small_int_stack(3, 64, 64, seed=3)
    sizes = [19, 1, 17]
    x = _sparse_x(40, 64, seed=4)
    f = jax.jit(lambda x, q, g: xla_ragged_matmul(x, q, g, window=window))
    y = f(x, qw, jnp.asarray(sizes, jnp.int32))
    np.testing.assert_array_equal(np.asarray(y, np.float64), _reference(x, qw, sizes))


def test_random_weights_match_ragged_dot_under_jit():
    rng = np.random.default_rng(5)
    w = rng.normal(size=(6, 192, 130)).astype(np.float32) * 0.05
    qw = nybble.quantize(w, group_size=64, symmetric=False)
    x = jnp.asarray(rng.normal(size=(50, 192)), jnp.float32)
    gs = jnp.asarray([7, 0, 20, 3, 0, 11], jnp.int32)
    y = jax.jit(nybble.ragged_matmul)(x, qw, gs)
    ref = jax.lax.ragged_dot(x, nybble.dequantize(qw), gs)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert not np.asarray(y[41:]).any()


def test_interpret_mode_runs_on_cpu():
    qw = _small_int_stack(4, 128, 64, symmetric=True, seed=6)
    sizes = [0, 5, 0, 6]
    x = _sparse_x(16, 128, dtype=jnp.bfloat16, seed=7)
    with nybble.kernels.interpret():
        assert available_ragged_implementations(x, qw, jnp.asarray(sizes, jnp.int32))["mosaic_gpu"] is None
        y = nybble.ragged_matmul(x, qw, jnp.asarray(sizes, jnp.int32))  # the grouped kernel, interpreted
    np.testing.assert_array_equal(np.asarray(y, np.float64), _reference(x, qw, sizes))


def test_stacked_quantize_is_per_expert():
    rng = np.random.default_rng(8)
    w = rng.normal(size=(3, 100, 72)).astype(np.float32)
    for layout, symmetric in (("wgmma_int4", False), ("nk_int4", True)):
        qw = nybble.quantize(w, group_size=32, symmetric=symmetric, layout=layout)
        assert num_experts(qw) == 3 and qw.shape == (100, 72) and qw.codes.shape[0] == 3
        d = np.asarray(nybble.dequantize(qw))
        assert d.shape == (3, 100, 72)
        assert nybble.dequantize(qw, padded=True).shape == (3, 128, 128)
        for e in range(3):
            one = nybble.quantize(w[e], group_size=32, symmetric=symmetric, layout=layout)
            for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(unstack_weight(qw, e)), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(reference_dequantize(one)[:100, :72], d[e])
        assert abs(qw.bits_per_weight - one.bits_per_weight) < 1e-9


def test_stacked_quantize_reports_nan_position():
    w = np.zeros((2, 64, 64), np.float32)
    w[1, 3, 5] = np.nan
    with pytest.raises(ValueError, match=r"\(expert, k, n\) = \(1, 3, 5\)"):
        nybble.quantize(w)


def _buffer_elements(hlo: str, dtypes=("f32", "bf16", "f16")) -> list[int]:
    """Element counts of every float array shape written in an HLO text."""
    out = []
    for _dt, dims in re.findall(r"\b(" + "|".join(dtypes) + r")\[([\d,]*)\]", hlo):
        out.append(int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1)
    return out


def test_xla_path_never_holds_the_float_stack():
    # 16 experts of (256, 512): the float stack would be 16 * 256 * 512 elements. At decode (4 rows),
    # the compiled program holds one expert's float weight at a time.
    e, k, n, rows = 16, 256, 512, 4
    qw = jax.eval_shape(lambda: nybble.quantize(jnp.zeros((e, k, n)), group_size=128))
    x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((e,), jnp.int32)
    ours = jax.jit(nybble.ragged_matmul).lower(x, qw, gs).compile()
    naive_fn = lambda x, q, g: jax.lax.ragged_dot(x, nybble.dequantize(q, x.dtype), g)
    naive = jax.jit(naive_fn).lower(x, qw, gs).compile()
    stack = e * k * n
    assert max(_buffer_elements(ours.as_text())) < stack // 8, "a float buffer of several experts"
    assert max(_buffer_elements(ours.as_text())) >= k * n  # one expert's float weight: the test sees it
    assert max(_buffer_elements(naive.as_text())) >= stack  # and it would see the stack
    temp = ours.memory_analysis().temp_size_in_bytes
    naive_temp = naive.memory_analysis().temp_size_in_bytes
    assert temp <= 4 * k * n * 4, temp  # a few (K, N) float32 arrays at most, never the stack
    assert naive_temp >= stack * 2, naive_temp
    print(f"ragged path temp {temp / 2**20:.2f} MiB; dequantize + ragged_dot {naive_temp / 2**20:.2f} MiB")


def test_row_window():
    assert row_window(8, 128) == 8
    assert row_window(4096 * 8, 128) == 128
    assert row_window(40, 3) == 16


def test_bad_inputs():
    qw = _small_int_stack(3, 64, 64, seed=9)
    x = jnp.zeros((10, 64), jnp.float32)
    gs = jnp.asarray([2, 3, 4], jnp.int32)
    with pytest.raises(TypeError, match=r"must be int32.*astype"):
        nybble.ragged_matmul(x, qw, gs.astype(jnp.int64) if jax.config.x64_enabled else gs.astype(jnp.int16))
    with pytest.raises(TypeError, match="int32 array of shape"):
        nybble.ragged_matmul(x, qw, [2, 3, 4])
    with pytest.raises(ValueError, match=r"stacks 3 experts: it must be \(3,\)"):
        nybble.ragged_matmul(x, qw, jnp.asarray([2, 3], jnp.int32))
    with pytest.raises(ValueError, match=r"group_sizes\[1\] = -1 is negative"):
        nybble.ragged_matmul(x, qw, jnp.asarray([2, -1, 4], jnp.int32))
    with pytest.raises(ValueError, match="sum to 11 but x has 10 rows"):
        nybble.ragged_matmul(x, qw, jnp.asarray([2, 5, 4], jnp.int32))
    with pytest.raises(ValueError, match=r"a plain \(K, N\) weight.*nybble\.matmul"):
        nybble.ragged_matmul(x, unstack_weight(qw, 0), jnp.asarray([10], jnp.int32))
    with pytest.raises(TypeError, match=r"stacked nybble\.QuantizedWeight"):
        nybble.ragged_matmul(x, np.zeros((3, 64, 64)), gs)
    with pytest.raises(ValueError, match=r"x must be \(rows, K\) = \(rows, 64\)"):
        nybble.ragged_matmul(jnp.zeros((10, 32)), qw, gs)
    with pytest.raises(ValueError, match="x must be"):
        nybble.ragged_matmul(jnp.zeros((2, 5, 64)), qw, gs)
    with pytest.raises(TypeError, match="dtype int32"):
        nybble.ragged_matmul(jnp.zeros((10, 64), jnp.int32), qw, gs)
    with pytest.raises(ValueError, match="unknown implementation"):
        nybble.ragged_matmul(x, qw, gs, implementation="cuda")
    with pytest.raises(ValueError, match="weight 1 has"):
        stack_weights([unstack_weight(qw, 0), nybble.quantize(jnp.zeros((64, 128)))])


def test_traced_group_sizes_are_clamped_not_checked():
    # Under jit the values are not checked: a negative size counts as zero, rows past x's are dropped.
    qw = _small_int_stack(3, 64, 64, seed=10)
    x = _sparse_x(10, 64, seed=11)
    f = jax.jit(nybble.ragged_matmul)
    y = f(x, qw, jnp.asarray([4, -3, 9], jnp.int32))
    np.testing.assert_array_equal(np.asarray(y, np.float64), _reference(x, qw, [4, 0, 6]))


def test_forced_kernel_outside_interpret_says_why():
    qw = _small_int_stack(2, 64, 64, seed=12)
    x = jnp.zeros((4, 64), jnp.bfloat16)
    gs = jnp.asarray([1, 3], jnp.int32)
    reasons = available_ragged_implementations(x, qw, gs)
    assert reasons["xla"] is None and reasons["mosaic_gpu"]
    if jax.default_backend() == "cpu":
        with pytest.raises(NotImplementedError, match="Hopper GPU"):
            jax.block_until_ready(nybble.ragged_matmul(x, qw, gs, implementation="mosaic_gpu"))
    # A layout the grouped kernel does not read: refused by its argument rules, with the reason.
    nk = _small_int_stack(2, 64, 64, layout="nk_int4", seed=12)
    with pytest.raises(NotImplementedError, match=r"cannot run: .*layout 'nk_int4'"):
        nybble.ragged_matmul(x, nk, gs, implementation="mosaic_gpu")


def test_gptq_of_a_stack_is_per_expert():
    rng = np.random.default_rng(13)
    w = rng.normal(size=(2, 64, 64)).astype(np.float32)
    inputs = [rng.normal(size=(40, 64)).astype(np.float32) for _ in range(2)]
    stacked = nybble.quant.gptq(w, inputs=inputs, group_size=32)
    assert num_experts(stacked) == 2
    for e in range(2):
        one = nybble.quant.gptq(w[e], inputs=inputs[e], group_size=32)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(unstack_weight(stacked, e)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"one Hessian per expert, \(E, K, K\)"):
        nybble.quant.gptq(w, np.eye(64, dtype=np.float32), group_size=32)


class _NotHopper:  # a GPU with no Mosaic GPU kernel (Hopper and Blackwell have one)
    device_kind = "NVIDIA A100-SXM4-80GB"
    compute_capability = "8.0"


def test_fallback_warns_once_per_reason_on_a_gpu_machine(monkeypatch):
    """As nybble.matmul: on a GPU with no grouped kernel it may run, implementation=None says once per
    reason that it runs XLA; a forced XLA says nothing."""
    monkeypatch.setattr(device, "gpu_device", lambda: _NotHopper())
    monkeypatch.setattr(device, "hopper_device", lambda: None)
    monkeypatch.setattr(backends, "_WARNED", set())
    qw = _small_int_stack(2, 64, 64, seed=14)
    x, gs = jnp.ones((4, 64), jnp.bfloat16), jnp.asarray([1, 3], jnp.int32)

    def warned(x, **kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            nybble.ragged_matmul(x, qw, gs, **kw)
        return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    (first,) = warned(x)
    assert "nybble.ragged_matmul: running the XLA path" in first and "NVIDIA A100" in first
    assert warned(x) == []
    (f32,) = warned(x.astype(jnp.float32))
    assert "x has dtype float32" in f32
    assert warned(x.astype(jnp.float16), implementation="xla") == []


def test_kernel_plans_for_the_devices_sm_count(monkeypatch):
    """The grouped kernel's heuristics get the SM count the device reports (here 78), as the dense one's."""
    from nybble.kernels.mosaic_gpu import grouped

    seen = []
    real = grouped.grouped_matmul

    def spy(*args, num_sms, **kwargs):
        seen.append(num_sms)
        return real(*args, num_sms=num_sms, **kwargs)

    monkeypatch.setattr(grouped, "grouped_matmul", spy)
    monkeypatch.setattr(device, "num_sms", lambda: 78)
    qw = _small_int_stack(2, 64, 64, seed=15)
    x, gs = jax.ShapeDtypeStruct((4, 64), jnp.bfloat16), jnp.asarray([1, 3], jnp.int32)
    with nybble.kernels.interpret():
        out = jax.eval_shape(lambda x: nybble.ragged_matmul(x, qw, gs), x)
    assert out.shape == (4, 64) and seen == [78]
