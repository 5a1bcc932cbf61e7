"""ORPO from scratch in one stage, compared with SFT alone at the same step budget.

    python recipes/orpo.py                 # ORPO, then the SFT baseline with the same steps
    python recipes/orpo.py --no-baseline   # ORPO only
    python recipes/orpo.py --resume        # continue a killed run from its last checkpoint

ORPO needs no reference model: its loss is the NLL of the chosen completion plus a penalty on
the log odds ratio of chosen over rejected, both from length-normalised log-probs. The train
step below is ordinary user code composed from `tunelib.logprobs` and `tunelib.losses`.
"""

import sys

import common
import jax
import jax.numpy as jnp
import optax
import sft
from flax import nnx

from tunelib import logprobs, losses
from tunelib.data import preference_dataset, preference_pairs


def build_parser():
    p = common.parser(__doc__.splitlines()[0], steps=1000, batch_size=64, learning_rate=3e-3)
    p.add_argument(
        "--lambda", dest="lambda_", type=float, default=0.1, help="weight of the odds-ratio term"
    )
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the SFT-only run with the same steps, seed and learning rate",
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    run = common.Run("orpo", args)
    task = common.task(args)
    config = common.model_config(task.tokenizer, args.model_size)
    graphdef, params = common.init_model(config, args.seed)
    pairs = preference_pairs(task.train, seed=args.seed)
    batches = iter(
        preference_dataset(
            pairs,
            task.tokenizer,
            max_length=task.max_length,
            batch_size=args.batch_size,
            seed=args.seed,
        )
    )
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.learning_rate, warmup_steps=max(1, args.steps // 20), decay_steps=args.steps
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)
    )

    def loss_fn(params, batch):
        both = jax.tree.map(
            lambda c, r: jnp.concatenate([c, r]), batch["chosen"], batch["rejected"]
        )
        model = nnx.merge(graphdef, params)
        hidden = model(both["tokens"], attention_where=both["attention_where"])
        token = logprobs.fused_token_logps(
            hidden,
            model.unembedding(),
            both["targets"],
            where=both["where"],
            implementation=args.logprobs,
        )
        chosen, rejected = jnp.split(logprobs.sequence_mean(token, where=both["where"]), 2)
        per_pair = losses.orpo_loss(chosen, rejected, lambda_=args.lambda_)
        log_odds_ratio = losses.orpo_log_odds_ratio(chosen, rejected)
        return per_pair.mean(), {"nll": -chosen.mean(), "log_odds_ratio": log_odds_ratio.mean()}

    @jax.jit
    def train_step(state, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state}, {"loss": loss, **metrics}

    def evaluate(params):
        return {"accuracy": common.accuracy(graphdef, params, task)}

    accuracy_before = evaluate(params)["accuracy"]
    state = {
        "params": params,
        "opt_state": optimizer.init(params),
        "rng": common.key_data(args.seed),
    }
    state = run.train(state=state, batches=batches, step_fn=train_step, evaluate=evaluate)
    common.save_model(run.folder / "model", config, state["params"])
    headline = {
        "seed": args.seed,
        "steps": args.steps,
        "accuracy_before": accuracy_before,
        "accuracy_after": run.records()[-1]["accuracy"],
    }
    if not args.no_baseline:
        same = ("seed", "steps", "learning_rate", "batch_size", "num_train", "num_heldout",
                "max_digits", "eval_every", "logprobs", "model_size")  # fmt: skip
        out = ["--out", str(run.folder / "sft-baseline")]
        baseline = sft.main(common.forward_flags(args, *same) + out)
        headline["sft_accuracy_after"] = baseline["accuracy_after"]
    return run.finish(headline)


if __name__ == "__main__":
    main(sys.argv[1:])
