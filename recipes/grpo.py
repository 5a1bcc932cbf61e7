"""GRPO of an SFT model with a verifiable reward; DAPO and Dr. GRPO by `--mode`.

    python recipes/grpo.py                    # trains recipes/sft.py first if its model is absent
    python recipes/grpo.py --mode dapo        # clip-higher, token mean, overlong, dynamic sampling
    python recipes/grpo.py --mode dr_grpo     # unscaled advantages, token sum / max length
    python recipes/grpo.py --resume           # continue the run from its last checkpoint
    python recipes/grpo.py --lora-rank 16     # LoRA adapters on the frozen SFT model (--qlora)
    python recipes/grpo.py --reward my_rewards.py:score          # a reward function of your own
    python recipes/grpo.py --reward-model runs/reward_model-seed0  # RLHF: a learned reward
    python recipes/grpo.py --model HF_CHECKPOINT --data problems.jsonl   # your model and prompts
    python -m tunelib.launch -n 2 recipes/grpo.py --max-staleness 1   # one process samples

The data: prompts with answers (the built-in task's "12+7=" and "19", or a file's
`prompt`/`answer` records, the prompt a string or chat messages). Each step samples
`--group-size` completions of each of `--batch-size` prompts with the KV-cache sampler of
`tunelib.rollout` and scores them: 1 for the right answer (the task's verifier; exact match for
a file) plus `--format-weight` for a well-formed one on the built-in task, or your own
`--reward`, or the score a reward model trained by `recipes/reward_model.py` gives the prompt
and completion (`--reward-model`; the verifier then only measures). The loss: the clipped
surrogate of `tunelib.losses` on group-relative advantages of `tunelib.advantages`, with the
sampler's log-probs as the behaviour policy and a k3 KL penalty to the SFT model, frozen. The
step: `--updates-per-batch` Optax updates per batch of rollouts; with `--lora-rank` only
adapters train, the reference is the frozen base, and the sampler gets the adapters merged
before each batch. Held-out: greedy accuracy.

Disaggregated and asynchronous (`--max-staleness s`, on two processes): process 0 trains,
process 1 samples, and a batch is sampled at most s updates before it is trained on
(`kit.disaggregated`); s = 0 is this recipe's synchronous steps on two processes. With s > 0
each batch is corrected by default for the weights that sampled it: truncated importance
weights of the trainer's log-probs before the update over the sampler's (`--is-correction`).

A reward function takes a completion's text and its prompt's record (a dict with `prompt`,
`answer` and any other field of the file) and returns a float:

    def score(completion: str, record: dict) -> float:
        return float(completion.strip() == record["answer"])

`--reward my_rewards.py:score` loads it from a file, `--reward package.module:score` from an
importable module.
"""

import dataclasses
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import kit
from kit.config import DataFile, Lora, Run, SFTStart, Task, flag
from kit.errors import UserError

# What each mode sets; every value can be overridden by its flag.
MODES = {
    # Shao et al. 2024: group-normalised advantages, symmetric clip, k3 KL, per-sequence mean.
    "grpo": {"scale": "group", "aggregation": "seq_mean_token_mean", "epsilon_high": 0.2,
             "kl_coef": 0.04, "overlong_buffer": 0, "dynamic_sampling": False},
    # Yu et al. 2025: clip-higher, no KL, token mean, soft overlong penalty, dynamic sampling.
    "dapo": {"scale": "group", "aggregation": "token_mean", "epsilon_high": 0.28,
             "kl_coef": 0.0, "overlong_buffer": 2, "dynamic_sampling": True},
    # Liu et al. 2025: advantages not divided by the std, token sum / max length, no KL.
    "dr_grpo": {"scale": "none", "aggregation": "seq_mean_token_sum_norm", "epsilon_high": 0.2,
                "kl_coef": 0.0, "overlong_buffer": 0, "dynamic_sampling": False},
}  # fmt: skip


def load_reward(spec: str) -> Callable[[str, dict], float]:
    """The function `module:function` or `path/to/file.py:function` names; loading it writes
    nothing (no `__pycache__` beside the user's file)."""
    previous, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        return _load_reward(spec)
    finally:
        sys.dont_write_bytecode = previous


def _load_reward(spec: str) -> Callable[[str, dict], float]:
    source, _, name = spec.rpartition(":")
    if not source or not name:
        raise UserError(f"--reward {spec}: give module:function or file.py:function")
    if source.endswith(".py"):
        path = Path(source)
        if not path.is_file():
            raise UserError(f"--reward {spec}: no such file {path}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:  # the user's file: report it in one line
            raise UserError(f"--reward {spec}: {path} failed to load: {error!r}") from None
    else:
        sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(source)
        except ImportError as error:
            raise UserError(f"--reward {spec}: {error}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"--reward {spec}: {source} has no function {name!r}")
    try:
        inspect.signature(function).bind("completion", {})
    except TypeError:
        raise UserError(
            f"--reward {spec}: {name} must take (completion: str, record: dict)"
        ) from None
    return function


@dataclasses.dataclass(kw_only=True)
class GRPOConfig(Run, Task, DataFile, SFTStart, Lora):
    RECIPE = "grpo"
    LEARNING_RATE = 1e-4
    LORA_LEARNING_RATE = 1e-3

    steps: int = flag(150, "optimizer steps (batches of rollouts)")
    eval_every: int = flag(50, "steps between held-out evaluations")
    checkpoint_every: int = flag(50, "steps between checkpoints")
    mode: Literal["grpo", "dapo", "dr_grpo"] = flag("grpo", "the algorithm's defaults")
    group_size: int = flag(8, "completions per prompt, G")
    temperature: float = flag(1.0, "sampling temperature (> 0: the G completions must differ)")
    epsilon_low: float = flag(0.2, "lower clip bound of the ratio")
    epsilon_high: float | None = flag(None, "upper clip bound (default: the mode's)")
    kl_coef: float | None = flag(
        None, "weight of the k3 KL penalty (default: the mode's)", aliases=("--kl-beta",)
    )
    updates_per_batch: int = flag(
        1, "optimizer steps on each batch of rollouts (PPO epochs); > 1 makes the clip bind"
    )
    format_weight: float = flag(0.1, "built-in task: reward of a well-formed answer")
    reward: str | None = flag(
        None, "your reward function, module:function or file.py:function (see the docstring)"
    )
    reward_model: Path | None = flag(
        None, "score completions with this reward model (a run of recipes/reward_model.py)"
    )
    num_prompts: int = flag(9000, "built-in task: training prompts sampled from")
    max_new_tokens: int = flag(
        64, "the most tokens of a sampled completion (the built-in task's room may be less)"
    )
    max_staleness: int | None = flag(
        None,
        "run disaggregated on 2 processes (python -m tunelib.launch -n 2): process 0 trains, "
        "process 1 samples batches at most this many updates old (0: they take turns)",
    )
    is_correction: Literal["auto", "none", "tis"] = flag(
        "auto",
        "importance weights for rollouts sampled by older weights: tis truncates the "
        "trainer's log-probs before the update over the sampler's at --is-cap; auto is tis "
        "when --max-staleness > 0",
    )
    is_cap: float = flag(2.0, "the cap C of the truncated importance weights")

    def run_name(self) -> str:
        return "grpo" if self.mode == "grpo" else f"grpo-{self.mode}"

    def check(self) -> None:
        super().check()
        kit.config.at_least("group_size", self.group_size, 2)
        kit.config.at_least("updates_per_batch", self.updates_per_batch, 1)
        kit.config.at_least("max_new_tokens", self.max_new_tokens, 1)
        kit.config.at_least("num_prompts", self.num_prompts, 1)
        if self.max_staleness is not None:
            kit.config.at_least("max_staleness", self.max_staleness, 0)
        if not self.is_cap > 0:
            raise UserError(f"--is-cap must be > 0, got {self.is_cap}")
        if self.is_correction == "auto":
            self.is_correction = "tis" if self.max_staleness else "none"
        if not self.temperature > 0:
            raise UserError(
                f"--temperature must be > 0 (GRPO needs G different completions per prompt), "
                f"got {self.temperature}"
            )
        mode = MODES[self.mode]
        self.epsilon_high = mode["epsilon_high"] if self.epsilon_high is None else self.epsilon_high
        self.kl_coef = mode["kl_coef"] if self.kl_coef is None else self.kl_coef
        if self.epsilon_low < 0 or self.epsilon_high < 0 or self.kl_coef < 0:
            raise UserError("--epsilon-low, --epsilon-high and --kl-coef must be >= 0")
        if self.reward is not None:
            load_reward(self.reward)
        if self.reward_model is not None:
            if self.reward is not None:
                raise UserError("--reward and --reward-model are two rewards: pass one")
            from kit.reward_model import check_folder

            check_folder(self.reward_model)


def batch_template(task, config, sampling) -> dict:
    """Zeros shaped like a batch of scored rollouts (`train`'s `sample`), the trainer's
    side of the disaggregated exchange."""
    import numpy as np

    rows, new = config.batch_size * config.group_size, sampling.max_new_tokens
    return {
        "prompt_tokens": np.zeros((config.batch_size, task.prompt_length), np.int32),
        "prompt_where": np.zeros((config.batch_size, task.prompt_length), bool),
        "tokens": np.zeros((rows, new), np.int32),
        "where": np.zeros((rows, new), bool),
        "logps": np.zeros((rows, new), np.float32),
        "rewards": np.zeros(rows, np.float32),
        "keep": np.zeros(rows, bool),
        "right": np.zeros(rows, bool),
        "lengths": np.zeros(rows, np.int32),
        "version": np.int32(0),
    }


def well_formed(text: str, truncated: bool) -> bool:
    """A built-in task answer of digits (with an optional leading minus), ended by EOS."""
    return not truncated and text.lstrip("-").isdigit() and text.count("-") <= 1


def train(config: GRPOConfig, run: kit.runs.RunFolder) -> dict:
    import grain
    import jax
    import numpy as np
    import optax

    from tunelib import advantages, losses, metrics, peft, rollout

    from kit import (
        chain,
        data,
        disaggregated,
        evaluate,
        goodput,
        loop,
        lora,
        models,
        optim,
        parallel,
        reward_model,
    )

    mode = MODES[config.mode]
    # Every device of every process, prompts by rows; disaggregated, each process's own.
    split = config.max_staleness is not None
    placement = parallel.placement(config, across_processes=not split)
    if split and placement.process_count != 2:
        raise UserError(
            f"--max-staleness runs on 2 processes (one trains, one samples), not "
            f"{placement.process_count}: start it with python -m tunelib.launch -n 2"
        )
    trainer = not split or disaggregated.role() == disaggregated.TRAINER
    folder, sft_seconds = chain.sft_start(config)
    model = models.replicated(models.load_model(folder), placement)
    model = models.with_remat(model, config.remat)
    graphdef, vocab_size = model.graphdef, model.config.vocab_size
    task = data.load_task(config, "rl", model.tokenizer, num_train=config.num_prompts)
    tuning = lora.tuning(config, model, placement)
    # With LoRA the reference is the frozen base without adapters: the policy's start.
    frozen = {"base": tuning.base, "reference": tuning.base or model.params}
    group = config.group_size
    if config.reward_model is not None:  # scored on the devices, in `sample`
        scorer = reward_model.load(config.reward_model)
        if scorer.model.config.vocab_size != vocab_size:
            raise UserError(
                f"--reward-model {config.reward_model}: its vocabulary of "
                f"{scorer.model.config.vocab_size} tokens is not the policy's {vocab_size}; "
                "train it from the same SFT model"
            )
        scorer_params = placement.replicate({"decoder": scorer.model.params, "head": scorer.head})
        score = jax.jit(
            lambda params, *arrays: reward_model.completion_scores(
                scorer.model.graphdef,
                params["decoder"],
                params["head"],
                *arrays,
                pooling=scorer.pooling,
            )
        )
    if config.reward is not None:
        user_reward = load_reward(config.reward)

        def reward(text, record, truncated):
            return float(user_reward(text, record))
    else:
        format_weight = config.format_weight if task.name == "arithmetic" else 0.0

        def reward(text, record, truncated):
            return task.correct(text, record) + format_weight * well_formed(text, truncated)

    greedy = evaluate.greedy_config(task, vocab_size)
    sampling = dataclasses.replace(
        greedy,
        temperature=config.temperature,
        max_new_tokens=min(config.max_new_tokens, greedy.max_new_tokens),
    )
    new_tokens = sampling.max_new_tokens
    # This process's prompts of each step's batch: rows [p * b, (p + 1) * b) of the batch.
    index, count = placement.shard
    order = grain.MapDataset.range(len(task.train)).shuffle(seed=config.seed).repeat()
    order = order.batch(config.batch_size // count)[index::count]
    batches = iter(order.to_iter_dataset())
    optimizer = optim.adamw(config, schedule="constant", warmup=0.1)

    def completion_logps(params, batch):
        return rollout.completion_logps(
            graphdef, params, batch["prompt_tokens"], batch["prompt_where"], batch["tokens"],
            batch["where"], temperature=config.temperature, with_entropy=True,
            implementation=config.logprobs,
        )  # fmt: skip

    def loss_fn(trainable, frozen, batch, dropout_key):
        token_logps, entropy = peft.lora(completion_logps)(
            tuning.params(trainable, dropout_key), batch
        )
        where = batch["where"] & batch["keep"][:, None]
        adv = advantages.group_advantages(batch["rewards"], group_size=group, scale=mode["scale"])
        clip = {"epsilon_low": config.epsilon_low, "epsilon_high": config.epsilon_high}
        old = batch["old"]  # the sampler's log-probs, or with --is-correction the trainer's
        per_token = losses.policy_gradient_loss(token_logps, old, adv, **clip, where=where)
        if "is_weights" in batch:
            per_token = per_token * batch["is_weights"]
        logged = {}
        if config.kl_coef:  # without the penalty, no forward pass of the reference
            ref_logps, _ = jax.lax.stop_gradient(
                peft.lora(completion_logps)(frozen["reference"], batch)
            )
            # Over every completion (dropped groups included) for the log; `aggregate` masks it.
            kl = losses.kl_penalty(token_logps, ref_logps, estimator="k3", where=batch["where"])
            per_token = per_token + config.kl_coef * kl
            logged["kl"] = kl
        norm = new_tokens if mode["aggregation"] == "seq_mean_token_sum_norm" else None
        loss = losses.aggregate(
            per_token, mode=mode["aggregation"], norm_constant=norm, where=where
        )

        def token_mean(x):
            return losses.aggregate(x, mode="token_mean", where=batch["where"]).mean()

        fractions = metrics.clip_fractions(token_logps, old, adv, **clip, where=where)
        return loss.mean(), {
            "entropy": token_mean(entropy),
            **{name: token_mean(value) for name, value in logged.items()},
            "clip_fraction": fractions.region,
        }

    @jax.jit
    def batch_means(rewards, right, lengths, keep):  # over every process's rows
        return {
            "reward": rewards.mean(),
            "sample_accuracy": right.mean(),
            "length": lengths.mean(),
            "kept_groups": keep.mean(),
        }

    @jax.jit
    def update(frozen, state, batch, dropout_key):
        (loss, out), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], frozen, batch, dropout_key
        )
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state}, {"loss": loss, **out}

    def sample(policy, indices, sample_key) -> dict:
        """A group per prompt sampled on the devices, this process's completions scored on
        the host: its rows of the batch, as NumPy arrays."""
        records = [task.train[i] for i in indices]
        prompt_tokens, prompt_where = data.prompts(task, records)
        prompts = placement.rows((prompt_tokens, prompt_where))
        out = rollout.sample(graphdef, policy, *prompts, sample_key, sampling, group_size=group)
        tokens = placement.local(out.tokens)  # this process's rows: its prompts' groups
        texts = [task.tokenizer.decode(row) for row in tokens.tolist()]
        truncated = placement.local(out.truncated)
        prompt_of = [records[i // group] for i in range(len(texts))]
        if config.reward_model is not None:
            scores = score(scorer_params, *prompts, out.tokens, out.where)
            rewards = np.asarray(placement.local(scores), np.float32)
        else:
            rewards = np.array(
                [reward(t, r, c) for t, r, c in zip(texts, prompt_of, truncated, strict=True)],
                np.float32,
            )
        right = np.array([task.correct(t, r) for t, r in zip(texts, prompt_of, strict=True)])
        if mode["overlong_buffer"]:
            rewards = rewards + np.asarray(
                advantages.overlong_penalty(
                    placement.local(out.lengths),
                    max_length=new_tokens,
                    buffer_length=mode["overlong_buffer"],
                )
            )
        keep = np.ones(len(texts), bool)
        if mode["dynamic_sampling"]:  # groups whose rewards all agree carry no signal
            keep = np.asarray(advantages.dynamic_sampling_mask(rewards, group_size=group))
        return {
            "prompt_tokens": prompt_tokens,  # [B, P]; completion_logps repeats them per group
            "prompt_where": prompt_where,
            "tokens": tokens,
            "where": placement.local(out.where),
            "logps": placement.local(out.logps),
            "rewards": rewards,
            "keep": keep,
            "right": right,
            "lengths": placement.local(out.lengths),
        }

    @jax.jit
    def prox_logps(trainable, batch):
        return peft.lora(completion_logps)(tuning.params(trainable), batch)[0]

    def learn(state, rows: dict, dropout_key):
        """The jitted updates on a batch (this process's rows of it, on the host)."""
        batch = placement.rows(rows)
        batch["old"] = batch["logps"]
        if config.is_correction == "tis":  # the trainer's log-probs before the update
            with goodput.phase("logprobs"):
                batch["old"] = jax.block_until_ready(prox_logps(state["params"], batch))
            batch["is_weights"] = losses.truncated_importance_weights(
                batch["old"], batch["logps"], cap=config.is_cap, where=batch["where"]
            )
        for i in range(config.updates_per_batch):
            step_key = jax.random.fold_in(dropout_key, i) if config.lora_dropout else None
            state, out_metrics = update(frozen, state, batch, step_key)
        means = batch_means(batch["rewards"], batch["right"], batch["lengths"], batch["keep"])
        return state, {**out_metrics, **means}

    def train_step(state, indices):
        """Sample and score a group per prompt, then update on them."""
        rng, sample_key, dropout_key = loop.step_keys(state["rng"], "rollouts", "dropout")
        with goodput.phase("sync"):  # the sampler's weights: LoRA adapters merged
            policy = jax.block_until_ready(tuning.dense(state["params"]))
        with goodput.phase("rollout"):
            rows = sample(policy, placement.local(indices), sample_key)
        return learn({**state, "rng": rng}, rows, dropout_key)

    # Disaggregated: the trainer's and the sampler's sides of each step (kit.disaggregated).
    sampler_policy = {}
    rollouts = disaggregated.Rollouts(
        config.max_staleness or 0, sample, template=batch_template(task, config, sampling),
        fresh_batches=lambda: iter(order.to_iter_dataset()),
    )  # fmt: skip

    def disaggregated_step(state, indices):
        rng, _, dropout_key = loop.step_keys(state["rng"], "rollouts", "dropout")
        version = int(np.asarray(state["updates"]))
        if not sampler_policy:  # the first step of the run, or after a restore: the same state
            sampler_policy["weights"] = tuning.dense(state["params"])
        with goodput.phase("rollout"):  # the trainer waits for a batch; the sampler samples
            rows = rollouts.take(
                sampler_policy["weights"], placement.local(indices), batches, state["rng"], version
            )  # fmt: skip
        state, out = {**state, "rng": rng, "updates": state["updates"] + 1}, {}
        if trainer:
            staleness = version - int(rows.pop("version"))
            state, out = jax.block_until_ready(learn(state, rows, dropout_key))  # in "train"
            out["staleness"] = staleness
        with goodput.phase("sync"):  # the next batch to the trainer, the weights to the sampler
            rollouts.deliver()
            dense = tuning.dense(state["params"]) if trainer else sampler_policy["weights"]
            weights, rate = rollouts.push(placement.fetch(dense))
            if not trainer:
                sampler_policy["weights"] = placement.replicate(weights)
        return state, {**out, "weight_push_mb_per_s": rate / 1e6} if trainer else {}

    def evaluate_fn(trainable):
        if not trainer:  # the sampler's copy of the state is not the trained one
            return {"accuracy": float("nan")}
        return {"accuracy": evaluate.accuracy(graphdef, tuning.dense(trainable), task, vocab_size)}

    def pieces(state, indices):  # a step's jitted parts, for --plan and --device-memory
        sized = dataclasses.replace(config, batch_size=indices.shape[0])
        rows = {
            k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placement.by_rows())
            for k, x in batch_template(task, sized, sampling).items() if k != "version"
        }  # fmt: skip
        policy = jax.eval_shape(tuning.dense, state["params"]) if tuning.base else state["params"]
        prompts = rows["prompt_tokens"], rows["prompt_where"]
        return {
            "rollout": kit.plan.sampler(graphdef, policy, *prompts, sampling, group_size=group),
            "update": kit.plan.Piece(
                update, (frozen, state, {**rows, "old": rows["logps"]}, None), batch_argnums=(2,)
            ),
        }

    state = loop.initial_state(tuning.trainable, optimizer, config.seed)
    checkpointed = None
    if split:  # the trainer's state is checkpointed and saved on every device of both
        state = {**state, "updates": placement.replicate(np.int32(0))}
        both = disaggregated.everywhere()
        checkpointed = (
            lambda state: disaggregated.shared(state, both),
            lambda saved: disaggregated.own(saved, placement),
        )
    state = loop.train(
        run, config, state=state, batches=batches, evaluate=evaluate_fn,
        step_fn=disaggregated_step if split else train_step, checkpointed=checkpointed,
        pieces=pieces,
    )  # fmt: skip
    if split:
        model, state = models.replicated(model, both), checkpointed[0](state)
        tuning = dataclasses.replace(tuning, base=disaggregated.shared(tuning.base, both))
    tuning.save(run.path, model, state["params"])
    before, after = loop.first_and_last(run, "accuracy")
    last = run.records()[-1]
    return loop.finish(
        run, config,
        {"mode": config.mode, **tuning.headline(), "accuracy_before": before,
         "accuracy_after": after, "final_reward": last["reward"],
         "final_entropy": last["entropy"]},
        chained={"sft_seconds": sft_seconds},
    )  # fmt: skip


if __name__ == "__main__":
    kit.cli.main(GRPOConfig, train, __doc__)
