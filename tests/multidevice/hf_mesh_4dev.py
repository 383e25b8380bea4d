"""Run by tests/test_hf_models.py in a subprocess with 4 CPU devices: from_pretrained(mesh=) on a 2x2 mesh.

Every float tensor is placed straight into its shards (column-parallel q/k/v/gate/up, row-parallel o/down,
embedding split over the vocab) and the logits equal transformers' as on one device. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from nybble import models

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"

assert len(jax.devices()) == 4, jax.devices()
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
out = {}
for name in sys.argv[1:]:
    d = FIXTURES / name
    ids = np.load(d / "prompt_ids.npy")
    want = np.load(d / "transformers_logits.npy")
    model = models.from_pretrained(d, dtype=jnp.float32, mesh=mesh)
    q = model.layers[0].attn.q_proj.kernel[...]
    o = model.layers[0].attn.o_proj.kernel[...]
    got = np.asarray(model(jnp.asarray(ids)[None]))
    out[name] = {
        "q_spec": list(q.sharding.spec),
        "q_shard": list(q.addressable_shards[0].data.shape),
        "o_spec": list(o.sharding.spec),
        "rel": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
    }
print(json.dumps(out))
