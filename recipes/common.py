"""Plumbing shared by the recipes: flags, model set-up, checkpoints, metrics and evaluation.

Nothing here is an objective: each recipe's train step is written out in the recipe itself.
This module only keeps the scripts short. It is imported as `common` because every recipe is
run as a script from this folder (`python recipes/sft.py`).
"""

import argparse
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from tunelib import peft, rollout
from tunelib.data import (
    CharTokenizer,
    HFTokenizer,
    arithmetic_split,
    encode_prompts,
    read_records,
    verify_answer,
)
from tunelib.logprobs import IMPLEMENTATIONS
from tunelib.models import Decoder, DecoderConfig, load_hf_checkpoint, save_hf_checkpoint

RUNS = Path(os.environ.get("TUNELIB_RUNS", "runs"))


def parser(
    description: str,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    lora_learning_rate: float | None = None,
) -> argparse.ArgumentParser:
    """Flags every recipe takes; each recipe adds its own.

    Recipes that fine-tune an existing model pass `lora_learning_rate` and get the LoRA /
    QLoRA flags; `--learning-rate` then defaults to the one of the chosen mode.
    """
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data split, init and order")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=batch_size)
    if lora_learning_rate is None:
        p.add_argument("--learning-rate", type=float, default=learning_rate)
    else:
        p.add_argument(
            "--learning-rate",
            type=float,
            default=None,
            help=f"default {learning_rate} for full fine-tuning, {lora_learning_rate} with LoRA",
        )
        p.set_defaults(default_learning_rates=(learning_rate, lora_learning_rate))
        add_lora_flags(p)
    p.add_argument("--max-digits", type=int, default=2, help="operand digits of the task")
    p.add_argument(
        "--operations", default="+", help="the task's operations, any of '+-*' (e.g. '-*')"
    )
    p.add_argument("--num-train", type=int, default=1000, help="problems with demonstrations")
    p.add_argument("--num-heldout", type=int, default=300, help="held-out problems for accuracy")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="base")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out evals")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument(
        "--out", type=Path, default=None, help="run folder (default runs/<recipe>-seed<seed>)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="train on this .jsonl / .json / .parquet file of Hugging Face-style records "
        "instead of the built-in task (needs a Hugging Face checkpoint with a tokenizer)",
    )
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="with --data: skip and count invalid records instead of stopping at the first",
    )
    p.add_argument("--max-length", type=int, default=256, help="with --data: tokens per sequence")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument(
        "--logprobs",
        choices=IMPLEMENTATIONS,
        default="auto",
        help="how log-probs are computed from hidden states: the fused chunked head "
        "('auto' picks the Pallas kernel on TPU), or 'naive' materialised logits",
    )
    return p


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="> 0: train LoRA adapters of this rank on every attention and MLP projection "
        "and keep the other weights frozen (0: train every weight)",
    )
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha; default 2 x rank")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on adapter inputs")
    p.add_argument(
        "--qlora",
        action="store_true",
        help="with --lora-rank: store the frozen projections in NF4 with double quantisation",
    )


def add_start_flags(p: argparse.ArgumentParser) -> None:
    """The model a fine-tuning recipe (DPO, GRPO) starts from, and its SFT run if absent."""
    p.add_argument(
        "--sft-dir",
        "--model",
        dest="sft_dir",
        type=Path,
        default=None,
        help="the model to start from, also the reference: a recipe's SFT model folder or a "
        "Hugging Face checkpoint (default runs/sft-seed<seed>/model, trained if absent)",
    )
    p.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="steps of the SFT run when the SFT model must be trained first (default: sft.py's)",
    )


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`p.parse_args(argv)` with the LoRA flags checked and the learning rate resolved."""
    args = p.parse_args(argv)
    if hasattr(args, "lora_rank"):
        if args.lora_rank < 0:
            p.error(f"--lora-rank must be >= 0, got {args.lora_rank}")
        if args.qlora and not args.lora_rank:
            p.error("--qlora trains LoRA adapters on the NF4 base: give --lora-rank too")
        if args.learning_rate is None:
            full, lora = args.default_learning_rates
            args.learning_rate = lora if args.lora_rank else full
    return args


def forward_flags(args: argparse.Namespace, *names: str) -> list[str]:
    """Flags that pass this run's values of `names` (and `--no-progress`) to another recipe."""
    out = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in names]
    return out + (["--no-progress"] if args.no_progress else [])


# ----------------------------------------------------------------------------- task and model


@dataclasses.dataclass(frozen=True)
class Task:
    tokenizer: CharTokenizer
    train: list[dict[str, str]]
    heldout: list[dict[str, str]]
    max_length: int


def task(args: argparse.Namespace, num_train: int | None = None) -> Task:
    """The built-in arithmetic task, split deterministically by the run's seed.

    The held-out problems depend only on the seed and `--num-heldout`, so every recipe of a
    seed is scored on the same problems; a larger `num_train` extends a smaller one.
    """
    train, heldout = arithmetic_split(
        seed=args.seed,
        num_train=args.num_train if num_train is None else num_train,
        num_heldout=args.num_heldout,
        max_digits=args.max_digits,
        operations=tuple(args.operations),
    )
    max_length = 4 * args.max_digits + 8
    return Task(CharTokenizer(), train, heldout, max_length)


# Qwen3-style decoders (QK-norm, tied embeddings) of three sizes: "base" learns the task in a
# minute on two CPU cores; "teacher" and "student" are the pair of the distillation recipe.
MODEL_SIZES = {
    "student": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    "base": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    "teacher": {"hidden_size": 192, "intermediate_size": 576, "num_hidden_layers": 3,
                "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32},
}  # fmt: skip


def model_config(tokenizer: CharTokenizer, size: str = "base") -> DecoderConfig:
    """The recipes' decoder of the given size for the task's vocabulary."""
    return DecoderConfig(
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        use_qk_norm=True,
        **MODEL_SIZES[size],
    )


def init_model(config: DecoderConfig, seed: int) -> tuple[nnx.GraphDef, dict]:
    """The model's graph definition and its parameters as a plain nested dict of arrays."""
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(seed)))
    return graphdef, nnx.to_pure_dict(state)


def save_model(path: Path, config: DecoderConfig, params: dict) -> None:
    """Final weights (Orbax) and the config (JSON) side by side, for the next recipe."""
    path = path.resolve()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "params", params, force=True)
    (path / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))


def load_model(path: Path) -> tuple[DecoderConfig, nnx.GraphDef, dict]:
    path = path.resolve()
    config = DecoderConfig(**json.loads((path / "config.json").read_text()))
    graphdef, template = init_model(config, seed=0)
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(
            path / "params", jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        )
    return config, graphdef, params


def has_model(path: Path) -> bool:
    return (path / "config.json").exists() and (
        (path / "params").exists() or is_hf_checkpoint(path)
    )


# ----------------------------------------------------------------------------- Hugging Face


def is_hf_checkpoint(path: Path) -> bool:
    """A Hugging Face checkpoint folder: its `config.json` names a `model_type`."""
    config = path / "config.json"
    return config.exists() and "model_type" in json.loads(config.read_text())


@dataclasses.dataclass(frozen=True)
class Start:
    """The model a recipe starts from: a recipe's `model/` folder or a Hugging Face one."""

    config: DecoderConfig
    graphdef: nnx.GraphDef
    params: dict
    folder: Path
    hf_config: dict | None  # set for a Hugging Face checkpoint

    def tokenizer(self) -> HFTokenizer:
        if self.hf_config is None:
            raise SystemExit(f"--data needs a Hugging Face checkpoint; {self.folder} is not one.")
        return HFTokenizer.from_directory(self.folder)


def load_start(path: Path) -> Start:
    """The model in `path`: a Hugging Face checkpoint (`config.json` with a `model_type`,
    safetensors weights) or the `model/` folder a recipe saved."""
    if is_hf_checkpoint(path):
        checkpoint = load_hf_checkpoint(path)
        return Start(
            checkpoint.config, checkpoint.graphdef, checkpoint.params, path, checkpoint.hf_config
        )
    config, graphdef, params = load_model(path)
    return Start(config, graphdef, params, path, None)


def save_outputs(folder: Path, start: Start, params: dict, trainable: dict, base) -> None:
    """The final weights (Orbax, and a Hugging Face checkpoint when the run started from
    one, LoRA adapters merged) and, with LoRA, the adapters alone."""
    save_model(folder / "model", start.config, params)
    save_adapters(folder, trainable, base)
    if start.hf_config is not None:
        save_hf_checkpoint(
            folder / "hf_model",
            start.graphdef,
            params,
            hf_config=start.hf_config,
            copy_files_from=start.folder,
            overwrite=True,
        )


def data_records(args: argparse.Namespace, kind: str) -> tuple[list, list]:
    """`(train, heldout)` records of `--data`: the first `--num-heldout` (at most a fifth of
    the file) are held out for evaluation."""
    records, report = read_records(
        args.data, kind=kind, on_invalid="skip" if args.skip_invalid else "raise"
    )
    if report.skipped:
        print(f"{args.data}: kept {report.kept} records, skipped {dict(report.skipped)}")
    heldout = min(args.num_heldout, len(records) // 5)
    return records[heldout:], records[:heldout]


# ----------------------------------------------------------------------------- LoRA / QLoRA

# Every attention and MLP projection of every layer: QLoRA adapts all linear layers but the head.
LORA_TARGETS = r"layers/.*_proj/kernel"


def lora_setup(args: argparse.Namespace, params: dict) -> tuple[dict, dict | None]:
    """`(trainable, base)`: the weights themselves and no base for a full fine-tune; with
    `--lora-rank`, fresh adapters and the frozen base (in NF4 with `--qlora`)."""
    if not getattr(args, "lora_rank", 0):
        return params, None
    rule = peft.LoraRule(
        pattern=LORA_TARGETS,
        rank=args.lora_rank,
        alpha=args.lora_alpha or 2.0 * args.lora_rank,
        dropout=args.lora_dropout,
    )
    adapters = peft.init_lora(params, [rule], key=jax.random.key(args.seed + 1))
    base = peft.quantize_params(params, [LORA_TARGETS]) if args.qlora else params
    return adapters, base


def model_params(trainable: dict, base: dict | None, dropout_key: jax.Array | None = None):
    """The parameters a forward pass runs with: the trainable weights, or the base with the
    adapters applied (call the forward through `peft.lora`)."""
    return trainable if base is None else peft.apply_lora(base, trainable, dropout_key=dropout_key)


def dense_params(trainable: dict, base: dict | None) -> dict:
    """Plain weights for evaluation, sampling and saving: the adapters merged into the base."""
    return trainable if base is None else peft.merge_lora(base, trainable)


def tuning_headline(args: argparse.Namespace, trainable: dict, base: dict | None) -> dict:
    """What was trained, for the final JSON line: the mode and the trainable parameter count."""
    mode = "full" if base is None else "qlora" if args.qlora else "lora"
    count = sum(x.size for x in jax.tree.leaves(trainable))
    out = {"tuning": mode, "trainable_params": int(count)}
    if base is not None:
        out["base_bits_per_param"] = round(peft.bits_per_parameter(base), 3)
    return out


def save_adapters(folder: Path, trainable: dict, base: dict | None) -> None:
    """With LoRA, the adapters alone: an Orbax checkpoint and the Hugging Face PEFT format."""
    if base is None:
        return
    peft.save_adapters(folder / "adapters", trainable)
    peft.export_peft(folder / "peft_adapter", trainable, base)


# ----------------------------------------------------------------------------- evaluation


def greedy_config(task: Task) -> rollout.SamplingConfig:
    """Greedy decoding of an answer: the second half of the task's length, up to EOS."""
    tok = task.tokenizer
    return rollout.SamplingConfig(
        max_new_tokens=task.max_length - task.max_length // 2,
        temperature=0.0,
        stop_tokens=(tok.eos_id,),
        pad_token=tok.pad_id,
    )


def greedy_texts(
    graphdef: nnx.GraphDef,
    params: dict,
    prompts: list,
    encode: Callable[[list], tuple[np.ndarray, np.ndarray]],
    decode: Callable[[list[int]], str],
    config: rollout.SamplingConfig,
) -> list[str]:
    """The completions of `prompts` under `config` (greedy), in bounded batches.

    `encode` turns a list of prompts into left-padded `(tokens, where)`; `decode` a row of
    completion ids into text.
    """
    texts = []
    for first in range(0, len(prompts), 512):  # bounded batches, few distinct shapes
        tokens, where = encode(prompts[first : first + 512])
        out = rollout.sample(graphdef, params, tokens, where, jax.random.key(0), config)
        texts += [decode(row.tolist()) for row in np.asarray(out.tokens)]
    return texts


def greedy_answers(
    graphdef: nnx.GraphDef, params: dict, task: Task, records: list[dict]
) -> list[str]:
    """The model's greedy completion of each record's prompt, cut at EOS (KV-cache sampler)."""

    def encode(prompts):
        return encode_prompts(prompts, task.tokenizer, max_length=task.max_length // 2)

    prompts = [r["prompt"] for r in records]
    return greedy_texts(
        graphdef, params, prompts, encode, task.tokenizer.decode, greedy_config(task)
    )


def accuracy(graphdef: nnx.GraphDef, params: dict, task: Task) -> float:
    """Exact-match accuracy of greedy answers on the held-out problems."""
    answers = greedy_answers(graphdef, params, task, task.heldout)
    return float(
        np.mean([verify_answer(a, r["answer"]) for a, r in zip(answers, task.heldout, strict=True)])
    )


# ----------------------------------------------------------------------------- checkpoints


class Checkpoints:
    """Orbax checkpoints of the train state and the data iterator position.

    Orbax writes each step into a temporary folder and renames it into place only once it is
    complete, so a process killed mid-write leaves the last complete checkpoint as the latest.
    """

    def __init__(self, folder: Path, every: int):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=2, save_interval_steps=every, enable_async_checkpointing=False, create=True
        )
        self.manager = ocp.CheckpointManager(folder.resolve(), options=options)

    def save(self, step: int, state: dict, data_state: dict) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
            ),
        )

    def restore_latest(self, template: dict) -> tuple[int, dict, dict] | None:
        step = self.manager.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()
            ),
        )
        return step, out["state"], out["data"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


# ----------------------------------------------------------------------------- the loop


class Run:
    """A run folder: metrics as JSON lines, a progress bar, a plot and the final JSON line."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name = name
        self.args = args
        self.folder = (args.out or RUNS / f"{name}-seed{args.seed}").resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.folder / "metrics.jsonl"
        if not args.resume:  # a fresh run replaces an earlier run's log and checkpoints
            self.metrics_path.unlink(missing_ok=True)
            shutil.rmtree(self.folder / "checkpoints", ignore_errors=True)
        self.start = time.perf_counter()

    def log(self, record: dict) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line]

    def train(
        self,
        *,
        state: dict,
        batches: Iterator,
        step_fn: Callable[[dict, Any], tuple[dict, dict]],
        evaluate: Callable[[dict], dict],
    ) -> dict:
        """Run `step_fn` from the last checkpoint (with `--resume`) to `--steps`.

        `state` is a pytree holding at least `params`; `batches` a Grain iterator whose
        position is checkpointed with it; `step_fn(state, batch) -> (state, metrics)` is the
        recipe's jitted step; `evaluate(params) -> metrics` runs every `--eval-every` steps.
        """
        from tqdm import tqdm

        args = self.args
        ckpt = Checkpoints(self.folder / "checkpoints", args.checkpoint_every)
        start = 0
        if args.resume and (restored := ckpt.restore_latest(state)) is not None:
            start, state, data_state = restored
            batches.set_state(data_state)
            print(f"{self.name}: resuming from the checkpoint of step {start}", flush=True)
            kept = [r for r in self.records() if r["step"] <= start]
            self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        bar = tqdm(
            range(start, args.steps),
            initial=start,
            total=args.steps,
            desc=self.name,
            disable=args.no_progress,
            dynamic_ncols=True,
        )
        for step in bar:
            state, metrics = step_fn(state, next(batches))
            record = {"step": step + 1, **{k: float(v) for k, v in metrics.items()}}
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                record.update(evaluate(state["params"]))
            self.log(record)
            bar.set_postfix(
                {k: f"{v:.3f}" for k, v in record.items() if k != "step"}, refresh=False
            )
            if (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
                ckpt.save(step + 1, state, batches.get_state())
        ckpt.close()
        return state

    def finish(self, headline: dict) -> dict:
        """Plot the curves, write and print the final JSON line."""
        headline = {
            "recipe": self.name,
            "seconds": round(time.perf_counter() - self.start, 1),
            **headline,
        }
        self.plot()
        (self.folder / "result.json").write_text(json.dumps(headline, indent=2))
        print(json.dumps(headline), flush=True)
        return headline

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        keys = sorted({k for r in records for k in r if k != "step"})
        if not keys:
            return
        fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 2.8), squeeze=False)
        for ax, key in zip(axes[0], keys, strict=True):
            points = [(r["step"], r[key]) for r in records if key in r]
            ax.plot(*zip(*points, strict=True), marker="." if len(points) < 40 else None)
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
        fig.suptitle(f"{self.name} (seed {self.args.seed})", fontsize=10)
        fig.tight_layout()
        fig.savefig(self.folder / "curves.png", dpi=110)
        plt.close(fig)


def key_data(seed: int) -> jax.Array:
    """A PRNG key as raw uint32 data, so it checkpoints like any other array.

    Every recipe keeps its key in the checkpointed train state; the SFT, DPO and ORPO steps
    are deterministic and do not consume it, steps that sample (dropout, rollouts) split it.
    """
    return jax.random.key_data(jax.random.key(seed))
