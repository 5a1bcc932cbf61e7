r"""The same GRPO run on two backends (CPU and GPU or TPU), step by step: where and why they part.

    python benchmarks/grpo_parity.py --out cpu.npz                    # on one machine
    python benchmarks/grpo_parity.py --out tpu.npz --replay cpu.npz   # on the other
    python benchmarks/grpo_parity.py --compare cpu.npz tpu.npz        # anywhere

A float32 GRPO run of the recipes' `base` decoder shape (2 layers, hidden 128, tied
embeddings, QK-norm; vocabulary 32) on a synthetic verifiable task, from seed 0: each step
draws `--batch` prompts of 8 random tokens, samples `--group-size` completions of 16 tokens
per prompt at temperature 1 (`tunelib.rollout.sample`), rewards a completion with the fraction
of its tokens below 8, takes group-normalised advantages (`tunelib.advantages.
group_advantages`) and one AdamW step on the clipped policy-gradient loss
(`tunelib.losses.policy_gradient_loss`, token mean) with the trainer's log-probs from
`tunelib.rollout.completion_logps`. Everything is a function of the seed: two runs on one
backend are identical.

Each run records, per step: the sampled tokens, the sampler's log-probs of them, the
trainer's log-probs of them before the update, the loss, the gradient's global norm, the mean
reward and the parameters' global norm after the update.

With `--replay FILE`, the run trains on FILE's sampled tokens instead of its own (it still
samples, to count how many of its own tokens agree), so that the losses and gradient norms of
the two runs compare step for step on the same data: their differences are the backends'
arithmetic alone, compounded through the updates. Without it, the runs sample freely, and
the first token that differs sends the two trajectories apart.

`--compare A B` prints, per step, the fraction of equal sampled tokens, the largest
differences of the log-probs, and the relative differences of loss, gradient norm and
parameter norm (the loss's absolute difference: an on-policy loss is the mean advantage,
about 0), and ends with one JSON line: the first step with a differing token, and
the largest relative differences over the run. `--matmul-precision highest` asks for full
float32 products (a GPU otherwise may use TF32 for float32 matrix products, a TPU bfloat16
passes).
"""

import argparse
import json
import sys
from pathlib import Path

VOCAB, PROMPT_LEN, NEW_TOKENS, SMALL = 32, 8, 16, 8
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
    tie_word_embeddings=True, use_qk_norm=True,
)  # fmt: skip
PER_STEP = ("tokens", "sampler_logps", "trainer_logps", "loss", "grad_norm", "reward")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=None, help="run, and write the record here (.npz)")
    p.add_argument("--replay", type=Path, default=None, help="train on this record's tokens")
    p.add_argument("--compare", type=Path, nargs=2, default=None, metavar=("A", "B"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--matmul-precision", choices=("default", "highest"), default="default")
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.out is None) == (args.compare is None):
        parser.error("give either --out (run) or --compare A B.")
    for name in ("steps", "batch", "group_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1.")
    if args.group_size < 2:
        parser.error("--group-size must be at least 2 (the advantages are group-normalised).")
    for path in [args.replay, *(args.compare or [])]:
        if path is not None and not path.is_file():
            parser.error(f"{path} is not a file.")
    return args


def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from tunelib import advantages, losses
    from tunelib.models import Decoder, DecoderConfig
    from tunelib.rollout import SamplingConfig, completion_logps, sample

    if args.matmul_precision == "highest":
        jax.config.update("jax_default_matmul_precision", "highest")
    replay = None if args.replay is None else np.load(args.replay)
    graphdef, params = nnx.split(Decoder(DecoderConfig(**CONFIG), rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    optimizer = optax.adamw(args.learning_rate)
    opt_state = optimizer.init(params)
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, stop_tokens=())
    g = args.group_size

    @jax.jit
    def update(params, opt_state, prompts, tokens, old_logps):
        where = jnp.ones(tokens.shape, jnp.bool_)
        prompt_where = jnp.ones(prompts.shape, jnp.bool_)
        rewards = jnp.mean(tokens < SMALL, axis=1)
        adv = advantages.group_advantages(rewards, group_size=g)

        def loss_fn(params):
            logps = completion_logps(graphdef, params, prompts, prompt_where, tokens, where)
            per_token = losses.policy_gradient_loss(logps, old_logps, adv, where=where)
            return jnp.mean(per_token), logps

        (loss, logps), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {
            "loss": loss, "grad_norm": optax.global_norm(grads), "reward": jnp.mean(rewards),
            "trainer_logps": logps, "param_norm": optax.global_norm(params),
        }  # fmt: skip

    record = {name: [] for name in (*PER_STEP, "param_norm", "own_token_agreement")}
    key = jax.random.key(0)
    for step in range(args.steps):
        prompt_key, sample_key = jax.random.split(jax.random.fold_in(key, step))
        prompts = jax.random.randint(prompt_key, (args.batch, PROMPT_LEN), 0, VOCAB)
        where = jnp.ones(prompts.shape, jnp.bool_)
        out = sample(graphdef, params, prompts, where, sample_key, sampling, group_size=g)
        tokens, logps = np.asarray(out.tokens), np.asarray(out.logps)
        if replay is not None:
            record["own_token_agreement"].append(float(np.mean(tokens == replay["tokens"][step])))
            tokens, logps = replay["tokens"][step], replay["sampler_logps"][step]
        params, opt_state, metrics = update(params, opt_state, prompts, tokens, logps)
        record["tokens"].append(tokens)
        record["sampler_logps"].append(logps)
        for name, value in metrics.items():
            record[name].append(np.asarray(value))
    arrays = {name: np.stack(values) for name, values in record.items() if values}
    np.savez(args.out, **arrays)
    return {
        "benchmark": "grpo_parity", "mode": "run", "out": str(args.out),
        "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "matmul_precision": args.matmul_precision,
        "replay": None if args.replay is None else str(args.replay), "steps": args.steps,
        "first_loss": float(arrays["loss"][0]), "last_loss": float(arrays["loss"][-1]),
        "first_reward": float(arrays["reward"][0]), "last_reward": float(arrays["reward"][-1]),
    }  # fmt: skip


def compare(a_path: Path, b_path: Path) -> dict:
    import numpy as np

    a, b = np.load(a_path), np.load(b_path)
    steps = min(len(a["loss"]), len(b["loss"]))

    def relative(name: str) -> np.ndarray:
        x, y = a[name][:steps].astype(np.float64), b[name][:steps].astype(np.float64)
        return np.abs(x - y) / np.maximum(np.abs(x), 1e-30)

    agree = [float(np.mean(a["tokens"][s] == b["tokens"][s])) for s in range(steps)]
    sampler = [float(np.max(np.abs(a["sampler_logps"][s] - b["sampler_logps"][s])))
               for s in range(steps)]  # fmt: skip
    trainer = [float(np.max(np.abs(a["trainer_logps"][s] - b["trainer_logps"][s])))
               for s in range(steps)]  # fmt: skip
    loss, grad, param = relative("loss"), relative("grad_norm"), relative("param_norm")
    # An on-policy step's loss is the mean advantage, about 0 (1e-8): its absolute difference
    # is the figure to read; the relative one divides by rounding noise.
    loss_abs = np.abs(a["loss"][:steps].astype(np.float64) - b["loss"][:steps])
    print(f"{a_path} against {b_path}, {steps} steps")
    print(f"{'step':>4} {'tokens equal':>12} {'sampler logp':>13} {'trainer logp':>13} "
          f"{'loss abs':>9} {'grad rel':>9} {'param rel':>9}")  # fmt: skip
    for s in range(steps):
        print(f"{s:>4} {agree[s]:>12.1%} {sampler[s]:>13.2e} {trainer[s]:>13.2e} "
              f"{loss_abs[s]:>9.1e} {grad[s]:>9.1e} {param[s]:>9.1e}")  # fmt: skip
    differing = [s for s in range(steps) if agree[s] < 1.0]
    return {
        "benchmark": "grpo_parity", "mode": "compare", "a": str(a_path), "b": str(b_path),
        "steps": steps, "first_step_with_differing_tokens": differing[0] if differing else None,
        "token_agreement": agree, "max_sampler_logp_diff": sampler,
        "max_trainer_logp_diff": trainer, "loss_abs_diff": loss_abs.tolist(),
        "loss_relative_diff": loss.tolist(),
        "grad_norm_relative_diff": grad.tolist(), "param_norm_relative_diff": param.tolist(),
        "reward": [a["reward"][:steps].tolist(), b["reward"][:steps].tolist()],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)  # flags are checked before JAX is imported
    result = compare(*args.compare) if args.compare is not None else run(args)
    line = json.dumps(result)
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
