"""End-to-end tuning of a quantized model's group scales (and offsets) against the float model's logits.

Block-wise methods (GPTQ, AutoRound) fit each block's output; errors that only show in the whole model's
next-token distribution are left. Here the codes stay fixed and every group's scale (and, for asymmetric
groups, offset) gets one learned factor, trained through the *whole* model on the calibration windows:

    s = s0 * (1 + a),   o = o0 + c * |s0|        (a in [-0.5, 0.5], c in [-1, 1], one per group)

minimizing the KL divergence from the float model's next-token distribution (its logits computed once,
before quantization, by :func:`float_logits`) to the quantized model's, averaged over every token (as
EfficientQAT's end-to-end stage trains quantization parameters only, here against the float model
rather than the text). ``s`` and ``o`` are rounded to the stored dtype in the forward pass (gradients
straight through), so what is trained is exactly what is stored: ordinary ``QuantizedWeight`` scales.
Adam with a linearly decaying step, one window a step, every window once an epoch in an order drawn from
``seed``. The calibration loss is measured over every window before and after; the tuned parameters are
kept only if it dropped, so the model never ends worse on it.

Memory: the float logits, windows x length x vocab in bf16 (SmolLM2-135M, 20 x 256 x 49,152: 503 MB),
and one window's activations and gradients through the whole model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from nybble.models.definitions.layers import QuantizedParam
from nybble.quant.autoround import OFFSET_RANGE, SCALE_RANGE, adam_direction
from nybble.quant.qweight import QuantizedWeight

__all__ = ["TuneResult", "float_logits", "tune_group_params"]

# Adam's epsilon: the scale factors' KL gradients are small (1e-6..1e-3); 1e-8 as in optax's default.
ADAM_EPS = 1e-8


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What :func:`tune_group_params` did: the mean KL over every calibration token before and after."""

    loss_start: float
    loss: float  # the kept parameters' loss: never above loss_start
    kept: bool  # whether the tuned scales were kept (False: the model is unchanged)
    steps: int


def _is_qweight(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def _logits(model: nnx.Module, ids: jax.Array) -> jax.Array:
    return model(ids)


@jax.jit(static_argnums=0)
def _float_logits(graphdef: Any, state: Any, ids: jax.Array) -> jax.Array:
    return _logits(nnx.merge(graphdef, state), ids).astype(jnp.bfloat16)


def float_logits(model: nnx.Module, ids: Any, *, batch: int = 4) -> jax.Array:
    """``model(ids)`` in bf16, ``batch`` windows a call: the target of :func:`tune_group_params`, taken
    from the float model before it is quantized. ``ids``: (windows, length) token ids."""
    ids = jnp.asarray(ids, jnp.int32)
    if ids.ndim != 2:
        raise ValueError(f"float_logits: ids must be (windows, length), got shape {ids.shape}")
    graphdef, state = nnx.split(model)
    return jnp.concatenate(
        [_float_logits(graphdef, state, ids[i : i + batch]) for i in range(0, len(ids), batch)]
    )


def _factors(qw: QuantizedWeight) -> dict[str, jax.Array]:
    theta = {"a": jnp.zeros(qw.scales.shape, jnp.float32)}
    if qw.offsets is not None:
        theta["c"] = jnp.zeros(qw.scales.shape, jnp.float32)
    return theta


def _rounded(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` rounded to ``dtype`` (as f32) in the forward pass; the gradient passes straight through."""
    return x + jax.lax.stop_gradient(x.astype(dtype).astype(jnp.float32) - x)


def _apply(qw: QuantizedWeight, theta: dict[str, jax.Array], *, stored: bool = False) -> QuantizedWeight:
    s0 = qw.scales.astype(jnp.float32)
    scales = _rounded(s0 * (1.0 + jnp.clip(theta["a"], -SCALE_RANGE, SCALE_RANGE)), qw.scales.dtype)
    offsets = qw.offsets
    if offsets is not None:
        shift = jnp.clip(theta["c"], -OFFSET_RANGE, OFFSET_RANGE) * jnp.abs(s0)
        offsets = _rounded(offsets.astype(jnp.float32) + shift, qw.offsets.dtype)
        if stored:
            offsets = offsets.astype(qw.offsets.dtype)
    if stored:
        scales = scales.astype(qw.scales.dtype)
    return dataclasses.replace(qw, scales=scales, offsets=offsets)


def _with_factors(qstate: Any, theta: Any, *, stored: bool = False) -> Any:
    return jax.tree.map(lambda q, t: _apply(q, t, stored=stored), qstate, theta, is_leaf=_is_qweight)


def _kl(graphdef: Any, qstate: Any, rest: Any, theta: Any, ids: jax.Array, target: jax.Array) -> jax.Array:
    """Mean over tokens of KL(float || quantized) of the next-token distributions."""
    model = nnx.merge(graphdef, _with_factors(qstate, theta), rest)
    log_q = jax.nn.log_softmax(_logits(model, ids).astype(jnp.float32), axis=-1)
    log_p = jax.nn.log_softmax(target.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1))


_kl_jit = jax.jit(_kl, static_argnums=0)


@jax.jit(static_argnums=0)
def _step(graphdef, qstate, rest, theta, moments, ids, target, lr, n):
    loss, grads = jax.value_and_grad(lambda th: _kl(graphdef, qstate, rest, th, ids, target))(theta)
    direction, moments = adam_direction(moments, grads, n, eps=ADAM_EPS)
    theta = jax.tree.map(lambda p, d: p - lr * d, theta, direction)
    return theta, moments, loss


def tune_group_params(
    model: nnx.Module,
    ids: Any,
    target: jax.Array,
    *,
    epochs: int = 2,
    lr: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
    callback: Callable[[int, float], None] | None = None,
) -> TuneResult:
    """Tunes the group scales (and offsets) of every ``QLinear`` in ``model`` in place (module docstring).

    Args:
      model: a quantized NNX model whose ``model(ids)`` returns logits (vocab on the last axis).
      ids: calibration token ids, (windows, length).
      target: the float model's logits for ``ids`` (:func:`float_logits`), (windows, length, vocab).
      epochs: passes over the windows (one window a step).
      lr: Adam's step at the start, decaying linearly to 0 (the factors are relative: 3e-3 moves a scale by
        about 0.3% a step).
      seed: the window order.
      progress: a tqdm bar with the current loss; ``callback(steps_done, loss)`` after each step.
    """
    ids = np.asarray(ids, np.int32)
    if ids.ndim != 2:
        raise ValueError(f"tune_group_params: ids must be (windows, length), got shape {ids.shape}")
    if tuple(target.shape[:2]) != ids.shape:
        raise ValueError(
            f"tune_group_params: target logits {tuple(target.shape)} do not match ids {ids.shape}; "
            "pass float_logits(float_model, ids)"
        )
    if not (isinstance(epochs, int) and epochs >= 0) or not lr > 0:
        raise ValueError(f"tune_group_params: epochs must be an int >= 0 and lr > 0, got {epochs}, {lr}")
    graphdef, qstate, rest = nnx.split(model, QuantizedParam, ...)
    leaves = jax.tree.leaves(qstate, is_leaf=_is_qweight)
    if not leaves or not all(_is_qweight(x) for x in leaves):
        raise ValueError(
            "tune_group_params: the model has no QLinear layers holding a QuantizedWeight (quantize it "
            "first; sharded weights are not supported)"
        )
    theta0 = jax.tree.map(_factors, qstate, is_leaf=_is_qweight)

    def full_loss(theta: Any) -> float:
        return float(np.mean([_kl_jit(graphdef, qstate, rest, theta, ids[i : i + 1], target[i : i + 1])
                              for i in range(len(ids))]))  # fmt: skip

    loss_start = full_loss(theta0)
    steps = epochs * len(ids)
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(ids)) for _ in range(epochs)]) if steps else []
    theta = theta0
    moments = (jax.tree.map(jnp.zeros_like, theta0), jax.tree.map(jnp.zeros_like, theta0))
    with tqdm(
        total=steps, desc="nybble: end-to-end scales", unit="step", disable=not progress, leave=False
    ) as bar:
        for t, i in enumerate(order):
            lr_t = np.float32(lr * (1.0 - t / steps))
            theta, moments, loss = _step(
                graphdef, qstate, rest, theta, moments, ids[i : i + 1], target[i : i + 1], lr_t, t + 1
            )
            bar.update()
            bar.set_postfix_str(f"loss {float(loss):.4g}", refresh=False)
            if callback is not None:
                callback(t + 1, float(loss))
    loss_end = full_loss(theta) if steps else loss_start
    if loss_end >= loss_start:
        return TuneResult(loss_start, loss_start, False, steps)
    nnx.update(model, _with_factors(qstate, theta, stored=True))
    return TuneResult(loss_start, loss_end, True, steps)
