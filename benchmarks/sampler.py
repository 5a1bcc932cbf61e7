r"""Tokens per second of the KV-cache sampler against re-running the full forward per token.

    python benchmarks/sampler.py                   # the default case, 35-40 min on 2 cores
    python benchmarks/sampler.py --size smoke      # seconds; what the tests run
    python benchmarks/sampler.py --batch 16 --new-tokens 128 --json-out result.json

The same randomly initialised `tunelib.models.Decoder` generates `N` tokens after prompts of
`P` random tokens (all real, no padding), in these variants:

- ``no_cache``: the baseline, greedy decoding by re-running the whole forward pass,
  `model(buffer, where=...)` over a fixed `[B, P + N]` buffer, for every new token
  (a jitted `lax.fori_loop` of `N` steps, argmax of the last real position's logits);
- ``greedy``: `tunelib.rollout.sample` at temperature 0 (prefill once, then one cached
  `Decoder.extend` per token inside a `lax.while_loop`);
- ``top_p``: `sample` at temperature 1 with top-p 0.9;
- ``sample``: `sample` at temperature 1 without filters, with `group_size` G in {1, 4, 8}
  over `B * G` = 32 rows (32, 8 and 4 prompts; at the smoke size G in {1, 4} over 8 rows):
  the G completions of a prompt share its prefill.

`stop_tokens=()`, so no completion stops early: every variant generates exactly `N` tokens per
row, and tokens per second count rows times `N`.

In order:

1. Correctness, before anything is timed: the greedy tokens of `sample` must equal the
   `no_cache` generator's on the headline batch (`--batch`), and every `sample` row must be
   `N` tokens long (no early stop). Otherwise the script exits with status 1.
2. One warm-up (compiling) call of every variant. Its compile time is what JAX reports through
   `jax.monitoring` for that call: tracing, lowering to MLIR and XLA compilation (the sum of
   the `COMPILE_EVENTS` durations).
3. `--repeats` rounds, each timing one call of every variant (ended by
   `block_until_ready`), the order reversed on every other round: the variants of each ratio
   are interleaved, so a slow spell on this shared machine hits both sides of it. Each
   variant's time is the median of its runs.

The variants share one process (no memory is measured, and each is compiled once before any
timing; the logprobs benchmark's subprocess isolation is for its peak-RSS figures). The
script prints a table and ends with one JSON line holding `case`, `speedup_vs_no_cache`
(tokens/s of `greedy` / tokens/s of `no_cache` at `--batch`), `topp_cost_vs_greedy` (time
per token of `top_p` / of `greedy` at `--batch`), `tokens_per_s` of those three, the batch
table (`greedy` and `no_cache` at batch 1, `--batch` and 32, with the speedup at each; batch
1 and `--batch` at the smoke size), the group table, and `meets_targets` for
`speedup_vs_no_cache >= 40` and `topp_cost_vs_greedy <= 1.3`, which are reported, never
asserted. The two headline ratios are ratios of medians; `by_round` holds the same ratios
round by round (of two runs that followed each other), whose spread shows how much the
machine's load moved them.
"""

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunelib.models import Decoder, DecoderConfig
from tunelib.rollout import SamplingConfig, sample


class Size(NamedTuple):
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    prompt_len: int
    new_tokens: int
    batch: int  # the headline batch: speedup_vs_no_cache and topp_cost_vs_greedy
    batches: tuple[int, ...]  # the batch table, with the headline batch added
    group_rows: int  # B * G of the group table
    group_sizes: tuple[int, ...]


SIZES = {
    "default": Size(
        layers=4, hidden=256, heads=8, kv_heads=4, head_dim=32, intermediate=768, vocab=1024,
        prompt_len=16, new_tokens=256, batch=8, batches=(1, 32), group_rows=32,
        group_sizes=(1, 4, 8),
    ),
    "smoke": Size(
        layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64, vocab=64,
        prompt_len=4, new_tokens=16, batch=8, batches=(1,), group_rows=8, group_sizes=(1, 4),
    ),
}  # fmt: skip
TOP_P = 0.9
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
TARGETS = {"speedup_vs_no_cache": 40.0, "topp_cost_vs_greedy": 1.3}


class Variant(NamedTuple):
    name: str  # "no_cache", "greedy", "top_p" or "sample"
    batch: int  # prompts
    group_size: int

    @property
    def rows(self) -> int:
        return self.batch * self.group_size

    @property
    def label(self) -> str:
        return f"{self.name} B={self.batch} G={self.group_size}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--size", choices=sorted(SIZES), default="default", help="model and lengths")
    p.add_argument("--batch", type=int, default=None, help="headline batch (default: size's, 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="N (default: size's)")
    p.add_argument("--prompt-len", type=int, default=None, help="P (default: size's)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each variant")
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    return p


def size_of(args: argparse.Namespace) -> Size:
    size = SIZES[args.size]
    for field, value in (
        ("batch", args.batch),
        ("new_tokens", args.new_tokens),
        ("prompt_len", args.prompt_len),
    ):
        if value is not None:
            if value < 1:
                raise SystemExit(f"--{field.replace('_', '-')} must be >= 1, got {value}.")
            size = size._replace(**{field: value})
    return size


def variants(size: Size) -> list[Variant]:
    """Every timed variant once: the headline three, the batch table, the group table."""
    out = [Variant("no_cache", size.batch, 1), Variant("greedy", size.batch, 1)]
    out.append(Variant("top_p", size.batch, 1))
    for batch in sorted({*size.batches, size.batch}):
        out += [Variant("no_cache", batch, 1), Variant("greedy", batch, 1)]
    for g in size.group_sizes:
        out.append(Variant("sample", size.group_rows // g, g))
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------------- generators


def make_model(size: Size) -> tuple[nnx.GraphDef, nnx.State]:
    config = DecoderConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        dtype="float32",
        param_dtype="float32",
    )
    return nnx.split(Decoder(config, rngs=nnx.Rngs(0)))


def make_no_cache(graphdef: nnx.GraphDef, new_tokens: int) -> Callable:
    """Greedy generation re-running the full forward over a `[B, P + N]` buffer per token."""

    @jax.jit
    def generate(params, tokens, where):
        model = nnx.merge(graphdef, params)
        batch, prompt_len = tokens.shape
        buffer = jnp.concatenate([tokens, jnp.zeros((batch, new_tokens), tokens.dtype)], axis=1)
        real = jnp.concatenate([where, jnp.zeros((batch, new_tokens), jnp.bool_)], axis=1)

        def step(i, carry):
            buffer, real = carry
            hidden = model(buffer, where=real)
            last = jax.lax.dynamic_index_in_dim(hidden, prompt_len + i - 1, 1, keepdims=False)
            token = jnp.argmax(model.unembed(last), axis=-1).astype(buffer.dtype)
            buffer = jax.lax.dynamic_update_slice_in_dim(buffer, token[:, None], prompt_len + i, 1)
            real = jax.lax.dynamic_update_slice_in_dim(
                real, jnp.ones((batch, 1), jnp.bool_), prompt_len + i, 1
            )
            return buffer, real

        buffer, _ = jax.lax.fori_loop(0, new_tokens, step, (buffer, real))
        return buffer[:, prompt_len:]

    return generate


def sampling_config(name: str, new_tokens: int) -> SamplingConfig:
    if name == "greedy":
        return SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, stop_tokens=())
    if name == "top_p":
        return SamplingConfig(
            max_new_tokens=new_tokens, temperature=1.0, top_p=TOP_P, stop_tokens=()
        )
    return SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, stop_tokens=())


def runner(variant: Variant, size: Size, graphdef, params, prompts: jax.Array) -> Callable:
    """A function of no arguments that generates with `variant` and returns its tokens."""
    tokens = prompts[: variant.batch]
    where = jnp.ones(tokens.shape, jnp.bool_)
    if variant.name == "no_cache":
        generate = make_no_cache(graphdef, size.new_tokens)
        return lambda: generate(params, tokens, where)
    config = sampling_config(variant.name, size.new_tokens)
    key = jax.random.key(1)
    return lambda: sample(
        graphdef, params, tokens, where, key, config, group_size=variant.group_size
    )


def seconds(fn: Callable) -> tuple[float, object]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - start, out


class CompileClock:
    """Seconds JAX spent tracing, lowering and compiling, summed from `jax.monitoring`."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, event: str, duration_secs: float, **kwargs) -> None:
        if event in COMPILE_EVENTS:
            self.seconds += duration_secs

    def warm_up(self, fn: Callable) -> tuple[float, float, object]:
        """`fn`'s first call: its wall seconds, the compile seconds within them, its output."""
        before = self.seconds
        wall, out = seconds(fn)
        return wall, self.seconds - before, out


# ----------------------------------------------------------------------------- measurement


def check(size: Size, no_cache_tokens, rollout) -> tuple[bool, str | None]:
    """Whether `sample`'s greedy tokens equal the `no_cache` generator's, and why not."""
    ours, naive = np.asarray(rollout.tokens), np.asarray(no_cache_tokens)
    if (
        not np.asarray(rollout.where).all()
        or (np.asarray(rollout.lengths) != size.new_tokens).any()
    ):
        return False, "a greedy completion stopped before max_new_tokens"
    if ours.shape != naive.shape:
        return False, f"greedy tokens have shape {ours.shape}, no_cache's {naive.shape}"
    bad = np.flatnonzero((ours != naive).any(axis=1))
    if bad.size:
        row = int(bad[0])
        col = int(np.flatnonzero(ours[row] != naive[row])[0])
        return False, (
            f"greedy tokens differ from no_cache's in {bad.size} of {len(ours)} rows; first "
            f"at row {row}, token {col}: {int(ours[row, col])} against {int(naive[row, col])}"
        )
    return True, None


def warm_up(size: Size, runners: dict, clock: CompileClock) -> dict | str:
    """Every variant's first call, {variant: (wall s, compile s)}; or why the check failed.

    The headline batch's two greedy generators go first and their tokens are compared before
    anything else runs.
    """
    first, outputs = {}, {}
    naive, greedy = Variant("no_cache", size.batch, 1), Variant("greedy", size.batch, 1)
    for variant in (naive, greedy):
        wall, compile_s, outputs[variant] = clock.warm_up(runners[variant])
        first[variant] = (wall, compile_s)
    correct, reason = check(size, outputs[naive], outputs[greedy])
    if not correct:
        return reason
    for variant, run in runners.items():
        if variant not in first:
            print(f"[{variant.label}] warm-up ...", file=sys.stderr, flush=True)
            wall, compile_s, out = clock.warm_up(run)
            first[variant] = (wall, compile_s)
            lengths = getattr(out, "lengths", None)
            if lengths is not None and (np.asarray(lengths) != size.new_tokens).any():
                return f"{variant.label} stopped before max_new_tokens"
    return first


def measure(size: Size, repeats: int) -> dict:
    graphdef, params = make_model(size)
    rows = max(v.rows for v in variants(size))
    prompts = jax.random.randint(jax.random.key(0), (rows, size.prompt_len), 0, size.vocab)
    runners = {v: runner(v, size, graphdef, params, prompts) for v in variants(size)}
    clock = CompileClock()
    jax.monitoring.register_event_duration_secs_listener(clock)
    try:
        first = warm_up(size, runners, clock)
    finally:
        jax.monitoring.unregister_event_duration_listener(clock)
    if isinstance(first, str):
        return {"correct": False, "reason": first}

    times: dict[Variant, list[float]] = {v: [] for v in runners}
    for round_ in range(repeats):
        print(f"round {round_ + 1} of {repeats} ...", file=sys.stderr, flush=True)
        order = list(runners) if round_ % 2 == 0 else list(reversed(runners))
        for variant in order:
            times[variant].append(seconds(runners[variant])[0])

    records = []
    for variant, runs in times.items():
        median = statistics.median(runs)
        tokens = variant.rows * size.new_tokens
        records.append({
            "variant": variant.name,
            "batch": variant.batch,
            "group_size": variant.group_size,
            "rows": variant.rows,
            "tokens": tokens,
            "median_s": median,
            "runs_s": runs,
            "tokens_per_s": tokens / median,
            "ms_per_token": 1e3 * median / tokens,
            "ms_per_step": 1e3 * median / size.new_tokens,
            "first_call_s": first[variant][0],
            "compile_s": first[variant][1],
        })  # fmt: skip
    return {"correct": True, "reason": None, "runs": records}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def summarise(args: argparse.Namespace, size: Size, measured: dict) -> dict:
    result = {
        "benchmark": "sampler",
        "size": args.size,
        "case": {
            "layers": size.layers,
            "hidden": size.hidden,
            "heads": size.heads,
            "kv_heads": size.kv_heads,
            "head_dim": size.head_dim,
            "intermediate": size.intermediate,
            "vocab": size.vocab,
            "dtype": "float32",
            "prompt_len": size.prompt_len,
            "new_tokens": size.new_tokens,
            "batch": size.batch,
            "top_p": TOP_P,
            "group_rows": size.group_rows,
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
        },
        "repeats": args.repeats,
        "correct": measured["correct"],
        "reason": measured["reason"],
    }
    if not measured["correct"]:
        return result
    runs = measured["runs"]

    def record(name: str, batch: int) -> dict | None:
        return next((r for r in runs if (r["variant"], r["batch"]) == (name, batch)), None)

    def tps(name: str, batch: int) -> float | None:
        return (record(name, batch) or {}).get("tokens_per_s")

    def by_round(name: str, over: str, batch: int) -> list[float]:
        """`name`'s seconds / `over`'s, run by run: the runs of a round follow each other."""
        pairs = zip(record(name, batch)["runs_s"], record(over, batch)["runs_s"], strict=True)
        return [a / b for a, b in pairs]

    b = size.batch
    tokens_per_s = {name: tps(name, b) for name in ("no_cache", "greedy", "top_p")}
    speedup = ratio(tokens_per_s["greedy"], tokens_per_s["no_cache"])
    # Time per token is 1 / (tokens/s), so this is the ratio of medians at the same batch.
    topp_cost = ratio(tokens_per_s["greedy"], tokens_per_s["top_p"])
    batch_table = [
        {
            "batch": batch,
            "greedy_tokens_per_s": tps("greedy", batch),
            "no_cache_tokens_per_s": tps("no_cache", batch),
            "speedup_vs_no_cache": ratio(tps("greedy", batch), tps("no_cache", batch)),
        }
        for batch in sorted({*size.batches, b})
    ]
    group_table = [
        {
            "group_size": r["group_size"],
            "prompts": r["batch"],
            "rows": r["rows"],
            "tokens_per_s": r["tokens_per_s"],
            "ms_per_token": r["ms_per_token"],
        }
        for r in runs
        if r["variant"] == "sample"
    ]
    result |= {
        "speedup_vs_no_cache": speedup,
        "topp_cost_vs_greedy": topp_cost,
        "tokens_per_s": tokens_per_s,
        "by_round": {
            "speedup_vs_no_cache": by_round("no_cache", "greedy", b),
            "topp_cost_vs_greedy": by_round("top_p", "greedy", b),
        },
        "batch_table": batch_table,
        "group_table": group_table,
        "targets": {
            "speedup_vs_no_cache>=": TARGETS["speedup_vs_no_cache"],
            "topp_cost_vs_greedy<=": TARGETS["topp_cost_vs_greedy"],
        },
        "meets_targets": {
            "speedup_vs_no_cache>=40": speedup is not None
            and speedup >= TARGETS["speedup_vs_no_cache"],
            "topp_cost_vs_greedy<=1.3": topp_cost is not None
            and topp_cost <= TARGETS["topp_cost_vs_greedy"],
        },
        "runs": runs,
    }
    return result


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    speedups = {r["batch"]: r["speedup_vs_no_cache"] for r in result["batch_table"]}
    head = ["variant", "batch", "G", "rows", "tokens/s", "ms/token", "ms/step", "compile s"]
    lines = [[*head, "vs no_cache"]]
    for r in result["runs"]:
        row = [r["variant"], str(r["batch"]), str(r["group_size"]), str(r["rows"])]
        row += [fmt(r["tokens_per_s"], ",.0f"), fmt(r["ms_per_token"], ".4f")]
        row += [fmt(r["ms_per_step"], ".3f"), fmt(r["compile_s"], ".2f")]
        row.append(fmt(speedups.get(r["batch"]), ".1f") if r["variant"] == "greedy" else "")
        lines.append(row)
    widths = [max(len(x) for x in column) for column in zip(*lines, strict=True)]
    text = [
        " | ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in lines
    ]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


def report(result: dict) -> str:
    c = result["case"]
    lines = [
        f"size {result['size']}: decoder L={c['layers']} H={c['hidden']} heads={c['heads']}/"
        f"{c['kv_heads']}x{c['head_dim']} F={c['intermediate']} V={c['vocab']} {c['dtype']}, "
        f"P={c['prompt_len']} N={c['new_tokens']}, {c['backend']} ({c['device']}), median of "
        f"{result['repeats']} interleaved runs",
    ]
    if not result["correct"]:
        return "\n".join([*lines, f"correctness check FAILED, nothing timed: {result['reason']}"])
    met = ", ".join(
        f"{k} {'met' if ok else 'NOT met'}" for k, ok in result["meets_targets"].items()
    )
    lines += [
        "greedy tokens of sample == no_cache's: pass",
        "",
        table(result),
        "",
        f"speedup_vs_no_cache (tokens/s greedy / no_cache, batch {c['batch']}) = "
        f"{fmt(result['speedup_vs_no_cache'], '.1f')}, topp_cost_vs_greedy (time per token "
        f"top_p / greedy, batch {c['batch']}) = {fmt(result['topp_cost_vs_greedy'], '.3f')}",
        "per round (the ratio of each round's two runs): "
        + ", ".join(
            f"{k} median {statistics.median(x):.3g}, range {min(x):.3g} to {max(x):.3g}"
            for k, x in result["by_round"].items()
        ),
        f"targets (reported, not asserted): {met}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}.")
    size = size_of(args)
    result = summarise(args, size, measure(size, args.repeats))
    print(report(result))
    line = json.dumps(result)
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    return 0 if result["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
