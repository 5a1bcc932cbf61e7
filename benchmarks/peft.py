r"""Side by side: a full fine-tune step, LoRA and QLoRA steps, and their naive versions.

    python benchmarks/peft.py                  # the `cpu` size: memory and time
    python benchmarks/peft.py --size smoke --measure full,qlora   # what the tests run
    python benchmarks/peft.py --size llama-1b  # memory of a Llama-3.2-1B-shaped decoder only

Every variant takes one AdamW step on the token-mean NLL of a batch through the reference
decoder (`tunelib.models.Decoder`) and the fused log-prob head:

- ``full``: every weight trains (float32 weights, AdamW state for all of them);
- ``lora_merged`` (naive LoRA): adapters of rank `--rank` on every attention and MLP
  projection, applied by forming $W + s\,AB$ inside the step (`merge_lora`, differentiated);
- ``lora``: the same adapters through `tunelib.peft.lora`: $xW + s\,(xA)B$, nothing formed;
- ``qlora_dequantized`` (naive QLoRA): the projections stored in NF4 with double
  quantisation, the whole model dequantised at the start of the step, then as ``lora_merged``;
- ``qlora``: the NF4 base through `tunelib.peft.lora`: each layer's product dequantises under
  a custom VJP that saves only the codes.

The parent process only orchestrates; each variant is measured in a fresh worker subprocess
(`--variant X --size S --json-out FILE`). First the loss and adapter gradients of every LoRA
variant and of its naive twin (one worker, `--check`) are compared with a float64 reference
on the same inputs (one more worker, `--check --float64`: the merged weights formed in
float64, the model run in float64): the loss's relative error and the gradients'
$\max|g - g_{ref}| / \max|g_{ref}|$ over all adapters. A variant passes when its error is at
most twice its naive twin's plus `TOLERANCE` (float32 rounding alone reaches about 1e-3 of the
largest entry at the `cpu` size). Then each variant is measured:
`memory_analysis()` of the compiled step (temporary, argument and output bytes), the bytes of
its stored parameters and of its optimizer state (counted from the arrays), the worker's peak
RSS, and the median wall time of `--repeats` steps after a warm-up (sizes that `run` only).

Stored parameters are reported against the same model in bfloat16: the NF4 base with the
embedding and norms left in bfloat16 (as QLoRA and bitsandbytes do), and with the embedding
quantised too (`qlora_bits` counts both). The script prints a table and ends with one JSON
line; ratios are reported, never asserted.
"""

import argparse
import functools
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tunelib import logprobs, losses, peft
from tunelib.models import PROJECTION_KERNELS, Decoder, DecoderConfig

from _measure import peak_rss_bytes, ratio, relative_error, step_memory, step_seconds, worker_result


class Size(NamedTuple):
    config: dict
    batch: int
    tokens: int
    run: bool  # False: compile only (memory); the weights are never allocated


def _decoder(hidden, mlp, layers, heads, kv_heads, vocab):
    # Layers scanned and rematerialised, as a model of some size is trained: activations stay
    # small and each layer's dequantised weights exist only inside its step of the scan.
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        tie_word_embeddings=True,
        scan_layers=True,
        remat=True,
    )


SIZES = {
    # Every projection of the smoke size is [64, 64] (MLP width = hidden, K = N heads), so
    # quantising them compiles NF4's steps for one shape only.
    "smoke": Size(_decoder(64, 64, 2, 2, 2, 64), batch=2, tokens=8, run=True),
    "cpu": Size(_decoder(512, 1536, 4, 8, 4, 8192), batch=8, tokens=128, run=True),
    "llama-1b": Size(_decoder(2048, 8192, 16, 32, 8, 128_256), batch=4, tokens=1024, run=False),
}
VARIANTS = ("full", "lora_merged", "lora", "qlora_dequantized", "qlora")
NAIVE_TWIN = {"lora": "lora_merged", "qlora": "qlora_dequantized"}
TOLERANCE = 1e-5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--size", choices=sorted(SIZES), default="cpu")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="timed steps after one warm-up")
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    p.add_argument(
        "--measure", default=",".join(VARIANTS),
        help="comma-separated variants to measure (the check covers every LoRA variant)",
    )  # fmt: skip
    worker = p.add_argument_group("worker mode (started by the parent)")
    worker.add_argument("--variant", choices=VARIANTS, default=None, help="measure it")
    worker.add_argument(
        "--check", action="store_true", help="every LoRA variant's loss and gradients, no timing"
    )
    worker.add_argument(
        "--float64", action="store_true", help="with --check: the references, in float64"
    )
    return p


# ----------------------------------------------------------------------------- one variant


def setup(size: Size, variant: str, rank: int):
    """`(step, trainable, frozen, batch)`; abstract shapes for sizes that are not run."""
    config = DecoderConfig(**size.config)

    def build():
        graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
        params = nnx.to_pure_dict(state)
        if variant == "full":
            return graphdef, params, None
        rule = peft.LoraRule(pattern=PROJECTION_KERNELS, rank=rank, alpha=2.0 * rank)
        adapters = peft.init_lora(params, [rule], key=jax.random.key(1))
        adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # as if trained: B != 0
        base = (
            peft.quantize_params(params, [PROJECTION_KERNELS])
            if variant.startswith("qlora")
            else params
        )
        return graphdef, adapters, base

    if size.run:
        graphdef, trainable, frozen = build()
    else:
        out = nnx.eval_shape(lambda: jax.tree.map(jnp.asarray, build()[1:]))
        graphdef = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))[0]
        trainable, frozen = out
    rng = np.random.default_rng(0)
    shape = (size.batch, size.tokens)
    batch = {
        "tokens": rng.integers(0, config.vocab_size, shape).astype(np.int32),
        "targets": rng.integers(0, config.vocab_size, shape).astype(np.int32),
    }
    optimizer = optax.adamw(1e-4)

    def nll(params, batch):
        model = nnx.merge(graphdef, params)
        hidden = model(batch["tokens"])
        token = logprobs.fused_token_logps(hidden, model.unembedding(), batch["targets"])
        return losses.aggregate(-token, mode="token_mean").mean()

    def loss(trainable, frozen, batch):
        if variant == "full":
            return nll(trainable, batch)
        if variant == "lora_merged":
            return nll(peft.merge_lora(frozen, trainable), batch)
        if variant == "qlora_dequantized":
            return nll(peft.merge_lora(peft.dequantize_params(frozen), trainable), batch)
        return peft.lora(nll)(peft.apply_lora(frozen, trainable), batch)

    def step(trainable, opt_state, frozen, batch):
        value, grads = jax.value_and_grad(loss)(trainable, frozen, batch)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, value

    def gradients(trainable, frozen, batch):
        return jax.value_and_grad(loss)(trainable, frozen, batch)

    opt_state = jax.eval_shape(optimizer.init, trainable)
    if size.run:
        opt_state = optimizer.init(trainable)
    # The step updates the trainable weights and the optimizer state in place, as a train
    # loop does (donated buffers).
    step = jax.jit(step, donate_argnums=(0, 1))
    return step, jax.jit(gradients), trainable, opt_state, frozen, batch


def stored(tree) -> int:
    return 0 if tree is None else peft.stored_bytes(tree)


def measure(size: Size, variant: str, rank: int, repeats: int) -> dict:
    step, _, trainable, opt_state, frozen, batch = setup(size, variant, rank)
    compiled = step.lower(trainable, opt_state, frozen, batch).compile()
    params = trainable if frozen is None else frozen
    out = {
        **step_memory(compiled),
        "stored_param_bytes": stored(params) + (0 if frozen is None else stored(trainable)),
        "trainable_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(trainable))),
        "optimizer_bytes": stored(opt_state),
    }
    if size.run:
        seconds = step_seconds(compiled, trainable, opt_state, frozen, batch, repeats=repeats)
        out["median_ms"] = 1e3 * statistics.median(seconds)
        out["runs_ms"] = [round(1e3 * s, 2) for s in seconds]
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def check(size: Size, variant: str, rank: int, float64: bool = False) -> dict:
    """Loss and adapter gradients of one step. With `float64`, the reference for `variant`'s
    inputs: $W + s\\,AB$ formed in float64 (a quantised base dequantised first) and the model
    run in float64 (JAX x64)."""
    if float64:
        jax.config.update("jax_enable_x64", True)
    _, gradients, trainable, _, frozen, batch = setup(size, variant, rank)
    if float64:
        config = DecoderConfig(**{**size.config, "dtype": "float64", "param_dtype": "float64"})
        graphdef = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))[0]
        to64 = functools.partial(jax.tree.map, lambda x: jnp.asarray(x, jnp.float64))
        trainable, frozen = to64(trainable), to64(peft.dequantize_params(frozen))

        @jax.jit
        def gradients(trainable, frozen, batch):
            def loss(trainable):
                model = nnx.merge(graphdef, peft.merge_lora(frozen, trainable))
                token = logprobs.fused_token_logps(
                    model(batch["tokens"]), model.unembedding(), batch["targets"]
                )
                return -token.mean()

            return jax.value_and_grad(loss)(trainable)

    value, grads = gradients(trainable, frozen, batch)
    return {
        "loss": float(value),
        "grads": [np.asarray(g, np.float64).ravel().tolist() for g in jax.tree.leaves(grads)],
    }


def bits(size: Size) -> dict:
    """Stored bits per parameter of the base: bfloat16, NF4 projections, NF4 everything."""
    config = DecoderConfig(**size.config)

    def count(quantize_embedding: bool):
        def build():
            params = nnx.to_pure_dict(nnx.state(Decoder(config, rngs=nnx.Rngs(0))))
            params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
            base = peft.quantize_params(params, [PROJECTION_KERNELS])
            if quantize_embedding:
                base = peft.quantize_params(base, ["embed_tokens/embedding"], layout="out_in")
            return base

        tree = nnx.eval_shape(build) if not size.run else build()
        return peft.bits_per_parameter(tree), peft.stored_bytes(tree)

    bf16_bits = 16.0
    projections, projections_bytes = count(False)
    everything, everything_bytes = count(True)
    return {
        "bf16_bits": bf16_bits,
        "nf4_projections_bits": projections,
        "nf4_all_bits": everything,
        "bf16_over_nf4_projections": bf16_bits / projections,
        "bf16_over_nf4_all": bf16_bits / everything,
        "nf4_projections_bytes": projections_bytes,
        "nf4_all_bytes": everything_bytes,
    }


def worker(args: argparse.Namespace) -> None:
    """Measure `--variant`; or, with `--check`, the loss and gradients of each variant that is
    checked, one after the other (compared, not measured: they share a process), or with
    `--float64` the reference of each LoRA variant's inputs."""
    size = SIZES[args.size]
    if args.check:
        names = NAIVE_TWIN if args.float64 else [*NAIVE_TWIN, *NAIVE_TWIN.values()]
        result = {name: check(size, name, args.rank, float64=args.float64) for name in names}
    else:
        result = measure(size, args.variant, args.rank, args.repeats)
        if args.variant == "qlora":
            result["bits"] = bits(size)
    args.json_out.write_text(json.dumps(result))


# ----------------------------------------------------------------------------- parent


def run_worker(
    args: argparse.Namespace, variant: str | None, folder: Path, float64: bool = False
) -> dict:
    """Measure `variant`, or (None) check every LoRA variant, or compute their references."""
    mode = "measure" if variant else "reference" if float64 else "check"
    out = folder / f"{variant or 'all'}-{mode}.json"
    command = [sys.executable, str(Path(__file__).resolve())]
    command += ["--variant", variant] if variant else ["--check"]
    command += ["--size", args.size, "--rank", str(args.rank), "--repeats", str(args.repeats)]
    command += ["--json-out", str(out)] + (["--float64"] if float64 else [])
    return worker_result(command, out, label=f"[{variant or 'LoRA variants'}] {mode}")


def summarise(args, variants: dict, errors: dict) -> dict:
    def get(name, key):
        return variants.get(name, {}).get(key)

    full, lora, qlora = (variants.get(n, {}) for n in ("full", "lora", "qlora"))
    result = {
        "size": args.size,
        "rank": args.rank,
        "config": SIZES[args.size].config,
        # Ours may be at most TOLERANCE less accurate than the naive path (float32 rounding
        # alone reaches 1e-3 of the largest gradient entry at the cpu size).
        "correct": bool(errors)
        and all(
            errors.get(ours) is not None
            and errors.get(naive) is not None
            and errors[ours] <= 2 * errors[naive] + TOLERANCE
            for ours, naive in NAIVE_TWIN.items()
        ),
        "errors": errors,
        "variants": variants,
        "bits": qlora.get("bits"),
        "lora_temp_over_full": ratio(lora.get("temp_bytes"), full.get("temp_bytes")),
        "lora_optimizer_over_full": ratio(lora.get("optimizer_bytes"), full.get("optimizer_bytes")),
        "qlora_temp_over_full": ratio(qlora.get("temp_bytes"), full.get("temp_bytes")),
        "lora_total_over_full": ratio(lora.get("total_bytes"), full.get("total_bytes")),
        "qlora_total_over_full": ratio(qlora.get("total_bytes"), full.get("total_bytes")),
        "naive_lora_temp_over_lora": ratio(
            get("lora_merged", "temp_bytes"), get("lora", "temp_bytes")
        ),
        "naive_qlora_temp_over_qlora": ratio(
            get("qlora_dequantized", "temp_bytes"), get("qlora", "temp_bytes")
        ),
        "lora_time_over_full": ratio(get("lora", "median_ms"), get("full", "median_ms")),
        "qlora_time_over_lora": ratio(get("qlora", "median_ms"), get("lora", "median_ms")),
    }
    return result


def table(result: dict) -> str:
    def mb(x):
        return "" if x is None else f"{x / 2**20:,.1f}"

    rows = [
        "| variant | trainable params | stored params MB | optimizer MB | temp MB | step total MB "
        "| peak RSS MB | median ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["variants"].items():
        if "failed" in r:
            rows.append(f"| {name} | failed | | | | | | |")
            continue
        ms = r.get("median_ms")
        rows.append(
            f"| {name} | {r['trainable_params']:,} | {mb(r['stored_param_bytes'])} | "
            f"{mb(r['optimizer_bytes'])} | {mb(r['temp_bytes'])} | {mb(r['total_bytes'])} | "
            f"{mb(r['peak_rss_bytes'])} | "
            f"{'' if ms is None else f'{ms:,.1f}'} |"
        )
    bits = result["bits"] or {}
    lines = ["\n".join(rows)]
    if bits:
        lines.append(
            f"stored bits per parameter: bf16 16, NF4 projections "
            f"{bits['nf4_projections_bits']:.3f} ({bits['bf16_over_nf4_projections']:.2f}x "
            f"smaller), NF4 projections and embedding {bits['nf4_all_bits']:.3f} "
            f"({bits['bf16_over_nf4_all']:.2f}x smaller)"
        )
    for key in (
        "lora_temp_over_full",
        "lora_optimizer_over_full",
        "qlora_temp_over_full",
        "lora_total_over_full",
        "qlora_total_over_full",
        "naive_lora_temp_over_lora",
        "naive_qlora_temp_over_qlora",
        "lora_time_over_full",
        "qlora_time_over_lora",
    ):
        if result[key] is not None:
            lines.append(f"{key}: {result[key]:.3f}")
    errors = ", ".join(f"{k} {v:.2e}" for k, v in result["errors"].items() if v is not None)
    lines.append(f"errors against float64 (largest entry): {errors}")
    lines.append(f"correct (at most 2 x the naive error + {TOLERANCE}): {result['correct']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    measured = args.measure.split(",")
    if unknown := [name for name in measured if name not in VARIANTS]:
        parser.error(f"--measure: no variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    if args.variant is not None or args.check:
        if args.json_out is None:
            raise SystemExit("worker mode needs --json-out.")
        worker(args)
        return 0
    size = SIZES[args.size]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        errors = {}
        if size.run:
            references = run_worker(args, None, folder, float64=True)
            checks = run_worker(args, None, folder)
            for worker_result in (references, checks):
                if "failed" in worker_result:
                    print(f"check failed:\n{worker_result['failed']}", file=sys.stderr)
            failed = "failed" in references or "failed" in checks
            for ours, naive in NAIVE_TWIN.items():
                for name in (ours, naive):
                    errors[name] = (
                        None if failed else relative_error(checks[name], references[ours])
                    )
        variants = {name: run_worker(args, name, folder) for name in VARIANTS if name in measured}
    result = summarise(args, variants, errors)
    print(table(result))
    line = json.dumps({k: v for k, v in result.items()})
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    crashed = any("failed" in r for r in variants.values())
    return 0 if (result["correct"] or not size.run) and not crashed else 1


if __name__ == "__main__":
    sys.exit(main())
