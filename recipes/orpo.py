"""ORPO in one stage, without a reference model, against SFT alone at the same budget.

    python recipes/orpo.py                 # a new model: the SFT baseline, then ORPO
    python recipes/orpo.py --no-baseline   # ORPO only
    python recipes/orpo.py --resume        # continue the run from its last checkpoint
    python recipes/orpo.py --model HF_CHECKPOINT --data pairs.jsonl   # your model and pairs

The data: preference pairs (on the built-in task the right answer against a near miss; with
`--data`, a file's `prompt`/`chosen`/`rejected` records). The loss: the NLL of the chosen
completion plus a penalty on the log odds ratio of chosen over rejected, both from
length-normalised log-probs (`tunelib.losses.orpo_loss`), from one forward pass over both
sides. The step: one Optax update. The baseline (built-in task only) is `recipes/sft.py` with
the same seed, steps, learning rate and batch size, in the run's `baseline/` folder.
"""

import dataclasses
import functools
from pathlib import Path
from typing import Literal

import kit
from kit.config import MODELS, DataFile, Run, Start, Task, flag
from kit.errors import UserError


@dataclasses.dataclass(kw_only=True)
class ORPOConfig(Run, Task, DataFile, Start):
    RECIPE = "orpo"
    LEARNING_RATE = 3e-3

    model: Path | None = flag(
        None, f"start from this model instead of a new one: {MODELS}",
    )  # fmt: skip
    model_size: Literal["student", "base", "teacher"] = flag("base", "the size of a new model")
    odds_ratio_weight: float = flag(
        0.1, "weight of the odds-ratio term, ORPO's lambda", aliases=("--lambda",)
    )
    no_baseline: bool = flag(False, "skip the SFT run with the same budget (built-in task)")

    def check(self) -> None:
        super().check()
        if self.data is not None and self.model is None:
            raise UserError("--data needs --model: a model whose tokenizer reads the file's text")
        if self.odds_ratio_weight < 0:
            raise UserError(f"--odds-ratio-weight must be >= 0, got {self.odds_ratio_weight}")


def orpo_objective(params, batch, *, graphdef, odds_ratio_weight, implementation="auto"):
    """The batch's mean ORPO loss over its pairs (held-out batches end with rows of padding),
    with the chosen completions' NLL and the log odds ratio as metrics."""
    import jax.numpy as jnp

    from tunelib import losses

    from kit import pairs

    both = pairs.pair_logps(graphdef, params, batch, implementation=implementation)
    per_pair = losses.orpo_loss(
        both.chosen_mean, both.rejected_mean, odds_ratio_weight=odds_ratio_weight
    )
    log_odds_ratio = losses.orpo_log_odds_ratio(both.chosen_mean, both.rejected_mean)

    def mean(x):
        return jnp.where(both.real, x, 0.0).sum() / jnp.maximum(both.real.sum(), 1)

    return mean(per_pair), {"nll": mean(-both.chosen_mean), "log_odds_ratio": mean(log_odds_ratio)}


def train(config: ORPOConfig, run: kit.runs.RunFolder) -> dict:
    import jax

    from kit import chain, data, evaluate, loop, models, optim, parallel, plan

    # The SFT baseline of the same budget, trained first: before this process opens its devices
    # (not for --plan, which writes nothing).
    chained = {}
    if not (config.no_baseline or config.plan) and config.data is None:
        chained["baseline_seconds"], baseline = chain.baseline(
            run, config, model_size=config.model_size
        )
    # Every device of every process; each batch split by rows.
    placement = parallel.placement(config.batch_size, config.devices)
    model = models.start_model(config.model, config.model_size, config.seed)
    model = models.with_remat(model, config.remat)
    model = models.replicated(model, placement)
    graphdef, vocab_size = model.graphdef, model.config.vocab_size
    task = data.load_task(config, "preference", model, data=config.data)
    optimizer = optim.adamw(config.learning_rate, config.steps, warmup=0.05, weight_decay=0.01)

    loss_fn = functools.partial(
        orpo_objective, graphdef=graphdef, odds_ratio_weight=config.odds_ratio_weight,
        implementation=config.logprobs,
    )  # fmt: skip
    step_fn = optim.update_step(loss_fn, optimizer)  # value_and_grad, then AdamW

    heldout = data.heldout_batches(task, placement, batch_size=config.batch_size, kind="preference")
    heldout_loss = jax.jit(lambda params, batch: loss_fn(params, batch)[0])

    def evaluate_fn(params):
        out = {"heldout_loss": evaluate.pair_mean(lambda b: heldout_loss(params, b), heldout)}
        if task.problems:
            out["accuracy"] = evaluate.accuracy(graphdef, params, task, vocab_size, placement)
        return out

    state = loop.initial_state(model.params, optimizer, config.seed, placement)
    batches = data.batches(
        task, placement, batch_size=config.batch_size, seed=config.seed, kind="preference"
    )
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
    models.save_model(run.path / "model", model, state["params"])
    headline = loop.before_and_after(run, "accuracy", "heldout_loss")
    if "baseline_seconds" in chained:
        headline["sft_accuracy_after"] = baseline["accuracy_after"]
    return loop.finish(run, config, headline, chained=chained)


if __name__ == "__main__":
    kit.cli.main(ORPOConfig, train, __doc__)
