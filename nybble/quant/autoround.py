"""Learned rounding (AutoRound-style): int4 codes and group scales fitted to a block's output by gradient.

Round to nearest rounds every weight on its own. GPTQ rounds a layer's weights so that its *linear* output
moves little. Here the rounding itself is learned against the output of a whole function of several weights
(a transformer block: attention, norms, SwiGLU and all), on calibration inputs:

    w_hat = s * clip(round((w - b) / s + v), -8, 7) + b          (b = 0 when symmetric)

with one learned offset ``v`` per weight (in ``[v0 - radius, v0 + radius]``, ``v0 = 0`` from round to
nearest: each weight may round up or down), one learned factor per group on the scale (``s = s0 * (1 + a)``,
``a`` in ``[-0.5, 0.5]``) and, for asymmetric groups, a learned shift of the offset (``b = b0 + c * s0``).
``round`` passes gradients straight through; ``s`` and ``b`` are rounded to the scale dtype in the forward
pass (straight through too), so what is trained is exactly what is stored. The loss is the mean squared
error between the function's output with every selected weight so quantized and the target output (the
float function's); it is minimized by signed gradient descent with a linearly decaying step (AutoRound,
Cheng et al., 2023) on mini-batches of calibration samples. At the end the offsets are frozen into ordinary
codes and scales: a plain :class:`QuantizedWeight`, nothing new for the kernels or checkpoints.

Guarantee: the full calibration set's loss is measured at the start (the starting codes: round to nearest,
or any given ``QuantizedWeight`` such as GPTQ's) and at the end; the learned result is kept only if it is
lower, so the returned weights never do worse than the start on the calibration objective.

Entry points: :func:`autoround_block` (any ``apply_fn(params, *inputs)`` and a params pytree: the engine),
:func:`autoround` (one (K, N) weight and its inputs, ``y = x @ w``), and ``nybble.models.quantize(...,
method="autoround", calibration=ids)`` (every block of an NNX model in turn, see
``nybble.models.quantization.autoround``).
Everything is deterministic given ``seed``: the mini-batch order is drawn from it and nothing else is random.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nybble.packing import (
    DEFAULT_LAYOUT,
    check_group_size,
    get_layout,
    group_rows,
    num_groups,
    pad_to,
    padded_weight_dims,
)
from nybble.quant.qformat import QuantFormat, check_scale_dtype, check_zero_point
from nybble.quant.qweight import QuantizedWeight, dequantize
from nybble.quant.rtn import check_weight, group_params, integer_zero_factor

__all__ = [
    "PRESETS",
    "AutoRoundConfig",
    "AutoRoundResult",
    "WeightSpec",
    "adam_direction",
    "autoround",
    "autoround_block",
    "block_loss",
    "key_path_str",
    "resolve_config",
]

SCALE_RANGE = 0.5  # the learned scale factor 1 + a stays in [0.5, 1.5]
OFFSET_RANGE = 1.0  # the learned offset shift c (in units of the starting scale) stays in [-1, 1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoRoundConfig:
    """How the rounding is learned (see the module docstring); ``PRESETS`` holds named ones."""

    # Signed-gradient steps per block.
    steps: int = 200
    # Step size at the start (decays linearly to 0); None: 2 * radius / steps, so that an offset can
    # travel ``radius`` in all (AutoRound's 1 / steps for radius 0.5).
    lr: float | None = None
    # Calibration samples (first axis of the inputs: sequences for a transformer block) per step.
    batch_size: int = 1
    # Learn each group's scale (and offset) factor, not only the per-weight rounding offsets.
    learn_scales: bool = True
    # The scale and offset factors' step, as a fraction of the rounding offsets' step. 1.0 measured best on
    # SmolLM2-135M (g128 sym, fast preset: 0.1, 0.5, 1.0, 1.5, 3.0 removed 62, 65, 71, 67, 61% of RTN's
    # perplexity increase; the README's accuracy section).
    scale_lr: float = 1.0
    # How far each learned rounding offset may move from its start (0.5: round up or down).
    radius: float = 0.5
    # "mse": mean squared error of the outputs; "relative": each output vector's (last axis) squared
    # error relative to its float squared norm (see ``_sample_error``).
    loss: str = "relative"
    # "sign": signed gradient descent (AutoRound); "adam": Adam with the same decaying step.
    optimizer: str = "adam"
    # The gradient of the scale and offset factors: "codes" (the codes held fixed: dw/ds = q, dw/db = 1)
    # or "ste" (straight through the rounding as well, as LSQ: dw/ds = q - w/s, dw/db = 0 in range).
    scale_gradient: str = "codes"
    # Seed of the mini-batch order.
    seed: int = 0
    # Steps per compiled chunk: the progress callback (and bar) is updated between chunks.
    chunk: int = 25
    # Whole models only (``nybble.models.quantize``): after the blocks, passes over the calibration windows
    # tuning every group's scale (and offset) against the float model's logits, codes fixed
    # (``nybble.models.quantization.tune``; 0: none), and that stage's starting step.
    end_to_end_epochs: int = 0
    end_to_end_lr: float = 3e-3

    def __post_init__(self) -> None:
        if not (isinstance(self.steps, int) and self.steps >= 0):
            raise ValueError(f"AutoRoundConfig: steps must be an int >= 0, got {self.steps!r}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"AutoRoundConfig: lr must be a positive float or None, got {self.lr!r}")
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"AutoRoundConfig: batch_size must be an int >= 1, got {self.batch_size!r}")
        if not (math.isfinite(self.scale_lr) and self.scale_lr >= 0):
            raise ValueError(f"AutoRoundConfig: scale_lr must be a float >= 0, got {self.scale_lr!r}")
        if not 0 < self.radius <= 2:
            raise ValueError(f"AutoRoundConfig: radius must be in (0, 2], got {self.radius!r}")
        if self.loss not in ("mse", "relative"):
            raise ValueError(f"AutoRoundConfig: loss must be 'mse' or 'relative', got {self.loss!r}")
        if self.optimizer not in ("sign", "adam"):
            raise ValueError(f"AutoRoundConfig: optimizer must be 'sign' or 'adam', got {self.optimizer!r}")
        if self.scale_gradient not in ("codes", "ste"):
            raise ValueError(
                f"AutoRoundConfig: scale_gradient must be 'codes' or 'ste', got {self.scale_gradient!r}"
            )
        if not (isinstance(self.chunk, int) and self.chunk >= 1):
            raise ValueError(f"AutoRoundConfig: chunk must be an int >= 1, got {self.chunk!r}")
        if not (isinstance(self.end_to_end_epochs, int) and self.end_to_end_epochs >= 0):
            raise ValueError(
                f"AutoRoundConfig: end_to_end_epochs must be an int >= 0, got {self.end_to_end_epochs!r}"
            )
        if not (math.isfinite(self.end_to_end_lr) and self.end_to_end_lr > 0):
            raise ValueError(f"AutoRoundConfig: end_to_end_lr must be > 0, got {self.end_to_end_lr!r}")

    @property
    def step_size(self) -> float:
        return self.lr if self.lr is not None else 2.0 * self.radius / max(self.steps, 1)


PRESETS: dict[str, AutoRoundConfig] = {
    "default": AutoRoundConfig(),
    "fast": AutoRoundConfig(steps=50),
}


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One (K, N) leaf to quantize: its group size (None: per column), symmetry and zero-point kind.

    ``zero_point="integer"`` (asymmetric): each group keeps the integer zero z of its start (``w = (u - z)
    * s``, as compressed-tensors / GPTQ / AWQ store it) and learns its scale only; offsets stay
    ``(8 - z) * s`` in float32 (exact), so the result exports to those formats."""

    group_size: int | None = 128
    symmetric: bool = True
    zero_point: str = "float"

    @classmethod
    def of(cls, fmt: QuantFormat) -> WeightSpec:
        """The spec of a weight stored in ``fmt`` (its scale dtype and layout are the block's)."""
        return cls(fmt.group_size, fmt.symmetric, fmt.zero_point)


@dataclasses.dataclass(frozen=True)
class AutoRoundResult:
    """What :func:`autoround_block` returns: the quantized weights by path, and the calibration losses."""

    weights: dict[str, QuantizedWeight]
    loss_start: float  # mean loss of the starting codes over every calibration sample
    loss: float  # the same for the returned weights: never above loss_start
    learned: bool  # whether learned codes were kept (False: the start was returned)


# --------------------------------------------------------------------------------------- one weight


@dataclasses.dataclass(frozen=True)
class _Shape:
    """Static description of one weight: logical and padded shape, groups (the last may be partial: its
    rows past K_pad exist only while learning), format."""

    k: int
    n: int
    k_pad: int
    n_pad: int
    g: int
    ng: int
    symmetric: bool
    group_size: int | None
    integer: bool = False  # asymmetric with integer zero points: b = (8 - z) * s, z fixed

    @classmethod
    def of(cls, shape: tuple[int, int], spec: WeightSpec) -> _Shape:
        k, n = shape
        k_pad, n_pad = padded_weight_dims(k, n)
        g, ng = group_rows(k_pad, spec.group_size), num_groups(k_pad, spec.group_size)
        integer = spec.zero_point == "integer" and not spec.symmetric
        return cls(k, n, k_pad, n_pad, g, ng, spec.symmetric, spec.group_size, integer)


def _start(
    w: jax.Array, shp: _Shape, start: QuantizedWeight | None, scale_dtype: Any
) -> dict[str, jax.Array]:
    """Frozen per-weight arrays: groups of w, validity, starting scales/offsets and rounding offsets."""
    rows = shp.ng * shp.g
    wg = pad_to(w.astype(jnp.float32), (rows, shp.n_pad)).reshape(shp.ng, shp.g, shp.n_pad)
    valid = (jnp.arange(rows) < shp.k).reshape(shp.ng, shp.g, 1)
    if start is None:
        fmt = QuantFormat(
            group_size=shp.group_size,
            symmetric=shp.symmetric,
            zero_point="integer" if shp.integer else "float",
            scale_dtype=scale_dtype,
        )
        scales, offsets = group_params(wg, valid, fmt)
        v0 = jnp.zeros_like(wg)
    else:
        scales, offsets = start.scales, start.offsets
    s0 = scales.astype(jnp.float32)[:, None, :]
    b0 = jnp.zeros_like(s0) if offsets is None else offsets.astype(jnp.float32)[:, None, :]
    extra = {}
    if shp.integer:  # 8 - z per group: the zero stays, the offset follows the learned scale
        extra["zf"] = integer_zero_factor(scales, offsets)[:, None, :]
    if start is not None:  # the offsets that reproduce the given codes: round(z + v0) = q
        q = pad_to(start.logical_codes().astype(jnp.float32), (rows, shp.n_pad)).reshape(wg.shape)
        v0 = jnp.where(s0 == 0, 0.0, q - (wg - b0) / jnp.where(s0 == 0, 1.0, s0))
    return dict(w=wg, valid=valid, s0=s0, b0=b0, v0=v0, **extra)


def _ste(x: jax.Array, exact: jax.Array) -> jax.Array:
    """``exact`` in the forward pass, the gradient of ``x`` in the backward pass."""
    return x + jax.lax.stop_gradient(exact - x)


def _fake_quant(
    fixed: dict[str, jax.Array],
    theta: dict[str, jax.Array],
    shp: _Shape,
    scale_dtype: Any,
    scale_gradient: str = "codes",
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(w_hat (K, N) float32, codes (ng, G, N_pad), scales, offsets (ng, 1, N_pad)) for parameters theta."""
    s0, b0 = fixed["s0"], fixed["b0"]
    s = s0 * (1.0 + jnp.clip(theta["a"], -SCALE_RANGE, SCALE_RANGE))
    s = _ste(s, s.astype(scale_dtype).astype(jnp.float32))
    if shp.symmetric:
        b = jnp.zeros_like(s)
    elif shp.integer:
        b = fixed["zf"] * s  # exact in float32 for the stored (rounded) s: no rounding to the scale dtype
    else:
        b = b0 + s0 * jnp.clip(theta["c"], -OFFSET_RANGE, OFFSET_RANGE)
        b = _ste(b, b.astype(scale_dtype).astype(jnp.float32))
    dead = s0 == 0  # an all-zero (or padding) group: code 0, the offset carries the value
    if scale_gradient == "codes":  # the gradient of s and b holds the codes fixed: q and 1
        z = (fixed["w"] - jax.lax.stop_gradient(b)) / jax.lax.stop_gradient(jnp.where(dead, 1.0, s))
    else:  # "ste": through the rounding too (LSQ): q - z and 0 inside the code range
        z = (fixed["w"] - b) / jnp.where(dead, 1.0, s)
    v = fixed["v0"] + theta["v"]  # the optimizer keeps theta within its bounds
    q = jnp.clip(_ste(z + v, jnp.round(z + v)), -8, 7)
    q = jnp.where(dead | ~fixed["valid"], 0.0, q)
    w_hat = (q * s + b).reshape(shp.ng * shp.g, shp.n_pad)[: shp.k, : shp.n]
    return w_hat, q, s, b


def _theta0(fixed: dict[str, jax.Array], shp: _Shape) -> dict[str, jax.Array]:
    theta = dict(v=jnp.zeros_like(fixed["w"]), a=jnp.zeros_like(fixed["s0"]))
    if not shp.symmetric and not shp.integer:
        theta["c"] = jnp.zeros_like(fixed["s0"])
    return theta


def _freeze(
    fixed: dict[str, jax.Array],
    theta: dict[str, jax.Array],
    shp: _Shape,
    scale_dtype: Any,
    layout: str,
) -> QuantizedWeight:
    _, q, s, b = _fake_quant(fixed, theta, shp, scale_dtype)
    codes = q.reshape(shp.ng * shp.g, shp.n_pad)[: shp.k_pad].astype(jnp.int8)
    offsets = None if shp.symmetric else b[:, 0].astype(jnp.float32 if shp.integer else scale_dtype)
    return QuantizedWeight.from_codes(
        codes,
        s[:, 0].astype(scale_dtype),
        offsets,
        shape=(shp.k, shp.n),
        group_size=shp.group_size,
        layout=layout,
    )


# --------------------------------------------------------------------------------------- the engine


def _leaf_paths(params: Any) -> tuple[list[str], list[Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    return [key_path_str(p) for p, _ in leaves], [leaf for _, leaf in leaves], treedef


def key_path_str(path: Sequence[Any]) -> str:
    """A pytree key path as a dotted string (``layers.3.attn.q_proj``): how ``weights=`` names leaves."""
    return ".".join(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)


def _substitute(leaves: list[Any], treedef: Any, index: tuple[int, ...], new: Sequence[jax.Array]) -> Any:
    leaves = list(leaves)
    for i, w in zip(index, new, strict=True):
        leaves[i] = w.astype(leaves[i].dtype)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _sample_error(out: Any, target: Any, loss: str) -> jax.Array:
    """The error of each sample (axis 0), averaged over its outputs: (batch,). ``"mse"``: squared error
    per element; ``"relative"``: per output vector (last axis), squared error over the target's squared
    norm, so that a few huge vectors (a transformer's attention-sink tokens) do not drown the rest."""
    pairs = list(zip(jax.tree.leaves(out), jax.tree.leaves(target), strict=True))
    errs = []
    for a, b in pairs:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        e = jnp.square(a - b)
        if loss == "relative":
            e = e.sum(-1) / (jnp.square(b).sum(-1) + 1e-12)
        errs.append(e.reshape(e.shape[0], -1))
    return sum(e.sum(1) for e in errs) / sum(e.shape[1] for e in errs)


def _sample_loss(
    theta,
    fixed,
    leaves,
    inputs,
    target,
    *,
    apply_fn,
    treedef,
    index,
    shapes,
    scale_dtype,
    loss,
    scale_gradient,
):
    w_hat = [
        _fake_quant(f, t, s, scale_dtype, scale_gradient)[0]
        for f, t, s in zip(fixed, theta, shapes, strict=True)
    ]
    return _sample_error(apply_fn(_substitute(leaves, treedef, index, w_hat), *inputs), target, loss)


_STATIC = ("apply_fn", "treedef", "index", "shapes", "scale_dtype", "loss", "scale_gradient")
_sample_loss_jit = jax.jit(_sample_loss, static_argnames=_STATIC)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "optimizer"), donate_argnums=(0,))
def _train_chunk(
    carry,
    fixed,
    leaves,
    inputs,
    target,
    ref,
    batches,
    lrs,
    steps0,
    count,
    radius,
    learn_scales,
    *,
    optimizer,
    **static,
):
    """``count`` steps (of the ``len(lrs)`` a chunk holds), step t on samples ``batches[t]`` with step size
    ``lrs[t]``; ``steps0`` steps were done before (Adam's bias correction). ``radius`` bounds the rounding
    offsets; the scale and offset factors take ``learn_scales`` times the step (0: frozen).

    ``carry = (theta, best_theta, best_ratio, last_loss, adam_moments)``: besides the current parameters
    it keeps the ones with the lowest mini-batch loss relative to the starting codes' loss on the same samples
    (``ref``, per sample), so that a lucky easy batch does not count as progress.
    """
    grad_fn = jax.value_and_grad(
        lambda th, xb, yb: jnp.mean(_sample_loss(th, fixed, leaves, xb, yb, **static))
    )
    bounds = {"v": radius, "a": SCALE_RANGE, "c": OFFSET_RANGE}

    def step(t, carry):
        theta, best, best_ratio, _, moments = carry
        idx = batches[t]
        xb = [jnp.take(x, idx, axis=0) for x in inputs]
        yb = jax.tree.map(lambda y: jnp.take(y, idx, axis=0), target)
        loss, grads = grad_fn(theta, xb, yb)
        ratio = loss / jnp.maximum(jnp.mean(ref[idx]), jnp.finfo(jnp.float32).tiny)
        better = ratio < best_ratio
        best = jax.tree.map(lambda b, p: jnp.where(better, p, b), best, theta)
        best_ratio = jnp.where(better, ratio, best_ratio)

        if optimizer == "adam":
            direction, moments = adam_direction(moments, grads, steps0 + t + 1)
        else:
            direction = jax.tree.map(jnp.sign, grads)

        def update(p, d, name):
            if name != "v":  # scale and offset factors: a fraction of the step (0: frozen)
                d = d * learn_scales
            return jnp.clip(p - lrs[t] * d, -bounds[name], bounds[name])

        theta = [{k: update(p[k], d[k], k) for k in p} for p, d in zip(theta, direction, strict=True)]
        return theta, best, best_ratio, loss, moments

    return jax.lax.fori_loop(0, count, step, carry)


def adam_direction(moments: tuple[Any, Any], grads: Any, n: Any, eps: float = 1e-12) -> tuple[Any, Any]:
    """Adam's bias-corrected step direction for gradients ``grads`` at step ``n`` (1-based), and the new
    ``moments`` (first and second, each a pytree like ``grads``; zeros before the first step)."""
    m1, m2 = moments
    m1 = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m1, grads)
    m2 = jax.tree.map(lambda m, g: 0.999 * m + 0.001 * g * g, m2, grads)
    n = jnp.asarray(n, jnp.float32)
    direction = jax.tree.map(lambda a, b: (a / (1 - 0.9**n)) / (jnp.sqrt(b / (1 - 0.999**n)) + eps), m1, m2)
    return direction, (m1, m2)


def _pad(a: np.ndarray, length: int) -> np.ndarray:
    return np.concatenate([a, np.zeros((length - len(a), *a.shape[1:]), a.dtype)])


def _losses(theta, fixed, leaves, inputs, target, batch: int, **static: Any) -> np.ndarray:
    """The loss of every calibration sample, ``batch`` samples per call (no gradient)."""
    n = jax.tree.leaves(inputs)[0].shape[0]
    out = []
    for i in range(0, n, batch):
        sl = slice(i, i + batch)
        yb = jax.tree.map(lambda y, sl=sl: y[sl], target)
        out.append(np.asarray(_sample_loss_jit(theta, fixed, leaves, [x[sl] for x in inputs], yb, **static)))
    return np.concatenate(out)


@functools.partial(jax.jit, static_argnames=("apply_fn", "treedef", "index", "loss"))
def _output_loss(weights, leaves, inputs, target, *, apply_fn, treedef, index, loss):
    w = [dequantize(qw) for qw in weights]
    return _sample_error(apply_fn(_substitute(leaves, treedef, index, w), *inputs), target, loss)


def block_loss(
    apply_fn: Callable[..., Any],
    params: Any,
    weights: Mapping[str, QuantizedWeight],
    inputs: Sequence[Any],
    target: Any,
    *,
    loss: str = "relative",
    eval_batch: int = 4,
) -> float:
    """Mean squared error of ``apply_fn(params, *inputs)`` against ``target`` with the leaves named in
    ``weights`` replaced by those quantized weights (dequantized), averaged over every calibration sample:
    the objective :func:`autoround_block` minimizes (``loss``: ``AutoRoundConfig.loss``)."""
    names, leaves, treedef = _leaf_paths(params)
    if missing := sorted(set(weights) - set(names)):
        raise ValueError(f"block_loss: no leaf at path(s) {missing}")
    order = sorted(weights, key=names.index)
    index = tuple(names.index(p) for p in order)
    qws = [weights[p] for p in order]
    inputs = [jnp.asarray(x) for x in inputs]
    n = inputs[0].shape[0]
    out = []
    for i in range(0, n, eval_batch):
        sl = slice(i, i + eval_batch)
        yb = jax.tree.map(lambda y, sl=sl: y[sl], target)
        out.append(
            np.asarray(
                _output_loss(
                    qws,
                    leaves,
                    [x[sl] for x in inputs],
                    yb,
                    apply_fn=apply_fn,
                    treedef=treedef,
                    index=index,
                    loss=loss,
                )
            )
        )
    return float(np.concatenate(out).mean())


def resolve_config(config: AutoRoundConfig | str, **options: Any) -> AutoRoundConfig:
    """A preset name or config, with ``options`` overriding its fields; clear errors otherwise."""
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(f"autoround: unknown preset {config!r}; presets are {sorted(PRESETS)}")
        config = PRESETS[config]
    if not isinstance(config, AutoRoundConfig):
        raise TypeError(
            f"autoround: config must be an AutoRoundConfig or a preset name, got {type(config).__name__}"
        )
    fields = {f.name for f in dataclasses.fields(AutoRoundConfig)}
    if bad := sorted(set(options) - fields):
        raise TypeError(
            f"autoround: unexpected keyword argument(s) {bad}; AutoRoundConfig fields are {sorted(fields)}"
        )
    return dataclasses.replace(config, **options)


def autoround_block(
    apply_fn: Callable[..., Any],
    params: Any,
    weights: Mapping[str, WeightSpec],
    inputs: Sequence[Any],
    target: Any,
    *,
    config: AutoRoundConfig | str = "default",
    start: Mapping[str, QuantizedWeight] | None = None,
    scale_dtype: Any = jnp.bfloat16,
    layout: str = DEFAULT_LAYOUT,
    eval_batch: int = 4,
    callback: Callable[[int, float], None] | None = None,
) -> AutoRoundResult:
    """Learns int4 codes and group parameters for some 2-D leaves of ``params`` (see the module doc).

    Args:
      apply_fn: ``apply_fn(params, *inputs)`` -> an output array (or pytree); pure (it is traced under
        ``jax.jit``). For jit's cache to be reused across calls, pass the same function object.
      params: a pytree (dict, ``nnx.State``, ...) holding the float weights.
      weights: ``{path: WeightSpec}`` for the leaves to quantize, ``path`` the dotted leaf path
        (``"attn.q_proj.kernel.value"`` for an ``nnx.State``, ``"Dense_0.kernel"`` for a Linen dict).
      inputs: the calibration inputs, each with the samples on axis 0 (mini-batches are drawn along it).
      target: the output to match for those samples (same structure as ``apply_fn``'s output).
      config: an :class:`AutoRoundConfig` or a preset name (``PRESETS``).
      start: optional starting ``QuantizedWeight`` per path (e.g. GPTQ's); default round to nearest.
      scale_dtype, layout: the stored format, as ``nybble.quantize``.
      eval_batch: samples per call when measuring the full-calibration loss.
      callback: ``callback(steps_done, loss)`` after each chunk of steps (progress bars).
    """
    cfg = resolve_config(config)
    check_scale_dtype(scale_dtype, "autoround")
    get_layout(layout)
    start = dict(start or {})
    sdt = np.dtype(scale_dtype)
    names, leaves, treedef = _leaf_paths(params)
    if not weights:
        raise ValueError("autoround: weights= selects no leaf; pass {path: WeightSpec(...)}")
    missing = sorted(set(weights) - set(names))
    if missing:
        raise ValueError(f"autoround: no leaf at path(s) {missing}; the params' leaf paths are {names}")
    if extra := sorted(set(start) - set(weights)):
        raise ValueError(f"autoround: start= has weights for unselected path(s) {extra}")
    inputs = [jnp.asarray(x) for x in inputs]
    n_samples = {x.shape[0] if x.ndim else -1 for x in inputs} | {
        y.shape[0] if y.ndim else -1 for y in jax.tree.leaves(target)
    }
    if len(n_samples) != 1 or -1 in n_samples:
        raise ValueError(
            "autoround: every input and target needs the calibration samples on axis 0, the same count; "
            f"got input shapes {[tuple(x.shape) for x in inputs]}, target shapes "
            f"{[tuple(np.shape(y)) for y in jax.tree.leaves(target)]}"
        )
    (n,) = n_samples
    index, shapes, fixed = [], [], []
    for path, spec in sorted(weights.items(), key=lambda kv: names.index(kv[0])):
        i = names.index(path)
        w = leaves[i]
        check_weight(w, f"autoround ({path})")
        check_group_size(spec.group_size)
        check_zero_point(spec.zero_point, f"autoround ({path})")
        shp = _Shape.of(tuple(w.shape), spec)
        qw = start.get(path)
        if qw is not None and (
            qw.shape != tuple(w.shape) or qw.symmetric != spec.symmetric or qw.group_size != spec.group_size
        ):
            raise ValueError(
                f"autoround: start weight for {path} is {qw.shape} g{qw.group_size} "
                f"{'sym' if qw.symmetric else 'asym'}; the leaf needs {tuple(w.shape)} g{spec.group_size} "
                f"{'sym' if spec.symmetric else 'asym'}"
            )
        if qw is not None and shp.integer:
            zf = integer_zero_factor(qw.scales, qw.offsets)
            if not bool(jnp.all(zf * qw.scales.astype(jnp.float32) == qw.offsets.astype(jnp.float32))):
                raise ValueError(
                    f"autoround: start weight for {path} has float zero points; zero_point='integer' needs "
                    "offsets (8 - z) * s with integer z (quantize the start with zero_point='integer')"
                )
        index.append(i)
        shapes.append(shp)
        fixed.append(_start(jnp.asarray(w), shp, qw, sdt))
    static = dict(
        apply_fn=apply_fn, treedef=treedef, index=tuple(index), shapes=tuple(shapes), scale_dtype=sdt
    )
    static = dict(static, loss=cfg.loss, scale_gradient=cfg.scale_gradient)
    theta0 = [_theta0(f, s) for f, s in zip(fixed, shapes, strict=True)]
    ref = _losses(theta0, fixed, leaves, inputs, target, eval_batch, **static)
    loss_start = float(ref.mean())

    steps = cfg.steps
    rng = np.random.default_rng(cfg.seed)
    batch = min(cfg.batch_size, n)
    batches = np.stack([rng.choice(n, batch, replace=False) for _ in range(steps)]) if steps else None
    lrs = (cfg.step_size * (1.0 - np.arange(steps) / steps)).astype(np.float32)
    copy = functools.partial(jax.tree.map, jnp.copy)
    zeros = functools.partial(jax.tree.map, jnp.zeros_like)
    moments = (zeros(theta0), zeros(theta0)) if cfg.optimizer == "adam" else ()
    carry = (copy(theta0), copy(theta0), jnp.float32(np.inf), jnp.float32(loss_start), moments)
    chunk = max(1, min(cfg.chunk, steps))  # steps=0: no chunk runs
    for t0 in range(0, steps, chunk):  # every chunk has one shape (the last padded): one compilation
        t1 = min(t0 + chunk, steps)
        carry = _train_chunk(
            carry,
            fixed,
            leaves,
            inputs,
            target,
            jnp.asarray(ref),
            jnp.asarray(_pad(batches[t0:t1], chunk)),
            jnp.asarray(_pad(lrs[t0:t1], chunk)),
            jnp.int32(t0),
            jnp.int32(t1 - t0),
            jnp.float32(cfg.radius),
            jnp.float32(cfg.learn_scales * cfg.scale_lr),
            optimizer=cfg.optimizer,
            **static,
        )
        if callback is not None:
            callback(t1, float(carry[3]))
    # The final parameters and the best-tracked ones, each measured on every sample; the start wins ties.
    theta, loss_end = theta0, loss_start
    if steps:
        for candidate in (carry[0], carry[1]):
            loss = float(_losses(candidate, fixed, leaves, inputs, target, eval_batch, **static).mean())
            if loss < loss_end:
                theta, loss_end = candidate, loss
    out = {}
    for i, f, t, s in zip(index, fixed, theta, shapes, strict=True):
        out[names[i]] = _freeze(f, t, s, sdt, layout)
    return AutoRoundResult(out, loss_start, loss_end, theta is not theta0)


# --------------------------------------------------------------------------------------- one layer


def _matmul(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)


def autoround(
    w: Any,
    inputs: Any,
    *,
    group_size: int | None = 128,
    symmetric: bool = True,
    config: AutoRoundConfig | str = "default",
    start: QuantizedWeight | None = None,
    scale_dtype: Any = jnp.bfloat16,
    layout: str = DEFAULT_LAYOUT,
    zero_point: str = "float",
) -> QuantizedWeight:
    """Learned rounding of one weight (K, N) for ``y = x @ w`` on calibration inputs ``x`` (n, K).

    Mini-batches are drawn over the n rows of ``inputs`` (``config.batch_size`` rows a step, so raise it
    for a layer: e.g. ``AutoRoundConfig(batch_size=128)``). Never worse than ``start`` (default: round to
    nearest) on ``|x @ w - x @ w_hat|^2`` over all of ``inputs``. ``zero_point``: see :class:`WeightSpec`.
    """
    check_weight(w, "autoround")
    x = jnp.asarray(inputs, jnp.float32)
    if x.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(
            f"autoround: inputs must be (n, {w.shape[0]}) for a weight {tuple(w.shape)}, got {x.shape}"
        )
    w = jnp.asarray(w, jnp.float32)
    res = autoround_block(
        _matmul,
        w,
        {"": WeightSpec(group_size, symmetric, zero_point)},
        [x],
        _matmul(w, x),
        config=config,
        start=None if start is None else {"": start},
        scale_dtype=scale_dtype,
        layout=layout,
        eval_batch=max(1, x.shape[0]),
    )
    return res.weights[""]
