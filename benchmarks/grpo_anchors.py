r"""The whole GRPO step, tunelib's recipe step against TRL's `GRPOTrainer` and Tunix's
`GRPOLearner`, side by side on CPU: rollout, log-probs and update.

    python benchmarks/grpo_anchors.py --anchors-python /tmp/anchors/bin/python
    python benchmarks/grpo_anchors.py --size smoke            # tunelib only, seconds
    python benchmarks/grpo_anchors.py --anchors-python /tmp/anchors/bin/python \
        --json-out result.json

The anchors live in their own environment, outside tunelib's (Tunix pins its own jax and
flax); one environment holds both (google-tunix 0.1.7, trl 1.16.0, transformers 5.12.1,
torch 2.13.0+cpu):

    python3 -m venv /tmp/anchors
    /tmp/anchors/bin/pip install --find-links /opt/wheels google-tunix==0.1.7 trl \
        transformers "torch==2.13.0+cpu"

Without `--anchors-python` (or when that interpreter cannot import `tunix`, `trl` and
`torch`) the anchor columns are left out with one line saying why, and tunelib is measured
alone.

The model is `sampler_anchors.py`'s (`_anchors.write_checkpoint`: a Qwen3-style decoder, 4
layers, hidden 256, vocabulary 1,024, float32, seed 0), written once as a Hugging Face Qwen3
checkpoint that each library loads as its policy and, frozen, as its reference. Each step
takes the same `B` (`--prompts`, 4) prompts of `P` (16) random ids, written as strings of ids
("5 17 3"), draws `G` = 8 completions of each at temperature 1 (no top-k, no top-p), exactly
`N` (`--new-tokens`, 64) tokens each (no stop token can be drawn), scores each completion with
`score` (the fraction of its ids that are even), and takes one AdamW step (learning rate 1e-5,
no warm-up, no weight decay, gradients clipped to global norm 1) on the GRPO loss: the
clipped surrogate (epsilon 0.2 both ways) on group advantages `(r - mean) / (std + eps)`
(std with ddof 1), plus 0.04 times the k3 KL estimate to the reference, per-token terms
averaged over each completion's tokens, then over completions; one update per batch, so the
behaviour policy is the policy itself. Each library, as configured:

- tunelib: the GRPO recipe's own pieces (`recipes/kit/grpo.py`): its `Sampler` (the
  `tunelib.rollout.sample` call with `group_size=G`, then the reward as `--reward` runs it)
  and its `Learner` (`learn`: the batch's rewards and advantages, then one jitted update of
  `kit.grpo.objective` with the reference's log-probs inside it), the config of
  `recipes/grpo.py --mode grpo --kl-coef 0.04` (aggregation `seq_mean_token_mean`, k3 KL,
  eps 1e-4), the optimizer `kit.optim.adamw`; the model loaded as
  `kit.models.load_model` loads an HF checkpoint (its layers stacked under one `lax.scan`),
  on one device;
- TRL: `GRPOTrainer` on `Qwen3ForCausalLM` with `GRPOConfig(loss_type="grpo", beta=0.04,
  epsilon=0.2, num_iterations=1, scale_rewards="group", use_bias_correction_kl=False,
  num_generations=8, max_completion_length=N, temperature=1.0, top_k=0, top_p=1.0,
  learning_rate=1e-5, lr_scheduler_type="constant", max_grad_norm=1.0,
  per_device_train_batch_size=B * G, use_cpu=True)`, generation by transformers' `generate`
  (eager PyTorch, its default thread count); a word-level tokenizer over the ids, its
  padding and EOS ids outside the model's vocabulary (never drawn);
- Tunix: `GRPOLearner` on its Qwen3 with `GRPOConfig(num_generations=8, num_iterations=1,
  beta=0.04, kl_loss_mode="low_var_kl", epsilon=0.2, loss_agg_mode=
  "sequence-mean-token-mean")`, the `"vanilla"` rollout engine (its `Sampler`) with
  `RolloutConfig(temperature=1.0, top_p=1.0, max_tokens_to_generate=N)`, actor and reference
  on one single-device mesh, `RLTrainingConfig(mini_batch_size=B)` and the same optax
  optimizer.

Where the algorithms still differ (the libraries expose no option for it): Tunix's group
std is divided with eps 1e-6 (TRL and tunelib: 1e-4), and it clips the log-ratio to
[-20, 20] before the exponential (a no-op here: one update per batch); TRL and Tunix take
the ratio's denominator as the trainer's own log-probs, detached (`old = current` when
`num_iterations` is 1), tunelib as the sampler's recorded log-probs (the same numbers up to
float32 rounding, which the recipe logs as `mismatch_kl`); each draws its own random numbers,
so the completions (and the rewards) differ between the libraries, never their shapes.

The phases of a step, as each library runs them: **rollout**, sampling and scoring (tunelib:
the `Sampler` call; TRL: `_generate` and `_calculate_rewards`; Tunix: `RLCluster.generate`
and `_compute_rewards`); **log-probs**, the reference's (and old policy's) log-probs computed
before the update (TRL: its no-grad `_get_per_token_logps_and_entropies` calls; Tunix:
`get_ref_per_token_logps`; tunelib: none, its reference forward runs inside the jitted
update, so its log-probs column is 0 and the update carries it; compare the **trainer**
column, log-probs plus update); **update**, the rest of the step (the loss's forward and
backward and the optimizer). Tokens/s are `B * G * N` over the whole step.

Each library runs in its own process (`--worker NAME`, driven over its standard input and
output). In order:

1. Correctness, before anything is timed: each library's log-probs of the same fixed
   completions (`B` prompts, `N` random ids each) under the initial weights, through the
   function its loss uses (`kit.grpo.Learner.completion_logps`, TRL's
   `_get_per_token_logps_and_entropies`, Tunix's `common.compute_per_token_logps`), must
   agree between every pair within `--logps-tol` (1e-5, absolute); otherwise the script
   exits with status 1.
2. `--warmup` (2) steps, then `--rounds` (5) timed steps, interleaved: every library takes its
   next step in turn, the order rotated from step to step, so that a slow spell on a shared
   machine hits all of them. Each figure is the median over the timed steps.

The script prints a table and ends with one JSON line: `case`, per library the median
seconds of a step and of each phase, tokens/s and the mean reward of the timed steps;
tunelib's ratio (anchor's seconds over tunelib's) to each anchor per phase; the log-probs'
largest differences, the libraries' versions, the load average before and after, and
`meets_target`: tunelib's step faster than each anchor's (null without the anchors).
Targets are reported, never asserted.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _anchors import (
    SEED,
    SIZES,
    IdTokenizer,
    claim_stdout,
    interpreters,
    load_average,
    reply,
    started,
    tunix_qwen3,
    tunix_version,
    write_checkpoint,
)

from _measure import print_result

LIBRARIES = ("tunelib", "trl", "tunix")
PHASES = ("rollout", "logprobs", "update")
GROUP = 8
KL_COEF = 0.04
EPSILON = 0.2
LEARNING_RATE = 1e-5
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def score(completion: str, record: dict | None = None) -> float:
    """The reward: the fraction of a completion's ids (a string of ids) that are even."""
    ids = [int(x) for x in completion.split()]
    return sum(i % 2 == 0 for i in ids) / max(len(ids), 1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--size", choices=tuple(SIZES), default="default", help="model size")
    p.add_argument("--prompts", type=int, default=None, help="B, prompts a step (smoke 2)")
    p.add_argument("--prompt", type=int, default=16, help="P, prompt ids per row")
    p.add_argument("--new-tokens", type=int, default=None, help="N, default 64 (smoke 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=5, help="timed interleaved steps")
    p.add_argument(
        "--anchors-python",
        type=Path,
        default=None,
        help="the interpreter of an environment with google-tunix, trl and torch",
    )
    p.add_argument("--logps-tol", type=float, default=1e-5, help="largest |log-prob difference|")
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    p.add_argument("--worker", choices=LIBRARIES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompts-file", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    return p


# ----------------------------------------------------------------------------- the workers


class Clock:
    """Seconds spent in each phase of the current step."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.start = time.perf_counter()

    def timed(self, phase: str, function, ready=lambda out: out):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = ready(function(*args, **kwargs))
            self.seconds[phase] += time.perf_counter() - start
            return out

        return run

    def split(self, **extra) -> dict:
        """The step's phases; the update is what the rest of the step took."""
        total = time.perf_counter() - self.start
        update = total - self.seconds["rollout"] - self.seconds["logprobs"]
        return {**self.seconds, "update": update, "total": total, **extra}


class IdText:
    """tunelib's tokenizer protocol over strings of ids, with no BOS and no stop id."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.bos_id, self.eos_id, self.pad_id = vocab_size, None, 0, 0
        self.add_bos, self.stop_ids, self.chat_template = False, (), None

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        return " ".join(str(int(x)) for x in ids)


class TunelibWorker:
    def __init__(self, args):
        sys.path.insert(0, str(RECIPES))
        import jax

        from tunelib.formats import config_from_hf, load_hf_checkpoint
        from tunelib.rollout import SamplingConfig

        import kit
        from kit import data, grpo, loop, lora, models, optim, parallel
        from kit.grpo_config import GRPOConfig

        prompts = json.loads(args.prompts_file.read_text())
        group, new = GROUP, args.new_tokens
        argv = [
            "--mode", "grpo", "--group-size", str(group), "--batch-size", str(len(prompts)),
            "--max-new-tokens", str(new), "--kl-coef", str(KL_COEF), "--temperature", "1.0",
            "--learning-rate", str(LEARNING_RATE), "--epsilon-low", str(EPSILON),
            "--epsilon-high", str(EPSILON), "--reward", f"{Path(__file__).resolve()}:score",
            "--no-progress",
        ]  # fmt: skip
        config = kit.config.parse(GRPOConfig, argv, description="", prog="grpo.py")
        placement = parallel.placement(len(prompts), 1)  # one device, as the anchors run
        # As `kit.models.load_model` loads an HF checkpoint (its tokenizer aside): layers
        # stacked under one `lax.scan` when they are all of one shape.
        hf_config = json.loads((args.checkpoint / "config.json").read_text())
        loaded = load_hf_checkpoint(
            args.checkpoint, scan_layers=config_from_hf(hf_config).stackable
        )
        model = models.Model(
            loaded.config, loaded.graphdef, loaded.params, IdText(loaded.config.vocab_size),
            args.checkpoint, loaded.hf_config,
        )  # fmt: skip
        model = models.replicated(model, placement)
        width = args.prompt_length + new
        task = data.Task(
            name="ids", tokenizer=model.tokenizer,
            train=[{"prompt": p, "answer": ""} for p in prompts],
            heldout=[], problems=[], correct=lambda text, r: False, max_length=width,
            prompt_length=args.prompt_length, max_new_tokens=new, pack_length=width,
        )  # fmt: skip
        tuning = lora.tuning(model, placement, rank=0)
        frozen = {"base": tuning.base, "reference": model.params}
        sampling = SamplingConfig(max_new_tokens=new, temperature=1.0)
        optimizer = optim.adamw(LEARNING_RATE, 1, schedule="constant")  # 1 step: no warm-up
        self.sample = grpo.Sampler(
            model.graphdef, task, placement, sampling, group, reward=config.reward
        )
        self.learner = grpo.Learner(
            model.graphdef, tuning, frozen, optimizer, placement, config, new
        )
        self.state = self.learner.initial_state(
            loop.initial_state(tuning.trainable, optimizer, config.seed, placement)
        )
        self.tuning, self.placement, self.jax, self.optim, self.loop = (
            tuning, placement, jax, optim, loop,
        )  # fmt: skip
        self.indices, self.version = list(range(len(prompts))), 0
        self.versions = {"jax": jax.__version__, "jaxlib": jax.lib.__version__}

    def logps(self, prompts: np.ndarray, completions: np.ndarray) -> np.ndarray:
        batch = {
            "prompt_tokens": prompts, "prompt_where": np.ones(prompts.shape, bool),
            "tokens": completions, "where": np.ones(completions.shape, bool),
        }  # fmt: skip
        logps, _ = self.learner.completion_logps(self.state["params"], batch)
        return np.asarray(logps)

    def step(self) -> dict:
        """`recipes/grpo.py`'s `train_step`: hand out the policy, sample, learn."""
        clock, jax = Clock(), self.jax
        rng, sample_key, dropout_key = self.loop.step_keys(self.state["rng"], "rollouts", "dropout")
        policy = self.tuning.policy(self.state["params"])
        self.learner.hand_out(self.version, policy)
        sample = clock.timed("rollout", self.sample)
        rows = sample(policy, self.indices, sample_key, version=self.version)
        state, _ = self.learner.learn(
            {**self.state, "rng": rng}, rows, dropout_key, version=self.version
        )
        self.state = jax.block_until_ready(state)
        self.version += 1
        return clock.split(reward=float(np.mean(rows.scores)))


def hf_tokenizer(vocab_size: int):
    """A transformers tokenizer over strings of ids, its padding and EOS ids past the model's
    vocabulary (never drawn)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(vocab_size)} | {"<pad>": vocab_size, "<eos>": vocab_size + 1}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")


class Stepper:
    """Runs a library's own training loop one step per request: `begin` (at a step's start)
    waits for the driver's next request, `end` answers it with the step's phases."""

    def __init__(self):
        self.first, self.clock = True, None

    def begin(self):
        if not self.first and sys.stdin.readline().strip() == "":
            raise SystemExit(0)  # the driver has gone
        self.first, self.clock = False, Clock()

    def end(self, **extra):
        reply(self.clock.split(**extra))


class TRLWorker:
    def __init__(self, args):
        import datasets
        import torch
        import transformers
        import trl

        prompts = json.loads(args.prompts_file.read_text())
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.checkpoint, dtype=torch.float32
        )
        tokenizer = hf_tokenizer(model.config.vocab_size)
        self.stepper, self.rewards = Stepper(), []

        def reward(completions, completion_ids, **_):
            rewards = [score(" ".join(map(str, ids))) for ids in completion_ids]
            self.rewards.extend(rewards)
            return rewards

        config = trl.GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="grpo_anchors_trl_"), loss_type="grpo",
            beta=KL_COEF, epsilon=EPSILON, num_iterations=1, scale_rewards="group",
            use_bias_correction_kl=False, num_generations=GROUP,
            max_completion_length=args.new_tokens, temperature=1.0, top_k=0, top_p=1.0,
            learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=1.0, per_device_train_batch_size=len(prompts) * GROUP,
            gradient_accumulation_steps=1, max_steps=args.steps, use_cpu=True, bf16=False,
            save_strategy="no", report_to="none", logging_steps=10**6, seed=SEED,
            shuffle_dataset=False, disable_tqdm=True,
        )  # fmt: skip
        stepper = self.stepper

        class Steps(transformers.TrainerCallback):
            def on_step_begin(self, *_, **__):
                stepper.begin()

            def on_step_end(self, *_, **__):
                stepper.end()

        dataset = datasets.Dataset.from_dict({"prompt": prompts})
        self.trainer = trl.GRPOTrainer(
            model=model, reward_funcs=reward, args=config, train_dataset=dataset,
            processing_class=tokenizer, callbacks=[Steps()],
        )  # fmt: skip
        self.torch, self.started = torch, False
        self.versions = {
            "trl": trl.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        }  # fmt: skip

    def logps(self, prompts: np.ndarray, completions: np.ndarray) -> np.ndarray:
        torch = self.torch
        ids = torch.tensor(np.concatenate([prompts, completions], axis=1), dtype=torch.long)
        with torch.no_grad():
            logps, _, _ = self.trainer._get_per_token_logps_and_entropies(
                self.trainer.model, ids, torch.ones_like(ids), completions.shape[1]
            )
        return logps.numpy()

    def train(self) -> None:
        trainer, stepper = self.trainer, self.stepper
        clock = lambda: stepper.clock  # noqa: E731  (the current step's)
        generate, rewards, logps = (
            trainer._generate, trainer._calculate_rewards,
            trainer._get_per_token_logps_and_entropies,
        )  # fmt: skip

        def timed(phase, function):
            return lambda *a, **k: clock().timed(phase, function)(*a, **k)

        def logps_outside_the_loss(*a, **k):
            if self.torch.is_grad_enabled():  # the loss's own forward: part of the update
                return logps(*a, **k)
            return clock().timed("logprobs", logps)(*a, **k)

        trainer._generate = timed("rollout", generate)
        trainer._calculate_rewards = timed("rollout", rewards)
        trainer._get_per_token_logps_and_entropies = logps_outside_the_loss
        original_end = stepper.end
        stepper.end = lambda: original_end(reward=float(np.mean(self.rewards[-self.batch :])))
        trainer.train()

    @property
    def batch(self) -> int:
        return self.trainer.args.per_device_train_batch_size


class TunixWorker:
    def __init__(self, args):
        import jax
        import optax
        from flax import nnx
        from tunix.rl import rl_cluster as rl_cluster_lib
        from tunix.rl.grpo import grpo_learner
        from tunix.rl.rollout import base_rollout

        prompts = json.loads(args.prompts_file.read_text())
        actor, config = tunix_qwen3(args.checkpoint)
        reference, _ = tunix_qwen3(args.checkpoint)
        self.tokenizer = IdTokenizer(config.vocab_size)
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
        optimizer = optax.chain(
            optax.clip_by_global_norm(1.0), optax.adamw(LEARNING_RATE, weight_decay=0.0)
        )
        cluster_config = rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optimizer,
                eval_every_n_steps=10**6,
                max_steps=args.steps,
                mini_batch_size=len(prompts),
                pbar_description=None,
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=args.new_tokens,
                max_prompt_length=args.prompt_length,
                kv_cache_size=args.prompt_length + args.new_tokens,
                temperature=1.0,
                top_p=1.0,
                top_k=None,
                eos_tokens=[-1],
            ),
        )
        self.cluster = rl_cluster_lib.RLCluster(
            actor=actor, reference=reference, tokenizer=self.tokenizer,
            cluster_config=cluster_config,
        )  # fmt: skip
        algorithm = grpo_learner.GRPOConfig(
            num_generations=GROUP, num_iterations=1, beta=KL_COEF, kl_loss_mode="low_var_kl",
            epsilon=EPSILON, loss_agg_mode="sequence-mean-token-mean",
        )  # fmt: skip
        self.learner = grpo_learner.GRPOLearner(self.cluster, algorithm, reward_fns=self.reward)
        self.prompts, self.steps, self.actor = prompts, args.steps, actor
        self.stepper, self.rewards, self.jax, self.nnx = Stepper(), [], jax, nnx
        self.versions = {"tunix": tunix_version(), "tunix_jax": jax.__version__}

    def reward(self, prompts, completions, **_):
        rewards = [score(text) for text in completions]
        self.rewards.extend(rewards)
        return rewards

    def logps(self, prompts: np.ndarray, completions: np.ndarray) -> np.ndarray:
        from tunix.rl import common

        graphdef, state = self.nnx.split(self.actor)
        logps = common.compute_per_token_logps(
            graphdef, state, self.jax.numpy.asarray(prompts),
            self.jax.numpy.asarray(completions), pad_id=self.tokenizer.pad_id(),
            eos_id=self.tokenizer.eos_id(),
        )  # fmt: skip
        return np.asarray(logps)

    def train(self) -> None:
        jax, cluster, learner, stepper = self.jax, self.cluster, self.learner, self.stepper
        clock = lambda: stepper.clock  # noqa: E731  (the current step's)
        ready = jax.block_until_ready
        generate, ref_logps = cluster.generate, cluster.get_ref_per_token_logps
        rewards, update = learner._compute_rewards, cluster.update_actor

        def begin_and_generate(*a, **k):
            stepper.begin()
            return clock().timed("rollout", generate)(*a, **k)

        def update_and_end(*a, **k):
            out = update(*a, **k)
            ready(self.nnx.state(self.actor))  # its updates are dispatched asynchronously
            batch = len(self.prompts) * GROUP
            stepper.end(reward=float(np.mean(self.rewards[-batch:])))
            return out

        cluster.generate = begin_and_generate
        cluster.get_ref_per_token_logps = lambda *a, **k: clock().timed(
            "logprobs", ref_logps, ready
        )(*a, **k)
        learner._compute_rewards = lambda *a, **k: clock().timed("rollout", rewards)(*a, **k)
        cluster.update_actor = update_and_end
        dataset = [{"prompts": np.array(self.prompts)}] * self.steps  # arrays: it maps leaves
        learner.train(dataset)


def serve(args: argparse.Namespace) -> int:
    """A worker: load the checkpoint and build the trainer, answer `logps` requests, then run
    one training step per `step` request (the library's own loop answers them)."""
    claim_stdout()
    # This folder's scripts would shadow packages the libraries look for (`peft.py`).
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    args.prompt_length = len(json.loads(args.prompts_file.read_text())[0].split())
    worker = {"tunelib": TunelibWorker, "trl": TRLWorker, "tunix": TunixWorker}[args.worker]
    worker = worker(args)
    reply({"ready": True, "versions": worker.versions})
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "logps":
            prompts, completions = np.load(request["prompts"]), np.load(request["completions"])
            np.save(request["out"], worker.logps(prompts, completions).astype(np.float32))
            reply({})
        elif request["op"] == "step" and args.worker == "tunelib":
            reply(worker.step())
        elif request["op"] == "step":  # the library's loop reads the next steps' requests
            worker.train()
    return 0


# ----------------------------------------------------------------------------- the driver


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        return serve(args)
    smoke = args.size == "smoke"
    prompts = args.prompts if args.prompts is not None else (2 if smoke else 4)
    new = args.new_tokens if args.new_tokens is not None else (8 if smoke else 64)
    for name, value, low in (
        ("--prompts", prompts, 1), ("--prompt", args.prompt, 1), ("--new-tokens", new, 1),
        ("--warmup", args.warmup, 0), ("--rounds", args.rounds, 1),
    ):  # fmt: skip
        if value < low:
            raise SystemExit(f"{name} must be >= {low}, got {value}.")
    pythons, missing = interpreters(args.anchors_python, LIBRARIES, "tunix, trl, torch")
    load_before = load_average()
    vocab = SIZES[args.size][-1]
    rng = np.random.default_rng(SEED)
    prompt_ids = rng.integers(0, vocab, (prompts, args.prompt)).astype(np.int32)
    completion_ids = rng.integers(0, vocab, (prompts, new)).astype(np.int32)
    steps = args.warmup + args.rounds

    with tempfile.TemporaryDirectory(prefix="grpo_anchors_") as scratch:
        scratch = Path(scratch)
        checkpoint = scratch / "qwen3"
        write_checkpoint(checkpoint, args.size)
        texts = [" ".join(str(int(i)) for i in row) for row in prompt_ids]
        (scratch / "prompts.json").write_text(json.dumps(texts))
        np.save(scratch / "prompts.npy", prompt_ids)
        np.save(scratch / "completions.npy", completion_ids)
        worker_args = [
            "--checkpoint", str(checkpoint), "--prompts-file", str(scratch / "prompts.json"),
            "--new-tokens", str(new), "--steps", str(steps),
        ]  # fmt: skip
        with started(pythons, __file__, worker_args) as workers:
            result = measure(args, workers, scratch)
    result["case"] = {
        "size": args.size, "layers_hidden_heads_kv_headdim_mlp_vocab": SIZES[args.size],
        "prompts": prompts, "group": GROUP, "prompt": args.prompt, "new_tokens": new,
        "warmup": args.warmup, "rounds": args.rounds, "kl_coef": KL_COEF, "epsilon": EPSILON,
        "learning_rate": LEARNING_RATE,
    }  # fmt: skip
    result["tokens_per_step"] = prompts * GROUP * new
    for row in result["libraries"].values():
        row["tokens_per_s"] = prompts * GROUP * new / row["total"]
    result["anchors_skipped"] = missing
    result["meets_target"] = None if missing else all(
        result["ratios"][name]["total"] > 1 for name in LIBRARIES[1:]
    )  # fmt: skip
    result["load_average_before"], result["load_average_after"] = load_before, load_average()
    report(result)
    print_result(result, args.json_out)
    return 0 if result["logps_agree"] else 1


def measure(args, workers, scratch) -> dict:
    names = tuple(workers)
    # 1. Correctness: the log-probs of fixed completions under the initial weights.
    logps = {}
    for name, worker in workers.items():
        worker.ask(
            op="logps", prompts=str(scratch / "prompts.npy"),
            completions=str(scratch / "completions.npy"), out=str(scratch / f"{name}.npy"),
        )  # fmt: skip
        logps[name] = np.load(scratch / f"{name}.npy")
    differences = {
        f"{a}_vs_{b}": float(np.max(np.abs(logps[a] - logps[b])))
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    logps_agree = all(d <= args.logps_tol for d in differences.values())
    print(
        f"log-probs: largest differences {differences} (tolerance {args.logps_tol:g})",
        file=sys.stderr,
        flush=True,
    )
    # 2. Warm-up steps, then interleaved timed steps.
    steps = {name: [] for name in names}
    for s in range(args.warmup + args.rounds):
        order = names[s % len(names) :] + names[: s % len(names)]
        for name in order:
            answer = workers[name].ask(op="step")
            if s >= args.warmup:
                steps[name].append(answer)
        stage = "warm-up" if s < args.warmup else "timed"
        print(f"step {s + 1}/{args.warmup + args.rounds} ({stage}) done", file=sys.stderr)
    medians = {
        name: {
            key: statistics.median(step[key] for step in steps[name]) for key in (*PHASES, "total")
        }
        | {"reward": statistics.mean(step["reward"] for step in steps[name])}
        for name in names
    }
    for row in medians.values():
        row["trainer"] = row["logprobs"] + row["update"]
    ratios = {
        name: {
            key: medians[name][key] / medians["tunelib"][key]
            if medians["tunelib"][key] > 0
            else None
            for key in (*PHASES, "trainer", "total")
        }
        for name in names[1:]
    }
    versions = {k: v for worker in workers.values() for k, v in worker.versions.items()}
    return {
        "libraries": medians, "ratios": ratios, "steps": steps,
        "logps_max_abs_diff": differences, "logps_agree": logps_agree, "versions": versions,
    }  # fmt: skip


def report(result: dict) -> None:
    names = list(result["libraries"])
    columns = ("total", *PHASES, "trainer")
    print("library | s/step | rollout | log-probs | update | trainer | tokens/s | reward")
    for name in names:
        row = result["libraries"][name]
        cells = [name, *(f"{row[key]:.3f}" for key in columns)]
        cells += [f"{row['tokens_per_s']:,.0f}", f"{row['reward']:.3f}"]
        print(" | ".join(cells))
    for name in names[1:]:
        ratio = result["ratios"][name]
        cells = [f"{name} / tunelib (x)"]
        cells += ["-" if ratio[key] is None else f"{ratio[key]:.2f}" for key in columns]
        print(" | ".join(cells))
    print(
        f"log-probs: largest differences {result['logps_max_abs_diff']}; versions: "
        f"{result['versions']}; load {result['load_average_before']} -> "
        f"{result['load_average_after']}"
    )


if __name__ == "__main__":
    sys.exit(main())
