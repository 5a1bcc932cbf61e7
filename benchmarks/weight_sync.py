"""How long a weight sync takes: trained parameters from a training mesh to a rollout mesh.

    python benchmarks/weight_sync.py                  # the GRPO recipe's model ("base")
    python benchmarks/weight_sync.py --model-size teacher --repeats 20
    python benchmarks/weight_sync.py --model-size student --repeats 2   # seconds: the tests'

Eight CPU devices are simulated (`--xla_force_host_platform_device_count=8`). The training
mesh is devices 0-3 with every weight split FSDP-style along its "embed" axis; the rollout
mesh is devices 4-7 as 2 x 2 ("data", "model"; the recipes' models have 2 key/value heads and
82 tokens) with the tensor-parallel layout of `tunelib.models.TENSOR_PARALLEL_RULES`.
The model is the recipes' decoder of `--model-size` (`kit.models.new_model`, the character
tokenizer). Each run calls `tunelib.rollout.sync_weights` with and without a cast to bfloat16
and waits for every array. Before timing, every synced leaf is checked to hold its source's
values (cast) on its rollout sharding; a dtype that fails is reported and not timed, and the
exit status is 1. Prints a table and one JSON line (`--json-out` writes it to a file too) with
the median milliseconds per sync, the bytes moved and `correct`.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from kit import models


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-size", choices=sorted(models.MODEL_SIZES), default="base")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")

    import jax
    import numpy as np

    from tunelib.data import CharTokenizer
    from tunelib.models import TENSOR_PARALLEL_RULES, param_shardings
    from tunelib.rollout import sync_weights

    model = models.new_model(CharTokenizer(), args.model_size, seed=0)
    graphdef, params = model.graphdef, model.params
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

    result = {
        "benchmark": "weight_sync",
        "model_size": args.model_size,
        "parameters": sum(x.size for x in leaves),
        "repeats": args.repeats,
        "exact": {},
    }
    rows = []
    for dtype in (None, "bfloat16"):
        name = dtype or "float32"
        synced = jax.block_until_ready(sync_weights(trained, targets, dtype=dtype))
        wrong = [
            jax.tree_util.keystr(path)
            for (path, out), source, target in zip(
                jax.tree_util.tree_leaves_with_path(synced), leaves, jax.tree.leaves(targets),
                strict=True,
            )
            if out.sharding != target
            or not np.array_equal(np.asarray(out), np.asarray(source).astype(out.dtype))
        ]  # fmt: skip
        result["exact"][name] = not wrong
        if wrong:  # reported, not timed
            print(f"{name}: not the source's values on the rollout mesh: {wrong}", file=sys.stderr)
            continue
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(sync_weights(trained, targets, dtype=dtype))
            times.append(1e3 * (time.perf_counter() - start))
        moved = nbytes // 2 if dtype else nbytes
        rows.append((name, moved, statistics.median(times)))
        result[f"{name}_ms"] = round(statistics.median(times), 3)
        result[f"{name}_bytes"] = moved
    result["correct"] = all(result["exact"].values())
    print(f"{'rollout dtype':>14} {'bytes moved':>12} {'median ms':>10}")
    for name, moved, ms in rows:
        print(f"{name:>14} {moved:>12,} {ms:>10.2f}")
    line = json.dumps(result)
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    return 0 if result["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
