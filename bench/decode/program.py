"""The program ``bench.decode`` compiles: one decode step of an abstract model (no weight is allocated).

``abstract_step(cfg, weights, batch, context)`` builds the model with ``nnx.eval_shape`` (bf16 weights, or
int4 g128 symmetric as ``nybble.models.quantize`` makes them, every int4 layer on the Mosaic GPU kernel)
and returns the step :func:`nybble.models.evaluate.decode_step` with its abstract arguments: the model
state, token ids (batch, 1), a bf16 KV cache of ``context`` positions per layer, and the position
``context - 1`` (every cached position is read).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

WEIGHTS = ("bf16", "int4")
GROUP_SIZE = 128


@dataclasses.dataclass(frozen=True)
class StepProgram:
    fn: Any  # fn(state, token_ids, cache, position) -> (logits, cache)
    args: tuple[Any, ...]
    donate_argnums: tuple[int, ...]
    state: Any  # the abstract model state (args[0])


def abstract_model(
    cfg: Any,
    weights: str,
    *,
    fused: bool = False,
    int4_lm_head: bool = False,
    attention: str = "xla",
    routing: str = "xla",
) -> Any:
    """The model as ShapeDtypeStructs: bf16 weights, or int4 g128 (``nybble.models.quantize``, RTN; the LM
    head too with ``int4_lm_head``, the ``QuantRule`` a user gives for it); a decode step's attention by
    ``attention`` (``nybble.models.set_decode_attention``), an MoE model's one-token routing by ``routing``
    (``nybble.models.set_decode_routing``; a dense model has none to set)."""
    import jax.numpy as jnp
    from flax import nnx

    from nybble.models import QuantRule, quantize
    from nybble.models.definitions.llama import Llama, set_decode_attention
    from nybble.models.definitions.moe import set_decode_routing

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")

    def build() -> Any:
        model = Llama(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
        if weights == "int4":
            rules = [QuantRule(pattern=r"(^|\.)lm_head$")] if int4_lm_head else None
            options = {"rules": rules, "progress": False, "fuse_projections": fused}
            quantize(model, group_size=GROUP_SIZE, symmetric=True, **options)
        elif fused:
            from nybble.models.definitions.fuse import fuse_projections

            fuse_projections(model)
        set_decode_attention(model, attention)
        return set_decode_routing(model, routing) if cfg.moe is not None else model

    model = nnx.eval_shape(build)
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "implementation"):  # QLinear, QExperts: the Hopper kernel, not XLA's fallback
            module.implementation = "mosaic_gpu"
    return model


def abstract_step(
    cfg: Any,
    weights: str,
    batch: int,
    context: int,
    *,
    fused: bool = False,
    donate: bool = False,
    int4_lm_head: bool = False,
    attention: str = "xla",
    routing: str = "xla",
) -> StepProgram:
    """One decode step of ``cfg`` at ``batch`` sequences over a ``context``-position cache (see module)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nybble.models.definitions.llama import KVCache
    from nybble.models.evaluate.measure import decode_step

    if batch < 1 or context < 1:
        raise ValueError(f"batch ({batch}) and context ({context}) must be positive")
    model = abstract_model(
        cfg, weights, fused=fused, int4_lm_head=int4_lm_head, attention=attention, routing=routing
    )
    graphdef, state = nnx.split(model)
    kv = jax.ShapeDtypeStruct((batch, cfg.num_kv_heads, context, cfg.head_dim), jnp.bfloat16)
    cache = KVCache(k=(kv,) * cfg.num_layers, v=(kv,) * cfg.num_layers)
    ids = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    position = jax.ShapeDtypeStruct((), jnp.int32)
    fn = functools.partial(decode_step, graphdef)
    return StepProgram(fn, (state, ids, cache, position), (2,) if donate else (), state)


def param_leaves(state: Any) -> dict[str, Any]:
    """Every array of the state by the name XLA's parameters carry (``state['layers'][0]...``), and every
    ``QuantizedWeight`` by its prefix (its arrays are ``<prefix>.codes``, ``.scales``, ``.offsets``)."""
    import jax

    from nybble.quant.qweight import QuantizedWeight

    out: dict[str, Any] = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    for path, leaf in flat:
        out["state" + jax.tree_util.keystr(path)] = leaf
    return out
