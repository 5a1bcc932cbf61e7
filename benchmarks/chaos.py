"""Chaos: SFT and asynchronous GRPO on 2 processes under `python -m tunelib.launch
--max-restarts`, with faults of every kind injected (`TUNELIB_FAULTS`), recovering with no
one involved; each against the same run uninterrupted.

    python benchmarks/chaos.py                  # SFT and GRPO, ~15 min on 2 busy CPU cores
    python benchmarks/chaos.py --compile-cache both   # and again without the cache: ~30 min
    python benchmarks/chaos.py --size smoke     # SFT killed mid-checkpoint: the tests' run

For each recipe it runs the recipe uninterrupted on 2 processes of 2 devices (GRPO: process
0 trains, process 1 samples, `recipes/grpo_async.py`, taking turns: `--max-staleness 0`,
with a weight push every step), then the same command with `--resume auto` under the
supervisor with the faults below, and reports: the faults that
fired, the restarts, MTTR (mean, max), MTTI, badput by cause, goodput and capacity-aware
goodput (the run's `result.json`, `kit.recovery`), and how the final weights compare with
the uninterrupted run's: bit for bit when the process count never changed, within 1e-6
(absolute, 1e-5 relative) when it did (the `lose` fault: the run goes on with 1 process
and grows back to 2). GRPO starts from the uninterrupted SFT run's model. Prints a table
and one JSON line (`--json-out` writes it to a file too).

`--compile-cache run` (the default) lets every run keep JAX's compilation cache beside it, as
the recipes do by default, so a restart loads its programs instead of compiling them;
`none` passes the recipes `--compile-cache none`; `both` runs the faults twice, with and
without, and reports the ratio of their MTTRs (`recovery_with_cache_over_without`).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SMALL = ["--num-train", "128", "--num-heldout", "12", "--batch-size", "8", "--no-progress",
         "--no-plots", "--model-size", "student"]  # fmt: skip
GRPO = ["--num-prompts", "64", "--steps", "10", "--checkpoint-every", "2", "--eval-every", "10",
        "--group-size", "4", "--max-new-tokens", "6", "--eval-samples", "0",
        "--max-staleness", "0", "--num-heldout", "12", "--batch-size", "8",
        "--no-progress", "--no-plots"]  # fmt: skip
SIZES = {
    "smoke": {
        "sft": {
            "args": [*SMALL, "--steps", "12", "--checkpoint-every", "4", "--eval-every", "12"],
            "faults": "kill@checkpoint,step=8,rank=1",
        },
    },
    "full": {
        "sft": {
            "args": [*SMALL, "--steps", "40", "--checkpoint-every", "5", "--eval-every", "40"],
            "faults": (
                "kill@step=7,rank=1; kill@checkpoint,step=15,rank=1; hang@step=18; "
                "raise@step=22,rank=1; raise@random=0.04,seed=3,rank=0; "
                "lose@step=30,rank=1,back=20"
            ),
        },
        "grpo": {
            "args": GRPO,
            "faults": "kill@push,step=3,rank=0; kill@step=5,rank=1; hang@step=7; "
            "raise@step=8,rank=1",
        },
    },
}
RECIPES = {"sft": "sft.py", "grpo": "grpo_async.py"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--hang-timeout", type=float, default=30.0,
                        help="the supervisor's: longer than any step, its evaluation and "
                             "compilation included, on this machine")  # fmt: skip
    parser.add_argument("--grace", type=float, default=2.0)
    parser.add_argument("--compile-cache", choices=("run", "none", "both"), default="run",
                        help="the restarted runs' compilation cache: each run's own (the "
                             "recipes' default), none, or both in turn")  # fmt: skip
    parser.add_argument("--json-out", type=Path, default=None)
    return parser


def launch(recipe: str, args: list[str], out: Path, *, faults: str | None, flags) -> str:
    """The recipe on 2 processes of 2 devices, supervised with `faults` (None: plainly)."""
    env = {k: v for k, v in os.environ.items() if k != "TUNELIB_FAULTS"}
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f
    )
    command = [sys.executable, "-m", "tunelib.launch", "-n", "2", "--devices-per-process", "2",
               "--grace", str(flags.grace)]  # fmt: skip
    if faults is not None:
        env["TUNELIB_FAULTS"] = faults
        command += ["--max-restarts", "10", "--hang-timeout", str(flags.hang_timeout),
                    "--min-processes", "1"]  # fmt: skip
    command += [str(ROOT / "recipes" / RECIPES[recipe]), *args, "--out", str(out)]
    if faults is not None:
        command += ["--resume", "auto"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.exit(f"failed: {' '.join(command)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stderr


def weights(folder: Path) -> list:
    """The saved model's weights on this process's first device."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    path = (folder / "model" / "params").resolve()
    with ocp.StandardCheckpointer() as checkpointer:
        shapes = checkpointer.metadata(path).item_metadata
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here),
                              shapes)  # fmt: skip
        return [np.asarray(x) for x in jax.tree.leaves(checkpointer.restore(path, target))]


def compare(chaos: Path, calm: Path, *, exact: bool) -> dict:
    import numpy as np

    pairs = list(zip(weights(chaos), weights(calm), strict=True))
    diff = max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in pairs)
    equal = all(np.array_equal(a, b) for a, b in pairs)
    close = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)
    return {"bit_for_bit": equal, "max_abs_diff": diff, "ok": equal if exact else close}


def scenario(recipe: str, spec: dict, tmp: Path, flags, start: list[str], cache: str) -> dict:
    """The recipe under its faults, with the compilation cache `cache` ("run" or "none"),
    against its uninterrupted run (made by the first scenario of the recipe)."""
    calm, chaos = tmp / f"{recipe}-calm", tmp / f"{recipe}-chaos-{cache}"
    args = [*spec["args"], *start]
    if not (calm / "result.json").exists():
        launch(recipe, args, calm, faults=None, flags=flags)
    uncached = ["--compile-cache", "none"] if cache == "none" else []
    log = launch(recipe, [*args, *uncached], chaos, faults=spec["faults"], flags=flags)
    events = [json.loads(line) for line in (chaos / "supervisor.jsonl").read_text().splitlines()]
    fired = [json.loads(line) for line in (chaos / "faults.jsonl").read_text().splitlines()]
    counts = {e["processes"] for e in events if e["event"] == "start"}
    result = json.loads((chaos / "result.json").read_text())
    recovery = result["recovery"]
    return {
        "compile_cache": cache,
        "faults": spec["faults"],
        "fired": [f"{f['action']}@{f['where']} step {f['step']} rank {f['rank']}" for f in fired],
        "restarts": sum(e["event"] == "restart" for e in events),
        "causes": [e["cause"] for e in events if e["event"] == "restart"],
        "process_counts": sorted(counts),
        **recovery,
        "weights": compare(chaos, calm, exact=counts == {2}),
        "restart_lines": [line for line in log.splitlines() if ": restart" in line],
    }


def table(results: dict) -> str:
    rows = ["| run | faults fired | restarts | MTTR mean / max (s) | MTTI (s) | badput: lost "
            "work / detection / restart / restore / recompile (s) | goodput | capacity "
            "goodput | final weights |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for recipe, r in results.items():
        b = r["badput_seconds"]
        weights = ("bit for bit" if r["weights"]["bit_for_bit"]
                   else f"max diff {r['weights']['max_abs_diff']:.1e}")  # fmt: skip
        rows.append(
            f"| {recipe} | {len(r['fired'])} | {r['restarts']} | {r['mttr_seconds']['mean']} / "
            f"{r['mttr_seconds']['max']} | {r['mtti_seconds']} | {b['lost_work']} / "
            f"{b['detection']} / {b['restart']} / {b['restore']} / {b['recompile']} | "
            f"{r['goodput']} | {r['capacity_goodput']} | {weights} |"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    flags = _parser().parse_args(argv)
    if not flags.hang_timeout > 0:
        _parser().error(f"--hang-timeout must be > 0, got {flags.hang_timeout}")
    caches = ("run", "none") if flags.compile_cache == "both" else (flags.compile_cache,)
    results, ratios = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for recipe, spec in SIZES[flags.size].items():
            start = ["--model", str(tmp / "sft-calm" / "model")] if recipe == "grpo" else []
            for cache in caches:
                name = recipe if cache == caches[0] else f"{recipe} (no cache)"
                results[name] = scenario(recipe, spec, tmp, flags, start, cache)
            if len(caches) == 2:
                with_cache, without = (results[n]["mttr_seconds"]["mean"]
                                       for n in (recipe, f"{recipe} (no cache)"))  # fmt: skip
                ratios[recipe] = round(with_cache / without, 3) if without else None
    print(table(results))
    for recipe, ratio in ratios.items():
        print(f"{recipe}: MTTR with the compilation cache / without: {ratio}")
    out = {"benchmark": "chaos", "size": flags.size, "hang_timeout": flags.hang_timeout,
           "compile_cache": flags.compile_cache, **results}  # fmt: skip
    if ratios:
        out["recovery_with_cache_over_without"] = ratios
    line = json.dumps(out)
    if flags.json_out is not None:
        flags.json_out.write_text(line)
    print(line)
    if not all(r["weights"]["ok"] for r in results.values()):
        sys.exit("the final weights differ from the uninterrupted run's")


if __name__ == "__main__":
    main()
