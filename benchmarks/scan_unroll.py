"""`DecoderConfig.scan_unroll` measured: one model's train step and sampler at several unrolls,
side by side, in one process.

    python benchmarks/scan_unroll.py                          # SmolLM2-135M's shape, bfloat16
    python benchmarks/scan_unroll.py --size smoke             # a 2-layer model, seconds
    python benchmarks/scan_unroll.py --unrolls 1,2,3,5

With stacked layers (`scan_layers=True`, as the recipes load every model that allows it) a
model runs its layers in one `lax.scan`; `scan_unroll=k` makes each step of the scan's loop
run k layers, so XLA compiles k copies of the layer and can fuse and overlap across them, for
a longer compilation. The weights and the computed values are the same at every unroll. For
each unroll this script compiles and times, on the same random weights:

- the **train step**: the gradient of the mean negative log-likelihood of a batch of tokens
  (the fused log-prob head, `implementation="auto"`), as the SFT recipe's step computes it;
- the **sampler**: `tunelib.rollout.sample` of `--new-tokens` tokens for a batch of prompts
  (prefill, then one decode step a token through the stacked layers).

Compile seconds (the train step's `lower` and `compile`; the sampler's first call less its
median; after a discarded first round, so that the process's first compilations are charged
to no unroll), the median of `--repeats` timed calls, the loss (equal at every unroll up to the
rounding of the order XLA sums in) and each figure's ratio to unroll 1's. Weights are drawn by
`_measure.random_key`'s generator. Prints a table and one JSON line (`--json-out` writes it).
"""

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

from _measure import print_result, random_key


@dataclasses.dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    batch: int  # rows of the train step, prompts of the sampler
    seq: int  # tokens of a train row; the prompts are a quarter of it
    dtype: str


SIZES = {
    "smoke": Size(2, 64, 4, 2, 16, 128, 256, 2, 16, "float32"),
    # SmolLM2-135M: 30 layers of width 576, 9 heads over 3 key-value heads, vocabulary 49,152.
    "smollm2": Size(30, 576, 9, 3, 64, 1536, 49152, 16, 256, "bfloat16"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", choices=sorted(SIZES), default="smollm2")
    p.add_argument("--unrolls", default=None, help="comma-separated (default 1,2,5 or 1,2)")
    p.add_argument("--new-tokens", type=int, default=None, help="sampled per prompt")
    p.add_argument("--repeats", type=int, default=5, help="timed calls of each")
    p.add_argument(
        "--warmup", action=argparse.BooleanOptionalAction, default=True,
        help="a discarded first round (--no-warmup: the first unroll's compile times also "
        "hold the process's first compilations)",
    )  # fmt: skip
    p.add_argument("--json-out", type=Path, default=None)
    return p


def model_config(size: Size, unroll: int):
    from tunelib.models import DecoderConfig

    return DecoderConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, head_dim=size.head_dim, tie_word_embeddings=True,
        scan_layers=True, scan_unroll=unroll, dtype=size.dtype, param_dtype=size.dtype,
    )  # fmt: skip


def random_params(config):
    """Weights of `config`'s shapes: matrices N(0, 0.02^2), vectors (the norms' scales) 1."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tunelib.models import Decoder

    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))))
    leaves, tree = jax.tree.flatten(shapes)

    @jax.jit
    def draw(key):
        keys = jax.random.split(key, len(leaves))
        return tree.unflatten([
            (0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
            if len(x.shape) > 1 else jnp.ones(x.shape, x.dtype)
            for k, x in zip(keys, leaves, strict=True)
        ])  # fmt: skip

    return draw(random_key(0))


def train_step(graphdef):
    """The gradient of the batch's mean next-token NLL (the fused head), and the loss."""
    import jax
    from flax import nnx

    from tunelib import logprobs

    def loss(params, tokens):
        model = nnx.merge(graphdef, params)
        hidden = model(tokens[:, :-1])
        logps = logprobs.fused_token_logps(hidden, model.unembedding(), tokens[:, 1:])
        return -logps.mean()

    return jax.jit(jax.value_and_grad(loss))


def timed(fn, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(size: Size, unroll: int, params, new_tokens: int, repeats: int) -> dict:
    """One unroll's compile seconds, call times and loss."""
    import jax
    import numpy as np
    from flax import nnx

    from tunelib.models import Decoder
    from tunelib.rollout import SamplingConfig, sample

    config = model_config(size, unroll)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, size.vocab, (size.batch, size.seq)).astype(np.int32)
    start = time.perf_counter()
    compiled = train_step(graphdef).lower(params, tokens).compile()
    train_compile = time.perf_counter() - start
    loss, _ = jax.block_until_ready(compiled(params, tokens))  # a warm-up call
    train = timed(lambda: jax.block_until_ready(compiled(params, tokens)), repeats)

    prompts = tokens[:, : max(size.seq // 4, 1)]
    where = np.ones(prompts.shape, bool)
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0)

    def run_sampler():
        out = sample(graphdef, params, prompts, where, jax.random.key(1), sampling)
        jax.block_until_ready(out.tokens)

    first = timed(run_sampler, 1)[0]
    sampler = timed(run_sampler, repeats)
    sampler_ms = statistics.median(sampler) * 1e3
    return {
        "unroll": unroll,
        "loss": float(loss),
        "train_compile_s": train_compile,
        "train_ms": statistics.median(train) * 1e3,
        "train_runs_ms": [s * 1e3 for s in train],
        "sampler_compile_s": max(first - sampler_ms / 1e3, 0.0),
        "sampler_ms": sampler_ms,
        "sampler_runs_ms": [s * 1e3 for s in sampler],
        "sampled_tokens_per_s": size.batch * new_tokens / (sampler_ms / 1e3),
    }


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row with its times over the first row's (unroll 1 when it is listed first)."""
    base = rows[0]
    keys = ("train_compile_s", "train_ms", "sampler_compile_s", "sampler_ms")
    return [{**r, **{f"{k}_ratio": r[k] / base[k] if base[k] else None for k in keys}}
            for r in rows]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    default = "1,2" if args.size == "smoke" else "1,2,5"
    try:
        unrolls = [int(u) for u in (args.unrolls or default).split(",") if u.strip()]
    except ValueError:
        parser.error(f"--unrolls: not whole numbers: {args.unrolls!r}")
    if not unrolls or min(unrolls) < 1 or max(unrolls) > size.layers:
        parser.error(f"--unrolls must lie in 1..{size.layers} (the layers), got {args.unrolls}")
    new_tokens = args.new_tokens or (4 if args.size == "smoke" else 64)
    if new_tokens < 1 or args.repeats < 1:
        parser.error("--new-tokens and --repeats must be >= 1")
    import jax

    params = random_params(model_config(size, unrolls[0]))
    # A discarded first round: the process's first compilations (JAX's and tunelib's own
    # caches filled) are not charged to the first unroll measured. It samples one token more,
    # so that the sampler measured next compiles its own program.
    if args.warmup:
        measure(size, unrolls[0], params, new_tokens + 1, 1)
    print(f"{'unroll':>6s} {'train compile s':>16s} {'train ms':>9s} {'sampler compile s':>18s} "
          f"{'sampler ms':>11s} {'tokens/s':>9s} {'loss':>10s}", flush=True)  # fmt: skip
    rows = []
    for unroll in unrolls:  # each row printed as it is measured
        r = measure(size, unroll, params, new_tokens, args.repeats)
        rows.append(r)
        print(f"{r['unroll']:>6d} {r['train_compile_s']:>16.2f} {r['train_ms']:>9.2f} "
              f"{r['sampler_compile_s']:>18.2f} {r['sampler_ms']:>11.1f} "
              f"{r['sampled_tokens_per_s']:>9.0f} {r['loss']:>10.5f}", flush=True)  # fmt: skip
    rows = with_ratios(rows)
    device = jax.devices()[0]
    result = {
        "benchmark": "scan_unroll", "size": args.size, "case": dataclasses.asdict(size),
        "new_tokens": new_tokens, "repeats": args.repeats, "warmup": args.warmup,
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)), "jax": jax.__version__,
        "key_impl": str(jax.random.key_impl(random_key(0))), "results": rows,
    }  # fmt: skip
    print_result(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
