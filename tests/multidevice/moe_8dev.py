"""Expert stacks on 8 CPU devices: expert- and tensor-parallel ragged products equal the unsharded op exactly.

Runs in its own process with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (started by
tests/test_moe_sharding.py). Small-integer weights and {-1, 0, 1} activations make every product exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import nybble
from nybble import models
from nybble.models.definitions.moe import MoE, MoEConfig, QExperts
from nybble.packing import get_layout
from nybble.quant.stacked import stack_weights
from nybble.sharding import ExpertParallel, ExpertShardedWeight, ShardingError, shard_experts

if jax.device_count() != 8:
    raise RuntimeError("tests/multidevice/moe_8dev.py needs 8 devices (tests/test_moe_sharding.py runs it)")

MESHES = {"1x8": (1, 8), "2x4": (2, 4), "8x1": (8, 1)}


def _mesh(name):
    return Mesh(np.array(jax.devices()).reshape(MESHES[name]), ("expert", "model"))


def _stack(e, k, n, *, layout="wgmma_int4", group_size=32, seed=0):
    rng = np.random.default_rng(seed)
    k_pad, n_pad = -(-k // 64) * 64, -(-n // 64) * 64
    groups = -(-k_pad // group_size)
    out = []
    for _ in range(e):
        q = np.zeros((k_pad, n_pad), np.int8)
        q[:k, :n] = rng.integers(-8, 8, (k, n))
        s = np.zeros((groups, n_pad), np.float32)
        s[:, :n] = rng.integers(1, 3, (groups, n))
        o = np.where(s != 0, rng.integers(-1, 2, s.shape), 0)
        out.append(
            nybble.QuantizedWeight(
                jnp.asarray(get_layout(layout).pack(q)),
                jnp.asarray(s, jnp.bfloat16),
                jnp.asarray(o, jnp.bfloat16),
                (k, n),
                group_size,
                False,
                layout,
            )
        )
    return stack_weights(out)


def _x(m, k, seed=1):
    rng = np.random.default_rng(seed)
    x = np.zeros((m, k), np.float32)
    for row in x:
        row[rng.choice(k, 6, replace=False)] = rng.choice([-1.0, 1.0], 6)
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("split", [None, "column", "row"])
@pytest.mark.parametrize("layout", ["wgmma_int4", "nk_int4"])
def test_sharded_equals_unsharded(mesh_name, split, layout):
    mesh = _mesh(mesh_name)
    qw = _stack(8, 512, 128, layout=layout, seed=2)
    sizes = [3, 0, 9, 0, 1, 14, 0, 2]  # 29 of 32 rows; zeros; experts of one device all empty
    x, gs = _x(32, 512), jnp.asarray(sizes, jnp.int32)
    want = nybble.ragged_matmul(x, qw, gs)
    par = ExpertParallel(mesh, "expert", "model" if split else None, split)
    sw = shard_experts(qw, par)
    assert isinstance(sw, ExpertShardedWeight) and sw.codes.sharding.spec[0] == "expert"
    got = jax.jit(nybble.ragged_matmul)(x, sw, gs)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert np.abs(np.asarray(want, np.float32)).max() > 10
    for a, b in zip(jax.tree.leaves(sw.gather()), jax.tree.leaves(qw), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The per-device kernel in interpret mode on the mesh that splits both axes (2x4: 4 experts a device,
    # each cut 4 ways); 1x8 and 8x1 run the same per-device program on other slices, 8 s each.
    if split is None or mesh_name != "2x4":
        return
    with nybble.kernels.interpret():  # the per-device op in interpret mode: the same numbers
        got_i = jax.jit(nybble.ragged_matmul)(x, sw, gs)
    np.testing.assert_array_equal(np.asarray(got_i, np.float32), np.asarray(want, np.float32))


def test_refusals():
    mesh = _mesh("1x8")
    with pytest.raises(ShardingError, match="6 experts do not split over the 8 devices"):
        shard_experts(_stack(6, 64, 64), ExpertParallel(mesh, "model"))
    with pytest.raises(ShardingError, match="not a multiple of 8"):
        shard_experts(_stack(2, 64, 72), ExpertParallel(mesh, None, "model", "column"))


def test_model_shard_places_expert_stacks():
    cfg = MoEConfig(hidden_size=128, intermediate_size=256, num_experts=8, top_k=2)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    models.quantize(moe, group_size=32, progress=False)
    x = jax.random.normal(jax.random.key(1), (12, 128), jnp.float32)
    want = np.asarray(moe(x))
    models.shard(moe, _mesh("2x4"), axis="model", expert_axis="expert")
    assert isinstance(moe.experts.gate_proj, QExperts)
    gate, down = moe.experts.gate_proj.weight, moe.experts.down_proj.weight
    assert isinstance(gate, ExpertShardedWeight)
    assert (gate.parallel.expert_axis, gate.parallel.split) == ("expert", "column")
    assert down.parallel.split == "row" and gate.local_shape == (128, 64)
    got = np.asarray(nnx.jit(lambda m, x: m(x))(moe, x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_mixtral_from_pretrained_on_a_mesh():
    # The tiny Mixtral (hidden 64: too narrow for tensor-parallel attention in wgmma_int4) with its experts
    # split 4 ways and gate/up 2 ways inside each expert; the rest replicated.
    from pathlib import Path

    from nybble.models.io.hf.pretrained import from_pretrained

    d = Path(__file__).resolve().parents[1] / "fixtures" / "moe" / "mixtral"
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("expert", "model"))
    rules = [models.ShardRule(pattern=r"attn|lm_head|embed|down_proj", placement="replicate")]
    ids = np.load(d / "prompt_ids.npy")[None]
    ref = np.load(d / "transformers_logits.npy")
    model = from_pretrained(d, dtype=jnp.float32, mesh=mesh, rules=rules, expert_axis="expert")
    assert tuple(model.layers[0].mlp.experts.gate_proj.kernel[...].sharding.spec) == ("expert", None, "model")
    out = np.asarray(model(ids))
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-3
    q = from_pretrained(d, dtype=jnp.float32)
    models.quantize(q, group_size=32, progress=False)
    want = np.asarray(q(ids))
    models.shard(q, mesh, axis="model", expert_axis="expert", rules=rules)
    gate = q.layers[1].mlp.experts.gate_proj.weight
    assert isinstance(gate, ExpertShardedWeight) and gate.local_shape == (64, 16)
    np.testing.assert_allclose(np.asarray(q(ids)), want, rtol=1e-5, atol=1e-5)  # eager: one jitted shard_map
