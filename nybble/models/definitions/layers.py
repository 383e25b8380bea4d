"""Layers that multiply with a ``QuantizedWeight``: NNX ``QLinear``, Linen ``QDense`` and ``dense``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Unpack

import jax
import jax.numpy as jnp
from flax import linen, nnx

from nybble.kernels.backends import Implementation
from nybble.ops import matmul
from nybble.quant.qformat import FormatFields, QuantFormat
from nybble.quant.qweight import QuantizedWeight
from nybble.quant.rtn import quantize
from nybble.sharding import ShardedWeight


class QuantizedParam(nnx.Variable):
    """Non-trainable NNX state holding a ``QuantizedWeight`` (not an ``nnx.Param``: optimizers skip it)."""


class InputPermutation(nnx.Variable):
    """Non-trainable NNX state: the int32 (in_features,) input permutation of an activation-order layer."""


class QLinear(nnx.Module):
    """An int4 ``nnx.Linear``: ``y = x @ dequantize(qweight) + bias`` through :func:`nybble.matmul`.

    Attributes:
      qweight: ``QuantizedParam`` holding the (in_features, out_features) ``QuantizedWeight`` (or a
        ``nybble.sharding.ShardedWeight``, placed by ``nybble.models.shard``).
      bias: ``nnx.Param`` of shape (out_features,), or None.
      input_perm: ``InputPermutation`` (in_features,) int32, or None: with it, ``y = x[..., perm] @ W``.
        Activation-order checkpoints (GPTQ ``desc_act``) whose groups are scattered over the input rows
        are stored with their rows sorted by group, which is exact only with the inputs permuted alike.
      implementation: passed to ``nybble.matmul`` (None: the best available here).
    """

    def __init__(
        self,
        qweight: QuantizedWeight | ShardedWeight,
        bias: jax.Array | None = None,
        *,
        input_perm: Any = None,
        implementation: Implementation | None = None,
    ) -> None:
        if not isinstance(qweight, QuantizedWeight | ShardedWeight):
            raise TypeError(f"QLinear expects a QuantizedWeight, got {type(qweight).__name__}")
        self.in_features, self.out_features = qweight.shape
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"QLinear: bias shape {tuple(bias.shape)} != ({self.out_features},)")
        self.qweight = QuantizedParam(qweight)
        self.bias = nnx.Param(bias) if bias is not None else None
        if input_perm is not None:
            input_perm = jnp.asarray(input_perm, jnp.int32)
            if tuple(input_perm.shape) != (self.in_features,):
                raise ValueError(
                    f"QLinear: input_perm shape {tuple(input_perm.shape)} != ({self.in_features},)"
                )
            self.input_perm: InputPermutation | None = InputPermutation(input_perm)
        else:
            self.input_perm = None
        self.implementation = implementation

    @classmethod
    def from_linear(
        cls,
        linear: nnx.Linear,
        format: QuantFormat | None = None,
        *,
        qweight: QuantizedWeight | None = None,
        implementation: Implementation | None = None,
        **fields: Unpack[FormatFields],
    ) -> QLinear:
        """Quantizes an ``nnx.Linear`` round-to-nearest (or wraps the given ``qweight``), bias kept.

        The stored format is ``format`` or its fields as keywords (``group_size=64, zero_point="integer"``),
        handed to :func:`nybble.quantize` whole, so no option is named (and lost) on the way."""
        if qweight is None:
            qweight = quantize(linear.kernel[...], format, **fields)
        elif format is not None or fields:
            raise TypeError("QLinear.from_linear: give a qweight or the format to quantize with, not both")
        elif qweight.shape != tuple(linear.kernel.shape):
            raise ValueError(f"qweight shape {qweight.shape} != kernel shape {tuple(linear.kernel.shape)}")
        bias = linear.bias[...] if linear.bias is not None else None
        return cls(qweight, bias, implementation=implementation)

    @property
    def weight(self) -> QuantizedWeight | ShardedWeight:
        """The ``QuantizedWeight`` (a ``ShardedWeight`` once the model is sharded)."""
        return self.qweight.get_value()

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` of shape (..., in_features) in bf16/f16/f32 -> (..., out_features) in ``x.dtype``."""
        if self.input_perm is not None:
            x = jnp.take(x, self.input_perm[...], axis=-1)
        y = matmul(x, self.qweight.get_value(), implementation=self.implementation)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


def dense(
    x: jax.Array,
    w: jax.Array | QuantizedWeight | ShardedWeight,
    *,
    implementation: Implementation | None = None,
) -> jax.Array:
    """``x @ w`` for a float (K, N) kernel, a ``QuantizedWeight`` or a ``ShardedWeight``; in ``x.dtype``."""
    if isinstance(w, QuantizedWeight | ShardedWeight):
        return matmul(x, w, implementation=implementation)
    return jnp.matmul(x, jnp.asarray(w).astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


class QDense(linen.Module):
    """A drop-in ``flax.linen.Dense`` whose ``kernel`` may be a float array or a ``QuantizedWeight``.

    Initialized like ``nn.Dense`` (float kernel); after ``nybble.models.quantize_params`` replaced the
    kernel with a ``QuantizedWeight`` it multiplies through ``nybble.matmul``.
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable[..., Any] = linen.initializers.lecun_normal()
    bias_init: Callable[..., Any] = linen.initializers.zeros_init()
    implementation: Implementation | None = None

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.has_variable("params", "kernel") and isinstance(
            w := self.get_variable("params", "kernel"), QuantizedWeight
        ):
            kernel: jax.Array | QuantizedWeight = w
            if w.shape != (x.shape[-1], self.features):
                raise ValueError(f"QDense: kernel shape {w.shape} != ({x.shape[-1]}, {self.features})")
        else:
            kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)
        dtype = self.dtype or (x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32)
        y = dense(x.astype(dtype), kernel, implementation=self.implementation)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            y = y + bias.astype(y.dtype)
        return y


def projections(
    module: nnx.Module, fused: str, names: tuple[str, ...], x: jax.Array
) -> tuple[jax.Array, ...]:
    """The outputs of ``module``'s projections ``names`` of one input ``x``: one launch when they are fused
    into ``module.<fused>`` (``models.definitions.fuse``), else one per projection; the same numbers."""
    layer = getattr(module, fused, None)
    if layer is not None:
        return layer(x)
    return tuple(getattr(module, name)(x) for name in names)


__all__ = ["InputPermutation", "QDense", "QLinear", "QuantizedParam", "dense", "projections"]
