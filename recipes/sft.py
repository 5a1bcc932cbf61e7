"""Supervised fine-tuning of the reference decoder on the arithmetic task, from scratch or not.

    python recipes/sft.py                 # quick default, from scratch: about a minute on 2 CPUs
    python recipes/sft.py --steps 3000    # longer
    python recipes/sft.py --resume        # continue a killed run from its last checkpoint
    python recipes/sft.py --model runs/sft-minus/model --lora-rank 16   # LoRA on a trained model
    python recipes/sft.py --model runs/sft-minus/model --lora-rank 16 --qlora
    python recipes/sft.py --model HF_CHECKPOINT --data chats.jsonl    # your model and data

The train step below is ordinary user code: a forward pass, `tunelib.losses.nll_loss` on the
completion tokens, `aggregate` for the token mean, and an Optax update. With `--lora-rank` the
same loss runs through `tunelib.peft.lora` on the frozen base with adapters applied, and only
the adapters are differentiated and updated. With `--data` the records of a file (chat
`messages`, or `prompt` / `completion`) are tokenized with the checkpoint's own tokenizer and
chat template, the loss covers the assistant turns, and the held-out metric is the loss.
"""

import functools
import sys
from pathlib import Path

import common
import jax
import optax
from flax import nnx

from tunelib import logprobs, losses, peft
from tunelib.data import hf_sft_dataset, sft_dataset


def build_parser():
    p = common.parser(
        __doc__.splitlines()[0],
        steps=1000,
        batch_size=64,
        learning_rate=3e-3,
        lora_learning_rate=3e-3,
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="start from the model in this folder (a Hugging Face checkpoint, or a recipe's "
        "model/ output) instead of a random initialisation",
    )
    p.add_argument(
        "--label-smoothing", type=float, default=0.0, help="> 0 computes the full logits"
    )
    p.add_argument("--z-loss-weight", type=float, default=0.0, help="> 0 computes the full logits")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = common.parse(build_parser(), argv)
    run = common.Run("sft", args)
    task = common.task(args) if args.data is None else None
    if args.model is None:
        if task is None:
            raise SystemExit("--data needs --model, a Hugging Face checkpoint with a tokenizer.")
        config = common.model_config(task.tokenizer, args.model_size)
        start = common.Start(config, *common.init_model(config, args.seed), None, None)
    else:
        start = common.load_start(args.model)
    graphdef = start.graphdef
    trainable, base = common.lora_setup(args, start.params)
    if task is not None:
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
    else:
        tokenizer = start.tokenizer()
        train, heldout = common.data_records(args, "sft")
        data = functools.partial(
            hf_sft_dataset, tokenizer=tokenizer, max_length=args.max_length,
            batch_size=args.batch_size, seed=args.seed,
        )  # fmt: skip
        batches = iter(data(train))
        heldout_batches = list(data(heldout, shuffle=False, num_epochs=1, drop_remainder=False))
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
    def train_step(base, state, batch):
        key, dropout_key = jax.random.split(jax.random.wrap_key_data(state["rng"]))

        def objective(trainable):  # the weights, or the adapters on the frozen base
            params = common.model_params(
                trainable, base, dropout_key if args.lora_dropout else None
            )
            return peft.lora(loss_fn)(params, batch)

        loss, grads = jax.value_and_grad(objective)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        state = {"params": params, "opt_state": opt_state, "rng": jax.random.key_data(key)}
        return state, {"loss": loss}

    heldout_loss = jax.jit(loss_fn)

    def evaluate(trainable):
        params = common.dense_params(trainable, base)
        if args.data is None:
            return {"accuracy": common.accuracy(graphdef, params, task)}
        # The token mean over every held-out token: batch means weighted by their tokens.
        counts = [float(b["where"].sum()) for b in heldout_batches]
        total = sum(
            float(heldout_loss(params, b)) * n for b, n in zip(heldout_batches, counts, strict=True)
        )
        return {"heldout_loss": total / sum(counts) if sum(counts) else float("nan")}

    before = evaluate(trainable)
    state = {
        "params": trainable,
        "opt_state": optimizer.init(trainable),
        "rng": common.key_data(args.seed),
    }
    state = run.train(
        state=state,
        batches=batches,
        step_fn=functools.partial(train_step, base),
        evaluate=evaluate,
    )
    params = common.dense_params(state["params"], base)
    common.save_outputs(run.folder, start, params, state["params"], base)
    last = run.records()[-1]
    metric = "accuracy" if args.data is None else "heldout_loss"
    return run.finish(
        {
            "seed": args.seed,
            "steps": args.steps,
            **common.tuning_headline(args, trainable, base),
            f"{metric}_before": before[metric],
            f"{metric}_after": last[metric],
            "final_loss": last["loss"],
        }
    )


if __name__ == "__main__":
    main(sys.argv[1:])
