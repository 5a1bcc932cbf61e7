r"""Tokens per second of SFT train steps on packed rows against padded rows.

    python benchmarks/packing.py                  # the default case, about 4 minutes on 2 cores
    python benchmarks/packing.py --size smoke     # seconds; what the tests run
    python benchmarks/packing.py --json-out result.json

A length-skewed set of prompt-completion records (log-normal lengths: most sequences short,
a few near the row width, as in real SFT data) is batched by `tunelib.data.sft_dataset`
twice: padded (one sequence per row) and packed (`packing=True`: Grain's first-fit packing,
several sequences per row, `segment_ids` and `positions` per token). Both variants run the
same train step of a `tunelib.models.Decoder`: the token-mean NLL of the completions through
the fused log-prob head, its gradient, and an Adam update, on `[batch, width]` rows. The only
difference is what the rows hold.

In order:

1. Correctness, before anything is timed: over the same records, once each (no shuffle), the
   summed NLL and its gradient from the packed batches must equal those from the padded
   batches within float32 rounding (the decoder attends within segments and restarts
   positions, so a packed row computes what the padded rows do). Otherwise the script exits
   with status 1.
2. A warm-up (compiling) step of each variant.
3. `--repeats` rounds; each times `--steps` steps of each variant (ended by
   `block_until_ready`), the order reversed every other round, so a slow spell on a shared
   machine hits both. A variant's time per step is the median over rounds.

Tokens per second count real completion tokens (the loss's tokens, `where`) and real input
tokens (`attention_where`) per second of train step. The script prints a table and ends with
one JSON line holding `case`, the fill of each variant (the share of row slots holding a
real token), `tokens_per_s`, `step_ms` and `speedup` (packed tokens/s over padded).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tunelib import logprobs, losses
from tunelib.data import CharTokenizer, sft_dataset
from tunelib.models import Decoder, DecoderConfig


class Size(NamedTuple):
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    width: int  # tokens per row
    batch: int  # rows per step
    records: int
    median_length: int  # of a completion, in characters


SIZES = {
    "default": Size(
        layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=384,
        width=256, batch=16, records=4096, median_length=24,
    ),
    "smoke": Size(
        layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64,
        width=64, batch=4, records=32, median_length=8,
    ),
}  # fmt: skip
ALPHABET = "abcdefghijklmnopqrstuvwxyz "


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--size", choices=sorted(SIZES), default="default")
    p.add_argument("--steps", type=int, default=10, help="steps timed per round and variant")
    p.add_argument("--repeats", type=int, default=5, help="rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, default=None)
    return p


def skewed_records(size: Size, seed: int) -> list[dict[str, str]]:
    """Prompt-completion records whose lengths are log-normal, capped to fit a row."""
    rng = np.random.default_rng(seed)
    longest = size.width - 2  # BOS and EOS
    records = []
    for _ in range(size.records):
        prompt_len = int(np.clip(rng.lognormal(np.log(8), 0.5), 1, longest // 4))
        completion_len = int(
            np.clip(rng.lognormal(np.log(size.median_length), 0.9), 1, longest - prompt_len)
        )
        text = rng.choice(list(ALPHABET), size=prompt_len + completion_len)
        records.append(
            {"prompt": "".join(text[:prompt_len]), "completion": "".join(text[prompt_len:])}
        )
    return records


def datasets(records, size: Size, *, shuffle: bool, num_epochs: int | None, seed: int):
    tok = CharTokenizer(ALPHABET)
    common = {
        "max_length": size.width, "batch_size": size.batch, "seed": seed, "shuffle": shuffle,
        "num_epochs": num_epochs, "drop_remainder": num_epochs is None,
    }  # fmt: skip
    padded = sft_dataset(records, tok, **common)
    packed = sft_dataset(records, tok, packing=True, max_segments=size.width // 2, **common)
    return tok, padded, packed


def make_model(size: Size, vocab: int, seed: int):
    config = DecoderConfig(
        vocab_size=vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, head_dim=size.head_dim,
        max_position_embeddings=size.width, tie_word_embeddings=True,
    )  # fmt: skip
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(seed)))
    return graphdef, nnx.to_pure_dict(state)


def nll_sum(graphdef, params, batch):
    """The summed NLL of the completion tokens of a padded or packed batch."""
    model = nnx.merge(graphdef, params)
    packed = {k: batch[k] for k in ("segment_ids", "positions") if k in batch}
    hidden = model(batch["tokens"], where=batch["attention_where"], **packed)
    token = logprobs.fused_token_logps(
        hidden, model.unembedding(), batch["targets"], where=batch["where"]
    )
    return -losses.aggregate(token, mode="token_mean", where=batch["where"]).total


def check_equal(graphdef, params, records, size: Size, seed: int) -> dict:
    """The summed NLL and its gradient over every record, from padded and packed batches."""
    _, padded, packed = datasets(records, size, shuffle=False, num_epochs=1, seed=seed)
    grad = jax.jit(jax.value_and_grad(nll_sum, argnums=1), static_argnums=0)
    out = {}
    for name, dataset in (("padded", padded), ("packed", packed)):
        total, grads = 0.0, jax.tree.map(jnp.zeros_like, params)
        for batch in dataset:
            value, g = grad(graphdef, params, batch)
            total += float(value)
            grads = jax.tree.map(jnp.add, grads, g)
        out[name] = (total, grads)
    (a, ga), (b, gb) = out["padded"], out["packed"]
    value_error = abs(a - b) / abs(a)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ga))
    pairs = zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True)
    grad_error = max(float(jnp.max(jnp.abs(x - y))) for x, y in pairs) / scale
    return {"nll_relative_error": value_error, "grad_relative_error": grad_error}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    size = SIZES[args.size]
    records = skewed_records(size, args.seed)
    tok, padded, packed = datasets(records, size, shuffle=True, num_epochs=None, seed=args.seed)
    graphdef, params = make_model(size, tok.vocab_size, args.seed)

    check = check_equal(graphdef, params, records, size, args.seed)
    print(f"packed equals padded: {check}", flush=True)
    if check["nll_relative_error"] > 1e-5 or check["grad_relative_error"] > 1e-4:
        print("packed and padded batches disagree", file=sys.stderr)
        sys.exit(1)

    optimizer = optax.adam(1e-3)

    @jax.jit
    def step(params, opt_state, batch):
        def loss(params):
            return nll_sum(graphdef, params, batch) / jnp.maximum(batch["where"].sum(), 1)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    variants = {}
    for name, dataset in (("padded", padded), ("packed", packed)):
        iterator = iter(dataset)
        batches = [next(iterator) for _ in range(args.steps)]
        state = (params, optimizer.init(params))
        jax.block_until_ready(step(*state, batches[0]))  # compile
        slots = sum(b["tokens"].size for b in batches)
        variants[name] = {
            "batches": batches,
            "state": state,
            "loss_tokens": int(sum(b["where"].sum() for b in batches)),
            "input_tokens": int(sum(b["attention_where"].sum() for b in batches)),
            "fill": sum(float(b["attention_where"].sum()) for b in batches) / slots,
            "times": [],
        }
    order = list(variants)
    for round_index in range(args.repeats):
        for name in order if round_index % 2 == 0 else order[::-1]:
            v = variants[name]
            params_, opt_state = v["state"]
            started = time.perf_counter()
            for batch in v["batches"]:
                params_, opt_state, value = step(params_, opt_state, batch)
            jax.block_until_ready(value)
            v["times"].append((time.perf_counter() - started) / args.steps)

    table = {}
    for name, v in variants.items():
        per_step = statistics.median(v["times"])
        table[name] = {
            "fill": round(v["fill"], 3),
            "step_ms": round(1000 * per_step, 2),
            "loss_tokens_per_s": round(v["loss_tokens"] / args.steps / per_step, 1),
            "input_tokens_per_s": round(v["input_tokens"] / args.steps / per_step, 1),
        }
    speedup = table["packed"]["loss_tokens_per_s"] / table["padded"]["loss_tokens_per_s"]
    print(f"{'variant':8} {'fill':>6} {'ms/step':>9} {'loss tok/s':>12} {'input tok/s':>12}")
    for name, row in table.items():
        print(
            f"{name:8} {row['fill']:6.3f} {row['step_ms']:9.2f} "
            f"{row['loss_tokens_per_s']:12.1f} {row['input_tokens_per_s']:12.1f}"
        )
    result = {
        "case": {"size": args.size, **size._asdict(), "steps": args.steps,
                 "repeats": args.repeats, "backend": jax.default_backend()},
        "correctness": check,
        "variants": table,
        "speedup": round(speedup, 3),
    }  # fmt: skip
    print(f"packed / padded tokens per second: {speedup:.2f}x")
    print(json.dumps(result))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
