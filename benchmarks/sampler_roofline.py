r"""The KV-cache sampler against the memory-bandwidth roofline of the device it runs on.

    python benchmarks/sampler_roofline.py                  # a Llama-3.2-1B-shaped decoder, bf16
    python benchmarks/sampler_roofline.py --size smoke     # seconds; what the tests run
    python benchmarks/sampler_roofline.py --batches 1,8 --unrolled
    python benchmarks/sampler_roofline.py --batches 1,8 --layout per_layer

Greedy decoding of a randomly initialised `tunelib.models.Decoder` with `tunelib.rollout.sample`
(temperature 0, no stop tokens, so every row generates exactly `N` tokens after a prompt of
`P` random tokens), at each batch size of `--batches`. A decode step must read every weight
once (the embedding too: it is tied, so it is the unembedding) and the keys and values the
cache holds so far; at small batches those bytes, not the arithmetic, bound the step:

$$
t_{\text{floor}} = \frac{\text{bytes}(\theta) + 2 L B K D s_t \cdot \text{bytes per value}}
{\text{bandwidth}},
$$

with $L$ layers, $B$ rows, $K$ key/value heads of width $D$, $s_t$ the filled positions at
step $t$ (averaged over the run: $P + (N + 1) / 2$). The bandwidth is measured in the same
process: the median time of `y = x + 1` on a `--copy-gib` GiB bfloat16 array, counting the
bytes read and written. `roofline_fraction` is $t_{\text{floor}}$ over the measured time of a
decode step; 1.0 is the best any implementation can do.

For each batch size:

- `prefill_tokens_per_s`: `B P` over the median time of the jitted forward pass over the
  prompts (the work of `sample`'s prefill, without writing the cache);
- `decode_ms_per_step`: (median time of `sample` minus that prefill time) over `N`;
- `tokens_per_s`: `B N` over the median time of the whole `sample` call;
- `one_token_forward_ms`: the same jitted forward over one position per row, with no cache
  and no loop: a decode step's weight reads and products alone, as one XLA program. A decode
  step well above it spends its time in the cache's attention or in the loop's overhead
  (one kernel launch per operation, per step).

Each call is timed `--repeats` times after one warm-up (compiling) call, and the median kept;
`first_call_s` is the sampler's first call, compilation included (it is also its warm-up).
Each batch size compiles three programs of its own (the sampler, the prompts' forward, the
one-token forward), so the script's time grows with the number of batch sizes asked; the
lines on stderr give the time of each stage. `--layout per_layer` decodes
stacked layers with the sampler's per-layer layout (`sample(layout="per_layer")`).
The script prints a table and ends with one JSON line; nothing is asserted. The process ends
as soon as that line is written, without the runtime's teardown (`_measure.end_process`: on a
TPU v5e that teardown once held the finished process for 80 s).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

from _measure import end_process, random_key  # beside this script, first on sys.path


class Size(NamedTuple):
    config: dict
    prompt_len: int
    new_tokens: int
    batches: tuple[int, ...]
    copy_gib: float
    dtype: str


SIZES = {
    # Llama 3.2 1B's shapes (1.24 B parameters, tied embeddings).
    "llama-1b": Size(
        config=dict(
            vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500_000.0,
            tie_word_embeddings=True,
        ),
        prompt_len=128, new_tokens=128, batches=(1, 4, 8, 16, 32, 64), copy_gib=2.0,
        dtype="bfloat16",
    ),
    "smoke": Size(
        config=dict(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
        ),
        prompt_len=4, new_tokens=8, batches=(1, 2), copy_gib=0.01, dtype="float32",
    ),
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--size", choices=sorted(SIZES), default="llama-1b")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default: size's)")
    p.add_argument(
        "--unrolled", action="store_true",
        help="the layers as separate modules (default: stacked and scanned, as the recipes run)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=5, help="timed calls after one warm-up")
    p.add_argument(
        "--layout", choices=("stacked", "per_layer"), default="stacked",
        help="the sampler's decoding layout of stacked layers (`sample(layout=...)`)",
    )  # fmt: skip
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    return p


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, tuple[int, ...]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}.")
    batches = SIZES[args.size].batches
    if args.batches is not None:
        try:
            batches = tuple(int(b) for b in args.batches.split(","))
        except ValueError:
            parser.error(f"--batches must be comma-separated integers, got {args.batches!r}.")
        if any(b < 1 for b in batches):
            parser.error(f"--batches must be at least 1 each, got {args.batches!r}.")
    return args, batches


def median_seconds(repeats: int, fn, *fn_args, warm_up: bool = True) -> float:
    """The median wall time of `fn(*fn_args)` over `repeats` calls after one warm-up call
    (`warm_up=False`: the caller made it)."""
    import jax

    if warm_up:
        jax.block_until_ready(fn(*fn_args))  # the warm-up (compiling) call
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    args, batches = parse(argv)  # flags are checked before JAX is imported

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tunelib.models import Decoder, DecoderConfig
    from tunelib.rollout import SamplingConfig, sample

    size = SIZES[args.size]
    config = DecoderConfig(
        **size.config, dtype=size.dtype, param_dtype=size.dtype, scan_layers=not args.unrolled
    )
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(random_key(0))))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    value_bytes = jnp.dtype(size.dtype).itemsize

    elements = int(size.copy_gib * 2**30) // 2
    big = jnp.ones((elements,), jnp.bfloat16)
    bump = jax.jit(lambda x: x + 1)
    bandwidth = 2 * big.nbytes / median_seconds(20, bump, big)
    del big

    @jax.jit
    def prefill(params, tokens, where):
        model = nnx.merge(graphdef, params)
        hidden = model(tokens, where=where)
        return jnp.argmax(model.unembed(hidden[:, -1]), axis=-1)

    sampling = SamplingConfig(max_new_tokens=size.new_tokens, temperature=0.0, stop_tokens=())
    p, n = size.prompt_len, size.new_tokens
    rows = []
    started = time.perf_counter()

    def progress(message: str) -> None:
        """A line on stderr as each stage ends, so a run cut off by a time limit says where."""
        print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr, flush=True)

    for batch in batches:
        tokens = jax.random.randint(jax.random.key(batch), (batch, p), 0, config.vocab_size)
        where = jnp.ones((batch, p), jnp.bool_)
        prefill_s = median_seconds(args.repeats, prefill, params, tokens, where)
        one_s = median_seconds(args.repeats, prefill, params, tokens[:, :1], where[:, :1])
        progress(f"batch {batch}: prefill and one-token forward compiled and timed")
        call = (graphdef, params, tokens, where, jax.random.key(0), sampling)
        started_compile = time.perf_counter()
        if not np.asarray(sample(*call, layout=args.layout).where).all():
            raise SystemExit("a greedy completion stopped before --new-tokens: not timed.")
        first_call_s = time.perf_counter() - started_compile
        progress(f"batch {batch}: sampler's first call (compiling) took {first_call_s:.1f} s")
        total_s = median_seconds(
            args.repeats, lambda *a: sample(*a, layout=args.layout), *call, warm_up=False
        )  # the first call was the warm-up
        progress(f"batch {batch}: sampler timed")
        step_s = max(total_s - prefill_s, 0.0) / n
        kv_per_position = 2 * config.num_hidden_layers * batch * config.num_key_value_heads
        kv_bytes = kv_per_position * config.head_dim * (p + (n + 1) / 2) * value_bytes
        floor_s = (param_bytes + kv_bytes) / bandwidth
        rows.append({
            "batch": batch, "prefill_ms": 1e3 * prefill_s, "sample_ms": 1e3 * total_s,
            "prefill_tokens_per_s": batch * p / prefill_s,
            "decode_ms_per_step": 1e3 * step_s, "one_token_forward_ms": 1e3 * one_s,
            "tokens_per_s": batch * n / total_s,
            "bytes_per_step": param_bytes + kv_bytes, "floor_ms_per_step": 1e3 * floor_s,
            "roofline_fraction": floor_s / step_s if step_s > 0 else None,
            "first_call_s": first_call_s,
        })  # fmt: skip

    device = jax.devices()[0].device_kind
    print(
        f"{args.size}, {size.dtype}, {'unrolled' if args.unrolled else 'scanned'} layers "
        f"(decoding layout {args.layout}), "
        f"{param_bytes / 1e9:.3f} GB of weights, P={p} N={n}, greedy; {jax.default_backend()} "
        f"({device}), measured bandwidth {bandwidth / 1e9:,.0f} GB/s"
    )
    print(
        f"{'B':>4} {'prefill tok/s':>14} {'ms/step':>9} {'1-token fwd':>11} {'floor ms':>9} "
        f"{'of roofline':>12} {'tokens/s':>10}"
    )
    for r in rows:
        fraction = r["roofline_fraction"]
        print(
            f"{r['batch']:>4} {r['prefill_tokens_per_s']:>14,.0f} {r['decode_ms_per_step']:>9.3f} "
            f"{r['one_token_forward_ms']:>11.3f} {r['floor_ms_per_step']:>9.3f} "
            f"{'-' if fraction is None else f'{fraction:.1%}':>12} {r['tokens_per_s']:>10,.0f}"
        )
    line = json.dumps({
        "benchmark": "sampler_roofline", "size": args.size, "dtype": size.dtype,
        "layers": "unrolled" if args.unrolled else "scanned", "layout": args.layout,
        "backend": jax.default_backend(),
        "device": device, "jax": jax.__version__, "param_bytes": param_bytes,
        "key_impl": str(jax.random.key_impl(random_key(0))),
        "bandwidth_bytes_per_s": bandwidth, "prompt_len": p, "new_tokens": n,
        "repeats": args.repeats, "batches": rows,
    })  # fmt: skip
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    end_process(main())
