"""Run folders that never lose work.

A run folder holds what a recipe writes: its configuration, metrics, checkpoints, plots,
models and result. A folder that already holds a run is never replaced or added to unless
the user says which: `--resume` continues it from its last checkpoint, `--overwrite` removes
the run's own files (nothing else in the folder) and starts again. Both are decided before any
work starts. Nothing here imports JAX.
"""

import json
import os
import shutil
import time
import tomllib
from pathlib import Path

from kit.config import to_toml
from kit.errors import UserError

RUNS = Path("runs")


def runs_root() -> Path:
    """Where runs go by default: `$TUNELIB_RUNS`, else `runs/` in the working folder."""
    return Path(os.environ.get("TUNELIB_RUNS", RUNS))


def default_out(name: str, seed: int) -> Path:
    """The run folder a recipe writes without `--out`: `<runs>/<name>-seed<seed>`."""
    return runs_root() / f"{name}-seed{seed}"


# What `--resume` may change: the budget, how often it evaluates and saves, where it logs, and
# how it runs (devices, log-prob implementation, remat). Every other setting picks the model, the
# data or the objective, which a checkpoint cannot be continued under.
RESUMABLE_CHANGES = frozenset(
    {
        "steps",
        "eval_every",
        "checkpoint_every",
        "log_to",
        "no_progress",
        "devices",
        "logprobs",
        "remat",
        "out",
    }
)

# Everything a recipe writes into its run folder; `--overwrite` removes these and only these.
RUN_ENTRIES = (
    "config.toml",
    "metrics.jsonl",
    "result.json",
    "curves.png",
    "checkpoints",
    "model",
    "hf_model",
    "adapters",
    "peft_adapter",
    "tensorboard",
    "wandb",
    "baseline",
)


def checkpoint_steps(folder: Path) -> list[int]:
    """The steps of the complete checkpoints in a run folder (Orbax names them by step)."""
    checkpoints = folder / "checkpoints"
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


class RunFolder:
    """The folder of one run, checked against `--resume` / `--overwrite` / `--steps` when
    opened, before any work."""

    def __init__(self, path: Path, *, resume: bool, overwrite: bool, steps: int):
        self.path = path.resolve()
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"--out {path} is a file, not a folder")
        held = [name for name in RUN_ENTRIES if (self.path / name).exists()]
        if resume:
            saved = checkpoint_steps(self.path)
            if not saved:
                what = "no run" if not held else "no checkpoint"
                raise UserError(f"--resume: {path} has {what} to resume from")
            if saved[-1] >= steps:
                raise UserError(
                    f"--resume: {path} is at step {saved[-1]} already; give --steps above "
                    f"{saved[-1]} to train it further"
                )
        elif held and not overwrite:
            raise UserError(
                f"{path} holds a run already: pass --resume to continue it, --overwrite to "
                "replace it, or --out to start elsewhere"
            )
        self.resume = resume
        self.overwrite = overwrite and bool(held)
        self.held = held
        self.started = time.perf_counter()

    def open(self, config) -> None:
        """Make the folder (replacing an earlier run's files with `--overwrite`) and save
        the configuration. Call once every check has passed, before the work starts."""
        if self.overwrite:
            for name in self.held:
                entry = self.path / name
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.toml").write_text(to_toml(config))

    def check_resume(self, config) -> None:
        """With `--resume`, refuse a configuration that differs from the saved `config.toml`
        in anything but `RESUMABLE_CHANGES`: another model, data or objective."""
        saved_file = self.path / "config.toml"
        if not self.resume or not saved_file.is_file():
            return
        saved = tomllib.loads(saved_file.read_text())
        now = tomllib.loads(to_toml(config))
        for name in sorted((saved.keys() | now.keys()) - RESUMABLE_CHANGES):
            if saved.get(name) != now.get(name):
                flag = "--" + name.replace("_", "-")
                raise UserError(
                    f"--resume: {self.path} was trained with {flag} {saved.get(name)} (its "
                    f"config.toml), not {now.get(name)}; a run resumes with the settings it "
                    "started with, except --steps, --eval-every, --checkpoint-every, --log-to, "
                    "--no-progress, --devices and --logprobs"
                )

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def records(self) -> list[dict]:
        """The metrics logged so far, one dict per line of `metrics.jsonl`."""
        if not self.metrics_path.exists():
            return []
        lines = self.metrics_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line]

    def seconds(self) -> float:
        return time.perf_counter() - self.started
