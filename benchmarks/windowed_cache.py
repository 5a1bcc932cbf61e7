r"""The sampler's KV cache with sliding-window layers in rings of their window
(`sample(..., windowed_cache=True)`, the default) against every layer keeping every slot
(`windowed_cache=False`): cache bytes, the compiled program's memory and time per token.

    python benchmarks/windowed_cache.py                     # Gemma 3 1B's cache, 4,096 tokens
    python benchmarks/windowed_cache.py --size gemma3-1b    # all of Gemma 3 1B (for a GPU)
    python benchmarks/windowed_cache.py --size smoke        # seconds; what the tests run

Sizes (random weights, float32, stacked layers `scan_layers=True`, one row, greedy, no stop
token, so every row draws `--new-tokens` tokens after a `--prompt-len` prompt):

- `gemma3-1b`: Gemma 3 1B (`google/gemma-3-1b-pt`'s config): 26 layers, 5 sliding (window
  512) to 1 full, 1 key/value head of width 256, hidden 1152, vocabulary 262,144;
- `gemma3-cache` (default): Gemma 3 1B's attention and cache (26 layers, the same heads and
  widths, window 512, local and global RoPE) on narrow MLPs and embeddings (hidden 256,
  vocabulary 1,024), so that a CPU decodes 4,096 tokens in minutes and the cache's part of
  a step is what the time shows;
- `smoke`: 4 layers (3 sliding, window 8), 64 tokens.

For each cache: its bytes (keys, values and the slot mask, `Decoder.init_cache` of the
sampler's length, from shapes alone), the compiled `sample` program's memory
(`memory_analysis()`: arguments, outputs and temporaries, the cache among them), and the
median seconds per drawn token over `--repeats` calls, the two variants interleaved in the
same process (the order reversed every other round), after a warm-up call that compiles.
Before timing, the greedy tokens of the two must be equal and the behaviour log-probs close
(exit status 1 otherwise); the largest log-prob difference is reported (the ring sums the
attention in another order: float32 rounding). The script prints a table and ends with one
JSON line (`--json-out` writes it to a file too).
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Size:
    config: dict
    prompt_len: int
    new_tokens: int


GEMMA3_ATTENTION = {
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "layer_types": tuple(
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)
    ),
    "query_pre_attn_scalar": 256,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "max_position_embeddings": 32_768,
    "use_qk_norm": True,
    "hidden_act": "gelu_pytorch_tanh",
    "norm_offset": True,
    "sandwich_norms": True,
    "scale_embeddings": True,
    "tie_word_embeddings": True,
}
SIZES = {
    "gemma3-1b": Size(
        {**GEMMA3_ATTENTION, "vocab_size": 262_144, "hidden_size": 1152, "intermediate_size": 6912},
        prompt_len=32,
        new_tokens=4064,
    ),
    "gemma3-cache": Size(
        {**GEMMA3_ATTENTION, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512},
        prompt_len=32,
        new_tokens=4064,
    ),
    "smoke": Size(
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ("sliding_attention",) * 3 + ("full_attention",),
            "rope_local_base_freq": 10_000.0,
            "tie_word_embeddings": True,
        },
        prompt_len=8,
        new_tokens=56,
    ),
}
VARIANTS = {"full": False, "windowed": True}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="gemma3-cache")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens drawn (default: size's)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per variant")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.new_tokens is not None and args.new_tokens < 1:
        p.error(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tunelib.models import Decoder, DecoderConfig
    from tunelib.rollout import SamplingConfig, sample

    size = SIZES[args.size]
    new = args.new_tokens or size.new_tokens
    config = DecoderConfig(**size.config, scan_layers=True)
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    prompts = jax.random.randint(jax.random.key(1), (1, size.prompt_len), 0, config.vocab_size)
    where = jnp.ones(prompts.shape, bool)
    sampling = SamplingConfig(max_new_tokens=new, temperature=0.0)
    length = size.prompt_len + new
    key = jax.random.key(0)

    def cache_bytes(windowed: bool) -> int:
        model = nnx.merge(graphdef, params)
        cache = jax.eval_shape(lambda: model.init_cache(1, length, windowed=windowed))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))

    results, programs = {}, {}
    for name, windowed in VARIANTS.items():
        # `sample` inside one jitted function: its compiled memory, and the calls timed.
        start = time.perf_counter()
        programs[name] = (
            jax.jit(
                lambda p, t, w, k, windowed=windowed: sample(
                    graphdef, p, t, w, k, sampling, windowed_cache=windowed
                )
            )
            .lower(params, prompts, where, key)
            .compile()
        )
        memory = programs[name].memory_analysis()
        out = jax.block_until_ready(programs[name](params, prompts, where, key))
        results[name] = {
            "cache_bytes": cache_bytes(windowed),
            "program_bytes": memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes,
            "temp_bytes": memory.temp_size_in_bytes,
            "first_call_s": time.perf_counter() - start,
            "tokens": np.asarray(out.tokens),
            "logps": np.asarray(out.logps),
            "seconds": [],
        }
    full, windowed = results["full"], results["windowed"]
    tokens_agree = bool((full["tokens"] == windowed["tokens"]).all())
    logp_diff = float(np.abs(full["logps"] - windowed["logps"]).max())
    if not tokens_agree or logp_diff > 1e-3:
        print(f"the two caches disagree: tokens equal {tokens_agree}, log-probs differ by "
              f"{logp_diff:.2e}", file=sys.stderr)  # fmt: skip
        return 1
    for round_ in range(args.repeats):
        order = list(VARIANTS.items())[:: -1 if round_ % 2 else 1]
        for name, _ in order:
            start = time.perf_counter()
            jax.block_until_ready(programs[name](params, prompts, where, key))
            results[name]["seconds"].append(time.perf_counter() - start)

    rows = {}
    for name, r in results.items():
        rows[name] = {
            "cache_bytes": r["cache_bytes"],
            "program_bytes": r["program_bytes"],
            "temp_bytes": r["temp_bytes"],
            "ms_per_token": 1e3 * statistics.median(r["seconds"]) / new,
            "compile_and_first_call_s": r["first_call_s"],
            "runs_s": r["seconds"],
        }
    ratio = {k: rows["full"][k] / rows["windowed"][k]
             for k in ("cache_bytes", "program_bytes", "ms_per_token")}  # fmt: skip
    print(f"{args.size}: {config.num_hidden_layers} layers "
          f"({sum(config.sliding_layers)} sliding, window {config.sliding_window}), "
          f"{size.prompt_len} + {new} tokens, {jax.default_backend()}")  # fmt: skip
    print("| cache | cache MiB | program MiB | ms / token |")
    print("|---|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['cache_bytes'] / 2**20:.2f} | {row['program_bytes'] / 2**20:.2f} "
              f"| {row['ms_per_token']:.3f} |")  # fmt: skip
    print(f"full / windowed: cache {ratio['cache_bytes']:.2f}x, program "
          f"{ratio['program_bytes']:.2f}x, time per token {ratio['ms_per_token']:.2f}x; "
          f"greedy tokens equal, log-probs within {logp_diff:.1e}")  # fmt: skip
    result = {
        "benchmark": "windowed_cache", "size": args.size, "backend": jax.default_backend(),
        "layers": config.num_hidden_layers, "sliding_layers": sum(config.sliding_layers),
        "window": config.sliding_window, "prompt_len": size.prompt_len, "new_tokens": new,
        "tokens_agree": tokens_agree, "max_logp_difference": logp_diff,
        "variants": rows, "full_over_windowed": ratio,
    }  # fmt: skip
    line = json.dumps(result)
    if args.json_out is not None:
        args.json_out.write_text(line)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
