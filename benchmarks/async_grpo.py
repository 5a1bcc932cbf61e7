"""Disaggregated GRPO on two processes: the wall time per step when they take turns
(`--max-staleness 0`, synchronous) against when sampling overlaps training
(`--max-staleness 1`, with its default importance correction and without), on the same two
processes, side by side in one run.

    python benchmarks/async_grpo.py                 # ~6 min on 2 CPU cores
    python benchmarks/async_grpo.py --steps 20 --json-out result.json
    python benchmarks/async_grpo.py --accuracy --sft-steps 1000   # accuracy, 3 seeds, ~40 min
    python benchmarks/async_grpo.py --model-size student --sft-steps 2 --steps 3 \
        --warmup-steps 1 --batch-size 4 --group-size 2 --max-new-tokens 4 \
        --runs staleness_1                                # the tests' smoke run

It trains a start model with `recipes/sft.py` (one process), then runs `recipes/grpo.py`
under `python -m tunelib.launch -n 2` (process 0 trains, process 1 samples, one device each)
with each staleness, and reads each step's time split from the runs' `metrics.jsonl`. A
step's time is its wall time less compilation, evaluation and checkpoints (the median over
the steps after the first `--warmup-steps`); `rollout` on the trainer is the time it waits
for a batch, `sync` the exchange of the batch and the weights. The weight push's bytes per
second is the median of what the runs log, `staleness` the largest any measured step had.
Prints a table and one JSON line (`--json-out` writes it to a file too).

With `--accuracy`, each seed trains its SFT model (`--sft-steps`) and then GRPO with each
staleness for `--accuracy-steps` steps of 32 prompts x 8 samples (held-out greedy accuracy
on 300 problems before and after), on the built-in task.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from kit.models import MODEL_SIZES

ROOT = Path(__file__).resolve().parents[1]
EXCLUDED = ("compile", "eval", "checkpoint")
# Each process of the launcher on a core of its own (`--pin`): the roles' own devices, as
# separate accelerators would be, instead of two processes sharing every core.
PINNED = """
import os, runpy, sys
os.sched_setaffinity(0, {int(os.environ["TUNELIB_PROCESS_ID"]) % os.cpu_count()})
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"failed: {' '.join(command)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def step_times(folder: Path, skip: int) -> dict:
    """The median seconds per phase and per step (less `EXCLUDED`) after `skip` steps."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > skip]
    phases = sorted({k[5:] for r in steps for k in r if k.startswith("time_")} - set(EXCLUDED))
    out = {p: statistics.median(r.get(f"time_{p}", 0.0) for r in steps) for p in phases}
    out["step"] = statistics.median(sum(r.get(f"time_{p}", 0.0) for p in phases) for r in steps)
    out["weight_push_mb_per_s"] = statistics.median(r["weight_push_mb_per_s"] for r in steps)
    out["staleness"] = max(r["staleness"] for r in steps)
    return out


def accuracy(args, tmp: Path) -> dict:
    """Held-out accuracy after GRPO with staleness 0 and 1, per seed."""
    out = {}
    for seed in args.seeds:
        sft = tmp / f"sft-{seed}"
        _run([
            sys.executable, str(ROOT / "recipes/sft.py"), "--seed", str(seed), "--steps",
            str(args.sft_steps), "--model-size", args.model_size, "--no-progress", "--no-plots",
            "--devices", "1", "--out", str(sft),
        ])  # fmt: skip
        for staleness in (0, 1):
            run = tmp / f"grpo-{seed}-s{staleness}"
            _run([
                sys.executable, "-m", "tunelib.launch", "-n", "2", "--devices-per-process", "1",
                str(ROOT / "recipes/grpo.py"), "--model", str(sft / "model"), "--no-progress",
                "--no-plots", "--seed", str(seed), "--steps", str(args.accuracy_steps),
                "--batch-size", "32", "--eval-every", "1000", "--eval-samples", "0",
                "--max-staleness", str(staleness), "--out", str(run),
            ])  # fmt: skip
            result = json.loads((run / "result.json").read_text())
            out[f"seed_{seed}_staleness_{staleness}"] = {
                k: result[k] for k in ("accuracy_before", "accuracy_after", "seconds")
            }
            print(seed, staleness, out[f"seed_{seed}_staleness_{staleness}"], flush=True)
    return out


# Each run: (--max-staleness, --is-correction).
RUNS = {"staleness_0": (0, "auto"), "staleness_1": (1, "auto"), "staleness_1_no_is": (1, "none")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument(
        "--warmup-steps", type=int, default=3, help="first steps left out of the medians"
    )
    parser.add_argument(
        "--model-size", choices=sorted(MODEL_SIZES), default="base",
        help="the recipes' model that SFT trains first",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--accuracy", action="store_true", help="held-out accuracy per seed")
    parser.add_argument(
        "--pin", action=argparse.BooleanOptionalAction, default=True,
        help="each process on a core of its own (default; --no-pin shares every core)",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--accuracy-steps", type=int, default=60)
    parser.add_argument(
        "--runs", default=",".join(RUNS),
        help="comma-separated runs to time (staleness_0 always runs: the ratios' baseline)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    chosen = ["staleness_0", *(r for r in args.runs.split(",") if r != "staleness_0")]
    if unknown := [r for r in chosen if r not in RUNS]:
        parser.error(f"--runs: no run {unknown[0]!r}; choose from {', '.join(RUNS)}")
    if not 0 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps must lie in [0, --steps), got {args.warmup_steps}")
    if args.accuracy:
        with tempfile.TemporaryDirectory() as tmp:
            results = accuracy(args, Path(tmp))
        if args.json_out:
            args.json_out.write_text(json.dumps(results, indent=2))
        return
    with tempfile.TemporaryDirectory() as tmp:
        sft = Path(tmp) / "sft"
        _run([sys.executable, str(ROOT / "recipes/sft.py"), "--steps", str(args.sft_steps),
              "--model-size", args.model_size, "--no-progress", "--no-plots", "--devices", "1",
              "--out", str(sft)])  # fmt: skip
        results = {}
        runs = {name: RUNS[name] for name in chosen}
        pinned = Path(tmp) / "pinned.py"
        pinned.write_text(PINNED)
        for name, (staleness, correction) in runs.items():
            out = Path(tmp) / name
            _run([
                sys.executable, "-m", "tunelib.launch", "-n", "2", "--devices-per-process", "1",
                *([str(pinned)] if args.pin else []), str(ROOT / "recipes/grpo.py"),
                "--model", str(sft / "model"), "--no-progress", "--no-plots",
                "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                "--group-size", str(args.group_size), "--max-new-tokens",
                str(args.max_new_tokens), "--eval-every", "1000", "--checkpoint-every", "1000",
                "--eval-samples", "0", "--max-staleness", str(staleness),
                "--is-correction", correction,
                "--out", str(out),
            ])  # fmt: skip
            results[name] = step_times(out, skip=args.warmup_steps)
    for name in [r for r in runs if r != "staleness_0"]:
        results[f"speedup_{name}"] = results["staleness_0"]["step"] / results[name]["step"]
    print(f"{'':<18}{'s/step':>9}{'rollout':>9}{'train':>9}{'logprobs':>9}{'sync':>9}{'MB/s':>9}")
    for name in runs:
        r = results[name]
        print(f"{name:<18}{r['step']:>9.3f}{r.get('rollout', 0):>9.3f}{r.get('train', 0):>9.3f}"
              f"{r.get('logprobs', 0):>9.3f}{r.get('sync', 0):>9.3f}"
              f"{r['weight_push_mb_per_s']:>9.2f}")  # fmt: skip
    for name in [r for r in runs if r != "staleness_0"]:
        print(f"{name} / staleness_0 speed: {results[f'speedup_{name}']:.2f}x")
    line = json.dumps({"benchmark": "async_grpo", **results})
    print(line)
    if args.json_out:
        args.json_out.write_text(line + "\n")


if __name__ == "__main__":
    main()
