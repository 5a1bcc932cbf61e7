"""What the two GRPO recipes share: the sampler's side of a step (sample a group per prompt,
score it), the trainer's side (the batch's rewards and advantages once, then the updates),
and the objective. `recipes/grpo.py` runs the two sides in turn; `recipes/grpo_async.py`
runs them on two processes.

The rewards a batch trains on are computed once per batch, in one jitted function
(`batch_rewards`): the verifier's (or the user's, or the reward model's) score, plus the
overlong penalty, the dynamic-sampling mask of the groups that carry a signal, and the group
advantages. The updates then read the advantages from the batch.
"""

import dataclasses
import math
import traceback
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np
import optax

from tunelib import advantages, losses, metrics, peft, rollout

from kit import (
    data,
    evaluate,
    goodput,
    loop,
    lora,
    models,
    optim,
    plan,
    reward_model,
)
from kit.errors import UserError
from kit.grpo_config import MODES, load_reward
from kit.images import model_inputs
from kit.rollout_batch import RolloutBatch

# The built-in tasks, whose answers are numbers: `--format-weight` rewards well-formed ones.
BUILT_IN = ("arithmetic", "vision_counting")


def reward_limit(group_size: int) -> float:
    """The largest reward magnitude a --reward function may return for groups of
    `group_size`. Scores are float32, and a group's standard deviation sums the squares of
    their differences from the group's mean: with every |reward| <= M, each square is at most
    (2M)^2 and the sum at most 4 G M^2, which must stay below float32's largest value
    (3.4e38); half of that M leaves room for the rounding of the mean. About 1.6e18 at G = 8."""
    return float(np.sqrt(np.finfo(np.float32).max / (4 * group_size))) / 2


def well_formed(text: str, truncated: bool) -> bool:
    """A built-in task answer of digits (with an optional leading minus), ended by EOS."""
    return not truncated and text.lstrip("-").isdigit() and text.count("-") <= 1


def sampling(task, vocab_size: int, *, temperature: float, max_new_tokens: int):
    """The rollouts' sampling: the task's greedy decoding at `temperature`, at most
    `max_new_tokens` (or the task's room, if less)."""
    greedy = evaluate.greedy_config(task, vocab_size)
    new_tokens = min(max_new_tokens, greedy.max_new_tokens)
    return dataclasses.replace(greedy, temperature=temperature, max_new_tokens=new_tokens)


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Samples `group_size` completions of each prompt and scores them: 1 for the right answer
    (the task's verifier) plus `format_weight` for a well-formed one, or the user's
    `reward`, or a reward model's score (`reward_model`, on the devices)."""

    graphdef: object
    task: object
    placement: object
    sampling: object
    group_size: int
    format_weight: float = 0.0
    reward: str | None = None
    reward_model: object = None  # a path
    vocab_size: int = 0
    record_routing: bool = False  # --replay-routing: each token's experts, for the trainer
    layout: str = "stacked"  # --decoding-layout
    products: str = "blocked"  # --decoding-products

    def __post_init__(self):
        user = load_reward(self.reward) if self.reward is not None else None
        object.__setattr__(self, "_user", user)
        score = None
        if self.reward_model is not None:
            scorer = reward_model.load(self.reward_model)
            if scorer.model.config.vocab_size != self.vocab_size:
                raise UserError(
                    f"--reward-model {self.reward_model}: its vocabulary of "
                    f"{scorer.model.config.vocab_size} tokens is not the policy's "
                    f"{self.vocab_size}; train it from the same SFT model"
                )
            params = {"decoder": scorer.model.params, "head": scorer.head}
            object.__setattr__(self, "_scorer_params", self.placement.replicate(params))

            @jax.jit
            def score(params, *arrays):
                return reward_model.completion_scores(
                    scorer.model.graphdef, params["decoder"], params["head"], *arrays,
                    pooling=scorer.pooling,
                )  # fmt: skip

        object.__setattr__(self, "_score", score)

    def _reward(self, text: str, record: dict, truncated: bool) -> float:
        if self._user is not None:
            prompt = record.get("prompt", record)
            try:
                score = float(self._user(text, record))
            except (Exception, SystemExit) as error:  # the user's code, in one line; a
                # sys.exit() there would otherwise end the run with its status, silently
                where = traceback.extract_tb(error.__traceback__)[-1]
                raise UserError(
                    f"--reward {self.reward} raised {error!r} at {where.filename}:"
                    f"{where.lineno} for the prompt {prompt!r}"
                ) from None
            if not math.isfinite(score):  # would train on NaN advantages, silently
                raise UserError(
                    f"--reward {self.reward} returned {score} for the prompt "
                    f"{prompt!r}: a reward must be a finite number"
                )
            if abs(score) > (limit := reward_limit(self.group_size)):  # inf once squared
                raise UserError(
                    f"--reward {self.reward} returned {score:g} for the prompt {prompt!r}: "
                    f"a reward must be at most {limit:.2g} in magnitude with groups of "
                    f"{self.group_size} (their statistics square differences of rewards in "
                    f"float32)"
                )
            return score
        weight = self.format_weight if self.task.name in BUILT_IN else 0.0
        return self.task.correct(text, record) + weight * well_formed(text, truncated)

    def _sample(self, policy, prompt_tokens, prompt_where, key, *, version=None, images=None):
        """`tunelib.rollout.sample` as this sampler calls it."""
        return rollout.sample(
            self.graphdef, policy, prompt_tokens, prompt_where, key, self.sampling,
            group_size=self.group_size, policy_version=version,
            record_routing=self.record_routing, images=images, layout=self.layout,
            products=self.products,
        )  # fmt: skip

    def template(self, policy, batch_size: int) -> RolloutBatch:
        """Zeros shaped as the rows of `batch_size` prompts' scored groups (the form of
        `RolloutBatch.local`), the completions' shapes the sampler's own: `jax.eval_shape`
        of its call with `policy` (arrays or shape structs) on prompts of the task's width.
        The trainer's side of the disaggregated exchange, and the batch `--plan` compiles
        the update for."""
        if self.task.images is not None:
            raise UserError(
                "records with images train with recipes/grpo.py, without --plan, "
                "--device-memory or --max-staleness: their rollouts carry pixels, which those "
                "do not plan for"
            )
        width = self.task.prompt_length
        prompts = (
            jax.ShapeDtypeStruct((batch_size, width), np.int32),
            jax.ShapeDtypeStruct((batch_size, width), np.bool_),
        )
        key = jax.eval_shape(lambda: jax.random.key(0))
        out = jax.eval_shape(lambda *args: self._sample(*args, version=0), policy, *prompts, key)
        rows = out.tokens.shape[0]

        def zeros(x):
            return None if x is None else np.zeros(x.shape, x.dtype)

        return RolloutBatch(
            prompt_tokens=zeros(prompts[0]), prompt_where=zeros(prompts[1]),
            tokens=zeros(out.tokens), where=zeros(out.where), logps=zeros(out.logps),
            scores=np.zeros(rows, np.float32), right=np.zeros(rows, np.bool_),
            lengths=zeros(out.lengths), version=np.int32(0), fingerprint=np.uint32(0),
            routing=zeros(out.routing),
        )  # fmt: skip

    def __call__(self, policy, indices, key, *, version: int) -> RolloutBatch:
        """A group per prompt of `indices` (this process's) sampled on the devices with
        `policy` (policy version `version`), scored: the global batch, on the devices, with
        the rollout's stamp (`version`, `fingerprint`). Only the completions' tokens go to the
        host, for the verifier (or `--reward`), and only their scores come back."""
        placement, group, task = self.placement, self.group_size, self.task
        records = [task.train[i] for i in indices]
        prompt_tokens, prompt_where, pixels = data.prompt_inputs(task, records)
        prompts = placement.rows((prompt_tokens, prompt_where))
        # A prompt's images are encoded once, into the KV cache its group shares.
        pixels = None if pixels is None else placement.rows(pixels)
        images = None if pixels is None else model_inputs(pixels)
        out = self._sample(policy, *prompts, key, version=version, images=images)
        tokens = placement.local(out.tokens)  # this process's rows: its prompts' groups
        texts = [task.tokenizer.decode(row) for row in tokens.tolist()]
        truncated = placement.local(out.truncated)
        prompt_of = [records[i // group] for i in range(len(texts))]
        if self._score is not None:
            scores = self._score(self._scorer_params, *prompts, out.tokens, out.where)
            scores = scores.astype(np.float32)
        else:
            scores = np.array(
                [self._reward(*row) for row in zip(texts, prompt_of, truncated, strict=True)],
                np.float32,
            )
            scores = placement.rows(scores)
        right = np.array([task.correct(t, r) for t, r in zip(texts, prompt_of, strict=True)])
        return RolloutBatch(
            prompt_tokens=prompts[0], prompt_where=prompts[1], tokens=out.tokens,
            where=out.where, logps=out.logps, scores=scores, right=placement.rows(right),
            lengths=out.lengths, version=np.int32(out.policy_version),
            fingerprint=np.uint32(out.fingerprint), routing=out.routing, pixels=pixels,
        )  # fmt: skip


def batch_rewards(mode: str, group_size: int, max_length: int) -> Callable:
    """`rewards(scores, lengths) -> {"rewards", "keep", "advantages"}`, jitted: once per batch,
    the scores plus the mode's overlong penalty, the dynamic-sampling mask (groups whose
    rewards all agree carry no signal) and the group advantages."""
    settings = MODES[mode]

    @jax.jit
    def rewards(scores, lengths):
        if settings["overlong_buffer"]:
            scores = scores + advantages.overlong_penalty(
                lengths, max_length=max_length, buffer_length=settings["overlong_buffer"]
            )
        keep = jax.numpy.ones(scores.shape, bool)
        if settings["dynamic_sampling"]:
            keep = advantages.dynamic_sampling_mask(scores, group_size=group_size)
        adv = advantages.group_advantages(scores, group_size=group_size, scale=settings["scale"])
        return {"rewards": scores, "keep": keep, "advantages": adv}

    return rewards


def objective(
    token_logps,
    entropy,
    ref_logps,
    batch: dict,
    *,
    aggregation: str,
    epsilon_low: float,
    epsilon_high: float,
    kl_coef: float,
    max_length: int,
):
    """The GRPO loss of a batch and its diagnostics: the clipped surrogate on the batch's
    advantages, plus `kl_coef` times the k3 KL to the reference (`ref_logps`, None without
    the penalty), aggregated by `aggregation` (a mode of `tunelib.losses.aggregate`)."""
    where = batch["where"] & batch["keep"][:, None]
    if "is_keep" in batch:  # tokens a rollout correction rejected leave the loss's means
        where = where & batch["is_keep"]
    adv = batch["advantages"]
    clip = {"epsilon_low": epsilon_low, "epsilon_high": epsilon_high}
    old = batch["old"]  # the sampler's log-probs, or with --is-correction the trainer's
    per_token = losses.policy_gradient_loss(token_logps, old, adv, **clip, where=where)
    if "is_weights" in batch:
        per_token = per_token * batch["is_weights"]
    logged = {}
    if ref_logps is not None:
        # Over every completion (dropped groups included) for the log; `aggregate` masks it.
        kl = losses.kl_penalty(token_logps, ref_logps, estimator="k3", where=batch["where"])
        per_token = per_token + kl_coef * kl
        logged["kl"] = kl
    if "entropy_weight" in batch:  # --target-entropy: the controller's current weight
        bonus = losses.entropy_bonus(entropy, entropy_weight=batch["entropy_weight"], where=where)
        per_token = per_token + bonus
    norm = max_length if aggregation == "seq_mean_token_sum_norm" else None
    loss = losses.aggregate(per_token, mode=aggregation, norm_constant=norm, where=where)

    def token_mean(x):
        return losses.aggregate(x, mode="token_mean", where=batch["where"]).mean()

    fractions = metrics.clip_fractions(token_logps, old, adv, **clip, where=where)
    # The trainer's log-probs against the sampler's, on the same weights at the first update
    # of a synchronous batch: the rollout/trainer mismatch (kit.grpo.Learner logs it there).
    current = jax.lax.stop_gradient(token_logps)
    mismatch = metrics.mismatch_kl(current, batch["logps"], where=batch["where"])
    return loss.mean(), {
        "entropy": token_mean(entropy),
        **{name: token_mean(value) for name, value in logged.items()},
        "clip_fraction": fractions.region,
        "mismatch_kl": mismatch.mean,
        "mismatch_kl_max": mismatch.max,
        "is_ess": metrics.effective_sample_size(current - batch["logps"], where=batch["where"]),
    }


class Learner:
    """The trainer's side of a step: `learn(state, rollouts, dropout_key)` checks a scored
    batch's stamp (`RolloutBatch`, on the devices), computes its rewards and advantages once
    (`batch_rewards`), then takes `--updates-per-batch` jitted updates on it (`update`)."""

    def __init__(
        self, graphdef, tuning, frozen, optimizer, placement, config, max_length: int,
        max_staleness: int = 0,
    ):  # fmt: skip
        self.graphdef, self.tuning, self.frozen = graphdef, tuning, frozen
        self.optimizer, self.placement, self.config = optimizer, placement, config
        self.max_length = max_length
        # The fingerprints of the policies handed to the sampler: a batch sampled by anything
        # else (weights or adapters that never reached it) stops the run in one line.
        self.ledger = rollout.PolicyLedger(max_staleness=max_staleness)
        self.entropy_control = None
        if config.target_entropy is not None:  # Skywork-OR1's additive rule
            self.entropy_control = advantages.adaptive_entropy_controller(
                target_entropy=config.target_entropy, step_size=config.entropy_step,
                max_entropy_weight=config.max_entropy_weight,
            )  # fmt: skip
        self.rewards = batch_rewards(config.mode, config.group_size, max_length)
        # The state is donated: the update writes the new weights and optimizer state into
        # its buffers (`kit.loop.initial_state` gives it buffers of its own).
        self.update = jax.jit(self._update, donate_argnums=1)
        self.prox_logps = jax.jit(self._prox_logps)

    def initial_state(self, state: dict) -> dict:
        """`state` (`kit.loop.initial_state`'s) with what the learner keeps across steps: with
        `--target-entropy`, the entropy controller's state (checkpointed with the rest)."""
        if self.entropy_control is None:
            return state
        control = self.placement.replicate(self.entropy_control.init())
        # Buffers of its own: the update donates the state (init may share one).
        return {**state, "entropy_control": loop.owned(control)}

    def completion_logps(self, params, batch, routing=None):
        """The batch's token log-probs and entropies under `params`; with `routing` (the
        sampler's record, `--replay-routing`) every MoE layer routes by it (R3)."""
        return rollout.completion_logps(
            self.graphdef, params, batch["prompt_tokens"], batch["prompt_where"],
            batch["tokens"], batch["where"], temperature=self.config.temperature,
            with_entropy=True, implementation=self.config.logprobs, routing=routing,
            images=model_inputs(batch) or None,
        )  # fmt: skip

    def loss(self, trainable, frozen, batch, dropout_key):
        forward = peft.lora(self.completion_logps)
        params = self.tuning.params(trainable, frozen["base"], dropout_key)
        token_logps, entropy = forward(params, batch, batch.get("routing"))
        ref_logps = None
        if self.config.kl_coef:  # without the penalty, no forward pass of the reference
            # The reference routes by its own router: it is another model, not the sampler's.
            ref_logps, _ = jax.lax.stop_gradient(forward(frozen["reference"], batch))
        config = self.config
        return objective(
            token_logps, entropy, ref_logps, batch, aggregation=MODES[config.mode]["aggregation"],
            epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high,
            kl_coef=config.kl_coef, max_length=self.max_length,
        )  # fmt: skip

    def _update(self, frozen, state, batch, dropout_key):
        """`(state, metrics)` after one optimizer step on `batch` (jitted as `update`)."""
        (loss, out), grads = jax.value_and_grad(self.loss, has_aux=True)(
            state["params"], frozen, batch, dropout_key
        )
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state}, {"loss": loss, **out}

    def _prox_logps(self, frozen, trainable, batch):
        forward = peft.lora(self.completion_logps)
        params = self.tuning.params(trainable, frozen["base"])
        return forward(params, batch, batch.get("routing"))[0]

    def batch(self, rollouts: RolloutBatch) -> dict:
        """The update's batch of `rollouts` (on the devices): its arrays, with their rewards,
        mask and advantages."""
        batch = rollouts.arrays()
        batch.update(self.rewards(batch.pop("scores"), batch["lengths"]))
        batch["old"] = batch["logps"]
        return batch

    def hand_out(self, version: int, policy) -> None:
        """Record `policy` (`tuning.policy` of the trained parameters) as policy version
        `version`, the one the sampler is given next."""
        self.ledger.record(version, policy)

    def ledger_state(self) -> dict:
        """The ledger's versions and fingerprints (`max_staleness + 1`, -1 where none), as
        arrays a checkpoint keeps: a resumed trainer checks the batches that were in flight
        against the versions that sampled them."""
        size = self.ledger.max_staleness + 1
        versions, digests = np.full(size, -1, np.int32), np.zeros(size, np.uint32)
        for i, (version, digest) in enumerate(self.ledger.recorded().items()):
            versions[i], digests[i] = version, digest
        return {"versions": versions, "digests": digests}

    def resume_ledger(self, saved: dict) -> None:
        """Record again the versions `ledger_state` kept."""
        versions, digests = np.asarray(saved["versions"]), np.asarray(saved["digests"])
        for version, digest in zip(versions, digests, strict=True):
            if version >= 0:
                self.ledger.record_fingerprint(int(version), int(digest))

    def learn(self, state, rollouts: RolloutBatch, dropout_key, *, version: int):
        """The updates on `rollouts` (on the devices), once their stamp says the sampler ran
        a policy handed out within the staleness bound of `version` (the trainer's)."""
        config = self.config
        try:
            self.ledger.check(rollouts.version, rollouts.fingerprint, version=version)
        except rollout.StalePolicyError as error:
            raise UserError(f"step {version + 1}: {error}") from None
        batch = self.batch(rollouts)
        if self.entropy_control is not None:  # a copy: the state's own buffer is donated
            batch["entropy_weight"] = jax.numpy.copy(state["entropy_control"].entropy_weight)
        correction = rollout_correction(config.is_correction, config.is_cap)
        corrected = {}
        if correction is not None:  # the trainer's log-probs before the update
            with goodput.phase("logprobs"):
                batch["old"] = jax.block_until_ready(
                    self.prox_logps(self.frozen, state["params"], batch)
                )
            out = _corrected(batch["old"], batch["logps"], correction, where=batch["where"])
            batch["is_weights"], batch["is_keep"] = out.weights, out.keep
            corrected = {f"rc_{k}": getattr(out, k) for k in CORRECTED}
        for i in range(config.updates_per_batch):
            step_key = jax.random.fold_in(dropout_key, i) if config.lora_dropout else None
            state, out_metrics = self.update(self.frozen, state, batch, step_key)
            if i == 0:  # the mismatch on the weights that sampled (synchronously), not after
                first = {k: out_metrics[k] for k in MISMATCH}
        means = _batch_means(batch["rewards"], batch["right"], batch["lengths"], batch["keep"])
        extra = {}
        if self.entropy_control is not None:  # the weight for the next batch, from this one's
            extra["entropy_weight"] = batch["entropy_weight"]
            control = self.entropy_control.update(out_metrics["entropy"], state["entropy_control"])
            state = {**state, "entropy_control": control}
        return state, {**out_metrics, **first, **means, **extra, **corrected}

    def pieces(self, state, template: RolloutBatch, sampling) -> dict:
        """A step's jitted parts for `--plan` and `--device-memory` (`kit.plan.Piece`): the
        sampler and an update, on a batch shaped as `template` (`Sampler.template`)."""
        group, by_rows = self.config.group_size, self.placement.by_rows()
        rows = {
            k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=by_rows)
            for k, x in template.arrays().items()
        }  # fmt: skip
        policy = self.tuning.policy(state["params"])
        prompts = rows["prompt_tokens"], rows["prompt_where"]
        rewards = jax.eval_shape(self.rewards, rows.pop("scores"), rows["lengths"])
        batch = {**rows, **{k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=by_rows)
                            for k, x in rewards.items()}}  # fmt: skip
        batch["old"] = rows["logps"]
        if self.entropy_control is not None:
            batch["entropy_weight"] = jax.ShapeDtypeStruct((), np.float32)
        return {
            "rollout": plan.sampler(self.graphdef, policy, *prompts, sampling, group_size=group),
            "update": plan.Piece(
                self.update, (self.frozen, state, batch, None), batch_argnums=(2,)
            ),
        }


# The update's metrics taken from a batch's first update: the trainer's log-probs against the
# sampler's (`tunelib.metrics.mismatch_kl`, k3, mean and max over tokens) and the effective
# sample size of the token importance weights, as a fraction.
MISMATCH = ("mismatch_kl", "mismatch_kl_max", "is_ess")
# What a rollout correction did to a batch, logged as rc_<name> (`losses.CorrectedRollouts`).
CORRECTED = ("ess", "rejected_tokens", "rejected_sequences", "truncated")


# One program a step for the correction, not one per operation.
_corrected = jax.jit(losses.rollout_correction, static_argnames="correction")


def rollout_correction(name: str, cap: float) -> losses.RolloutCorrection | None:
    """The setting `--is-correction name` names: token-level truncation at `cap` for tis, a
    preset of `tunelib.losses.ROLLOUT_CORRECTIONS`, or None for none."""
    if name == "none":
        return None
    if name == "tis":
        return losses.RolloutCorrection("token", cap)
    return losses.ROLLOUT_CORRECTIONS[name]


@jax.jit
def _batch_means(rewards, right, lengths, keep):  # over every process's rows
    return {
        "reward": rewards.mean(),
        "sample_accuracy": right.mean(),
        "length": lengths.mean(),
        "kept_groups": keep.mean(),
    }


class Setup(NamedTuple):
    """What a GRPO run trains and samples with (`setup`)."""

    task: data.Task  # the prompts and their verifier
    tuning: lora.Tuning  # every weight, or LoRA / QLoRA adapters on a frozen base
    sampling: object  # the rollouts' `tunelib.rollout.SamplingConfig`
    optimizer: object
    sample: Sampler
    learner: Learner


def setup(config, model, placement, *, max_staleness: int = 0) -> Setup:
    """The prompts of `config`'s task, what trains of `model` (`kit.models.Model`, on the
    devices of `placement`), the sampling, the optimizer (AdamW, constant after a warmup),
    the sampler and the learner of a GRPO run, whose batches may come from policies up to
    `max_staleness` versions old (`--max-staleness`, the disaggregated recipe's)."""
    vocab_size = model.config.vocab_size
    models.replayed_routing(model.config, config.replay_routing)  # an MoE model, if asked
    task = data.load_task(
        config, "rl", model, data=config.data, builtin=config.task,
        num_train=config.num_prompts, max_new_tokens=config.max_new_tokens,
    )  # fmt: skip
    tuning = lora.tuning(
        model, placement, rank=config.lora_rank, alpha=config.lora_alpha,
        dropout=config.lora_dropout, qlora=config.qlora, seed=config.seed,
    )  # fmt: skip
    # With LoRA the reference is the frozen base without adapters: the policy's start.
    frozen = {"base": tuning.base, "reference": tuning.base or model.params}
    rollouts = sampling(
        task, vocab_size, temperature=config.temperature, max_new_tokens=config.max_new_tokens
    )
    optimizer = optim.adamw(config.learning_rate, config.steps, schedule="constant", warmup=0.1)
    sample = Sampler(
        model.graphdef, task, placement, rollouts, config.group_size,
        format_weight=config.format_weight, reward=config.reward,
        reward_model=config.reward_model, vocab_size=vocab_size,
        record_routing=config.replay_routing, layout=config.decoding_layout,
        products=config.decoding_products,
    )  # fmt: skip
    learner = Learner(
        model.graphdef, tuning, frozen, optimizer, placement, config, rollouts.max_new_tokens,
        max_staleness,
    )  # fmt: skip
    return Setup(task, tuning, rollouts, optimizer, sample, learner)


def headline(run, config, tuning) -> dict:
    """The result line's figures of a GRPO run: its mode and tuning, the held-out accuracy
    before and after with the problems turned right and wrong (and the sampled metrics),
    the last step's reward and entropy."""
    records = run.records()
    accuracy = [r["accuracy"] for r in records if "accuracy" in r]
    return {
        "mode": config.mode, **tuning.headline(), "accuracy_before": accuracy[0],
        "accuracy_after": accuracy[-1], "final_reward": records[-1]["reward"],
        "final_entropy": records[-1]["entropy"], **evaluate.paired_headline(run),
        **loop.before_and_after(run, *evaluate.SAMPLED),  # with --eval-samples
    }  # fmt: skip
