"""Knowledge distillation: a small student learns from a larger SFT teacher's distributions.

    python recipes/distill.py                        # the teacher (trained first if absent),
                                                     # the distilled student, the SFT student
    python recipes/distill.py --divergence jsd --mix 0.5 --temperature 2.0
    python recipes/distill.py --soft-weight 1.0      # soft targets only, no hard labels
    python recipes/distill.py --on-policy 0.5 --divergence jsd   # GKD: half the batches sampled

The data: a transfer set of the built-in task's prompts, each with the teacher's greedy
answer. The loss: the divergence between the student's and the teacher's next-token
distributions over the whole vocabulary, computed from both models' hidden states by
`tunelib.logprobs.fused_divergence` without any `[B, T, V]` logits, mixed with the
cross-entropy of the teacher's tokens. The teacher is the recipes' "base" decoder trained by
`recipes/sft.py` on more demonstrations; the student is the "student" decoder, a quarter of
its parameters. The baseline is the same student trained by SFT alone on the demonstrations,
for the same number of steps, in the run's `baseline/` folder.

On-policy (`--on-policy L`, generalised knowledge distillation): on a share L of the steps,
spread evenly (L = 0.5: every other step), the student samples its own completions of the
batch's prompts with `tunelib.rollout.sample`, and the loss is the divergence alone on those
tokens, the teacher scoring what the student wrote; the other steps are the off-policy one
above.
"""

import dataclasses
import functools
import math
from pathlib import Path
from typing import Literal

import kit
from kit.config import RLEvaluation, Run, Task, flag
from kit.errors import UserError


@dataclasses.dataclass(kw_only=True)
class DistillConfig(Run, Task, RLEvaluation):
    RECIPE = "distill"
    LEARNING_RATE = 3e-3

    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = flag(
        "forward_kl", "the divergence from the teacher's distribution"
    )
    mix: float = flag(0.5, "JSD's mixture weight of the teacher", aliases=("--beta",))
    temperature: float = flag(1.0, "softmax temperature of both distributions")
    soft_weight: float = flag(
        0.5, "weight of the soft (teacher distribution) term; 1 - it on the hard labels",
        aliases=("--alpha",),
    )  # fmt: skip
    num_prompts: int = flag(3000, "transfer-set prompts the teacher answers for the student")
    teacher: Path | None = flag(
        None,
        "the teacher: a run folder or model folder (default runs/teacher-seed<seed>, trained "
        "first with recipes/sft.py if it is not there)",
        aliases=("--teacher-dir",),
    )
    teacher_demonstrations: int = flag(6000, "demonstrations of the teacher's SFT run")
    teacher_steps: int = flag(2000, "steps of the teacher's SFT run")
    no_baseline: bool = flag(False, "skip the SFT-only student")
    on_policy: float = flag(
        0.0,
        "the share of steps on the student's own samples (GKD's lambda, TRL's lmbda): 0 "
        "distils on the teacher's answers only, 1 on the student's samples only",
    )
    sample_temperature: float = flag(1.0, "temperature of the student's samples (--on-policy)")

    def check(self) -> None:
        super().check()
        if not 0.0 <= self.mix <= 1.0:
            raise UserError(f"--mix must lie in [0, 1], got {self.mix}")
        if not 0.0 <= self.soft_weight <= 1.0:
            raise UserError(f"--soft-weight must lie in [0, 1], got {self.soft_weight}")
        if not self.temperature > 0:
            raise UserError(f"--temperature must be > 0, got {self.temperature}")
        if not 0.0 <= self.on_policy <= 1.0:
            raise UserError(f"--on-policy must lie in [0, 1], got {self.on_policy}")
        if not self.sample_temperature > 0:
            raise UserError(f"--sample-temperature must be > 0, got {self.sample_temperature}")
        kit.config.at_least("num_prompts", self.num_prompts, 1)
        kit.config.at_least("teacher_steps", self.teacher_steps, 1)
        kit.config.at_least("teacher_demonstrations", self.teacher_demonstrations, 1)
        if self.teacher is not None:
            from kit.models import model_folder

            model_folder(self.teacher, "--teacher")


def teacher_and_baseline(config: DistillConfig, run: kit.runs.RunFolder) -> tuple:
    """The teacher's folder, trained first if absent, and the SFT baseline of the same budget
    (not for --plan, which writes nothing), each in its own process, before this one opens
    its devices: `(folder, chained seconds, the baseline's result or None)`."""
    from kit import chain

    teacher_flags = chain.sft_flags(
        config, num_train=config.teacher_demonstrations, steps=config.teacher_steps,
        model_size="base",
    )  # fmt: skip
    folder, teacher_seconds = chain.ensure_model(
        config.teacher, kit.runs.default_out("teacher", config.seed), teacher_flags,
        what="teacher",
    )  # fmt: skip
    chained, baseline = {"teacher_seconds": teacher_seconds}, None
    if not (config.no_baseline or config.plan):
        chained["baseline_seconds"], baseline = chain.baseline(run, config, model_size="student")
    return folder, chained, baseline


def distill_objective(
    params, batch, teacher_params, *, student_graphdef, teacher_graphdef, divergence, mix,
    temperature, soft_weight, implementation="auto",
):  # fmt: skip
    """The token mean of the soft term (`divergence` between the student's and the teacher's
    next-token distributions at `temperature`, times temperature squared) mixed with the hard
    one (the NLL of the labels) at `soft_weight`; the divergence alone on the student's own
    samples (`batch["sampled"]`), which have no labels. The two terms' means as metrics."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tunelib import logprobs, losses

    teacher_model = nnx.merge(teacher_graphdef, teacher_params)
    teacher_hidden = jax.lax.stop_gradient(
        teacher_model(batch["tokens"], where=batch["attention_where"])
    )
    model = nnx.merge(student_graphdef, params)
    hidden = model(batch["tokens"], where=batch["attention_where"])
    # tau^2 keeps the soft term's gradients on the scale of the hard one (Hinton et al.).
    soft = temperature**2 * logprobs.fused_divergence(
        hidden, model.unembedding(), teacher_hidden, teacher_model.unembedding(),
        divergence=divergence, mix=mix, temperature=temperature,
        student_softcap=model.config.final_logit_softcapping,
        teacher_softcap=teacher_model.config.final_logit_softcapping, where=batch["where"],
    )  # fmt: skip
    hard = -logprobs.fused_token_logps(
        hidden, model.unembedding(), batch["targets"], where=batch["where"],
        softcap=model.config.final_logit_softcapping, implementation=implementation,
    )  # fmt: skip

    def mean(x):
        return losses.aggregate(x, mode="token_mean", where=batch["where"]).mean()

    # On the student's own samples there are no labels: the divergence alone (GKD).
    weight = jnp.where(batch["sampled"], 1.0, soft_weight)
    per_token = weight * soft + (1 - weight) * hard
    return mean(per_token), {"soft": mean(soft), "hard": mean(hard)}


def student_rows(params, rows, key, *, graphdef, sampling, prompt_length: int):
    """The batch's prompts, each followed by a completion the student samples."""
    from tunelib import rollout

    from kit import data

    prompts = data.prompts_of_rows(rows, prompt_length)
    out = rollout.sample(graphdef, params, *prompts, key, sampling)
    return data.sequences_of_completions(*prompts, out.tokens, out.where)


def train_step(state, rows, *, update, sample, teacher_params, on_policy: float):
    """One update on the batch's rows, or on the student's own completions of their prompts
    at the `on_policy` share of the steps (step t samples when it completes another whole
    sample: floor((t + 1) L) > floor(t L))."""
    import jax
    import jax.numpy as jnp

    from kit import goodput, loop

    rng, sample_key = loop.step_keys(state["rng"], "rollouts")
    t = int(state["step"])
    sampled = math.floor((t + 1) * on_policy) > math.floor(t * on_policy)
    if sampled:
        with goodput.phase("rollout"):
            rows = jax.block_until_ready(sample(state["params"], rows, sample_key))
    state = {**state, "rng": rng, "step": state["step"] + 1}
    state, out = update(state, {**rows, "sampled": jnp.asarray(sampled)}, teacher_params)
    return state, {**out, "on_policy": float(sampled)}


def transfer_set(task, teacher, vocab_size: int, placement):
    """`task` with the teacher's own greedy answers to its training prompts as completions
    (the prompts it gives no answer to left out): the transfer set."""
    from kit import evaluate

    sampling = evaluate.greedy_config(task, vocab_size)
    answers = evaluate.completions(
        teacher.graphdef, teacher.params, task, task.train, sampling, placement
    )
    transfer = [{**r, "completion": a} for r, a in zip(task.train, answers, strict=True) if a]
    return dataclasses.replace(task, train=transfer)


def step_pieces(state, rows, *, update, sample, teacher_params) -> dict:
    """A step's jitted parts (`kit.plan.Piece`), for --plan and --device-memory: the update,
    and the student's sampling unless it never samples (`sample` None)."""
    import jax

    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    batch = {**rows, "sampled": jax.ShapeDtypeStruct((), bool)}
    out = {"update": kit.plan.Piece(update, (state, batch, teacher_params), (1,))}
    if sample is not None:
        out["rollout"] = kit.plan.Piece(sample, (state["params"], rows, key), (1,))
    return out


def result(run, config: DistillConfig, teacher_accuracy: float, best, baseline) -> dict:
    """The result line's figures: the teacher's accuracy, the student's before and after
    (paired), the sampled metrics (with --eval-samples), the best model kept (--keep-best)
    and the SFT baseline's accuracy."""
    from kit import evaluate, loop

    before, after = loop.first_and_last(run, "accuracy")
    headline = {
        "divergence": config.divergence, "teacher_accuracy": teacher_accuracy,
        "accuracy_before": before, "accuracy_after": after, **evaluate.paired_headline(run),
        **loop.before_and_after(run, *evaluate.SAMPLED),  # with --eval-samples
        **(best.headline() if best else {}),
    }  # fmt: skip
    if baseline is not None:
        headline["sft_accuracy_after"] = baseline["accuracy_after"]
    return headline


def student_step(config: DistillConfig, task, teacher, student):
    """The optimizer, the update (`distill_objective`, then AdamW), the student's sampler at
    --sample-temperature with its sampling config, and the step that calls them."""
    import jax

    from kit import evaluate, optim

    optimizer = optim.adamw(config.learning_rate, config.steps, warmup=0.05, weight_decay=0.01)
    loss_fn = functools.partial(
        distill_objective, student_graphdef=student.graphdef, teacher_graphdef=teacher.graphdef,
        divergence=config.divergence, mix=config.mix, temperature=config.temperature,
        soft_weight=config.soft_weight, implementation=config.logprobs,
    )  # fmt: skip
    update = optim.update_step(loss_fn, optimizer)  # value_and_grad, then AdamW
    sampling = dataclasses.replace(
        evaluate.greedy_config(task, student.config.vocab_size),
        temperature=config.sample_temperature,
    )
    sample = jax.jit(
        functools.partial(
            student_rows, graphdef=student.graphdef, sampling=sampling,
            prompt_length=task.prompt_length,
        )
    )  # fmt: skip
    step_fn = functools.partial(
        train_step, update=update, sample=sample, teacher_params=teacher.params,
        on_policy=config.on_policy,
    )  # fmt: skip
    return optimizer, update, sample, sampling, step_fn


def train(config: DistillConfig, run: kit.runs.RunFolder) -> dict:
    import numpy as np

    from tunelib.data import CharTokenizer

    from kit import data, evaluate, loop, models, parallel, watch

    folder, chained, baseline = teacher_and_baseline(config, run)
    # Every device of every process; each batch split by rows.
    placement = parallel.placement(config.batch_size, config.devices)
    teacher = models.replicated(models.load_model(folder), placement)
    student = models.new_model(CharTokenizer(), "student", config.seed)
    student = models.replicated(models.with_remat(student, config.remat), placement)
    task = data.load_task(config, "sft", teacher, num_train=config.num_prompts)
    vocab_size = student.config.vocab_size

    task = transfer_set(task, teacher, vocab_size, placement)
    optimizer, update, sample, sampling, step_fn = student_step(config, task, teacher, student)

    # Greedy accuracy, and with --eval-samples k the student's k samples at
    # --sample-temperature: pass@1, pass@k, maj@k, entropy and diversity (kit.evaluate).
    evaluate_fn = evaluate.for_rl(
        config, student.graphdef, vocab_size, lambda params: params, task, sampling, placement,
        run,
    )  # fmt: skip
    # A warning line at the signs of entropy collapse; with --keep-best, the best model kept.
    watcher, best = watch.watcher(
        config, run, lambda folder, params: models.save_model(folder / "model", student, params),
        placement,
    )  # fmt: skip

    pieces = functools.partial(  # a step's jitted parts, for --plan and --device-memory
        step_pieces, update=update, sample=sample if config.on_policy else None,
        teacher_params=teacher.params,
    )  # fmt: skip

    state = loop.initial_state(student.params, optimizer, config.seed, placement)
    state["step"] = placement.replicate(np.int32(0))  # which steps sample (--on-policy)
    batches = data.batches(
        task, placement, batch_size=config.batch_size, seed=config.seed, kind="sft"
    )
    # --plan and --device-memory: the step's parts compiled for the first batch, never run.
    planned = kit.plan.check(
        config, placement, state=state, batches=batches, step_fn=step_fn, pieces=pieces
    )
    if planned is not None:
        return planned

    with loop.Steps(run, config, placement, state, batches) as steps:
        state = steps.state  # the last checkpoint's, with --resume
        if steps.fresh:  # the start model, evaluated as step 0
            evaluated = steps.evaluate(evaluate_fn, state["params"])
            watcher(0, evaluated, state)  # the collapse guard, --keep-best
            steps.log_start(evaluated)
        for step in steps:
            state, metrics = steps.step(step_fn, state, steps.next_batch())
            if steps.evaluation_due(step):
                evaluated = steps.evaluate(evaluate_fn, state["params"])
                watcher(step, evaluated, state)  # the collapse guard, --keep-best
                metrics |= evaluated
            steps.done(step, state, metrics)
    models.save_model(run.path / "model", student, state["params"])
    teacher_accuracy = evaluate.accuracy(
        teacher.graphdef, teacher.params, task, vocab_size, placement
    )
    headline = result(run, config, teacher_accuracy, best, baseline)
    return loop.finish(run, config, headline, chained=chained)


if __name__ == "__main__":
    kit.cli.main(DistillConfig, train, __doc__)
