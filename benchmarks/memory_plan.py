r"""The memory plan of the recipes' steps against the memory a real step takes.

    python benchmarks/memory_plan.py                       # sft, dpo and grpo at their defaults
    python benchmarks/memory_plan.py --recipes sft --json-out plan.json   # what the tests run
    python benchmarks/memory_plan.py --variants            # what would make a big step fit

For each recipe, a worker subprocess builds the recipe's run as `--plan` does (its model,
task, state and step, up to its call of `kit.plan.check`) and takes the plan `kit.plan`
makes: the step compiled for the first batch's shapes and never run
(`tunelib.memory.memory_plan`). The plan predicts the step's peak memory per device, and of
it what a step adds to the memory held before it (`step_bytes`: the peak less the state,
frozen weights and compiled-in constants the run holds between steps).

The worker then runs the recipe's own step on the run's own batches, on one CPU device.
Step 1 compiles it (and is reported, compiler memory included, for what it is). Before step
2, Python's garbage is collected and the resident set size is read (`VmRSS` of
`/proc/self/status`); the peak resident set size is then reset (writing 5 to
`/proc/self/clear_refs`) and, after step 2 has finished (`block_until_ready`), read again
(`VmHWM`): the difference is the step's measured peak growth, compared with `step_bytes`.
The worker runs with `MALLOC_MMAP_THRESHOLD_=65536`: glibc then serves every allocation of
64 KiB or more (XLA's buffers) with its own mapping and returns it when it is freed, so the
resident set follows the live buffers rather than what glibc's heap keeps.

DPO and GRPO start from an SFT model: the worker makes a new one of the recipes' `base` size
(untrained; only its shapes matter) and passes it as `--model`. The script prints a table
and writes a JSON result (`--json-out`); nothing is asserted.

`--variants` plans instead one AdamW step of a decoder of SmolLM2-135M's shapes (`--rows`
sequences of `--length` tokens), as it is and with each change that lowers its memory:
remat, the naive head (materialised logits, against the fused head), four micro-batches with
gradient accumulation, LoRA and QLoRA; and the largest batch that fits `--memory` as it is.
Everything is compiled on shape structs: nothing is allocated, nothing runs.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
DEFAULT_RECIPES = ("sft", "dpo", "grpo")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.strip().splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--recipes", default=",".join(DEFAULT_RECIPES), help="comma-separated")
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here")
    p.add_argument(
        "--variants",
        action="store_true",
        help="instead: plans of a SmolLM2-135M-shaped step as it is and with each change",
    )
    p.add_argument("--rows", type=int, default=8, help="--variants: sequences a step")
    p.add_argument("--length", type=int, default=512, help="--variants: tokens a sequence")
    p.add_argument("--memory", default="4GiB", help="--variants: device memory to fit")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def _status() -> dict[str, int]:
    """`VmRSS` and `VmHWM` of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _measured_step(step_fn, state, next_batch) -> tuple[object, int]:
    """Run one step; the new state and the growth of the peak RSS over the RSS before it."""
    import jax

    gc.collect()
    before = _status()["VmRSS"]
    _reset_peak()
    state, metrics = step_fn(state, next_batch())
    jax.block_until_ready((state, metrics))
    return state, _status()["VmHWM"] - before


def worker(recipe: str, model: Path | None) -> dict:
    """Plan the recipe's step as `--plan` does, then measure two real steps."""
    sys.path.insert(0, str(RECIPES))
    import importlib.util

    import jax

    import kit
    from kit import plan

    spec = importlib.util.spec_from_file_location(f"recipe_{recipe}", RECIPES / f"{recipe}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config_type = next(
        v for v in vars(module).values()
        if isinstance(v, type) and getattr(v, "RECIPE", None) == recipe
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        argv = ["--plan", "--no-progress", "--out", str(Path(folder) / "run")]
        argv += ["--model", str(model)] if model is not None else []
        config = kit.config.parse(config_type, argv, description="", prog=f"{recipe}.py")
        started = time.perf_counter()
        planned = module.train(config, plan.PlanFolder(Path(folder) / "run", steps=config.steps))
        if not isinstance(planned, plan.Planned):
            raise SystemExit(f"{recipe}: the recipe returned without planning its step")
        context = planned.context  # the plan with its estimates, as --plan prints it
        step_plan = context.plan_at(planned.plan.batch_size, estimate=True)
        seconds = time.perf_counter() - started
    placed = context.placement

    def next_batch():
        batch = next(context.batches)
        return placed.rows(batch) if placed is not None else batch

    state, first = _measured_step(context.step_fn, context.live_state, next_batch)
    state, second = _measured_step(context.step_fn, state, next_batch)
    del state
    return {
        "recipe": recipe,
        "batch_size": step_plan.batch_size,
        "plan_seconds": round(seconds, 1),
        "parts": {
            name: {
                "peak_bytes": p.peak_bytes + step_plan.held[name],
                **{k: v for k, v in p._asdict().items() if v is not None},
            }
            for name, p in step_plan.plans.items()
        },
        "predicted_peak_bytes": step_plan.peak_bytes,
        "predicted_resident_bytes": step_plan.resident_bytes,
        "predicted_step_bytes": step_plan.step_bytes,
        "measured_step_bytes": second,
        "measured_first_step_bytes": first,
        "error": round(step_plan.step_bytes / second - 1, 4),
        "devices": jax.device_count(),
    }


def new_sft_model(folder: Path) -> Path:
    """A new model of the recipes' `base` size with the character tokenizer, saved."""
    sys.path.insert(0, str(RECIPES))
    from tunelib.data import CharTokenizer

    from kit import models

    model = models.new_model(CharTokenizer(), "base", seed=0)
    models.save_model(folder / "model", model, model.params)
    return folder / "model"


def run_worker(recipe: str, model: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "MALLOC_MMAP_THRESHOLD_": "65536"})
    command = [sys.executable, __file__, "--worker", recipe]
    command += ["--model", str(model)] if model is not None else []
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{recipe} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mib(count: int) -> str:
    return f"{count / 2**20:.2f}"


# A decoder of SmolLM2-135M's shapes (the project's real model), stacked layers.
SMOLLM2 = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "tie_word_embeddings": True, "scan_layers": True,
}  # fmt: skip


def variants(rows: int, length: int, budget: int) -> dict:
    """Plans of one AdamW step of SmolLM2-135M's shapes on `rows` sequences of `length`
    tokens (token-mean NLL from the fused head), as it is and with each change that lowers
    memory, each compiled on shape structs (nothing allocated); and the largest batch that
    fits `budget` bytes as it is."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from tunelib import logprobs, memory, peft
    from tunelib.models import PROJECTION_KERNELS, Decoder, DecoderConfig

    config = DecoderConfig(**SMOLLM2)
    optimizer = optax.adamw(1e-4)

    def shapes(config):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
        return graphdef, nnx.to_pure_dict(state)

    def make_step(graphdef, *, fused=True, accumulate=False):
        def loss_fn(trainable, frozen, batch):
            def run(params):
                model = nnx.merge(graphdef, params)
                hidden = model(batch["tokens"])
                if fused:
                    logps = logprobs.fused_token_logps(
                        hidden, model.unembedding(), batch["targets"]
                    )
                else:  # materialised [B, T, V] logits
                    logps = logprobs.token_logps(model.unembed(hidden), batch["targets"])
                return -logps.mean()

            params = trainable if frozen is None else peft.apply_lora(frozen, trainable)
            return peft.lora(run)(params)

        def step(trainable, opt_state, frozen, batch, accumulated):
            loss, grads = jax.value_and_grad(loss_fn)(trainable, frozen, batch)
            if accumulate:  # the last micro-batch: the sum of the others' gradients, then AdamW
                grads = jax.tree.map(jnp.add, grads, accumulated)
            updates, opt_state = optimizer.update(grads, opt_state, trainable)
            return optax.apply_updates(trainable, updates), opt_state, loss

        return step

    def plan(step, trainable, frozen=None, rows=rows, accumulated=None, estimate=True):
        batch = {k: jax.ShapeDtypeStruct((rows, length), jnp.int32) for k in ("tokens", "targets")}
        opt_state = jax.eval_shape(optimizer.init, trainable)
        return memory.memory_plan(
            step, trainable, opt_state, frozen, batch, accumulated, params=trainable,
            frozen=frozen, opt_state=opt_state, gradients=trainable,
            batch_argnums=(3,) if estimate else (),
        )  # fmt: skip

    graphdef, params = shapes(config)
    remat, _ = shapes(dataclasses.replace(config, remat=True))
    rule = peft.LoraRule(pattern=PROJECTION_KERNELS, rank=16)
    adapters = jax.eval_shape(lambda p: peft.init_lora(p, [rule], key=jax.random.key(0)), params)
    nf4 = jax.eval_shape(lambda p: peft.quantize_params(p, [PROJECTION_KERNELS]), params)
    timed = {}

    def timed_plan(name, *args, **kwargs):
        started = time.perf_counter()
        timed[name] = plan(*args, **kwargs)
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    timed_plan("as is", make_step(graphdef), params)
    timed_plan("remat", make_step(remat), params)
    timed_plan("naive head", make_step(graphdef, fused=False), params)
    timed_plan(
        f"4 micro-batches of {rows // 4}", make_step(graphdef, accumulate=True), params,
        rows=rows // 4, accumulated=params,
    )  # fmt: skip
    timed_plan("LoRA r16", make_step(graphdef), adapters, params)
    timed_plan("QLoRA r16", make_step(graphdef), adapters, nf4)
    found = memory.largest_batch(
        lambda b: plan(make_step(graphdef), params, rows=b, estimate=False),
        device_memory=budget, start=rows,
    )  # fmt: skip
    table = memory.format_plans(timed, device_memory=budget)
    return {
        "model": "SmolLM2-135M shapes",
        "rows": rows,
        "length": length,
        "device_memory": budget,
        "table": table,
        "plans": {name: p._asdict() for name, p in timed.items()},
        "largest_batch": found.size,
        "largest_batch_peak": found.plan.peak_bytes if found.plan is not None else None,
        "batch_sizes_compiled": found.peaks,
    }


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not recipes:
        parser.error("--recipes names no recipe")
    for recipe in recipes:
        if not (RECIPES / f"{recipe}.py").is_file():
            parser.error(f"--recipes: no recipe {recipe!r} in {RECIPES}")
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.model)), flush=True)
        return
    if args.variants:
        sys.path.insert(0, str(RECIPES))
        from kit.config import parse_size

        result = variants(args.rows, args.length, parse_size(args.memory, "--memory"))
        print(result["table"])
        print(
            f"the largest batch that fits as it is: {result['largest_batch']} rows "
            f"({len(result['batch_sizes_compiled'])} batch sizes compiled)"
        )
        line = json.dumps({"benchmark": "memory_plan_variants", **result})
        print(line)
        if args.json_out is not None:
            args.json_out.write_text(line + "\n")
        return
    results = []
    with tempfile.TemporaryDirectory() as folder:
        model = new_sft_model(Path(folder)) if set(recipes) - {"sft"} else None
        for recipe in recipes:
            results.append(run_worker(recipe, None if recipe == "sft" else model))
    header = (
        "| recipe | batch | parts | predicted peak (MiB) | resident (MiB) | predicted step "
        "(MiB) | measured step (MiB) | error | first step, compile included (MiB) |"
    )
    print(header)
    print("|" + "---|" * 9)
    for r in results:
        print(
            f"| {r['recipe']} | {r['batch_size']} | {', '.join(r['parts'])} | "
            f"{mib(r['predicted_peak_bytes'])} | {mib(r['predicted_resident_bytes'])} | "
            f"{mib(r['predicted_step_bytes'])} | {mib(r['measured_step_bytes'])} | "
            f"{100 * r['error']:+.1f} % | {mib(r['measured_first_step_bytes'])} |"
        )
    line = json.dumps({"benchmark": "memory_plan", "results": results})
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")


if __name__ == "__main__":
    main()
