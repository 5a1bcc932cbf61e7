"""DPO (or a DPO-family loss) of an SFT model on preference pairs.

    python recipes/dpo.py                     # trains recipes/sft.py first if its model is absent
    python recipes/dpo.py --loss ipo --beta 0.5
    python recipes/dpo.py --resume            # continue the run from its last checkpoint
    python recipes/dpo.py --lora-rank 16      # LoRA adapters on the frozen SFT model (--qlora: NF4)
    python recipes/dpo.py --model HF_CHECKPOINT --data pairs.jsonl   # your model and pairs

The data: pairs of a prompt, a chosen and a rejected completion. On the built-in task the
chosen answer is the right one and the rejected one is the SFT model's own wrong greedy
answer to that prompt (a near miss where it is right); with `--data`, a file's
`prompt`/`chosen`/`rejected` records. The loss: a pairwise loss of `tunelib.losses` on the
sequence log-probs of policy and reference (the SFT model, frozen), from one forward pass over
both sides. The step: an Optax update of the weights, or of LoRA adapters on the frozen base,
whose reference is that same base without adapters (as TRL does for PEFT models). Held-out:
the share of pairs whose chosen side gets the higher implicit reward, and the greedy accuracy
on the built-in task.
"""

import dataclasses
import functools
from typing import Literal

import kit
from kit.config import DataFile, Lora, Run, SFTStart, Task, flag
from kit.errors import UserError

LOSSES = (
    "dpo", "robust_dpo", "ipo", "hinge", "exo", "nca", "bco_pair", "sppo_hard", "apo_zero",
    "apo_down", "discopop",
)  # fmt: skip


@dataclasses.dataclass(kw_only=True)
class DPOConfig(Run, Task, DataFile, SFTStart, Lora):
    RECIPE = "dpo"
    LEARNING_RATE = 1e-4
    LORA_LEARNING_RATE = 1e-3

    steps: int = flag(600, "optimizer steps")
    loss: Literal[LOSSES] = flag("dpo", "the pairwise loss of tunelib.losses")
    beta: float = flag(1.0, "the loss's strength beta")
    rejected: Literal["model", "near_miss"] = flag(
        "model",
        "built-in task: rejected answers are the SFT model's own wrong greedy answers (near "
        "misses where it is right), or near misses only",
    )
    nll_weight: float = flag(
        0.0, "weight of the chosen answers' per-token NLL added to the loss (Llama 3: 0.2)"
    )
    num_prompts: int = flag(9000, "built-in task: training prompts the pairs are built on")
    packing: bool = flag(False, "pack several pairs into each row (--batch-size rows)")

    def check(self) -> None:
        super().check()
        if not self.beta > 0:
            raise UserError(f"--beta must be > 0, got {self.beta}")
        if self.nll_weight < 0:
            raise UserError(f"--nll-weight must be >= 0, got {self.nll_weight}")


def dpo_objective(
    trainable, frozen, batch, dropout_key, *, graphdef, tuning, loss, beta, nll_weight,
    implementation="auto", max_segments=None,
):  # fmt: skip
    """The batch's mean `tunelib.losses.<loss>_loss` (DPO or a variant, `--loss`) over its pairs
    (held-out batches end with rows of padding), the policy being the trainable weights (or
    adapters on `frozen["base"]`) and the reference `frozen["reference"]`, minus `nll_weight`
    times the chosen answer's per-token log-likelihood; the implicit rewards' accuracy and
    margin and the chosen log-probs as metrics."""
    import jax
    import jax.numpy as jnp

    from tunelib import losses, metrics, peft

    from kit import pairs

    pairwise_loss = getattr(losses, f"{loss}_loss")

    def sequence_logps(params, batch):
        return pairs.pair_logps(
            graphdef, params, batch, implementation=implementation, max_segments=max_segments
        )

    params = tuning.params(trainable, frozen["base"], dropout_key)
    policy = peft.lora(sequence_logps)(params, batch)
    ref = jax.lax.stop_gradient(peft.lora(sequence_logps)(frozen["reference"], batch))
    real = policy.real
    per_pair = pairwise_loss(
        policy.chosen, policy.rejected, ref.chosen, ref.rejected, beta=beta, where=real
    )
    # The chosen answer's per-token NLL (Llama 3 adds it to DPO with weight 0.2).
    per_pair = per_pair - nll_weight * jnp.where(real, policy.chosen_mean, 0.0)
    count = jnp.maximum(real.sum(), 1)
    chosen_rewards = metrics.implicit_rewards(policy.chosen, ref.chosen, beta=beta, where=real)
    rejected_rewards = metrics.implicit_rewards(
        policy.rejected, ref.rejected, beta=beta, where=real
    )
    margins = metrics.reward_margins(chosen_rewards, rejected_rewards, where=real)
    return per_pair.sum() / count, {
        "reward_accuracy": metrics.preference_accuracy(
            chosen_rewards, rejected_rewards, where=real
        ),
        "reward_margin": margins.sum() / count,
        "chosen_logps": jnp.where(real, policy.chosen, 0.0).sum() / count,
    }


def update(frozen, state, batch, *, loss_fn, optimizer, dropout: bool):
    """One AdamW update of the trainable weights on `loss_fn(trainable, frozen, batch,
    dropout_key) -> (loss, metrics)`."""
    import jax
    import optax

    from kit import loop

    rng, dropout_key = loop.step_keys(state["rng"], "dropout")
    dropout_key = dropout_key if dropout else None
    (loss, out), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state["params"], frozen, batch, dropout_key
    )
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "rng": rng}, {"loss": loss, **out}


def evaluation(config, task, loss_fn, frozen, model, tuning, placement):
    """Held-out: the reward accuracy of the pairs (the implicit reward of the chosen answer
    above the rejected one's), and the greedy accuracy where the records have answers."""
    import jax

    from kit import data, evaluate

    heldout = data.heldout_batches(task, placement, batch_size=config.batch_size, kind="preference")
    metrics_of = jax.jit(functools.partial(loss_fn, dropout_key=None))

    def evaluate_fn(trainable):
        out = {
            "heldout_reward_accuracy": evaluate.pair_mean(
                lambda b: metrics_of(trainable, frozen, b)[1]["reward_accuracy"], heldout
            )
        }
        if task.problems:
            out["accuracy"] = evaluate.accuracy(
                model.graphdef, tuning.policy(trainable), task, model.config.vocab_size,
                placement,
            )  # fmt: skip
        return out

    return evaluate_fn


def train(config: DPOConfig, run: kit.runs.RunFolder) -> dict:
    import jax

    from kit import chain, data, loop, lora, optim, pairs, parallel, plan

    # The SFT start, trained first if absent: before this process opens its devices.
    start, sft_seconds = chain.sft_start(config)
    # Every device of every process; each batch split by rows.
    placement = parallel.placement(config.batch_size, config.devices)
    model = chain.start_model(start, placement, run, remat=config.remat)
    graphdef, vocab_size = model.graphdef, model.config.vocab_size
    task = data.load_task(
        config, "preference", model, data=config.data, num_train=config.num_prompts
    )
    if task.name == "arithmetic" and config.rejected == "model":
        task = pairs.on_policy_pairs(task, graphdef, model.params, vocab_size, placement)
    tuning = lora.tuning(
        model, placement, rank=config.lora_rank, alpha=config.lora_alpha,
        dropout=config.lora_dropout, qlora=config.qlora, seed=config.seed,
    )  # fmt: skip
    # With LoRA the reference is the frozen base without adapters: the policy's start.
    frozen = {"base": tuning.base, "reference": tuning.base or model.params}
    optimizer = optim.adamw(config.learning_rate, config.steps, warmup=0.1)

    loss_fn = functools.partial(
        dpo_objective, graphdef=graphdef, tuning=tuning, loss=config.loss,
        beta=config.beta, nll_weight=config.nll_weight, implementation=config.logprobs,
        max_segments=data.max_segments(task),
    )  # fmt: skip

    evaluate_fn = evaluation(config, task, loss_fn, frozen, model, tuning, placement)
    state = loop.initial_state(tuning.trainable, optimizer, config.seed, placement)
    batches = data.batches(
        task, placement, batch_size=config.batch_size, seed=config.seed,
        kind="preference", packing=config.packing,
    )  # fmt: skip
    step_fn = functools.partial(  # the frozen weights: arguments; the state: donated
        jax.jit(update, static_argnames=("loss_fn", "optimizer", "dropout"), donate_argnums=1),
        frozen,
        loss_fn=loss_fn, optimizer=optimizer, dropout=bool(config.lora_dropout),
    )  # fmt: skip
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
    headline = {
        "loss": config.loss,
        **tuning.headline(),
        **loop.before_and_after(run, "accuracy", "heldout_reward_accuracy"),
    }
    headline["final_reward_accuracy"] = loop.first_and_last(run, "reward_accuracy")[1]
    return loop.finish(run, config, headline, chained={"sft_seconds": sft_seconds})


if __name__ == "__main__":
    kit.cli.main(DPOConfig, train, __doc__)
