"""Supervised fine-tuning: a new model on the arithmetic task, or your model on your data.

    python recipes/sft.py                      # a new model on the built-in task, ~4 min on 2 CPUs
    python recipes/sft.py --steps 3000         # longer
    python recipes/sft.py --resume             # continue the run from its last checkpoint
    python recipes/sft.py --model runs/sft-minus --lora-rank 16 [--qlora]   # LoRA on a model
    python recipes/sft.py --model HF_CHECKPOINT --data chats.jsonl          # your model and data
    python recipes/sft.py --config sft.toml    # flags from a TOML file (flags override it)
    python recipes/sft.py --task vision_counting   # count shapes in pictures: Gemma 4 with images

The data: records of a prompt and its completion (the built-in task's "12+7=" and "19", or a
file's chat `messages` / `prompt`-`completion` records), tokenized with the model's own
tokenizer and chat template. With images (`--task vision_counting`: "How many circles are
there?" of a picture, on a tiny Gemma 4 vision-language model; or a file of image records,
`{"images": [...], "messages": [...]}`), each image's soft tokens sit in the prompt, and the
batch carries the pixels that the vision encoder turns into them. The loss: the mean
negative log-likelihood of the completion tokens (and EOS), from the fused log-prob head, so
no `[B, T, V]` logits exist. The step: one Optax update of the weights, or of LoRA adapters
on the frozen base with `--lora-rank`. Held-out: the loss, and the greedy accuracy where the
records have answers.
"""

import dataclasses
import functools
from pathlib import Path
from typing import Literal

import kit
from kit.config import MODELS, DataFile, Lora, Run, Start, Task, VisionTask, flag
from kit.errors import UserError


@dataclasses.dataclass(kw_only=True)
class SFTConfig(Run, Task, VisionTask, DataFile, Start, Lora):
    RECIPE = "sft"
    FULL_LOGITS = ("label_smoothing", "z_loss_weight")
    LEARNING_RATE = 3e-3
    LORA_LEARNING_RATE = 3e-3

    steps: int = flag(2000, "optimizer steps")
    model: Path | None = flag(
        None,
        f"start from this model instead of a new one: {MODELS}",
    )
    model_size: Literal["student", "base", "teacher", "moe"] = flag(
        "base", "the size of a new model (without --model); moe: a mixture of experts"
    )
    packing: bool = flag(False, "pack several sequences into each row (--batch-size rows)")
    label_smoothing: float = flag(0.0, "label smoothing (> 0 computes the full logits)")
    z_loss_weight: float = flag(0.0, "weight of the z-loss (> 0 computes the full logits)")

    def check(self) -> None:
        super().check()
        if self.data is not None and self.model is None and not self.reads_images():
            raise UserError("--data needs --model: a model whose tokenizer reads the file's text")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UserError(f"--label-smoothing must lie in [0, 1), got {self.label_smoothing}")
        if self.z_loss_weight < 0:
            raise UserError(f"--z-loss-weight must be >= 0, got {self.z_loss_weight}")


def completion_nll(
    params, batch, *, graphdef, label_smoothing=0.0, z_loss_weight=0.0, implementation="auto"
):
    """The token mean of the completion tokens' negative log-likelihood under the model
    `nnx.merge(graphdef, params)`: from the fused log-prob head (no `[B, T, V]` logits), or
    from the full logits with label smoothing or a z-loss."""
    from flax import nnx

    from tunelib import logprobs, losses

    from kit import images

    model = nnx.merge(graphdef, params)
    packed = {k: batch[k] for k in ("segment_ids", "positions") if k in batch}
    pixels = images.model_inputs(batch)  # the batch's images, if it has any
    hidden = model(batch["tokens"], where=batch["attention_where"], **packed, **pixels)
    if label_smoothing or z_loss_weight:  # these need every logit
        per_token = losses.nll_loss(
            model.unembed(hidden),
            batch["targets"],
            label_smoothing=label_smoothing,
            z_loss_weight=z_loss_weight,
            where=batch["where"],
        )
    else:
        per_token = -logprobs.fused_token_logps(
            hidden,
            model.unembedding(),
            batch["targets"],
            softcap=model.config.final_logit_softcapping,
            where=batch["where"],
            implementation=implementation,
        )
    return losses.aggregate(per_token, mode="token_mean", where=batch["where"]).mean()


def train_step(state, batch, *, base, loss_fn, optimizer, tuning, dropout: bool):
    """One AdamW update of the trainable weights (`tuning`'s: the weights, or the LoRA
    adapters on the frozen `base`) on `loss_fn(params, batch)`."""
    import jax
    import optax

    from tunelib import peft

    from kit import loop

    rng, dropout_key = loop.step_keys(state["rng"], "dropout")
    dropout_key = dropout_key if dropout else None

    def objective(trainable):
        return peft.lora(loss_fn)(tuning.params(trainable, base, dropout_key), batch)

    loss, grads = jax.value_and_grad(objective)(state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "rng": rng}, {"loss": loss}


def train(config: SFTConfig, run: kit.runs.RunFolder) -> dict:
    import jax

    from kit import data, evaluate, loop, lora, models, optim, parallel, plan

    # Every device of every process; each batch split by rows.
    placement = parallel.placement(config.batch_size, config.devices)
    model = models.start_model(
        config.model, config.model_size, config.seed, images=config.reads_images()
    )
    model = models.with_remat(model, config.remat)
    task = data.load_task(config, "sft", model, data=config.data, builtin=config.task)
    tuning = lora.tuning(
        model, placement, rank=config.lora_rank, alpha=config.lora_alpha,
        dropout=config.lora_dropout, qlora=config.qlora, seed=config.seed,
    )  # fmt: skip
    optimizer = optim.adamw(config.learning_rate, config.steps, warmup=0.05, weight_decay=0.01)
    graphdef = model.graphdef

    loss_fn = functools.partial(
        completion_nll, graphdef=graphdef, label_smoothing=config.label_smoothing,
        z_loss_weight=config.z_loss_weight, implementation=config.logprobs,
    )  # fmt: skip

    heldout = data.heldout_batches(task, placement, batch_size=config.batch_size, kind="sft")
    heldout_loss = jax.jit(loss_fn)

    def evaluate_fn(trainable):
        params = tuning.dense(trainable)
        out = {
            "heldout_loss": evaluate.weighted_mean(
                lambda b: heldout_loss(params, b), heldout, lambda b: b["where"].sum()
            )
        }
        if task.problems:
            out["accuracy"] = evaluate.accuracy(
                graphdef, params, task, model.config.vocab_size, placement
            )
        return out

    state = loop.initial_state(tuning.trainable, optimizer, config.seed, placement)
    batches = data.batches(
        task, placement, batch_size=config.batch_size, seed=config.seed,
        kind="sft", packing=config.packing,
    )  # fmt: skip
    step = functools.partial(
        train_step, loss_fn=loss_fn, optimizer=optimizer, tuning=tuning,
        dropout=bool(config.lora_dropout),
    )  # fmt: skip
    # The frozen base (None without LoRA) is the step's argument, not a constant in it; the
    # state is donated (the new one takes its buffers: one copy of the weights on the device).
    step_fn = functools.partial(jax.jit(step, donate_argnums=0), base=tuning.base)
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
    tuning.save(run.path, model, state["params"], placement)
    headline = {**tuning.headline(), **loop.before_and_after(run, "accuracy", "heldout_loss")}
    headline["final_loss"] = loop.first_and_last(run, "loss")[1]
    return loop.finish(run, config, headline)


if __name__ == "__main__":
    kit.cli.main(SFTConfig, train, __doc__)
