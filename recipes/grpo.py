"""GRPO of the SFT model, rewarded by the task's verifier; DAPO and Dr. GRPO by flag.

    python recipes/grpo.py                    # trains recipes/sft.py first if its model is absent
    python recipes/grpo.py --mode dapo        # clip-higher, token mean, overlong, dynamic sampling
    python recipes/grpo.py --mode dr_grpo     # unscaled advantages, token sum / max length
    python recipes/grpo.py --resume           # continue a killed run from its last checkpoint
    python recipes/grpo.py --lora-rank 16     # LoRA adapters on the frozen SFT model (--qlora)
    python recipes/grpo.py --model HF_CHECKPOINT --data problems.jsonl   # your model and prompts

Each step samples `--group-size` completions for each of `--batch-size` training prompts
with the KV-cache sampler of `tunelib.rollout`, scores them with the task's verifier (1 for
the exact answer, plus `--format-weight` for a well-formed one: digits, ended by EOS), and
takes `--updates-per-batch` Optax steps on the clipped surrogate of `tunelib.losses` with
group-relative advantages from `tunelib.advantages`. The behaviour log-probs are the sampler's; the
reference policy (for the KL term) is the SFT model, frozen. With `--lora-rank` only LoRA
adapters train (`tunelib.peft`), the reference is the frozen base without them, and the sampler
gets the adapters merged into the base before each batch of rollouts. With `--data` the
prompts of a file (`prompt` / `answer` records) are sampled with the checkpoint's tokenizer and
stop tokens, a completion earns 1 when its text equals the answer (both stripped), and the
held-out metric is the greedy exact-match accuracy.
"""

import dataclasses
import functools
import sys

import common
import dpo
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tunelib import advantages, logprobs, losses, peft, rollout
from tunelib.data import encode_prompts, hf_prompts, verify_answer

# What each mode sets; every value can be overridden by its flag.
MODES = {
    # Shao et al. 2024: group-normalised advantages, symmetric clip, k3 KL, per-sequence mean.
    "grpo": {"scale": "group", "aggregation": "seq_mean_token_mean", "epsilon_high": 0.2,
             "kl_beta": 0.04, "overlong_buffer": 0, "dynamic_sampling": False},
    # Yu et al. 2025: clip-higher, no KL, token mean, soft overlong penalty, dynamic sampling.
    "dapo": {"scale": "group", "aggregation": "token_mean", "epsilon_high": 0.28,
             "kl_beta": 0.0, "overlong_buffer": 2, "dynamic_sampling": True},
    # Liu et al. 2025: advantages not divided by the std, token sum / max length, no KL.
    "dr_grpo": {"scale": "none", "aggregation": "seq_mean_token_sum_norm", "epsilon_high": 0.2,
                "kl_beta": 0.0, "overlong_buffer": 0, "dynamic_sampling": False},
}  # fmt: skip


def build_parser():
    p = common.parser(
        __doc__.splitlines()[0],
        steps=150,
        batch_size=64,
        learning_rate=1e-4,
        lora_learning_rate=1e-3,
    )
    p.set_defaults(eval_every=50, checkpoint_every=50)
    p.add_argument("--mode", choices=sorted(MODES), default="grpo")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt, G")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--epsilon-low", type=float, default=0.2)
    p.add_argument("--epsilon-high", type=float, default=None, help="default: the mode's")
    p.add_argument("--kl-beta", type=float, default=None, help="k3 KL weight; default: the mode's")
    p.add_argument(
        "--updates-per-batch",
        type=int,
        default=1,
        help="optimizer steps on each batch of rollouts (PPO epochs); > 1 makes the clip bind",
    )
    p.add_argument(
        "--format-weight", type=float, default=0.1, help="reward of a well-formed answer"
    )
    p.add_argument("--num-prompts", type=int, default=9000, help="training prompts sampled from")
    common.add_start_flags(p)
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="with --data: tokens per completion"
    )
    return p


def well_formed(text: str, truncated: bool) -> bool:
    """An answer of digits (with an optional leading minus) that ended with EOS."""
    return not truncated and text.lstrip("-").isdigit() and text.count("-") <= 1


def main(argv: list[str] | None = None) -> dict:
    args = common.parse(build_parser(), argv)
    mode = {**MODES[args.mode]}
    mode["epsilon_high"] = (
        args.epsilon_high if args.epsilon_high is not None else mode["epsilon_high"]
    )
    mode["kl_beta"] = args.kl_beta if args.kl_beta is not None else mode["kl_beta"]
    sft_folder = dpo.ensure_sft_model(args)
    run = common.Run(f"grpo-{args.mode}" if args.mode != "grpo" else "grpo", args)
    start = common.load_start(sft_folder)
    graphdef, ref_params = start.graphdef, start.params
    trainable, base = common.lora_setup(args, ref_params)
    # With LoRA the reference is the frozen base without adapters: the policy's start.
    frozen = {"base": base, "reference": ref_params if base is None else base}
    group = args.group_size
    if args.data is None:  # the built-in task: its verifier and a reward for the format
        task = common.task(args, num_train=args.num_prompts)
        tok, train, heldout = task.tokenizer, task.train, task.heldout
        greedy = common.greedy_config(task)

        def encode(prompts):
            return encode_prompts(prompts, tok, max_length=task.max_length // 2)

        def correct(text, record):
            return verify_answer(text, record["answer"])

        format_weight = args.format_weight
    else:  # a file of prompts and answers: exact match, the checkpoint's stop tokens
        tok = start.tokenizer()
        train, heldout = common.data_records(args, "rl")
        greedy = rollout.SamplingConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=0.0,
            stop_tokens=tok.stop_ids,
            pad_token=tok.pad_id,
            forbidden_tokens=tuple(range(tok.vocab_size, start.config.vocab_size)),
        )

        def encode(prompts):
            return hf_prompts(prompts, tok, max_length=args.max_length)

        def correct(text, record):
            return text.strip() == str(record["answer"]).strip()

        format_weight = 0.0  # `well_formed` describes the built-in task's answers
    sampling = dataclasses.replace(greedy, temperature=args.temperature)
    new_tokens = sampling.max_new_tokens
    prompts = grain.MapDataset.range(len(train)).shuffle(seed=args.seed).repeat()
    batches = iter(prompts.batch(args.batch_size).to_iter_dataset())
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optax.warmup_constant_schedule(0.0, args.learning_rate, max(1, args.steps // 10)),
            weight_decay=0.0,
        ),
    )

    def completion_logps(params, batch):
        """Log-probs `[R, N]` and entropies of the completion tokens under `params`."""
        model = nnx.merge(graphdef, params)
        tokens = jnp.concatenate([batch["prompt_tokens"], batch["tokens"]], axis=1)
        where = jnp.concatenate([batch["prompt_where"], batch["where"]], axis=1)
        hidden = model(tokens, attention_where=where)
        prompt_len = batch["prompt_tokens"].shape[1]
        # Left-padded prompts: position P - 1 + j predicts completion token j.
        hidden = hidden[:, prompt_len - 1 : prompt_len - 1 + new_tokens]
        return logprobs.fused_token_logps(
            hidden,
            model.unembedding(),
            batch["tokens"],
            temperature=args.temperature,
            with_entropy=True,
            where=batch["where"],
            implementation=args.logprobs,
        )

    def loss_fn(trainable, frozen, batch, dropout_key):
        params = common.model_params(trainable, frozen["base"], dropout_key)
        token_logps, entropy = peft.lora(completion_logps)(params, batch)
        where = batch["where"] & batch["keep"][:, None]
        adv = advantages.group_advantages(
            batch["rewards"].reshape(-1, group), scale=mode["scale"]
        ).reshape(-1)
        clip = {"epsilon_low": args.epsilon_low, "epsilon_high": mode["epsilon_high"]}
        old = batch["logps"]
        per_token = losses.policy_gradient_loss(token_logps, old, adv, **clip, where=where)
        ref_logps, _ = jax.lax.stop_gradient(
            peft.lora(completion_logps)(frozen["reference"], batch)
        )
        # Over every completion (dropped groups included) for the log; `aggregate` masks it.
        kl = losses.kl_penalty(token_logps, ref_logps, estimator="k3", where=batch["where"])
        per_token = per_token + mode["kl_beta"] * kl
        norm = new_tokens if mode["aggregation"] == "seq_mean_token_sum_norm" else None
        loss = losses.aggregate(
            per_token, mode=mode["aggregation"], norm_constant=norm, where=where
        ).mean()
        fractions = losses.clip_fractions(token_logps, old, adv, **clip, where=where)

        def token_mean(x):
            return losses.aggregate(x, mode="token_mean", where=batch["where"]).mean()

        return loss, {
            "entropy": token_mean(entropy),
            "kl": token_mean(kl),
            "clip_fraction": fractions.region,
        }

    @jax.jit
    def update(frozen, state, batch, dropout_key):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], frozen, batch, dropout_key
        )
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state}, {"loss": loss, **metrics}

    def train_step(frozen, state, indices):
        """Sample and score a group per prompt on the host, then one jitted update."""
        records = [train[i] for i in np.asarray(indices)]
        prompt_tokens, prompt_where = encode([r["prompt"] for r in records])
        rng = jax.random.wrap_key_data(state["rng"])
        key, sample_key = jax.random.split(rng)
        dropout_key = jax.random.fold_in(rng, 1)
        policy = common.dense_params(state["params"], frozen["base"])  # adapters merged on sync
        out = rollout.sample(
            graphdef, policy, prompt_tokens, prompt_where, sample_key, sampling,
            group_size=group,
        )  # fmt: skip
        texts = [tok.decode(row) for row in np.asarray(out.tokens).tolist()]
        truncated = np.asarray(out.truncated)
        right = np.array([correct(t, records[i // group]) for i, t in enumerate(texts)])
        formed = np.array([well_formed(t, c) for t, c in zip(texts, truncated, strict=True)])
        rewards = right + format_weight * formed
        if mode["overlong_buffer"]:
            rewards = rewards + np.asarray(
                advantages.overlong_penalty(
                    out.lengths, max_length=new_tokens, buffer_length=mode["overlong_buffer"]
                )
            )
        rewards = rewards.astype(np.float32)
        keep = np.ones(len(texts), bool)
        if mode["dynamic_sampling"]:  # groups whose rewards all agree carry no signal
            spread = advantages.dynamic_sampling_mask(rewards.reshape(-1, group))
            keep = np.repeat(np.asarray(spread), group)
        batch = {
            "prompt_tokens": np.repeat(prompt_tokens, group, axis=0),
            "prompt_where": np.repeat(prompt_where, group, axis=0),
            "tokens": out.tokens,
            "where": out.where,
            "logps": out.logps,
            "rewards": rewards,
            "keep": keep,
        }
        state = {**state, "rng": jax.random.key_data(key)}
        for i in range(args.updates_per_batch):
            step_key = jax.random.fold_in(dropout_key, i) if args.lora_dropout else None
            state, metrics = update(frozen, state, batch, step_key)
        return state, {
            **metrics,
            "reward": rewards.mean(),
            "sample_accuracy": right.mean(),
            "length": np.asarray(out.lengths).mean(),
            "kept_groups": keep.mean(),
        }

    def evaluate(trainable):
        """Greedy exact-match accuracy on the held-out prompts."""
        params = common.dense_params(trainable, base)
        prompts = [r["prompt"] for r in heldout]
        texts = common.greedy_texts(graphdef, params, prompts, encode, tok.decode, greedy)
        hits = [correct(t, r) for t, r in zip(texts, heldout, strict=True)]
        return {"accuracy": float(np.mean(hits)) if hits else float("nan")}

    accuracy_before = evaluate(trainable)["accuracy"]
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
    return run.finish(
        {
            "seed": args.seed,
            "mode": args.mode,
            "steps": args.steps,
            **common.tuning_headline(args, trainable, base),
            "accuracy_before": accuracy_before,
            "accuracy_after": last["accuracy"],
            "final_reward": last["reward"],
            "final_entropy": last["entropy"],
        }
    )


if __name__ == "__main__":
    main(sys.argv[1:])
