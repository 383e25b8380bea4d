"""nybble.matmul on the XLA path: against a float64 reference, under jit/vmap/grad, and its refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble
from nybble.device import hopper_device
from nybble.kernels import available_implementations, reference_matmul, relative_error
from tests.kernel_checks import assert_kernel_within_rounding, assert_within_rounding

ON_HOPPER = hopper_device() is not None

# ||out - ref|| / ||ref|| for bf16/f16 outputs (the weight itself is rounded to x.dtype, then one
# rounding of the f32 accumulator to the output dtype) and for f32.
TOLERANCE = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}


def _random_case(key, batch, k, n, group, symmetric, dtype):
    kw, kx = jax.random.split(key)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.05
    x = jax.random.normal(kx, (*batch, k), jnp.float32).astype(dtype)
    return x, nybble.quantize(w, group_size=group, symmetric=symmetric)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize(("batch", "k", "n", "group", "symmetric"), [
    ((1,), 576, 1536, 128, True),
    ((7,), 1536, 576, 64, False),
    ((2, 5), 100, 70, None, True),
    ((3,), 256, 192, 32, False),
    ((100,), 320, 128, 256, True),
])
def test_xla_matches_float64_reference(dtype, batch, k, n, group, symmetric):
    seed = np.random.SeedSequence().entropy % 2**31  # fresh data every run
    x, qw = _random_case(jax.random.key(seed), batch, k, n, group, symmetric, dtype)
    y = nybble.matmul(x, qw, implementation="xla")
    assert y.shape == (*batch, n) and y.dtype == dtype
    err = relative_error(y, reference_matmul(x, qw))
    assert err < TOLERANCE[dtype], f"seed {seed}: relative error {err}"
    # Element by element: the weight dequantized in x.dtype (q * s, then + o: one or two roundings, as the
    # kernel's exact-weights route), f32 accumulation, one rounding of y.
    assert_kernel_within_rounding(y.reshape(-1, n), x.reshape(-1, k), qw, "weights")


def test_small_integers_are_exact():
    """Small-integer activations and power-of-two scales: every product and sum is exact in f32."""
    rng = np.random.default_rng()
    q = rng.integers(-7, 8, size=(256, 128))
    # Pin each group's max to 7 (its min is >= -7) so that its scale is exactly 0.5. (A pinned -7 gave
    # scale max(3.5 / 8, max / 7): 0.4375 in the ~2% of runs where some column of a group lacked a 7.)
    q[0] = 7
    q[128] = 7
    w = (q * 0.5).astype(np.float32)
    qw = nybble.quantize(w, group_size=128)
    x = jnp.asarray(rng.integers(-3, 4, size=(9, 256)), jnp.float32)
    y = nybble.matmul(x, qw, implementation="xla")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) @ w)


@pytest.mark.parametrize("symmetric", [True, False])
def test_xla_path_on_nk_int4_weights(symmetric):
    """The XLA path's other branch: codes stored nk_int4 (read as int4 in place) give the same bits as the
    default layout, within the rounding bound of the float64 reference."""
    x, qw = _random_case(jax.random.key(7), (5,), 200, 72, 64, symmetric, jnp.bfloat16)
    nk = nybble.quant.relayout(qw, "nk_int4")
    y = nybble.matmul(x, nk, implementation="xla")
    assert_kernel_within_rounding(y, x, nk, "weights")  # dequantized in x.dtype (see above)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(nybble.matmul(x, qw, implementation="xla")))


def test_default_implementation():
    """The default is the kernel on a Hopper GPU and XLA elsewhere; either way x @ W within rounding."""
    x, qw = _random_case(jax.random.key(3), (4,), 256, 128, 128, True, jnp.bfloat16)
    reasons = available_implementations(x, qw)
    assert reasons["xla"] and reasons["xla"].reason is None and repr(reasons["xla"]) == "<available>"
    jaxpr = str(jax.make_jaxpr(nybble.matmul)(x, qw))
    if ON_HOPPER:
        from nybble.kernels.mosaic_gpu import plan

        assert reasons["mosaic_gpu"] and "wgmma" in jaxpr
        route = plan(4, qw, num_sms=nybble.kernels.num_sms()).config.scales_on
        assert_kernel_within_rounding(nybble.matmul(x, qw), x, qw, route)
    else:
        assert not reasons["mosaic_gpu"] and "Hopper" in reasons["mosaic_gpu"].reason
        assert repr(reasons["mosaic_gpu"]).startswith("<unavailable: it needs a Hopper GPU")
        assert "dot_general" in jaxpr and "wgmma" not in jaxpr
        assert_within_rounding(nybble.matmul(x, qw), x, qw)


def test_jit_vmap_grad():
    x, qw = _random_case(jax.random.key(4), (6,), 192, 64, 64, False, jnp.float32)
    f = jax.jit(lambda x, qw: nybble.matmul(x, qw, implementation="xla"))
    np.testing.assert_allclose(np.asarray(f(x, qw)), reference_matmul(x, qw), rtol=1e-4, atol=1e-4)
    ys = jax.vmap(lambda row: nybble.matmul(row, qw))(x)
    np.testing.assert_allclose(np.asarray(ys), reference_matmul(x, qw), rtol=1e-4, atol=1e-4)
    # d/dx sum(x @ W * c) = c @ W^T
    c = jax.random.normal(jax.random.key(5), (6, 64))
    g = jax.grad(lambda x: jnp.sum(nybble.matmul(x, qw) * c))(x)
    w = np.asarray(nybble.dequantize(qw), np.float64)
    np.testing.assert_allclose(np.asarray(g), np.asarray(c, np.float64) @ w.T, rtol=1e-4, atol=1e-4)


def test_refusals():
    x, qw = _random_case(jax.random.key(6), (2,), 128, 64, 64, True, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"x has shape \(2, 100\).*\(K, N\) = \(128, 64\).*K = 128"):
        nybble.matmul(jnp.ones((2, 100), jnp.bfloat16), qw)
    with pytest.raises(TypeError, match="x has dtype int32"):
        nybble.matmul(jnp.ones((2, 128), jnp.int32), qw)
    with pytest.raises(TypeError, match=r"must be a nybble\.QuantizedWeight.*ndarray"):
        nybble.matmul(x, np.ones((128, 64)))
    with pytest.raises(TypeError, match=r"x must be an array of shape \(..., K\)"):
        nybble.matmul([1.0] * 128, qw)
    with pytest.raises(ValueError, match="unknown implementation 'cuda'"):
        nybble.matmul(x, qw, implementation="cuda")
    if ON_HOPPER:  # a forced kernel runs here
        assert_within_rounding(nybble.matmul(x, qw, implementation="mosaic_gpu"), x, qw)
    else:
        with pytest.raises(NotImplementedError, match=r"only on an NVIDIA Hopper GPU.*kernels\.interpret"):
            nybble.matmul(x, qw, implementation="mosaic_gpu")
    with pytest.raises(NotImplementedError, match=r"cannot run: x has dtype float32.*implementation='xla'"):
        nybble.matmul(x.astype(jnp.float32), qw, implementation="mosaic_gpu")


def test_forced_mosaic_gpu_traces_and_lowers_for_cuda_on_a_cpu():
    """The public entry point, forced to the kernel, lowers for CUDA at a production shape on this CPU."""
    x = jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16)
    qw = jax.eval_shape(lambda w: nybble.quantize(w), jax.ShapeDtypeStruct((4096, 14336), jnp.float32))
    f = jax.jit(functools.partial(nybble.matmul, implementation="mosaic_gpu"))
    text = f.trace(x, qw).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
