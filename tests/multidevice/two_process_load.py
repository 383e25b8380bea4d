"""One of two processes of a CPU "cluster" (``jax.distributed``, 4 devices each, a 1x8 mesh over both).

``python two_process_load.py PROCESS_ID PORT CHECKPOINT``: loads the checkpoint's ``up`` (column-parallel)
and ``down`` (row-parallel) weights straight into their shards, counting the bytes this process reads, runs
``(x @ up) @ down`` (the row-parallel all-reduce crosses the two processes) and prints one JSON line of
facts for tests/test_sharding_devices.py to check.
"""

from __future__ import annotations

import json
import os
import sys
from unittest import mock

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main() -> None:
    process_id, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import nybble
    from nybble.sharding import ShardedWeight, TensorParallel

    mesh = Mesh(np.array(jax.devices()).reshape(1, 8), ("data", "model"))
    splits = {"up": "column", "down": "row"}
    with mock.patch("nybble.checkpoint.reader.os.pread", wraps=os.pread) as pread:
        tree = nybble.load(path, placement=lambda leaf: TensorParallel(mesh, splits[leaf.name]))
    bytes_read = sum(call.args[1] for call in pread.call_args_list)
    up, down = tree["up"], tree["down"]
    assert isinstance(up, ShardedWeight) and isinstance(down, ShardedWeight)
    x_host = np.random.default_rng(0).integers(-1, 2, (8, up.shape[0])).astype(np.float32)
    x = jax.make_array_from_callback(x_host.shape, NamedSharding(mesh, PartitionSpec()), lambda i: x_host[i])
    y = jax.jit(lambda x, up, down: nybble.matmul(nybble.matmul(x, up), down))(x, up, down)
    local = np.asarray(y.addressable_shards[0].data, np.float64)  # y is whole on every device
    whole = nybble.load(path)  # the reference, read whole (not counted above)
    w_up, w_down = (np.asarray(nybble.dequantize(whole[k]), np.float64) for k in ("up", "down"))
    want = x_host.astype(np.float64) @ w_up @ w_down
    facts = {
        "process": process_id,
        "local_devices": len(jax.local_devices()),
        "global_devices": len(jax.devices()),
        "bytes_read": bytes_read,
        "exact": bool(np.array_equal(local, want)),
        "max_abs": float(np.abs(want).max()),
    }
    print(json.dumps(facts), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
