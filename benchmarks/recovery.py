r"""Fast recovery: the time a run takes to come back after a kill, with and without JAX's
persistent compilation cache, and the step-time cost of a checkpoint, synchronous against
asynchronous.

    python benchmarks/recovery.py                  # SFT and GRPO, about 10 min on 2 cores
    python benchmarks/recovery.py --size smoke     # SFT alone, its smallest settings
    python benchmarks/recovery.py --size smollm2   # QLoRA SFT of SmolLM2-135M (recipes/smollm2)

Recovery, per recipe: a run (`--checkpoint-every` steps, the default asynchronous
checkpoints and compilation cache in its folder) is killed with SIGKILL once it has logged
`--kill-at` steps; copies of its folder are then restarted with the command a scheduler
reruns, `--resume auto`, once as it is (the cache the first start wrote) and once with
`--compile-cache none`, in alternating rounds. Recovery is the time from the process's
start to its first completed step after the checkpoint it resumed from (the step's line in
`metrics.jsonl`): start-up, restore, compilation (or loading it) and that step.

Checkpoint cost, per recipe: two runs of the killed run's settings (and its compilation
cache) with a checkpoint every `--cost-every` steps, synchronous (`--sync-checkpoints`) and
asynchronous (the default). A step's time is the sum of its phases (`kit.goodput`,
compilation left out; the first step and the last, which evaluates, left out); a
checkpoint's cost is the median over its checkpoints of the time of the step that saves and
of the `--cost-every` - 1 steps after it (which an asynchronous write overlaps), less as
many plain steps (the median of the synchronous run's steps that save nothing).

Prints a table and ends with one JSON line (also written to `--json-out`).
"""

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
# The recipes' small task, one device, no progress bar, no plots: what every run here shares.
COMMON = [
    "--num-train", "256", "--num-heldout", "32", "--batch-size", "8", "--no-progress",
    "--no-plots", "--devices", "1", "--eval-every", "100000",
]  # fmt: skip
RUNS = {  # name: the recipe's script and its flags
    "sft": ("sft", ["--model-size", "student"]),
    "grpo": ("grpo", ["--group-size", "4", "--max-new-tokens", "6", "--eval-samples", "0"]),
    # The real model as the README trains it: QLoRA on SmolLM2-135M's own Q4_1 blocks.
    "sft-smollm2": ("sft", ["--config", str(RECIPES / "smollm2" / "sft.toml")]),
}
SIZES = {  # runs, steps of every run, kill after, rounds, whether checkpoints are costed
    "smoke": {"recipes": ("sft",), "steps": 60, "kill_at": 3, "repeats": 1, "cost": True},
    "full": {"recipes": ("sft", "grpo"), "steps": 400, "kill_at": 6, "repeats": 3, "cost": True},
    "smollm2": {"recipes": ("sft-smollm2",), "steps": 40, "kill_at": 3, "repeats": 2,
                "cost": False},
}  # fmt: skip
POLL_SECONDS = 0.02


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", choices=tuple(SIZES), default="full")
    p.add_argument("--out", type=Path, default=None, help="where the runs go (default: temp)")
    p.add_argument("--checkpoint-every", type=int, default=2, help="of the killed run")
    p.add_argument("--cost-every", type=int, default=25, help="steps between checkpoints")
    p.add_argument("--json-out", type=Path, default=None)
    return p


def command(recipe: str, out: Path, *flags: str) -> list[str]:
    script, own = RUNS[recipe]
    return [sys.executable, str(RECIPES / f"{script}.py"), *own, *COMMON, "--out", str(out), *flags]


def records(folder: Path) -> list[dict]:
    """The complete lines of a run's `metrics.jsonl` (one cut short by a kill left out)."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # the text after the last newline: cut short
    return [json.loads(line) for line in lines if line.strip()]


def run_until(cmd: list[str], folder: Path, step: int, log: Path) -> float:
    """Start `cmd`, kill it (SIGKILL) once `folder` logged a step >= `step` and holds a
    complete checkpoint; the seconds from its start to then."""
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            while not (any(r["step"] >= step for r in records(folder)) and saved(folder)):
                if proc.poll() is not None:
                    raise SystemExit(f"recovery.py: the run ended first (exit {proc.returncode})")
                time.sleep(POLL_SECONDS)
            return time.perf_counter() - started
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


def run(cmd: list[str], log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"recovery.py: a run failed (exit {done.returncode}); see {log}")


def saved(folder: Path) -> list[int]:
    """The steps of the complete checkpoints in a run folder."""
    checkpoints = folder / "checkpoints"
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


def recovery(recipe: str, root: Path, size: dict, steps: list[str], every: int) -> dict:
    """Kill a run, then time `--resume auto` of it as it was left, with and without the
    cache."""
    killed = root / "killed"
    steps = [*steps, "--checkpoint-every", str(every)]
    run_until(command(recipe, killed, *steps), killed, size["kill_at"], root / "killed.log")
    step = saved(killed)[-1]
    kept = [r for r in records(killed) if r["step"] <= step]  # what a resume keeps
    (killed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    # Every restart starts from this state of the folder, in its place: the cache's keys
    # hold its folder's path (XLA's GPU autotuning cache lives in it), so a copy elsewhere
    # would compile again.
    pristine = root / "killed-as-left"
    shutil.copytree(killed, pristine)
    seconds = {"cache": [], "no_cache": []}
    for round_ in range(size["repeats"]):
        for variant in seconds:
            shutil.rmtree(killed)
            shutil.copytree(pristine, killed)
            off = ["--compile-cache", "none"] if variant == "no_cache" else []
            cmd = command(recipe, killed, *steps, "--resume", "auto", *off)
            log = root / f"{variant}-{round_}.log"
            seconds[variant].append(run_until(cmd, killed, step + 1, log))
    cache, no_cache = (statistics.median(seconds[v]) for v in ("cache", "no_cache"))
    return {
        "cache_entries": len(list((pristine / "compile_cache").iterdir())),
        "resumed_from": step,
        "recovery_cache_s": round(cache, 2),
        "recovery_no_cache_s": round(no_cache, 2),
        "cache_over_no_cache": round(cache / no_cache, 3),
        "rounds": {v: [round(s, 2) for s in seconds[v]] for v in seconds},
    }


def step_times(folder: Path) -> list[tuple[int, float]]:
    """Each step of a run and its time (its phases summed, compilation left out), the first
    step and the last (which evaluates) left out."""
    steps = [r for r in records(folder) if r["step"] > 0][1:-1]
    return [
        (r["step"], sum(v for k, v in r.items() if k.startswith("time_") and k != "time_compile"))
        for r in steps
    ]


def checkpoint_cost(recipe: str, root: Path, steps: list[str], cache: Path, every: int) -> dict:
    """Runs with a checkpoint every `every` steps, synchronous and asynchronous, with the
    killed run's settings and its compilation cache; the cost of a checkpoint in each."""
    shared = [*steps, "--compile-cache", str(cache), "--checkpoint-every", str(every)]
    arms = {"sync": ["--sync-checkpoints"], "async": []}
    for arm, extra in arms.items():
        run(command(recipe, root / arm, *shared, *extra), root / f"{arm}.log")
    return costs(root, every)


def costs(root: Path, every: int) -> dict:
    """The cost of a checkpoint in the runs `root/sync` and `root/async`: the median, over
    the checkpoints, of the time of the step that saves and the `every - 1` after it (which
    an asynchronous write overlaps), less `every` plain steps; a plain step's time is the
    median of the synchronous run's steps that save nothing (nor is anything written in the
    background during them). Medians, since a step of a few milliseconds on a shared machine
    is now and then many times longer."""
    times = {arm: dict(step_times(root / arm)) for arm in ("sync", "async")}
    plain = statistics.median(t for step, t in times["sync"].items() if step % every)
    cost = {}
    for arm, steps in times.items():
        periods = [
            sum(steps[s + i] for i in range(every))
            for s in steps
            if s % every == 0 and all(s + i in steps for i in range(every))
        ]
        cost[arm] = statistics.median(periods) - every * plain
    return {
        "step_s": round(plain, 4),
        "checkpoint_cost_sync_s": round(cost["sync"], 4),
        "checkpoint_cost_async_s": round(cost["async"], 4),
        "checkpoint_every": every,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("checkpoint_every", "cost_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    size = SIZES[args.size]
    root = args.out or Path(tempfile.mkdtemp(prefix="recovery-"))
    root.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "recovery", "size": args.size}
    start = root / "start"  # GRPO's start model: a short SFT run
    if "grpo" in size["recipes"]:
        run(command("sft", start, "--steps", "4"), root / "start.log")
    for recipe in size["recipes"]:
        folder = root / recipe
        folder.mkdir(exist_ok=True)
        steps = ["--steps", str(size["steps"])]
        steps += ["--model", str(start)] if recipe == "grpo" else []
        (folder / "recovery").mkdir(exist_ok=True)
        result[recipe] = recovery(recipe, folder / "recovery", size, steps, args.checkpoint_every)
        if size["cost"]:
            (folder / "cost").mkdir(exist_ok=True)
            cache = folder / "recovery" / "killed" / "compile_cache"  # the same programs
            result[recipe].update(
                checkpoint_cost(recipe, folder / "cost", steps, cache, args.cost_every)
            )
    print(table(result, size["recipes"]))
    if args.out is None:
        shutil.rmtree(root, ignore_errors=True)
    line = json.dumps(result)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print(line)
    return result


def table(result: dict, recipes: tuple[str, ...]) -> str:
    rows = [
        "| recipe | recovery, cache (s) | recovery, no cache (s) | ratio | step (s) | "
        "checkpoint cost, sync (s) | checkpoint cost, async (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for recipe in recipes:
        r = result[recipe]
        figures = [
            r.get(k, "-") for k in ("step_s", "checkpoint_cost_sync_s", "checkpoint_cost_async_s")
        ]
        rows.append(
            f"| {recipe} | {r['recovery_cache_s']} | {r['recovery_no_cache_s']} | "
            f"{r['cache_over_no_cache']} | {' | '.join(map(str, figures))} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
