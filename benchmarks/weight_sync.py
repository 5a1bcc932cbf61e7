"""How long a weight sync takes: trained parameters from a training mesh to a rollout mesh.

    python benchmarks/weight_sync.py                  # the GRPO recipe's model ("base")
    python benchmarks/weight_sync.py --model-size teacher --repeats 20

Eight CPU devices are simulated (`--xla_force_host_platform_device_count=8`). The training
mesh is devices 0-3 with every weight split FSDP-style along its "embed" axis; the rollout
mesh is devices 4-7 as 2 x 2 ("data", "model"; the recipes' models have 2 key/value heads and
82 tokens) with the tensor-parallel layout of `tunelib.models.TENSOR_PARALLEL_RULES`.
Each run calls `tunelib.rollout.sync_weights` with and without a cast to bfloat16 and waits
for every array. Before timing, the synced values are checked against the source. Prints a
table and one JSON line with the median milliseconds per sync and the bytes moved.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import common

from tunelib.data import CharTokenizer
from tunelib.models import TENSOR_PARALLEL_RULES, param_shardings
from tunelib.rollout import sync_weights


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-size", choices=sorted(common.MODEL_SIZES), default="base")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)

    config = common.model_config(CharTokenizer(), args.model_size)
    graphdef, params = common.init_model(config, seed=0)
    devices = np.array(jax.devices()[:8])
    auto = jax.sharding.AxisType.Auto
    train_mesh = jax.sharding.Mesh(devices[:4], ("fsdp",), axis_types=(auto,))
    rollout_mesh = jax.sharding.Mesh(
        devices[4:].reshape(2, 2), ("data", "model"), axis_types=(auto, auto)
    )
    fsdp = [(name, "fsdp" if name == "embed" else None) for name, _ in TENSOR_PARALLEL_RULES]
    trained = jax.device_put(params, param_shardings(graphdef, params, train_mesh, fsdp))
    targets = param_shardings(graphdef, params, rollout_mesh)
    leaves = jax.tree.leaves(params)
    nbytes = sum(x.nbytes for x in leaves)

    rows, result = [], {"model_size": args.model_size, "parameters": sum(x.size for x in leaves)}
    for dtype in (None, "bfloat16"):
        synced = jax.block_until_ready(sync_weights(trained, targets, dtype=dtype))
        for out, source in zip(jax.tree.leaves(synced), leaves, strict=True):
            expected = np.asarray(source).astype(out.dtype)
            if not np.array_equal(np.asarray(out), expected) or out.sharding.mesh != rollout_mesh:
                raise SystemExit("sync_weights did not move the exact values")
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(sync_weights(trained, targets, dtype=dtype))
            times.append(1e3 * (time.perf_counter() - start))
        name = dtype or "float32"
        moved = nbytes // 2 if dtype else nbytes
        rows.append((name, moved, statistics.median(times)))
        result[f"{name}_ms"] = round(statistics.median(times), 3)
        result[f"{name}_bytes"] = moved
    print(f"{'rollout dtype':>14} {'bytes moved':>12} {'median ms':>10}")
    for name, moved, ms in rows:
        print(f"{name:>14} {moved:>12,} {ms:>10.2f}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
