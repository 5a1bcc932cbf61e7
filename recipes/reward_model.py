"""A reward model: an SFT model with a score head, trained on preference pairs.

    python recipes/reward_model.py            # trains recipes/sft.py first if its model is absent
    python recipes/reward_model.py --pooling last   # the last token's state, not the mean
    python recipes/reward_model.py --resume   # continue the run from its last checkpoint
    python recipes/grpo.py --reward-model runs/reward_model-seed0   # RLHF: GRPO on its rewards

The data: pairs of a prompt, a chosen and a rejected completion, as for DPO (on the built-in
task the chosen answer is the right one, the rejected one the SFT model's own wrong answer,
sampled as GRPO will sample it, or a near miss where it is right; with `--data`, a file's
`prompt`/`chosen`/`rejected` records). The model: the SFT decoder with a score vector w on its
final hidden states: r(x, y) = w . h_last, at the sequence's last token, or the mean of w . h_j
over the completion's tokens (`--pooling`, `kit.reward_model`). The loss: the Bradley-Terry
negative log-likelihood of `tunelib.losses` on the two sides' rewards, from one forward pass
over both. The step: an Optax update of every weight and the head. Held-out: the share of pairs
whose chosen side gets the higher reward. The reward model learns which answers are right only
from the preferences: nothing else tells it.
"""

import dataclasses
import functools
from typing import Literal

import kit
from kit.config import CHECKPOINT_EVERY, DataFile, Run, SFTStart, Task, flag
from kit.errors import UserError


@dataclasses.dataclass(kw_only=True)
class RewardModelConfig(Run, Task, DataFile, SFTStart):
    RECIPE = "reward_model"
    LEARNING_RATE = 1e-3

    steps: int = flag(3000, "optimizer steps")
    eval_every: int = flag(500, "steps between held-out evaluations")
    checkpoint_every: int | Literal["auto"] = flag(500, CHECKPOINT_EVERY)
    rejected: Literal["sampled", "model", "near_miss"] = flag(
        "sampled",
        "built-in task: rejected answers are the SFT model's own wrong answers, sampled at "
        "temperature 1 as GRPO samples them, or greedy (model); near misses where it is right; "
        "or near misses only",
    )
    num_prompts: int = flag(9000, "built-in task: training prompts the pairs are built on")
    pooling: Literal["last", "mean"] = flag(
        "mean",
        "the reward: the head on the last token's hidden state, or its mean over the "
        "completion's tokens",
    )
    centering_weight: float = flag(
        0.0, "weight of the squared reward sum that keeps rewards near 0 (TRL suggests 0.01)"
    )

    def check(self) -> None:
        super().check()
        if self.centering_weight < 0:
            raise UserError(f"--centering-weight must be >= 0, got {self.centering_weight}")


def bradley_terry_objective(params, batch, *, graphdef, pooling, centering_weight):
    """The batch's mean Bradley-Terry loss over its pairs (held-out batches end with rows of
    padding) of the scores the head gives the decoder's pooled hidden states, with the pair
    accuracy, the reward margin and the chosen completions' reward as metrics."""
    import jax.numpy as jnp

    from tunelib import losses, metrics

    from kit import reward_model

    chosen, rejected, real = reward_model.pair_scores(
        graphdef, params["decoder"], params["head"], batch, pooling=pooling
    )
    per_pair = losses.bradley_terry_loss(
        chosen, rejected, centering_weight=centering_weight, where=real
    )
    count = jnp.maximum(real.sum(), 1)
    margins = metrics.reward_margins(chosen, rejected, where=real)
    return per_pair.sum() / count, {
        "pair_accuracy": metrics.preference_accuracy(chosen, rejected, where=real),
        "reward_margin": margins.sum() / count,
        "chosen_reward": jnp.where(real, chosen, 0.0).sum() / count,
    }


def train(config: RewardModelConfig, run: kit.runs.RunFolder) -> dict:
    import jax

    from kit import chain, data, evaluate, loop, optim, pairs, parallel, plan, reward_model

    # The SFT start, trained first if absent: before this process opens its devices.
    start, sft_seconds = chain.sft_start(config)
    # Every device of every process; each batch split by rows.
    placement = parallel.placement(config.batch_size, config.devices)
    model = chain.start_model(start, placement, run, remat=config.remat)
    graphdef, vocab_size = model.graphdef, model.config.vocab_size
    task = data.load_task(
        config, "preference", model, data=config.data, num_train=config.num_prompts
    )
    if task.name == "arithmetic" and config.rejected != "near_miss":
        task = pairs.on_policy_pairs(
            task, graphdef, model.params, vocab_size, placement,
            temperature=1.0 if config.rejected == "sampled" else 0.0, seed=config.seed,
        )  # fmt: skip
    head = reward_model.init_head(model.config.hidden_size, config.seed)
    params = {"decoder": model.params, "head": placement.replicate(head)}
    optimizer = optim.adamw(config.learning_rate, config.steps, warmup=0.1)

    loss_fn = functools.partial(
        bradley_terry_objective, graphdef=graphdef, pooling=config.pooling,
        centering_weight=config.centering_weight,
    )  # fmt: skip

    heldout = data.heldout_batches(task, placement, batch_size=config.batch_size, kind="preference")
    heldout_accuracy = jax.jit(lambda params, batch: loss_fn(params, batch)[1]["pair_accuracy"])

    def evaluate_fn(params):
        return {
            "heldout_pair_accuracy": evaluate.pair_mean(
                lambda b: heldout_accuracy(params, b), heldout
            )
        }

    state = loop.initial_state(params, optimizer, config.seed, placement)
    batches = data.batches(
        task, placement, batch_size=config.batch_size, seed=config.seed, kind="preference"
    )
    step_fn = optim.update_step(loss_fn, optimizer)  # value_and_grad, then AdamW
    # --plan and --device-memory: the step compiled for the first batch, never run.
    planned = plan.check(config, placement, state=state, batches=batches, step_fn=step_fn)
    if planned is not None:
        return planned

    with loop.Steps(run, config, placement, state, batches) as steps:
        state = steps.state  # the last checkpoint's, with --resume
        if steps.fresh:  # the start model, evaluated as step 0
            steps.log_start(steps.evaluate(evaluate_fn, state["params"]))
        for step in steps:
            state, metrics = steps.step(step_fn, state, steps.next_batch())
            if steps.evaluation_due(step):
                metrics |= steps.evaluate(evaluate_fn, state["params"])
            steps.done(step, state, metrics)
    trained = state["params"]
    reward_model.save(
        run.path / "model", model, trained["decoder"], trained["head"], pooling=config.pooling
    )
    headline = loop.before_and_after(run, "heldout_pair_accuracy")
    headline["final_pair_accuracy"] = loop.first_and_last(run, "pair_accuracy")[1]
    return loop.finish(run, config, headline, chained={"sft_seconds": sft_seconds})


if __name__ == "__main__":
    kit.cli.main(RewardModelConfig, train, __doc__)
