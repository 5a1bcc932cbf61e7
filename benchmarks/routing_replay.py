r"""Routing replay (R3) on a tiny Qwen3-MoE-shaped model in bfloat16: how often the trainer's
forward pass routes a token to other experts than the sampler did, and what that does to the
sampler/trainer mismatch, with and without replaying the sampler's routing.

    python benchmarks/routing_replay.py                  # 4 MoE layers, 8 experts, top-2; 3 seeds
    python benchmarks/routing_replay.py --size smoke --seeds 1    # seconds; what the tests run
    python benchmarks/routing_replay.py --json-out result.json

For each seed: a freshly initialised model (`DecoderConfig(dtype="bfloat16",
param_dtype="bfloat16")`, every layer a mixture of experts, renormalised top-k weights as
Qwen3-MoE), random prompts, and `rollout.sample(..., record_routing=True)` at temperature 1
(the KV-cache prefill, then one cached decode step per token), which returns the behaviour
log-probs and the experts every token went to. Then the trainer's recomputation,
`rollout.completion_logps` over each prompt and completion concatenated
(`share_prompts=False`, one full forward pass, as TRL and Tunix score), twice:

- ``plain``: the router's own top-k;
- ``replay``: `routing=rollout.routing`, the sampler's experts, the gate weights from the
  trainer's own router logits.

Reported per seed and as means: the fraction of real tokens (prompt and completion) whose set
of experts in some layer differs between the sampler's record and the plain forward pass
(`Decoder(..., return_routing=True)`), the fraction of completion tokens whose log-prob is
affected (the token itself or one before it flipped); the mismatch KL
(`tunelib.metrics.mismatch_kl`, $k_3$, mean and max over completion tokens) and max
$|\Delta \log p|$ of trainer against behaviour log-probs, for both. The replayed forward
pass's routing is checked equal to the record before anything is reported. The script prints
a table and one JSON line; nothing is timed.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import NamedTuple


class Size(NamedTuple):
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_width: int
    vocab: int
    prompt_len: int
    new_tokens: int
    batch: int


SIZES = {
    "tiny": Size(
        layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, experts=8, top_k=2,
        expert_width=64, vocab=512, prompt_len=16, new_tokens=32, batch=16,
    ),
    "smoke": Size(
        layers=2, hidden=32, heads=2, kv_heads=1, head_dim=16, experts=4, top_k=2,
        expert_width=16, vocab=64, prompt_len=4, new_tokens=8, batch=4,
    ),
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model and lengths")
    p.add_argument("--seeds", type=int, default=3, help="models and samples, seeds 0, 1, ...")
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    return p


def run_seed(size: Size, seed: int) -> dict:
    """One model, one rollout, the plain and the replayed recomputation."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tunelib import metrics
    from tunelib.models import Decoder, DecoderConfig
    from tunelib.rollout import SamplingConfig, completion_logps, sample

    config = DecoderConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.expert_width,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, head_dim=size.head_dim, num_experts=size.experts,
        num_experts_per_tok=size.top_k, moe_intermediate_size=size.expert_width,
        norm_topk_prob=True, use_qk_norm=True, dtype="bfloat16", param_dtype="bfloat16",
    )  # fmt: skip
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(seed)))
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, size.vocab, size=(size.batch, size.prompt_len), dtype=np.int32)
    prompt_where = np.ones_like(prompts, bool)
    sampling = SamplingConfig(max_new_tokens=size.new_tokens, temperature=1.0)
    out = sample(graphdef, params, prompts, prompt_where, jax.random.key(seed), sampling,
                 record_routing=True)  # fmt: skip

    @nnx.jit
    def routings(model, tokens, where, recorded):
        _, own = model(tokens, where=where, return_routing=True)
        _, replayed = model(tokens, where=where, routing=recorded, return_routing=True)
        return own, replayed

    tokens = jnp.concatenate([prompts, out.tokens], axis=1)
    where = jnp.concatenate([prompt_where, out.where], axis=1)
    record = jnp.transpose(out.routing, (2, 0, 1, 3))  # the decoder's layout, layers first
    own, replayed = routings(nnx.merge(graphdef, params), tokens, where, record)
    if not bool(jnp.all(replayed == record)):
        raise SystemExit("the replayed forward pass did not route by the record")

    score = jax.jit(completion_logps, static_argnums=0, static_argnames=("share_prompts",))
    logps = {
        "plain": score(graphdef, params, prompts, prompt_where, out.tokens, out.where,
                       share_prompts=False),
        "replay": score(graphdef, params, prompts, prompt_where, out.tokens, out.where,
                        share_prompts=False, routing=out.routing),
    }  # fmt: skip

    differs = np.any(np.sort(np.asarray(own), -1) != np.sort(np.asarray(record), -1), -1)
    flipped = differs.any(axis=0) & np.asarray(where)  # [R, P + N]: some layer differs
    # Completion token j's log-prob depends on every token before it (and on j's predictor).
    before = np.maximum.accumulate(flipped, axis=1)[:, size.prompt_len - 1 : -1]
    completion = np.asarray(out.where)
    result = {
        "seed": seed,
        "tokens": int(np.asarray(where).sum()),
        "completion_tokens": int(completion.sum()),
        "flipped_token_fraction": float(flipped.sum() / np.asarray(where).sum()),
        "affected_completion_fraction": float((before & completion).sum() / completion.sum()),
    }
    for name, values in logps.items():
        kl = metrics.mismatch_kl(values, out.logps, estimator="k3", where=out.where)
        delta = jnp.where(out.where, jnp.abs(values - out.logps), 0.0)
        result[name] = {
            "mismatch_kl_mean": float(kl.mean),
            "mismatch_kl_max": float(kl.max),
            "max_abs_logp_diff": float(delta.max()),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.seeds < 1:
        build_parser().error(f"--seeds must be >= 1, got {args.seeds}")
    size = SIZES[args.size]
    import jax

    runs = [run_seed(size, seed) for seed in range(args.seeds)]
    print(
        f"{args.size}: {size.layers} MoE layers, {size.experts} experts, top-{size.top_k}, "
        f"bfloat16; {size.batch} prompts of {size.prompt_len} tokens, {size.new_tokens} "
        f"sampled (jax {jax.__version__}, {jax.default_backend()})"
    )
    header = (
        "| seed | tokens with a routing flip | completion log-probs affected "
        "| mismatch KL mean, plain / replay | KL max, plain / replay "
        "| max abs dlogp, plain / replay |"
    )
    print(header)
    print("|" + "---|" * 6)
    for r in runs:
        p, q = r["plain"], r["replay"]
        print(
            f"| {r['seed']} | {r['flipped_token_fraction']:.1%} "
            f"| {r['affected_completion_fraction']:.1%} "
            f"| {p['mismatch_kl_mean']:.2e} / {q['mismatch_kl_mean']:.2e} "
            f"| {p['mismatch_kl_max']:.2e} / {q['mismatch_kl_max']:.2e} "
            f"| {p['max_abs_logp_diff']:.2e} / {q['max_abs_logp_diff']:.2e} |"
        )

    def mean(*keys):
        values = []
        for r in runs:
            value = r
            for key in keys:
                value = value[key]
            values.append(value)
        return statistics.fmean(values)

    result = {
        "size": args.size,
        **size._asdict(),
        "dtype": "bfloat16",
        "seeds": args.seeds,
        "runs": runs,
        "flipped_token_fraction": mean("flipped_token_fraction"),
        "affected_completion_fraction": mean("affected_completion_fraction"),
        **{
            f"{name}_{metric}": mean(name, metric)
            for name in ("plain", "replay")
            for metric in ("mismatch_kl_mean", "mismatch_kl_max", "max_abs_logp_diff")
        },
    }
    line = json.dumps(result)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
