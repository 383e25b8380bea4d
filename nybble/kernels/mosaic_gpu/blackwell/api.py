"""The Blackwell W4A16 kernel as an op: the Hopper kernel's argument checks and padding, the B200 config,
the gradient. ``blackwell_matmul(x2d, qw)`` is what the dispatcher calls on compute capability 10.x."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nybble.kernels.mosaic_gpu import dense as hopper_api
from nybble.kernels.mosaic_gpu.blackwell.config import DEFAULT_NUM_SMS, BlackwellConfig
from nybble.kernels.mosaic_gpu.blackwell.kernel import BlackwellProblem, a_in_tmem, plan, w4a16_blackwell
from nybble.kernels.mosaic_gpu.interpret import active_params
from nybble.kernels.mosaic_gpu.kernel import check_operands
from nybble.quant.qweight import QuantizedWeight

# What the Blackwell kernel accepts is exactly what the Hopper one does (same layout, dtypes, groups).
is_supported = hopper_api.is_supported


def _forward(x2d: jax.Array, qw: QuantizedWeight, config: BlackwellConfig | None, num_sms: int) -> jax.Array:
    m, k = x2d.shape
    n = qw.shape[1]
    k_pad = qw.padded_shape[0]
    if m == 0:
        return jnp.zeros((0, n), x2d.dtype)
    p = plan(m, qw, num_sms=num_sms, config=config, dtype=x2d.dtype)
    if active_params() is None:
        x2d = hopper_api._requires_gpu_p.bind(x2d)
    if k != k_pad or p.x_rows != m:
        x2d = jnp.pad(x2d, ((0, p.x_rows - m), (0, k_pad - k)))
    # The Hopper kernel's operand checks (codes, scales, offsets against x), by the same names.
    check_operands(x2d, qw.codes, qw.scales, qw.offsets, n=p.n, group=qw.group, config=_CheckOnly(p), m=m)
    y = w4a16_blackwell(p, qw.codes, x2d, qw.scales, qw.offsets)
    return y if (p.n, p.out_rows) == (n, m) else y[:m, :n]


class _CheckOnly:
    """Stands in for the Hopper TuningConfig in ``check_operands``: the Blackwell config's own rules."""

    def __init__(self, p: BlackwellProblem) -> None:
        self._p = p

    def check_problem(self, m: int, n_pad: int, k_pad: int, group: int) -> None:
        self._p.config.check_problem(m, n_pad, k_pad, group, a_in_smem=not a_in_tmem(self._p))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x2d: jax.Array, qw: QuantizedWeight, config: BlackwellConfig | None, num_sms: int) -> jax.Array:
    return _forward(x2d, qw, config, num_sms)


def _matmul_fwd(x2d, qw, config, num_sms):
    return _forward(x2d, qw, config, num_sms), qw


def _matmul_bwd(config, num_sms, qw, g):
    return hopper_api.x_gradient(qw, g)  # the Hopper kernel's backward pass: XLA, the weights get none


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul_supported(x2d: jax.Array, qw: QuantizedWeight, *, num_sms: int = DEFAULT_NUM_SMS) -> jax.Array:
    """:func:`blackwell_matmul` with the heuristic config, for arguments :func:`is_supported` accepted:
    what the dispatcher calls (``nybble.kernels.mosaic_gpu.backend``)."""
    return _matmul(x2d, qw, None, int(num_sms))


def blackwell_matmul(
    x2d: jax.Array,
    qw: QuantizedWeight,
    *,
    config: BlackwellConfig | None = None,
    num_sms: int = DEFAULT_NUM_SMS,
) -> jax.Array:
    """``x2d @ dequantize(qw)`` with the Blackwell (tcgen05) W4A16 kernel: (M, K) bf16/f16 -> (M, N).

    Args:
      x2d: (M, K) activations, K the weight's logical K.
      qw: a ``wgmma_int4`` QuantizedWeight (the Hopper kernel's layout; ``nybble.quant.relayout`` converts).
      config: a BlackwellConfig; None lets :func:`heuristic_config` choose (B200 rules).
      num_sms: SMs of the target GPU (148 on a B200).

    Refuses what the Hopper kernel refuses, with the same messages. Differentiable with respect to x2d.
    """
    hopper_api.check_call("blackwell_matmul", x2d, qw, config, BlackwellConfig, num_sms, is_supported)
    return _matmul(x2d, qw, config, int(num_sms))
