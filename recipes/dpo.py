"""DPO of the SFT model on verifier-labelled pairs: the correct answer against its own mistake.

    python recipes/dpo.py                   # trains recipes/sft.py first if its model is absent
    python recipes/dpo.py --loss ipo --beta 0.5
    python recipes/dpo.py --resume          # continue a killed run from its last checkpoint
    python recipes/dpo.py --lora-rank 16    # LoRA adapters on the frozen SFT model (--qlora: NF4)
    python recipes/dpo.py --model HF_CHECKPOINT --data pairs.jsonl   # your model and pairs

Where the SFT model answers a training prompt correctly, the rejected answer is a near miss.
The reference policy is the SFT model, frozen. The train step below is ordinary user code:
one forward pass over chosen and rejected completions, sequence log-probs from
`tunelib.logprobs`, a pairwise loss from `tunelib.losses`, and an Optax update. With
`--lora-rank` the policy is the SFT model with LoRA adapters (`tunelib.peft`) and the
reference is the same frozen base without them (in NF4 with `--qlora`), as TRL does for PEFT
models, so policy and reference start equal. With `--data` the pairs of a file (`prompt` /
`chosen` / `rejected`, as strings or chat messages) are tokenized with the checkpoint's own
tokenizer, and the held-out metric is the implicit-reward accuracy on held-out pairs.
"""

import functools
import sys
from pathlib import Path

import common
import jax
import jax.numpy as jnp
import optax
import sft
from flax import nnx

from tunelib import logprobs, losses, peft
from tunelib.data import hf_preference_dataset, preference_dataset, preference_pairs

# Pairwise losses that share DPO's signature: (chosen, rejected, ref_chosen, ref_rejected).
PAIRWISE = {
    "dpo": losses.dpo_loss,
    "robust_dpo": losses.robust_dpo_loss,
    "ipo": losses.ipo_loss,
    "hinge": losses.hinge_loss,
    "exo": losses.exo_loss,
    "nca": losses.nca_loss,
    "bco_pair": losses.bco_pair_loss,
    "sppo_hard": losses.sppo_hard_loss,
    "apo_zero": losses.apo_zero_loss,
    "apo_down": losses.apo_down_loss,
    "discopop": losses.discopop_loss,
}


def build_parser():
    p = common.parser(
        __doc__.splitlines()[0],
        steps=300,
        batch_size=64,
        learning_rate=1e-4,
        lora_learning_rate=1e-3,
    )
    p.add_argument("--loss", choices=sorted(PAIRWISE), default="dpo")
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument(
        "--rejected",
        choices=["model", "near_miss"],
        default="model",
        help="rejected answers: the SFT model's own wrong greedy answers (near misses where it "
        "is right), or near misses only",
    )
    p.add_argument(
        "--nll-weight",
        type=float,
        default=0.0,
        help="weight of the chosen answers' per-token NLL added to the pairwise loss "
        "(0 = the pairwise loss alone)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=9000,
        help="training prompts the preference pairs are built on",
    )
    common.add_start_flags(p)
    return p


def ensure_sft_model(args) -> Path:
    """The SFT model of this seed, trained first (quick default) when it is absent."""
    folder = args.sft_dir or common.RUNS / f"sft-seed{args.seed}" / "model"
    if not common.has_model(folder) and args.data is not None:
        raise SystemExit(f"no model at {folder}: --data needs --model, a Hugging Face checkpoint.")
    if not common.has_model(folder):
        print(f"no SFT model at {folder}: training it first with recipes/sft.py", flush=True)
        same = (
            "seed",
            "num_train",
            "num_heldout",
            "max_digits",
            "operations",
            "logprobs",
            "model_size",
        )
        steps = ["--steps", str(args.sft_steps)] if args.sft_steps else []
        sft.main(common.forward_flags(args, *same) + steps + ["--out", str(folder.parent)])
    return folder


def main(argv: list[str] | None = None) -> dict:
    args = common.parse(build_parser(), argv)
    sft_folder = ensure_sft_model(args)
    run = common.Run("dpo", args)
    start = common.load_start(sft_folder)
    graphdef, ref_params = start.graphdef, start.params
    trainable, base = common.lora_setup(args, ref_params)
    # With LoRA the reference is the frozen base without adapters: the policy's start.
    frozen = {"base": base, "reference": ref_params if base is None else base}
    if args.data is None:
        task = common.task(args, num_train=args.num_prompts)
        pairs = preference_pairs(task.train, seed=args.seed)
        if args.rejected == "model":
            # On-policy negatives: where the SFT model answers a training prompt wrongly,
            # prefer the correct answer over exactly that mistake.
            answers = common.greedy_answers(graphdef, ref_params, task, task.train)
            pairs = [
                {**pair, "rejected": answer} if answer and answer != pair["chosen"] else pair
                for pair, answer in zip(pairs, answers, strict=True)
            ]
        batches = iter(
            preference_dataset(
                pairs,
                task.tokenizer,
                max_length=task.max_length,
                batch_size=args.batch_size,
                seed=args.seed,
            )
        )
    else:
        train, heldout = common.data_records(args, "preference")
        data = functools.partial(
            hf_preference_dataset, tokenizer=start.tokenizer(), max_length=args.max_length,
            batch_size=args.batch_size, seed=args.seed,
        )  # fmt: skip
        batches = iter(data(train))
        heldout_batches = list(data(heldout, shuffle=False, num_epochs=1, drop_remainder=False))
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optax.warmup_cosine_decay_schedule(
                0.0,
                args.learning_rate,
                warmup_steps=max(1, args.steps // 10),
                decay_steps=args.steps,
            ),
            weight_decay=0.0,
        ),
    )
    pairwise_loss = PAIRWISE[args.loss]

    def token_logps(params, batch):
        """Completion token log-probs `[2B, T]` of chosen then rejected, in one forward pass."""
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
        return token, both["where"]

    def loss_fn(trainable, frozen, batch, dropout_key):
        params = common.model_params(trainable, frozen["base"], dropout_key)
        token, where = peft.lora(token_logps)(params, batch)
        chosen, rejected = jnp.split(logprobs.sequence_sum(token, where=where), 2)
        ref_token, _ = jax.lax.stop_gradient(peft.lora(token_logps)(frozen["reference"], batch))
        ref_chosen, ref_rejected = jnp.split(logprobs.sequence_sum(ref_token, where=where), 2)
        per_pair = pairwise_loss(chosen, rejected, ref_chosen, ref_rejected, beta=args.beta)
        # The NLL of the chosen answer, per token (Llama 3 adds it to DPO with weight 0.2).
        chosen_nll = -jnp.split(logprobs.sequence_mean(token, where=where), 2)[0]
        per_pair = per_pair + args.nll_weight * chosen_nll
        chosen_rewards = losses.implicit_rewards(chosen, ref_chosen, beta=args.beta)
        rejected_rewards = losses.implicit_rewards(rejected, ref_rejected, beta=args.beta)
        metrics = {
            "reward_accuracy": losses.preference_accuracy(chosen_rewards, rejected_rewards),
            "reward_margin": losses.reward_margins(chosen_rewards, rejected_rewards).mean(),
            "chosen_logps": chosen.mean(),
        }
        return per_pair.mean(), metrics

    @jax.jit
    def train_step(frozen, state, batch):
        key, dropout_key = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        dropout_key = dropout_key if args.lora_dropout else None
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], frozen, batch, dropout_key
        )
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        state = {"params": params, "opt_state": opt_state, "rng": jax.random.key_data(key)}
        return state, {"loss": loss, **metrics}

    heldout_metrics = jax.jit(
        lambda trainable, frozen, batch: loss_fn(trainable, frozen, batch, None)[1]
    )

    def evaluate(trainable):
        if args.data is None:
            params = common.dense_params(trainable, base)
            return {"accuracy": common.accuracy(graphdef, params, task)}
        # The share of held-out pairs whose chosen answer gets the higher implicit reward.
        rows = [len(b["chosen"]["tokens"]) for b in heldout_batches]
        right = sum(
            float(heldout_metrics(trainable, frozen, b)["reward_accuracy"]) * n
            for b, n in zip(heldout_batches, rows, strict=True)
        )
        return {"heldout_reward_accuracy": right / sum(rows) if rows else float("nan")}

    before = evaluate(trainable)
    state = {
        "params": trainable,
        "opt_state": optimizer.init(trainable),
        "rng": common.key_data(args.seed),
    }
    state = run.train(
        state=state,
        batches=batches,
        step_fn=functools.partial(train_step, frozen),
        evaluate=evaluate,
    )
    params = common.dense_params(state["params"], base)
    common.save_outputs(run.folder, start, params, state["params"], base)
    last = run.records()[-1]
    metric = "accuracy" if args.data is None else "heldout_reward_accuracy"
    return run.finish(
        {
            "seed": args.seed,
            "loss": args.loss,
            "steps": args.steps,
            **common.tuning_headline(args, trainable, base),
            f"{metric}_before": before[metric],
            f"{metric}_after": last[metric],
            "final_reward_accuracy": last["reward_accuracy"],
        }
    )


if __name__ == "__main__":
    main(sys.argv[1:])
