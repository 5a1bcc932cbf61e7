r"""GRPO on a tiny bfloat16 mixture of experts, with and without routing replay (R3).

    python benchmarks/grpo_routing_replay.py --out runs/grpo_routing_replay   # ~30 min, 2 cores
    python benchmarks/grpo_routing_replay.py --size smoke --out /tmp/r3       # what the test runs
    python benchmarks/grpo_routing_replay.py --out runs/grpo_routing_replay --summarize-only

One SFT start of the recipes' `moe` model (`recipes/sft.py --model-size moe`: Qwen3-MoE-shaped,
two layers of 8 experts, top-2 with renormalised weights, computing in bfloat16 on float32
weights), then for each seed two GRPO runs from it (`recipes/grpo.py`) with the same settings:
``plain``, the trainer's forward pass routing by its own router, and ``replay``, with
`--replay-routing` (the sampler records every token's experts and the trainer routes by them).
In bfloat16 the sampler's cached decode step and the trainer's full forward pass round
differently, so near ties between experts flip between them; the recipe logs the
trainer/sampler mismatch of every step (`mismatch_kl`, k3, mean and max over tokens; `is_ess`).

The table, per arm and seed: the batch reward (mean of the first and of the last `TAIL` steps),
held-out greedy accuracy at the first and last evaluation, the mean and the largest per-step
mismatch KL, the lowest `is_ess`, the collapse guard's warning lines (`kit.watch`) and whether
the run collapsed: a loss or mismatch that is not finite, or held-out accuracy ending below
half of where it started. Then the means over seeds per arm. Runs that exist are not run
again (delete their folder to redo one). Ends with one JSON line.
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from _recipe_runs import run_recipe

ARMS = {"plain": [], "replay": ["--replay-routing"]}
TAIL = 10  # steps averaged for the first and the final batch reward

# The flags of the SFT start and of every GRPO run, per size; both arms and every seed share
# them. "full" fits 6 GRPO runs in about 30 minutes on a loaded 2-core machine.
SIZES = {
    "full": {
        "sft": ["--steps", "800"],
        "grpo": [
            "--steps", "60", "--eval-every", "20", "--checkpoint-every", "60",
            "--batch-size", "16", "--eval-samples", "4", "--num-heldout", "300",
        ],
    },
    "smoke": {
        "sft": [
            "--steps", "1", "--eval-every", "1", "--batch-size", "4", "--num-train", "64",
            "--num-heldout", "2",
        ],
        "grpo": [
            "--steps", "2", "--eval-every", "2", "--checkpoint-every", "2", "--batch-size", "2",
            "--group-size", "2", "--max-new-tokens", "4", "--num-train", "64",
            "--num-heldout", "2", "--num-prompts", "64", "--eval-samples", "0",
        ],
    },
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("runs/grpo_routing_replay"))
    p.add_argument("--size", choices=sorted(SIZES), default="full", help="the runs' lengths")
    p.add_argument("--seeds", default=None, help="comma-separated GRPO seeds (default 0,1,2; "
                   "smoke: 0)")  # fmt: skip
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    p.add_argument(
        "--summarize-only", action="store_true", help="read the runs in --out, run nothing"
    )
    return p


def run_all(out: Path, size: str, seeds: list[int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    common = ["--no-progress", "--devices", "1"]
    sft = out / "sft"
    if not (sft / "result.json").exists():
        flags = ["--model-size", "moe", *SIZES[size]["sft"], "--out", str(sft), "--overwrite"]
        run_recipe("sft", [*flags, *common], out / "sft.log")
    for seed in seeds:
        for arm, extra in ARMS.items():
            folder = out / f"{arm}-seed{seed}"
            if not (folder / "result.json").exists():
                flags = ["--model", str(sft / "model"), *SIZES[size]["grpo"], *extra]
                run_recipe("grpo", [*flags, *common, "--seed", str(seed), "--out", str(folder),
                             "--overwrite"], out / f"{arm}-seed{seed}.log")  # fmt: skip


def summarize_run(folder: Path, log: Path) -> dict:
    """The table's figures of one GRPO run folder (its `metrics.jsonl`) and its log."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    accuracy = [r["accuracy"] for r in records if "accuracy" in r]
    mismatch = [r["mismatch_kl"] for r in steps]
    finite = all(
        math.isfinite(r[k]) for r in steps for k in ("loss", "mismatch_kl") if k in r
    )  # fmt: skip
    return {
        "steps": len(steps),
        "reward_first": statistics.fmean(r["reward"] for r in steps[:TAIL]),
        "reward_final": statistics.fmean(r["reward"] for r in steps[-TAIL:]),
        "accuracy_before": accuracy[0],
        "accuracy_after": accuracy[-1],
        "mismatch_kl_mean": statistics.fmean(mismatch),
        "mismatch_kl_max": max(r["mismatch_kl_max"] for r in steps),
        "is_ess_min": min(r["is_ess"] for r in steps),
        "warnings": (log.read_text() if log.exists() else "").count("entropy collapse?"),
        "collapsed": not finite or accuracy[-1] < 0.5 * accuracy[0],
    }


def summarize(out: Path, seeds: list[int]) -> dict:
    """The table of the runs in `out` and the means per arm; returns the JSON summary."""
    rows = []
    for arm in ARMS:
        for seed in seeds:
            folder = out / f"{arm}-seed{seed}"
            if (folder / "metrics.jsonl").exists():
                log = out / f"{arm}-seed{seed}.log"
                rows.append({"arm": arm, "seed": seed, **summarize_run(folder, log)})
    print(f"{'arm':>7} {'seed':>4} {'reward':>15} {'held-out acc':>15} {'mismatch KL':>10} "
          f"{'max':>9} {'min ESS':>8} {'warned':>6} {'collapsed':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['arm']:>7} {r['seed']:>4} "
            f"{r['reward_first']:>6.3f} -> {r['reward_final']:.3f} "
            f"{r['accuracy_before']:>6.3f} -> {r['accuracy_after']:.3f} "
            f"{r['mismatch_kl_mean']:>10.2e} {r['mismatch_kl_max']:>9.2e} "
            f"{r['is_ess_min']:>8.4f} {r['warnings']:>6} {'yes' if r['collapsed'] else 'no':>9}"
        )
    means = {}
    for arm in ARMS:
        ran = [r for r in rows if r["arm"] == arm]
        if ran:
            means[arm] = {
                k: statistics.fmean(r[k] for r in ran)
                for k in ("reward_final", "accuracy_after", "mismatch_kl_mean", "mismatch_kl_max")
            }
            means[arm]["collapsed_runs"] = sum(r["collapsed"] for r in ran)
            m = means[arm]
            print(f"{arm:>7} mean: final reward {m['reward_final']:.3f}, held-out accuracy "
                  f"{m['accuracy_after']:.3f}, mismatch KL {m['mismatch_kl_mean']:.2e} "
                  f"(max {m['mismatch_kl_max']:.2e}), collapsed {m['collapsed_runs']} of "
                  f"{len(ran)}")  # fmt: skip
    return {"benchmark": "grpo_routing_replay", "runs": rows, "means": means}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    default = "0" if args.size == "smoke" else "0,1,2"
    try:
        seeds = [int(s) for s in (args.seeds or default).split(",")]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.summarize_only:
        run_all(args.out, args.size, seeds)
    summary = summarize(args.out, seeds)
    if not summary["runs"]:
        parser.error(f"no runs in {args.out}")
    line = json.dumps(summary)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
