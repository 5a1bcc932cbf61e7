"""How much of a model an update changes: the share of elements whose bits differ after each
step of a recipe, as trained (float32) and as a bfloat16 copy would hold them, and what a
delta push (`tunelib.rollout.weight_delta`) would send against the whole weights.

    python benchmarks/weight_delta.py                          # the toy SFT, full and LoRA
    python benchmarks/weight_delta.py --recipes sft --steps 3  # seconds: what the tests run
    python benchmarks/weight_delta.py --recipes sft-smollm2    # SmolLM2's QLoRA SFT (TOML)

Each recipe is set up as `--plan` sets it up (`kit.plan`: its model, task, optimizer and
jitted step, never run), then its step runs `--steps` times from the start state on the
recipe's own batches. The run is given `--run-steps` steps in all, so that its learning-rate
warm-up (5 % of the steps) is the first step, which is not measured: the steps measured are
at about the recipe's peak learning rate. After each step the trainable parameters (the
whole model, or the adapters with LoRA: what a disaggregated run pushes) are compared with
the step's before, as float32 bits and rounded to bfloat16; a delta's bytes are its int32
positions and its values. Encoding (`weight_delta`) and applying (`apply_weight_delta`, with its
fingerprint check) are timed on the host. Prints a table and one JSON line (`--json-out`
writes it to a file too).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _measure import print_result  # beside this script, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

RECIPES = {  # name: the recipe's script and its flags
    "sft": ("sft", ["--batch-size", "16"]),
    "sft-lora": ("sft", ["--batch-size", "16", "--lora-rank", "8"]),
    "sft-smollm2": ("sft", ["--config", str(ROOT / "recipes" / "smollm2" / "sft.toml")]),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--recipes", default="sft,sft-lora", help=", ".join(RECIPES))
    p.add_argument("--steps", type=int, default=8, help="steps measured")
    p.add_argument("--run-steps", type=int, default=20, help="the run's --steps (its schedule)")
    p.add_argument(
        "--learning-rates", default=None,
        help="comma-separated: each recipe at each of these instead of its own",
    )  # fmt: skip
    p.add_argument("--json-out", type=Path, default=None)
    return p


def _recipe(script: str):
    """The recipe script as a module, and its configuration class."""
    import importlib.util

    path = ROOT / "recipes" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{script}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config_type = next(
        v for v in vars(module).values()
        if isinstance(v, type) and getattr(v, "RECIPE", None) == script
    )  # fmt: skip
    return module, config_type


def _median(values) -> float:
    return float(statistics.median(values))


def measure(name: str, steps: int, run_steps: int, learning_rate: float | None = None) -> dict:
    """Run the recipe's step `steps` times; after each, compare its trainable parameters."""
    import jax
    import ml_dtypes
    import numpy as np

    from tunelib.rollout import apply_weight_delta, weight_delta

    import kit
    from kit import plan

    script, flags = RECIPES[name]
    if learning_rate is not None:
        flags = [*flags, "--learning-rate", str(learning_rate)]
    module, config_type = _recipe(script)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run"
        argv = [*flags, "--plan", "--no-progress", "--steps", str(run_steps), "--out", str(out)]
        config = kit.config.parse(config_type, argv, description="", prog=f"{script}.py")
        planned = module.train(config, plan.PlanFolder(out, steps=config.steps))
    context = planned.context
    placed, state = context.placement, context.live_state

    def host(params):
        return [np.asarray(x) for x in jax.tree.leaves(params)]

    def step(state):
        batch = next(context.batches)
        return context.step_fn(state, placed.rows(batch) if placed is not None else batch)[0]

    # The warm-up step (its learning rate is 0), and deltas to compile the fingerprints.
    state = step(state)
    before = host(state["params"])
    for tree in (before, [x.astype(ml_dtypes.bfloat16) for x in before]):
        apply_weight_delta(tree, weight_delta(tree, tree))
    rows = []
    for _ in range(steps):
        state = step(state)
        after = host(state["params"])
        row = {}
        for kind, cast in (("f32", None), ("bf16", ml_dtypes.bfloat16)):
            old = before if cast is None else [x.astype(cast) for x in before]
            new = after if cast is None else [x.astype(cast) for x in after]
            started = time.perf_counter()
            delta = weight_delta(old, new)
            encoded = time.perf_counter()
            apply_weight_delta(old, delta)
            applied = time.perf_counter()
            full = sum(x.nbytes for x in new)
            row |= {
                f"{kind}_changed": delta.changed / sum(x.size for x in new),
                f"{kind}_delta_bytes": delta.nbytes,
                f"{kind}_full_bytes": full,
                f"{kind}_delta_over_full": delta.nbytes / full,
                f"{kind}_encode_ms": 1e3 * (encoded - started),
                f"{kind}_apply_ms": 1e3 * (applied - encoded),
            }
        rows.append(row)
        before = after
    result = {
        "recipe": name,
        "flags": flags,
        "run_steps": run_steps,
        "learning_rate": config.learning_rate,
        "params": sum(x.size for x in before),
        "steps": rows,
    }
    for key in rows[0]:
        result[f"{key}_median"] = _median(r[key] for r in rows)
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = [n for n in args.recipes.split(",") if n]
    unknown = [n for n in names if n not in RECIPES]
    if not names or unknown:
        build_parser().error(f"--recipes: no recipe {unknown[0]!r} in {sorted(RECIPES)}"
                             if unknown else "--recipes names no recipe")  # fmt: skip
    if args.steps < 1 or args.run_steps < args.steps + 1:
        build_parser().error("--steps must be >= 1 and --run-steps > --steps (a warm-up step)")
    rates = [None]
    if args.learning_rates:
        try:
            rates = [float(x) for x in args.learning_rates.split(",") if x]
        except ValueError:
            build_parser().error(f"--learning-rates: not numbers: {args.learning_rates!r}")
    results = [measure(n, args.steps, args.run_steps, lr) for n in names for lr in rates]
    print(f"{'recipe':12s} {'lr':>8s} {'params':>10s} {'f32 changed':>12s} {'bf16 changed':>13s} "
          f"{'bf16 delta/full':>16s} {'encode ms':>10s} {'apply ms':>9s}")  # fmt: skip
    for r in results:
        print(f"{r['recipe']:12s} {r['learning_rate']:>8.0e} {r['params']:>10,d} "
              f"{r['f32_changed_median']:>11.2%} "
              f"{r['bf16_changed_median']:>12.2%} {r['bf16_delta_over_full_median']:>15.3f} "
              f"{r['bf16_encode_ms_median']:>10.1f} {r['bf16_apply_ms_median']:>9.1f}")  # fmt: skip
    print_result({"benchmark": "weight_delta", "results": results}, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
