"""GRPO disaggregated and asynchronous: process 0 trains, process 1 samples.

    python -m tunelib.launch -n 2 recipes/grpo_async.py --max-staleness 1
    python -m tunelib.launch -n 2 recipes/grpo_async.py --max-staleness 0   # they take turns
    python -m tunelib.launch -n 2 recipes/grpo.py --max-staleness 1         # the same run

The synchronous recipe, `recipes/grpo.py`, split in two roles on the same kit
(`kit.grpo`): its flags, data, rewards and updates are that recipe's. Each process holds the
model on its own devices. Every step they meet through a collective of JAX's own
(`kit.disaggregated`): the sampler's batch of scored rollouts goes to the trainer, which
computes its rewards and advantages once and updates on it, then the trainer's new weights
(LoRA adapters merged) go to the sampler. A batch is sampled at most `--max-staleness` s
updates before it is trained on; s = 0 is the synchronous recipe's steps on two processes.
With s > 0 each batch is corrected by default for the weights that sampled it: truncated
importance weights of the trainer's log-probs before the update over the sampler's
(`--is-correction`). Checkpoints and the saved model hold the trainer's state, on both
processes.
"""

import dataclasses
import functools
from typing import Literal

import kit
from kit.config import at_least, flag
from kit.errors import UserError
from kit.grpo_config import GRPOConfig


@dataclasses.dataclass(kw_only=True)
class GRPOAsyncConfig(GRPOConfig):
    RECIPE = "grpo_async"

    max_staleness: int = flag(
        1,
        "run disaggregated on 2 processes (python -m tunelib.launch -n 2): process 0 trains, "
        "process 1 samples batches at most this many updates old (0: they take turns)",
    )

    push_dtype: Literal["float32", "bfloat16"] = flag(
        "float32",
        "the dtype of the weights pushed to the sampler, which samples with them as they "
        "arrive (bfloat16: half the bytes, and the sampler's rounding of the trained weights)",
    )
    weight_push: Literal["full", "delta"] = flag(
        "full",
        "delta: after the first push, send only the elements that changed when that is "
        "fewer bytes (pays with --push-dtype bfloat16 at small learning rates: "
        "benchmarks/weight_delta.py)",
    )

    def stale(self) -> bool:
        return self.max_staleness > 0

    def check_staleness(self) -> None:
        at_least("max_staleness", self.max_staleness, 0)
        if self.weight_push == "delta" and self.push_dtype == "float32":
            raise UserError(
                "--weight-push delta sends more than the weights in float32, where every "
                "element changes at each step (benchmarks/weight_delta.py): push bfloat16 "
                "(--push-dtype bfloat16), or push them whole"
            )
        if self.keep_best is not None:
            raise UserError(
                "--keep-best runs with recipes/grpo.py; with --max-staleness the trained "
                "weights live on the trainer alone: keep the final model, or its checkpoints"
            )
        if self.reads_images():
            raise UserError(
                "records with images train with recipes/grpo.py; the disaggregated recipe "
                "exchanges text rollouts only"
            )


@dataclasses.dataclass
class Step:
    """A step of both processes: the trainer takes the batch the sampler made (at most
    `--max-staleness` updates old) and updates on it; then the batch the sampler made
    meanwhile and the new weights change hands (`kit.disaggregated`)."""

    trainer: bool  # this process trains (else it samples)
    placement: object
    tuning: object  # kit.lora.Tuning
    learner: object  # kit.grpo.Learner
    rollouts: object  # kit.disaggregated.Rollouts
    batches: object  # the prompt indices of each step
    push_dtype: str = "float32"  # the weights as the sampler receives them
    weight_push: str = "full"  # or "delta"
    sampler_policy: dict = dataclasses.field(default_factory=dict)  # the sampler's weights

    def __call__(self, state, indices):
        import jax
        import numpy as np

        from kit import goodput, loop

        trainer, learner, rollouts = self.trainer, self.learner, self.rollouts
        rng, _, dropout_key = loop.step_keys(state["rng"], "rollouts", "dropout")
        version = int(np.asarray(state["updates"]))
        if not self.sampler_policy:  # the run's first step, or after a restore: the same state
            # as a push delivers it (rounded to --push-dtype), so that a resumed run samples
            # as the run that never stopped did
            start = state["params"]
            self.sampler_policy["trainable"] = as_trained(self.pushed(start), start)
            rollouts.held = None  # a delta push needs both to hold the last push
            if trainer:
                learner.hand_out(version, self.tuning.policy(self.sampler_policy["trainable"]))
        policy = self.tuning.policy(self.sampler_policy["trainable"])  # adapters beside the base
        with goodput.phase("rollout"):  # the trainer waits for a batch; the sampler samples
            rows = rollouts.take(
                policy, self.placement.local(indices), self.batches, state["rng"], version
            )
        state, out = {**state, "rng": rng, "updates": state["updates"] + 1}, {}
        if trainer:  # this process's rows, as the sampler sent them, on its devices
            staleness = version - int(rows.version)
            state, out = jax.block_until_ready(
                learner.learn(state, rows.placed(self.placement), dropout_key, version=version)
            )
            out["staleness"] = staleness
        with goodput.phase("sync"):  # the next batch to the trainer, the trained part (all
            rollouts.deliver()  # the weights, or only the adapters) to the sampler
            trained = state["params"] if trainer else self.sampler_policy["trainable"]
            pushed = self.pushed(trained)
            if trainer:  # the policy the sampler will run: the weights as they arrive there
                learner.hand_out(version + 1, self.tuning.policy(as_trained(pushed, trained)))
            weights, sent = rollouts.push(
                self.placement.fetch(pushed), delta=self.weight_push == "delta"
            )
            if not trainer:
                self.sampler_policy["trainable"] = as_trained(
                    self.placement.replicate(weights), trained
                )
        if not trainer:
            return state, {}
        pushed_metrics = {
            "weight_push_mb_per_s": sent["bytes"] / max(sent["seconds"], 1e-9) / 1e6,
            "weight_push_mb": sent["bytes"] / 1e6,
            "weight_push_delta": float(sent["delta"]),
        }
        return state, {**out, **pushed_metrics}

    def pushed(self, weights):
        """`weights` as they travel: floating-point arrays cast to `push_dtype`, in place."""
        from tunelib.rollout import sync_weights

        return sync_weights(weights, self.placement.replicated(), dtype=self.push_dtype)


def as_trained(pushed, trained):
    """The pushed weights in the trained weights' dtypes (the values as pushed)."""
    import jax

    return jax.tree.map(lambda x, like: x.astype(like.dtype), pushed, trained)


def to_saved(state, *, rollouts, learner, both, max_staleness: int):
    """The state as checkpointed and saved on every device of both processes, with the
    batches in flight (sampled for the next steps, by older weights) and the versions that
    sampled them: a resumed run trains on those, as the run that never stopped does."""
    from kit import disaggregated

    if max_staleness:
        state = {**state, "in_flight": rollouts.in_flight(), "ledger": learner.ledger_state()}
    return disaggregated.shared(state, both)


def from_saved(saved, *, rollouts, learner, placement, max_staleness: int):
    """This process's state from a checkpoint `to_saved` wrote."""
    from kit import disaggregated

    state = disaggregated.own(saved, placement)
    if max_staleness:
        rollouts.resume(state.pop("in_flight"))
        learner.resume_ledger(state.pop("ledger"))
    return state


def checkpointing(rollouts, learner, placement, both, max_staleness: int):
    """The state's way to a checkpoint and back (`to_saved`, `from_saved`), with the batches
    in flight and the ledger: `kit.loop.Steps(..., checkpointed=)`."""
    ends = {"rollouts": rollouts, "learner": learner, "max_staleness": max_staleness}
    return (
        functools.partial(to_saved, both=both, **ends),
        functools.partial(from_saved, placement=placement, **ends),
    )


def two_processes(config: GRPOAsyncConfig):
    """Each process's own devices (the trainer's and the sampler's meshes are apart), with
    one line for a run that is not on 2 processes."""
    from kit import parallel

    placement = parallel.placement(config.batch_size, config.devices, across_processes=False)
    if placement.process_count != 2:
        raise UserError(
            f"--max-staleness runs on 2 processes (one trains, one samples), not "
            f"{placement.process_count}: start it with python -m tunelib.launch -n 2"
        )
    return placement


def evaluation(config, model, tuning, task, sampling, placement, run, trainer: bool):
    """The held-out evaluation on the trainer; NaN for each metric on the sampler, whose copy
    of the state is not the trained one."""
    from kit import evaluate

    rl_evaluate = evaluate.for_rl(
        config, model.graphdef, model.config.vocab_size, tuning.policy, task, sampling,
        placement, run,
    )  # fmt: skip

    def evaluate_fn(trainable):
        if not trainer:
            return dict.fromkeys(evaluate.rl_metric_names(config), float("nan"))
        return rl_evaluate(trainable)

    return evaluate_fn


def train(config: GRPOAsyncConfig, run: kit.runs.RunFolder) -> dict:
    import grain
    import numpy as np

    from kit import chain, disaggregated, grpo, loop, models, watch

    # The SFT start, trained first if absent: before this process opens its devices.
    start, sft_seconds = chain.sft_start(config)
    placement = two_processes(config)
    trainer = disaggregated.role() == disaggregated.TRAINER
    model = chain.start_model(start, placement, run, remat=config.remat)
    # What grpo.py samples and trains with: `sample` runs on the sampler, `learner` on the
    # trainer.
    task, tuning, sampling, optimizer, sample, learner = grpo.setup(
        config, model, placement, max_staleness=config.max_staleness
    )
    order = grain.MapDataset.range(len(task.train)).shuffle(seed=config.seed).repeat()
    order = order.batch(config.batch_size)
    batches = iter(order.to_iter_dataset())
    # The batch as the trainer receives it, shaped by the sampler itself (zeros).
    template = sample.template(tuning.policy(tuning.trainable), config.batch_size)

    def sample_rows(*args, **kwargs):  # the batch as it travels: this process's rows, NumPy
        return sample(*args, **kwargs).local(placement)

    rollouts = disaggregated.Rollouts(
        config.max_staleness, sample_rows, template=template,
        fresh_batches=lambda: iter(order.to_iter_dataset()), faults=run.faults(),
    )  # fmt: skip
    train_step = Step(
        trainer, placement, tuning, learner, rollouts, batches,
        push_dtype=config.push_dtype, weight_push=config.weight_push,
    )  # fmt: skip
    evaluate_fn = evaluation(config, model, tuning, task, sampling, placement, run, trainer)

    def pieces(state, indices):  # a step's jitted parts, for --plan and --device-memory
        shaped = sample.template(tuning.policy(state["params"]), indices.shape[0])
        return learner.pieces(state, shaped, sampling)

    state = learner.initial_state(
        loop.initial_state(tuning.trainable, optimizer, config.seed, placement)
    )
    state = {**state, "updates": placement.replicate(np.int32(0))}
    both = disaggregated.everywhere()
    checkpointed = checkpointing(rollouts, learner, placement, both, config.max_staleness)
    watcher, _ = watch.watcher(config, run, None, placement)  # the collapse guard
    # --plan and --device-memory: the step's parts compiled for the first batch, never run.
    planned = kit.plan.check(
        config, placement, state=state, batches=batches, step_fn=train_step, pieces=pieces
    )
    if planned is not None:
        return planned

    with loop.Steps(run, config, placement, state, batches, checkpointed=checkpointed) as steps:
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
    model, state = models.replicated(model, both), disaggregated.shared(state, both)
    tuning = dataclasses.replace(tuning, base=disaggregated.shared(tuning.base, both))
    tuning.save(run.path, model, state["params"], both)
    headline = grpo.headline(run, config, tuning)
    return loop.finish(run, config, headline, chained={"sft_seconds": sft_seconds})


if __name__ == "__main__":
    kit.cli.main(GRPOAsyncConfig, train, __doc__)
