"""Supervised fine-tuning of the reference decoder, from scratch, on the arithmetic task.

    python recipes/sft.py                 # quick default, about a minute on 2 CPU cores
    python recipes/sft.py --steps 3000    # longer
    python recipes/sft.py --resume        # continue a killed run from its last checkpoint

The train step below is ordinary user code: a forward pass, `tunelib.losses.nll_loss` on the
completion tokens, `aggregate` for the token mean, and an Optax update.
"""

import sys

import common
import jax
import optax
from flax import nnx

from tunelib import logprobs, losses
from tunelib.data import sft_dataset


def build_parser():
    p = common.parser(__doc__.splitlines()[0], steps=1000, batch_size=64, learning_rate=3e-3)
    p.add_argument(
        "--label-smoothing", type=float, default=0.0, help="> 0 computes the full logits"
    )
    p.add_argument("--z-loss-weight", type=float, default=0.0, help="> 0 computes the full logits")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    run = common.Run("sft", args)
    task = common.task(args)
    config = common.model_config(task.tokenizer, args.model_size)
    graphdef, params = common.init_model(config, args.seed)
    records = [{"prompt": r["prompt"], "completion": r["answer"]} for r in task.train]
    batches = iter(
        sft_dataset(
            records,
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
        model = nnx.merge(graphdef, params)
        hidden = model(batch["tokens"], attention_where=batch["attention_where"])
        if args.label_smoothing or args.z_loss_weight:  # these need every logit
            per_token = losses.nll_loss(
                model.unembed(hidden),
                batch["targets"],
                label_smoothing=args.label_smoothing,
                z_loss_weight=args.z_loss_weight,
                where=batch["where"],
            )
        else:  # the NLL from the fused head: no [B, T, V] logits
            per_token = -logprobs.fused_token_logps(
                hidden,
                model.unembedding(),
                batch["targets"],
                where=batch["where"],
                implementation=args.logprobs,
            )
        return losses.aggregate(per_token, mode="token_mean", where=batch["where"]).mean()

    @jax.jit
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state}, {"loss": loss}

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
    last = run.records()[-1]
    return run.finish(
        {
            "seed": args.seed,
            "steps": args.steps,
            "accuracy_before": accuracy_before,
            "accuracy_after": last["accuracy"],
            "final_loss": last["loss"],
        }
    )


if __name__ == "__main__":
    main(sys.argv[1:])
