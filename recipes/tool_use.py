"""Learning to use a tool: SFT on demonstrations, then GRPO over multi-turn episodes.

    python recipes/tool_use.py                   # 3-digit multiplication with the calculator
    python recipes/tool_use.py --tool none       # the same budget, answering in the head
    python recipes/tool_use.py --resume          # continue the run from its last checkpoint
    python recipes/tool_use.py --steps 700 --sft-steps 500   # 500 SFT steps, then 200 of GRPO
    python recipes/tool_use.py --model-size moe --replay-routing   # a mixture of experts, R3

The data: problems "123*456" with answers (`tunelib.data.arithmetic_split`, `--operations`
on up to `--max-digits` digits), asked in a chat. A new decoder of `--model-size` reads them
with a character tokenizer that has a chat template and the tool-call tags as tokens
(`kit.episodes`). An episode runs in `tunelib.rollout.ToolEnvironment` with the `calculator`
tool: the model may call it (`<tool_call>{"name":"calculator","arguments":
{"expression":"123*456"}}</tool_call>`), reads its answer (a tool message, an observation),
and ends with an answer in a turn without a call, within `--max-turns` model turns. The
reward: 1 for the exact answer, else 0. With `--tool none` the model has no tool and one
turn.

The steps: the first `--sft-steps` of `--steps` train on `--sft-batch-size` of the
`--num-demonstrations` demonstration episodes (a call, the tool's answer, the answer;
without the tool, the answer) by the negative log-likelihood of their model tokens; the rest
are GRPO: each samples `--group-size` episodes of `--batch-size` problems with
`tunelib.rollout.run_episodes` and takes one Optax step on the clipped surrogate of
`tunelib.losses` with each episode's group-relative outcome advantage
(`episode_advantages`) on its model tokens, the sampler's log-probs as the behaviour policy.
Observation tokens are context, never trained on, in both stages. With `--replay-routing` (a
mixture-of-experts model, `--model-size moe`), the episodes record the experts each token of
the prompt, the model's turns and the observations was routed to (`run_episodes(...,
record_routing=True)`), and the GRPO steps' forward pass routes by that record (R3). Held-out:
greedy episodes' accuracy, tool-call rate, malformed-call rate and turns, before training,
after SFT and after GRPO.
"""

import dataclasses
import functools
from pathlib import Path
from typing import Literal

import kit
from kit.config import (
    CHECKPOINT_EVERY,
    RLEvaluation,
    RoutingReplay,
    Run,
    Task,
    at_least,
    flag,
)
from kit.errors import UserError


@dataclasses.dataclass(kw_only=True)
class ToolUseConfig(Run, Task, RLEvaluation, RoutingReplay):
    RECIPE = "tool_use"
    LEARNING_RATE = 3e-4

    steps: int = flag(660, "optimizer steps: --sft-steps of SFT, then GRPO")
    sft_steps: int = flag(600, "the first steps, SFT on the demonstrations")
    sft_learning_rate: float = flag(3e-3, "peak learning rate of the SFT steps")
    num_demonstrations: int = flag(1000, "demonstration episodes (the first training problems)")
    batch_size: int = flag(8, "problems per GRPO step")
    sft_batch_size: int = flag(16, "demonstrations per SFT step")
    eval_every: int = flag(100, "steps between held-out evaluations")
    checkpoint_every: int | Literal["auto"] = flag(100, CHECKPOINT_EVERY)
    operations: str = flag("*", "the task's operations, any of '+-*'")
    max_digits: int = flag(3, "operand digits of the task")
    num_train: int = flag(2000, "training problems")
    num_heldout: int = flag(200, "held-out problems")
    tool: Literal["calculator", "none"] = flag(
        "calculator", "the model's tool, or none (one turn, answered in the head)"
    )
    max_turns: int = flag(3, "model turns per episode with the tool")
    group_size: int = flag(8, "episodes per problem, G")
    temperature: float = flag(1.0, "sampling temperature of the GRPO episodes")
    epsilon: float = flag(0.2, "clip bound of the ratio (both sides)")
    model_size: Literal["student", "base", "teacher", "moe"] = flag(
        "base", "the new model's size; moe: a mixture of experts"
    )
    model: Path | None = flag(
        None, "start from this model (a tool_use run folder or its model/) instead of a new one"
    )

    def check(self) -> None:
        super().check()
        at_least("sft_steps", self.sft_steps, 0)
        if self.sft_steps >= self.steps:
            raise UserError(
                f"--sft-steps {self.sft_steps} leaves no GRPO step of --steps {self.steps}"
            )
        at_least("num_demonstrations", self.num_demonstrations, 1)
        at_least("sft_batch_size", self.sft_batch_size, 1)
        if self.num_demonstrations > self.num_train:
            raise UserError(
                f"--num-demonstrations {self.num_demonstrations} is more than --num-train "
                f"{self.num_train}"
            )
        if self.batch_size > self.num_train:
            raise UserError(f"--batch-size {self.batch_size} is more than --num-train")
        at_least("num_heldout", self.num_heldout, 1)
        at_least("max_turns", self.max_turns, 2)
        at_least("group_size", self.group_size, 2)
        if not self.temperature > 0:
            raise UserError(f"--temperature must be > 0, got {self.temperature}")
        if not self.sft_learning_rate > 0:
            raise UserError(f"--sft-learning-rate must be > 0, got {self.sft_learning_rate}")
        if not 0 < self.epsilon < 1:
            raise UserError(f"--epsilon must lie in (0, 1), got {self.epsilon}")
        if self.model is not None:
            from kit.models import model_folder

            model_folder(self.model)

    def run_name(self) -> str:
        return self.RECIPE if self.tool == "calculator" else f"{self.RECIPE}-{self.tool}"


def bucket(width: int, size: int = 128) -> int:
    """`width` rounded up to a multiple of `size`: few distinct shapes to compile."""
    return -(-width // size) * size


def trimmed(batch: dict, limit: int) -> dict:
    """The `[B, T]` arrays of `batch` cut to the columns its rows use (`context_where`),
    rounded up by `bucket` and at most `limit` (a recorded `routing`, `[B, P + T, M, k]`, to
    the prompt's columns and those)."""
    import numpy as np

    used = int(np.asarray(batch["context_where"]).sum(-1).max())
    width = min(limit, bucket(max(used, 1)))
    prompt = batch["prompt_tokens"].shape[1]
    cut = {"prompt_tokens": None, "prompt_where": None, "routing": prompt + width}
    return {k: x[:, : cut.get(k, width)] for k, x in batch.items()}


def scores(graphdef, params, batch, *, temperature=1.0, implementation="auto"):
    """`[B, T]` log-probs of every episode token after its prompt, the observations read as
    context (`context_where`); only `where` (model tokens) is ever counted. With the
    episodes' recorded `routing` (`--replay-routing`) every MoE layer routes by it (R3)."""
    from tunelib import rollout

    return rollout.completion_logps(
        graphdef, params, batch["prompt_tokens"], batch["prompt_where"], batch["tokens"],
        batch["context_where"], temperature=temperature, implementation=implementation,
        routing=batch.get("routing"),
    )  # fmt: skip


def sft_loss(token_logps, batch):
    """The token mean of the model tokens' negative log-likelihood."""
    from tunelib import losses

    return -losses.aggregate(token_logps, mode="token_mean", where=batch["where"]).mean()


def grpo_loss(token_logps, batch, *, epsilon: float):
    """The clipped surrogate on the model tokens, with the episodes' token advantages and the
    sampler's log-probs as the behaviour policy; per episode token mean, then the mean."""
    from tunelib import losses

    per_token = losses.policy_gradient_loss(
        token_logps, batch["logps"], batch["advantages"], epsilon_low=epsilon,
        epsilon_high=epsilon, where=batch["where"],
    )  # fmt: skip
    return losses.aggregate(per_token, mode="seq_mean_token_mean", where=batch["where"]).mean()


def episode_batch(task, records: list, episode, group_size: int) -> dict:
    """The GRPO batch of sampled episodes, as NumPy: their prompts `[B, P]`, and per episode
    the tokens exactly as sampled and observed, the masks, the behaviour log-probs and the
    group-relative advantage of its outcome on its model tokens (failed rows left out of
    their group's statistics); and the episodes' `routing` when they recorded it."""
    import jax.numpy as jnp
    import numpy as np

    from tunelib import rollout

    from kit import data

    prompt_tokens, prompt_where = data.prompts(task, records)
    rewards = jnp.where(episode.failed, jnp.nan, episode.rewards)
    advantages = rollout.episode_advantages(
        rewards, episode.turn_ids, group_size=group_size, where=episode.where
    )
    recorded = {} if episode.routing is None else {"routing": np.asarray(episode.routing)}
    return {
        "prompt_tokens": np.asarray(prompt_tokens), "prompt_where": np.asarray(prompt_where),
        "tokens": np.asarray(episode.tokens), "where": np.asarray(episode.where),
        "context_where": np.asarray(episode.context_where), "logps": np.asarray(episode.logps),
        "advantages": np.asarray(advantages), **recorded,
    }  # fmt: skip


def start_model(config: ToolUseConfig, placement):
    """`--model` (a model whose tokenizer has a chat template) or a new one with the chat
    tokenizer, replicated over `placement`'s devices."""
    from kit import episodes, models

    if config.model is not None:
        model = models.load_model(config.model)
        if getattr(model.tokenizer, "chat_template", None) is None:
            raise UserError(f"--model {config.model}: its tokenizer has no chat template")
    else:
        model = models.new_model(episodes.chat_tokenizer(), config.model_size, config.seed)
    models.replayed_routing(model.config, config.replay_routing)  # an MoE model, if asked
    return models.replicated(models.with_remat(model, config.remat), placement)


def episode_config(task, tokenizer, vocab_size: int, temperature: float):
    """Episodes of at most `task.max_turns` turns of `task.turn_tokens` sampled tokens each at
    `temperature` (0: greedy), stopping at the tokenizer's stop ids; embedding rows past the
    tokenizer's vocabulary are never sampled."""
    from tunelib import rollout

    return rollout.EpisodeConfig(
        sampling=rollout.SamplingConfig(
            max_new_tokens=task.turn_tokens, temperature=temperature,
            stop_tokens=tuple(tokenizer.stop_ids), pad_token=tokenizer.pad_id,
            forbidden_tokens=tuple(range(tokenizer.vocab_size, vocab_size)),
        ),
        max_turns=task.max_turns, max_tokens=task.episode_tokens,
        max_observation_tokens=task.observation_tokens,
    )  # fmt: skip


def episodes_of(model, task, params, records, key, episode, group_size, record_routing=False):
    """Episodes of `records` (`group_size` each) under `episode` (an `EpisodeConfig`) and
    their environments."""
    from tunelib import rollout

    from kit import data, episodes

    envs = episodes.environments(task, records, group_size)
    prompt_tokens, prompt_where = data.prompts(task, records)
    out = rollout.run_episodes(
        model.graphdef, params, prompt_tokens, prompt_where, key, episode, envs,
        group_size=group_size, tokenizer=model.tokenizer, record_routing=record_routing,
    )  # fmt: skip
    return out, envs


def optimizers(config: ToolUseConfig) -> tuple:
    """SFT's and GRPO's: global-norm clipping, then AdamW at each one's learning rate (SFT's
    warmed up over its first 5 %), of the same state structure, so that one checkpoint
    template holds either."""
    import optax

    sft_rate = optax.warmup_constant_schedule(
        0.0, config.sft_learning_rate, max(1, config.sft_steps // 20)
    )
    sft_optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sft_rate))
    grpo_rate = optax.constant_schedule(config.learning_rate)
    return sft_optimizer, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(grpo_rate))


def update(state, batch, *, objective, optimizer, graphdef, implementation="auto"):
    """One update of the weights on `objective(token_logps, batch)`, the episode tokens'
    log-probs under the weights (`scores`)."""
    import jax
    import optax

    def loss_fn(params):
        return objective(scores(graphdef, params, batch, implementation=implementation), batch)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {**state, "params": params, "opt_state": opt_state}, {"loss": loss}


def held_out(params, *, model, task, greedy, sampling, eval_samples: int) -> dict:
    """Greedy episodes of every held-out problem: accuracy and tool use; with
    --eval-samples k, k sampled episodes of each: pass@1, pass@k, maj@k (the model's tokens
    as the answer), the entropy and diversity of its tokens."""
    import jax
    import numpy as np

    from kit import episodes, evaluate

    episode, envs = episodes_of(model, task, params, task.heldout, jax.random.key(0), greedy, 1)
    rewards = np.asarray(episode.rewards)
    out = {
        "accuracy": float((rewards == 1.0).mean()),
        **episodes.tool_use(envs, np.asarray(episode.num_turns)),
    }
    if k := eval_samples:
        drawn, _ = episodes_of(model, task, params, task.heldout, jax.random.key(1), sampling, k)
        tokens, where = np.asarray(drawn.tokens), np.asarray(drawn.where)
        answers = [tuple(row[mask]) for row, mask in zip(tokens, where, strict=True)]
        out.update(evaluate.sample_metrics(
            tokens, where, np.asarray(drawn.logps), np.asarray(drawn.rewards) == 1.0, answers,
            k=k,
        ))  # fmt: skip
    return out


@dataclasses.dataclass
class Step:
    """A step of the run: SFT on demonstrations for the first `--sft-steps`, then GRPO on
    episodes the model plays, from a fresh optimizer state."""

    config: ToolUseConfig
    model: object
    task: object
    demos: dict
    placement: object
    sampling: object
    sft_update: object
    grpo_update: object
    grpo_optimizer: object
    evaluate: object

    def __call__(self, state, indices):
        import numpy as np

        from kit import episodes, goodput, loop

        config, task, width = self.config, self.task, self.task.episode_tokens
        step = int(state["step"]) + 1
        if step <= config.sft_steps:  # demonstrations drawn by the seed and the step
            draw = np.random.default_rng([config.seed, step])
            chosen = draw.integers(0, config.num_demonstrations, config.sft_batch_size)
            rows = {k: x[chosen] for k, x in self.demos.items()}
            state, out = self.sft_update(state, self.placement.rows(trimmed(rows, width)))
            if step == config.sft_steps and step % config.eval_every:
                out.update(self.evaluate(state["params"]))  # the start of GRPO, measured
            return {**state, "step": state["step"] + 1}, out
        if step == config.sft_steps + 1:
            state = {**state, "opt_state": self.grpo_optimizer.init(state["params"])}
        rng, key = loop.step_keys(state["rng"], "rollouts")
        records = [task.train[i] for i in self.placement.local(indices)]
        group = config.group_size
        with goodput.phase("rollout"):
            episode, envs = episodes_of(
                self.model, task, state["params"], records, key, self.sampling, group,
                config.replay_routing,
            )  # fmt: skip
            rows = episode_batch(task, records, episode, group)
        state, out = self.grpo_update(
            {**state, "rng": rng}, self.placement.rows(trimmed(rows, width))
        )
        out.update(
            reward=float(np.asarray(episode.rewards).mean()),
            **{f"sample_{k}": v for k, v in episodes.tool_use(
                envs, np.asarray(episode.num_turns)).items()},
        )  # fmt: skip
        return {**state, "step": state["step"] + 1}, out


def headline(run, config: ToolUseConfig) -> dict:
    """Accuracy and tool use before, at the end of SFT and after GRPO, with the sampled
    metrics (with --eval-samples)."""
    from kit import evaluate, loop

    records = run.records()
    at_sft = next((r for r in records if r["step"] == config.sft_steps and "accuracy" in r), {})
    out = {"tool": config.tool}
    for key in ("accuracy", "tool_call_rate", "malformed_rate", "turns"):
        values = [r[key] for r in records if key in r and r["step"] != config.sft_steps]
        out[f"{key}_before"] = values[0]
        out[f"{key}_sft"] = at_sft.get(key, float("nan"))
        out[f"{key}_after"] = values[-1]
    return out | loop.before_and_after(run, *evaluate.SAMPLED)  # with --eval-samples


def train(config: ToolUseConfig, run: kit.runs.RunFolder) -> dict:
    import grain
    import jax
    import jax.numpy as jnp

    from kit import episodes, loop, models, parallel, watch

    placement = parallel.placement(config.batch_size, config.devices)
    if placement.process_count > 1:
        raise UserError("tool_use.py runs in one process: start it without tunelib.launch")
    model = start_model(config, placement)
    task = episodes.load_task(
        config, model.tokenizer, tool=config.tool == "calculator", max_turns=config.max_turns
    )
    demos = episodes.demonstrations(task, task.train[: config.num_demonstrations])
    sampling, greedy = (
        episode_config(task, model.tokenizer, model.config.vocab_size, t)
        for t in (config.temperature, 0.0)
    )
    sft_optimizer, grpo_optimizer = optimizers(config)

    def updates(objective, optimizer):
        return jax.jit(functools.partial(
            update, objective=objective, optimizer=optimizer, graphdef=model.graphdef,
            implementation=config.logprobs,
        ))  # fmt: skip

    evaluate_fn = functools.partial(
        held_out, model=model, task=task, greedy=greedy, sampling=sampling,
        eval_samples=config.eval_samples,
    )  # fmt: skip
    train_step = Step(
        config, model, task, demos, placement, sampling,
        sft_update=updates(sft_loss, sft_optimizer),
        grpo_update=updates(functools.partial(grpo_loss, epsilon=config.epsilon), grpo_optimizer),
        grpo_optimizer=grpo_optimizer, evaluate=evaluate_fn,
    )  # fmt: skip
    # A warning line at the signs of entropy collapse; with --keep-best, the best model kept.
    watcher, best = watch.watcher(
        config, run, lambda folder, params: models.save_model(folder / "model", model, params),
        placement,
    )  # fmt: skip

    order = grain.MapDataset.range(len(task.train)).shuffle(seed=config.seed).repeat()
    batches = iter(order.batch(config.batch_size).to_iter_dataset())
    # The SFT optimizer's state; GRPO's replaces it (same structure) at its first step.
    state = loop.initial_state(model.params, sft_optimizer, config.seed, placement)
    state["step"] = placement.replicate(jnp.zeros((), jnp.int32))
    # --plan and --device-memory: the step compiled for the first batch, never run.
    planned = kit.plan.check(config, placement, state=state, batches=batches, step_fn=train_step)
    if planned is not None:
        return planned

    with loop.Steps(run, config, placement, state, batches) as steps:
        state = steps.state  # the last checkpoint's, with --resume
        if steps.fresh:  # the start model, evaluated as step 0
            evaluated = steps.evaluate(evaluate_fn, state["params"])
            watcher(0, evaluated, state)  # the collapse guard, --keep-best
            steps.log_start(evaluated)
        for step in steps:
            state, metrics = steps.step(train_step, state, steps.next_batch())
            if steps.evaluation_due(step):
                evaluated = steps.evaluate(evaluate_fn, state["params"])
                watcher(step, evaluated, state)  # the collapse guard, --keep-best
                metrics |= evaluated
            steps.done(step, state, metrics)
    models.save_model(run.path / "model", model, state["params"])
    return loop.finish(run, config, headline(run, config) | (best.headline() if best else {}))


if __name__ == "__main__":
    kit.cli.main(ToolUseConfig, train, __doc__)
