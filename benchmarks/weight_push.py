"""Weight pushes from a trainer to a sampler, whole against delta, at real models' shapes: the
disaggregated recipe's own push (`kit.disaggregated.Rollouts.push`) between two processes.

    python benchmarks/weight_push.py                        # SmolLM2-135M and Qwen3-0.6B, bf16
    python benchmarks/weight_push.py --models smollm2 --changed 0.01,0.5
    python benchmarks/weight_push.py --models tiny --changed 0.05,0.98 --repeats 2 \
        --bucket-mb 0.05                                       # the test's

Two processes (`python -m tunelib.launch -n 2`, one CPU device each, Gloo on loopback; on a
cluster the same code runs between hosts): process 0 holds a model's weights in bfloat16 (the
shapes of the decoder, `tunelib.models.DecoderConfig`, random values), pushes them whole once,
then for each share of changed elements (`--changed`) changes that share of the elements
(the lowest bit of each chosen bfloat16, positions drawn at random) and pushes the new
weights twice: as a delta (`weight_delta`: the changed elements' positions and values, after
a header of the version, the fingerprint and the counts; the sampler rebuilds the weights
and checks their fingerprint) and whole. Each push is timed on both processes, end to end
(on the trainer: encoding the delta and the collectives; on the sampler: the collectives and
rebuilding), with the collectives' seconds apart, `--repeats` times (median), after a
discarded round that compiles the delta's programs; and each process's peak resident
memory (one model after the other in the same processes: the largest's). Each bucket size
of `--bucket-mb` runs in processes of its own: the recipe's pushes travel in collectives of
at most 256 MiB (`kit.disaggregated.BUCKET_BYTES`), against one buffer for the whole push
(0). The shares' defaults: 0.01 (about the figure Hugging Face TRL gives for its delta
weight sync, 99 % of Qwen3-0.6B's bfloat16 elements bit-identical from one step to the
next), 0.026 (the toy model's full fine-tuning at learning rate 1e-6, `weight_delta.py`),
0.5, and 0.98 (the recipes' full fine-tuning at their own learning rates, 97.5-98.7 %).
Prints a table and one JSON line (`--json-out` writes it to a file too).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _measure import peak_rss_bytes, print_result

ROOT = Path(__file__).resolve().parents[1]
# The decoders' shapes: (layers, hidden, intermediate, heads, key-value heads, head dim, vocab).
MODELS = {
    "tiny": (2, 64, 128, 4, 2, 16, 512),
    "smollm2": (30, 576, 1536, 9, 3, 64, 49152),  # SmolLM2-135M
    "qwen3-0.6b": (28, 1024, 3072, 16, 8, 128, 151936),  # Qwen3-0.6B
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="smollm2,qwen3-0.6b", help=", ".join(MODELS))
    p.add_argument("--changed", default="0.01,0.026,0.5,0.98", help="shares of elements")
    p.add_argument("--repeats", type=int, default=3, help="pushes of each kind per share")
    p.add_argument(
        "--bucket-mb", default="256,0",
        help="the push's bucket sizes compared, in MiB (0: the whole push in one buffer); the "
        "first is the recipe's (kit.disaggregated.BUCKET_BYTES)",
    )  # fmt: skip
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--bucket-bytes", type=int, default=0, help=argparse.SUPPRESS)
    return p


def weights(model: str) -> dict:
    """The bfloat16 weights of `model`'s decoder shapes (stacked layers, tied embeddings),
    random values from one seed: the same on both processes."""
    import jax
    import ml_dtypes
    import numpy as np
    from flax import nnx

    from tunelib.models import Decoder, DecoderConfig

    layers, hidden, inter, heads, kv_heads, head_dim, vocab = MODELS[model]
    config = DecoderConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, tie_word_embeddings=True, scan_layers=True,
    )  # fmt: skip
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))))
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda x: (0.02 * rng.standard_normal(x.shape, np.float32)).astype(ml_dtypes.bfloat16),
        shapes,
    )


def changed(tree: dict, share: float, seed: int) -> dict:
    """`tree` with a `share` of each array's elements changed (their lowest bit flipped)."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)

    def change(x):
        bits = x.reshape(-1).view(np.uint16).copy()
        chosen = rng.random(bits.size, dtype=np.float32) < share
        bits[chosen] ^= 1
        return bits.view(x.dtype).reshape(x.shape)

    return jax.tree.map(change, tree)


def timed_push(rollouts, tree, *, delta: bool) -> dict:
    """One push, timed from a barrier: each process's seconds are the push's own, not its
    wait for the other to finish what it did before."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("push")
    start = time.perf_counter()
    _, sent = rollouts.push(tree, delta=delta)
    return {**sent, "wall_s": time.perf_counter() - start}


def worker(args) -> None:
    """Both processes: every push of every model and share, in the same order."""
    sys.path.insert(0, str(ROOT / "recipes"))
    import jax

    from tunelib import distributed
    from tunelib.distributed import FaultPlan

    from kit import disaggregated

    distributed.initialize()
    trainer = disaggregated.role() == disaggregated.TRAINER
    results = []
    for model in args.models.split(","):
        tree = weights(model)
        bucket = args.bucket_bytes or sum(x.nbytes for x in jax.tree.leaves(tree))
        rollouts = disaggregated.Rollouts(
            0, None, {}, None, faults=FaultPlan(), bucket_bytes=bucket
        )
        timed_push(rollouts, tree, delta=True)  # the first push is whole: both hold it
        # A discarded round: the first delta's programs compiled, not timed.
        tree = changed(tree, 0.01, seed=1) if trainer else tree
        timed_push(rollouts, tree, delta=True)
        for i, share in enumerate(float(c) for c in args.changed.split(",")):
            rows = {"delta": [], "whole": []}
            for repeat in range(args.repeats):
                tree = changed(tree, share, seed=1000 * i + repeat) if trainer else tree
                rows["delta"].append(timed_push(rollouts, tree, delta=True))
                rows["whole"].append(timed_push(rollouts, tree, delta=False))
                timed_push(rollouts, tree, delta=True)  # both hold the weights again
            results.append({"model": model, "share": share, "rows": rows})
    # Each process's times in a file of its own, beside the one the parent reads.
    path = args.worker if trainer else args.worker.with_name("sampler.json")
    path.write_text(json.dumps({"results": results, "peak_rss_bytes": peak_rss_bytes()}))
    jax.distributed.shutdown()


def summary(trainer: list[dict], sampler: list[dict]) -> list[dict]:
    """One row per model and share: bytes, and the median seconds of each kind of push."""
    rows = []
    for mine, theirs in zip(trainer, sampler, strict=True):
        row = {"model": mine["model"], "share": mine["share"]}
        for kind in ("delta", "whole"):
            pushes = mine["rows"][kind]
            row[f"{kind}_bytes"] = statistics.median(p["bytes"] for p in pushes)
            row[f"{kind}_collective_s"] = statistics.median(p["seconds"] for p in pushes)
            row[f"{kind}_trainer_s"] = statistics.median(p["wall_s"] for p in pushes)
            row[f"{kind}_sampler_s"] = statistics.median(p["wall_s"] for p in theirs["rows"][kind])
        row["pushes_as_delta"] = [p["delta"] for p in mine["rows"]["delta"]]
        row["bytes_ratio"] = row["delta_bytes"] / row["whole_bytes"]
        row["sampler_s_ratio"] = row["delta_sampler_s"] / row["whole_sampler_s"]
        rows.append(row)
    return rows


def pushes(models: list[str], shares: list[float], repeats: int, bucket_bytes: int):
    """Both processes' times and peak memory (`worker`), pushing in buckets of at most
    `bucket_bytes` (0: one buffer)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "pushes.json"
        command = [
            sys.executable, "-m", "tunelib.launch", "-n", "2", "--devices-per-process", "1",
            __file__, "--models", ",".join(models), "--changed", ",".join(map(str, shares)),
            "--repeats", str(repeats), "--bucket-bytes", str(bucket_bytes), "--worker", str(out),
        ]  # fmt: skip
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        if done.returncode:
            sys.exit(f"the pushes failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return json.loads(out.read_text()), json.loads(out.with_name("sampler.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    models = [m for m in args.models.split(",") if m]
    if not models or set(models) - set(MODELS):
        parser.error(f"--models: one or more of {', '.join(MODELS)}, got {args.models!r}")
    try:
        shares = [float(c) for c in args.changed.split(",") if c]
    except ValueError:
        parser.error(f"--changed: not numbers: {args.changed!r}")
    if not shares or not all(0 < s <= 1 for s in shares) or args.repeats < 1:
        parser.error("--changed takes shares in (0, 1], and --repeats must be >= 1")
    try:
        buckets = [float(b) for b in args.bucket_mb.split(",") if b]
    except ValueError:
        parser.error(f"--bucket-mb: not numbers: {args.bucket_mb!r}")
    if not buckets or min(buckets) < 0:
        parser.error("--bucket-mb takes sizes >= 0 (0: one buffer)")
    rows, peaks = [], {}
    for bucket in buckets:  # each in processes of its own: their own peak memory
        trainer, sampler = pushes(models, shares, args.repeats, int(bucket * 2**20))
        rows += [
            {**r, "bucket_mb": bucket} for r in summary(trainer["results"], sampler["results"])
        ]
        peaks[bucket] = {"trainer": trainer["peak_rss_bytes"], "sampler": sampler["peak_rss_bytes"]}
    print(f"{'bucket MiB':>10s} {'model':11s} {'changed':>8s} {'whole MB':>9s} {'delta MB':>9s} "
          f"{'whole s':>8s} {'delta s':>8s} {'delta / whole s':>16s}")  # fmt: skip
    for r in rows:
        print(f"{r['bucket_mb']:>10g} {r['model']:11s} {r['share']:>8.3f} "
              f"{r['whole_bytes'] / 1e6:>9.1f} {r['delta_bytes'] / 1e6:>9.1f} "
              f"{r['whole_sampler_s']:>8.3f} {r['delta_sampler_s']:>8.3f} "
              f"{r['sampler_s_ratio']:>16.2f}")  # fmt: skip
    for bucket, peak in peaks.items():
        print(f"bucket {bucket:g} MiB: peak RSS trainer {peak['trainer'] / 2**30:.2f} GiB, "
              f"sampler {peak['sampler'] / 2**30:.2f} GiB")  # fmt: skip
    result = {"benchmark": "weight_push", "repeats": args.repeats, "results": rows,
              "peak_rss_bytes": peaks}  # fmt: skip
    print_result(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
