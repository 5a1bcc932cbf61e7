"""GRPO of an SFT model with a verifiable reward; DAPO and Dr. GRPO by `--mode`.

    python recipes/grpo.py                    # trains recipes/sft.py first if its model is absent
    python recipes/grpo.py --mode dapo        # clip-higher, token mean, overlong, dynamic sampling
    python recipes/grpo.py --mode dr_grpo     # unscaled advantages, token sum / max length
    python recipes/grpo.py --resume           # continue the run from its last checkpoint
    python recipes/grpo.py --lora-rank 16     # LoRA adapters on the frozen SFT model (--qlora)
    python recipes/grpo.py --reward my_rewards.py:score          # a reward function of your own
    python recipes/grpo.py --reward-model runs/reward_model-seed0  # RLHF: a learned reward
    python recipes/grpo.py --model HF_CHECKPOINT --data problems.jsonl   # your model and prompts
    python recipes/grpo.py --task vision_counting   # count shapes in pictures (Gemma 4, images)
    python -m tunelib.launch -n 2 recipes/grpo_async.py --max-staleness 1   # one samples

The data: prompts with answers (the built-in task's "12+7=" and "19", or a file's
`prompt`/`answer` records, the prompt a string or chat messages). With images (the built-in
vision task's "How many circles are there?" of a picture and "3", or a file's `images`,
`prompt`, `answer` records) the model is a Gemma 4 vision-language model: the sampler
encodes a prompt's images once, into the KV cache its G completions share, and the
trainer's log-probs read them the same way. Each step samples
`--group-size` completions of each of `--batch-size` prompts with the KV-cache sampler of
`tunelib.rollout` and scores them: 1 for the right answer (the task's verifier; exact match for
a file) plus `--format-weight` for a well-formed one on the built-in task, or your own
`--reward`, or the score a reward model trained by `recipes/reward_model.py` gives the prompt
and completion (`--reward-model`; the verifier then only measures). The loss: the clipped
surrogate of `tunelib.losses` on group-relative advantages of `tunelib.advantages`, with the
sampler's log-probs as the behaviour policy and a k3 KL penalty to the SFT model, frozen. The
step: the batch's rewards, overlong penalty, dynamic-sampling mask and group advantages
once, in one jitted function, then `--updates-per-batch` Optax updates on it; with
`--lora-rank` only adapters train, the reference is the frozen base, and the sampler runs the
base with the adapters beside it, never merged (a QLoRA base stays quantised). Every batch is
stamped with the policy version and the fingerprint of the weights that sampled it, and the
trainer checks them (`tunelib.rollout.PolicyLedger`): a sampler that ran anything else stops
the run in one line. Each step logs the trainer/sampler mismatch (`mismatch_kl`, the
importance weights' `is_ess`). Held-out, every `--eval-every` steps: greedy accuracy, and
with `--eval-samples k` (default 8) pass@1, pass@k and maj@k of k samples per prompt, their
entropy and diversity; a warning line when they show entropy collapse, and `--keep-best
METRIC` keeps the best model in OUT/best.

Disaggregated and asynchronous, on two processes (process 0 trains, process 1 samples, a
batch at most `--max-staleness` updates old): `recipes/grpo_async.py`, on the same kit;
`grpo.py --max-staleness s` runs it.

A reward function takes a completion's text and its prompt's record (a dict with `prompt`,
`answer` and any other field of the file) and returns a float:

    def score(completion: str, record: dict) -> float:
        return float(completion.strip() == record["answer"])

`--reward my_rewards.py:score` loads it from a file, `--reward package.module:score` from an
importable module.
"""

import runpy
import sys
from pathlib import Path

import kit
from kit.grpo_config import GRPOConfig


def train(config: GRPOConfig, run: kit.runs.RunFolder) -> dict:
    import grain

    from kit import chain, evaluate, goodput, grpo, loop, optim, parallel, watch

    # The SFT start, trained first if absent: before this process opens its devices.
    start, sft_seconds = chain.sft_start(config)
    # Every device of every process; each process holds its rows of every batch.
    placement = parallel.placement(config.batch_size, config.devices)
    model = chain.start_model(start, placement, run, remat=config.remat)
    graphdef, vocab_size = model.graphdef, model.config.vocab_size
    # The prompts, what trains (every weight or adapters), the sampling and the optimizer;
    # `sample` draws a group per prompt and scores it (the verifier, --reward or
    # --reward-model); `learner` computes a batch's rewards and advantages once, then takes
    # --updates-per-batch updates of the clipped surrogate + KL (`kit.grpo.objective`).
    task, tuning, sampling, optimizer, sample, learner = grpo.setup(config, model, placement)
    # This process's prompts of each step's batch: rows [p * b, (p + 1) * b) of the batch.
    index, count = placement.shard
    order = grain.MapDataset.range(len(task.train)).shuffle(seed=config.seed).repeat()
    batches = iter(order.batch(config.batch_size // count)[index::count].to_iter_dataset())

    def train_step(state, indices):
        """Sample and score a group per prompt with the current weights, then update."""
        rng, sample_key, dropout_key = loop.step_keys(state["rng"], "rollouts", "dropout")
        # The sampler runs the trained weights, or the base with the adapters beside it
        # (never merged); the learner records their fingerprint and checks the rollouts'.
        version = optim.updates_made(state["opt_state"]) // config.updates_per_batch
        policy = tuning.policy(state["params"])
        with goodput.phase("sync"):
            learner.hand_out(version, policy)
        with goodput.phase("rollout"):
            rows = sample(policy, placement.local(indices), sample_key, version=version)
        return learner.learn({**state, "rng": rng}, rows, dropout_key, version=version)

    evaluate_fn = evaluate.for_rl(
        config, graphdef, vocab_size, tuning.policy, task, sampling, placement, run
    )

    def pieces(state, indices):  # a step's jitted parts, for --plan and --device-memory
        template = sample.template(tuning.policy(state["params"]), indices.shape[0])
        return learner.pieces(state, template, sampling)

    # A warning line at the signs of entropy collapse; with --keep-best, the best model kept.
    watcher, best = watch.watcher(
        config, run, lambda folder, trainable: tuning.save(folder, model, trainable, placement),
        placement,
    )  # fmt: skip
    state = learner.initial_state(
        loop.initial_state(tuning.trainable, optimizer, config.seed, placement)
    )
    # --plan and --device-memory: the step's parts compiled for the first batch, never run.
    planned = kit.plan.check(
        config, placement, state=state, batches=batches, step_fn=train_step, pieces=pieces
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
            state, metrics = steps.step(train_step, state, steps.next_batch())
            if steps.evaluation_due(step):
                evaluated = steps.evaluate(evaluate_fn, state["params"])
                watcher(step, evaluated, state)  # the collapse guard, --keep-best
                metrics |= evaluated
            steps.done(step, state, metrics)
    tuning.save(run.path, model, state["params"], placement)
    headline = {**grpo.headline(run, config, tuning), **(best.headline() if best else {})}
    return loop.finish(run, config, headline, chained={"sft_seconds": sft_seconds})


if __name__ == "__main__":
    if any(arg.split("=")[0] == "--max-staleness" for arg in sys.argv[1:]):
        # The disaggregated recipe beside this one, run as its own script.
        runpy.run_path(str(Path(__file__).with_name("grpo_async.py")), run_name="__main__")
    else:
        kit.cli.main(GRPOConfig, train, __doc__)
