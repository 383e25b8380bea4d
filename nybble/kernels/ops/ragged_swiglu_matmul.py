"""``nybble.kernels.ragged_swiglu_matmul``: a mixture of experts' gate/up product and SiLU product, one op.

    y[r] = silu(x[r] @ W_gate[e]) * (x[r] @ W_up[e])      for row r of expert e's group

for x's rows sorted by expert (as ``nybble.ragged_matmul`` takes them) and a stacked weight holding each
expert's gate and up interleaved (``nybble.packing.gate_up``; ``nybble.models``' fused experts hold theirs
so). On a Hopper or Blackwell GPU at decode sizes (the K-sliced configs) it is one launch of the grouped
kernel with the SwiGLU epilogue (``mosaic_gpu/grouped_swiglu.py``); everywhere else
``nybble.ragged_matmul`` (whatever it runs there) and the SiLU product in f32 after it, which XLA fuses into
one elementwise launch. The kernel takes the SiLU product of its f32 accumulators, the other path of the
product rounded to x's dtype: they differ by one rounding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from nybble.kernels import backends
from nybble.kernels.backends import Implementation
from nybble.kernels.epilogue import swiglu
from nybble.kernels.ops.ragged_matmul import api as ragged_api
from nybble.kernels.ops.swiglu_matmul import check_gate_up_columns
from nybble.quant.qweight import QuantizedWeight

WHAT = "nybble.kernels.ragged_swiglu_matmul"


def _check(x: Any, qw: Any, group_sizes: Any) -> None:
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(
            f"{WHAT}: the weight must be one stacked nybble.QuantizedWeight holding each expert's gate and "
            f"up interleaved (nybble.packing.gate_up), got {type(qw).__name__}"
        )
    ragged_api.check_args(x, qw, group_sizes)
    check_gate_up_columns(WHAT, qw.shape[1])


def ragged_swiglu_matmul(
    x: Any, qw: QuantizedWeight, group_sizes: Any, *, implementation: Implementation | None = None
) -> jax.Array:
    """``silu(x @ W_gate[e]) * (x @ W_up[e])`` row by row, e the expert whose group holds the row: x (rows,
    K) sorted by expert -> (rows, N / 2) in ``x.dtype``, rows past ``sum(group_sizes)`` zero.

    Args:
      x: (rows, K) bf16/f16/f32, rows sorted by expert (expert 0's first).
      qw: a stacked gate/up weight, (K, N) per expert: gate and up of N / 2 columns each, interleaved in
        blocks of 8 (``nybble.packing.gate_up``).
      group_sizes: int32 (experts,), as ``nybble.ragged_matmul`` takes them (checked where concrete).
      implementation: as ``nybble.ragged_matmul``'s. The grouped kernel runs the whole op in one launch
        where a config with the epilogue fits; otherwise the product runs as ``nybble.ragged_matmul`` runs
        it and the SiLU product after it.

    Forward only where the grouped kernel runs (as ``nybble.ragged_matmul``'s kernels).
    """
    _check(x, qw, group_sizes)
    ragged_api.check_implementation(implementation)
    n = qw.shape[1]
    if x.shape[0] == 0:
        return jnp.zeros((0, n // 2), x.dtype)
    # The backend nybble.ragged_matmul would run, with its own SwiGLU op where it has one for this call.
    name = implementation or backends.default_choice(ragged_api.OP, (x, qw, group_sizes))[0]
    backend = backends.load(name)
    fused = getattr(backend, "ragged_swiglu_matmul", None)
    forced = implementation is not None
    if fused is not None and backend.ragged_swiglu_unsupported(x, qw, group_sizes, forced=forced) is None:
        return fused(x, qw, group_sizes)
    y = ragged_api.ragged_matmul(x, qw, group_sizes, implementation=implementation).astype(jnp.float32)
    return swiglu(y, None, (1.0, 1.0)).astype(x.dtype)


__all__ = ["ragged_swiglu_matmul"]
