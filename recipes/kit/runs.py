"""Run folders that never lose work.

A run folder holds what a recipe writes: its configuration, metrics, checkpoints, plots,
models and result. A folder that already holds a run is never replaced or added to unless
the user says which: `--resume` continues it from its last checkpoint, `--overwrite` removes
the run's own files (nothing else in the folder) and starts again; `--resume auto` resumes
when there is a checkpoint and starts otherwise. All are decided before any work starts, and
checked again under the folder's lock (`kit.lock`) when the run opens it. Nothing here
imports JAX.
"""

import dataclasses
import json
import math
import os
import shutil
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kit.config import to_toml
from kit.errors import UserError
from kit.lock import Lock

RUNS = Path("runs")


def runs_root() -> Path:
    """Where runs go by default: `$TUNELIB_RUNS`, else `runs/` in the working folder."""
    return Path(os.environ.get("TUNELIB_RUNS", RUNS))


def default_out(name: str, seed: int) -> Path:
    """The run folder a recipe writes without `--out`: `<runs>/<name>-seed<seed>`."""
    return runs_root() / f"{name}-seed{seed}"


# What `--resume` may change: the budget, how often it evaluates and saves, where it logs, and
# how it runs (devices, log-prob implementation, remat, checkpoint writes, compilation cache).
# Every other setting picks the model, the data or the objective, which a checkpoint cannot
# be continued under.
RESUMABLE_CHANGES = frozenset(
    {
        "steps",
        "eval_every",
        "checkpoint_every",
        "log_to",
        "no_progress",
        "no_plots",
        "devices",
        "logprobs",
        "remat",
        "out",
        "mtti",
        "sync_checkpoints",
        "compile_cache",
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
    "badput.json",
    "goodput.png",
    "attempts.jsonl",
    "heldout_start.json",
    "best",  # --keep-best's model; left in place, the next run would compare with its record
    "best.partial",
    "faults.jsonl",  # injected faults that fired; left in place, they would not fire again
    "start_model.json",  # the start model's fingerprint, checked on --resume
)


def read_record(path: Path, check: Callable[[Any], Any], consequence: str) -> Any:
    """What `check` makes of the JSON in `path`, a run's own bookkeeping file (the restart
    count, the first held-out grades, the best model's record), or None when the file is
    absent or damaged: cut short, edited, or of another shape (`check` raising ValueError,
    KeyError or TypeError). A damaged one is said in one line, `{path} is damaged (...):
    {consequence}`, and the run goes on: bookkeeping is no reason to refuse its work."""
    if not path.is_file():
        return None
    try:
        return check(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as error:
        said = f"{path} is damaged ({type(error).__name__}: {error})"
        print(f"{said}: {consequence}", file=sys.stderr, flush=True)
        return None


def checkpoint_steps(folder: Path) -> list[int]:
    """The steps of the complete checkpoints in a run folder (Orbax names them by step)."""
    checkpoints = folder / "checkpoints"
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


# What a run folder holds once a run has trained: a checkpoint aside, these are work that
# only `--overwrite` may remove. A folder with the other entries alone (`config.toml`, the
# first evaluation's metrics, ...) is a start that failed before its first checkpoint.
WORK_ENTRIES = ("result.json", "model", "hf_model", "adapters", "peft_adapter")
# Runs of their own inside a run folder (`kit.chain.baseline`'s), trained before the run's
# first step: a start that failed after them starts again with them kept (they resume
# themselves); only `--overwrite` removes them.
CHAINED_ENTRIES = ("baseline",)


class RunFolder:
    """The folder of one run, checked against `--resume` / `--overwrite` / `--steps` when
    opened, before any work.

    `resume` is True (`--resume`), False, or "auto" (`--resume auto`: resume if the folder
    has a checkpoint, else start). After the checks, `resume` says which, and `finished`
    the result of a run that `--resume auto` found finished already (nothing to do), else
    None.

    A start that failed before its first checkpoint (a reward that raised, out of memory at
    the first evaluation) leaves a folder with its `config.toml` and no checkpoint nor model:
    the same command (the same settings, `check_resume`) starts there again without
    `--overwrite`, replacing those files; other settings are refused as for any run.
    """

    def __init__(self, path: Path, *, resume: bool | str, overwrite: bool, steps: int):
        self.path = path.resolve()
        self.named = path
        self.steps = steps
        self.lock = None
        self.finished = None
        self.start_record = None  # written into the folder when it opens (check_start_model)
        self._decide(resume, overwrite)
        self._check_writable()
        self.started = time.perf_counter()

    def _check_writable(self) -> None:
        """Refuse at once a folder the run could not write (its permissions, or a read-only
        file system): the folder, or where it would be made, its checkpoints and the files a
        resumed run adds to (`os.access`: nothing is written to find out). Found later, a
        checkpoint's folder that cannot be made left Orbax waiting 5 minutes for it before a
        traceback."""
        place = self.path
        while not place.exists():
            place = place.parent
        entries = [place, *(place / name for name in self.held)] if place == self.path else [place]
        for entry in entries:
            if not os.access(entry, os.W_OK | os.X_OK if entry.is_dir() else os.W_OK):
                raise UserError(
                    f"--out {self.named}: cannot write {entry} (its permissions, or a read-only "
                    "file system): make it writable, or give --out a folder you can write"
                )

    def faults(self):
        """The injected faults of this run (`tunelib.distributed.FaultPlan`, from
        `TUNELIB_FAULTS`; tests of recovery), those that fired kept in the folder's
        `faults.jsonl` unless a supervisor names its own file."""
        from tunelib import distributed

        try:
            return distributed.FaultPlan.from_environment(default_log=self.path / "faults.jsonl")
        except ValueError as error:  # a spec that does not parse, or names no process here
            raise UserError(str(error)) from None

    def _decide(self, resume: bool | str, overwrite: bool) -> None:
        """Whether the run resumes, starts or starts again, from what the folder holds now;
        a `UserError` when it can do none."""
        path, steps = self.named, self.steps
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"--out {path} is a file, not a folder")
        file = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if file is not None:  # the folder could not be made
            raise UserError(f"--out {path}: {file} is a file, not a folder")
        held = [name for name in RUN_ENTRIES if (self.path / name).exists()]
        saved = checkpoint_steps(self.path)
        work = bool(saved) or any(name in held for name in WORK_ENTRIES)
        if resume == "auto":
            if saved and saved[-1] == steps:
                self.finished = _result(self.path)
            resume = bool(saved)
            if not saved and work:
                raise UserError(
                    f"--resume auto: {path} holds a run without a checkpoint to resume from: "
                    "pass --overwrite to replace it, or --out to start elsewhere"
                )
        if resume:
            if not saved:
                what = "no run" if not held else "no checkpoint"
                raise UserError(f"--resume: {path} has {what} to resume from")
            # At `--steps` already: a run killed before its model was saved resumes to save
            # it; a finished one (its result written) has nothing left to do at these steps.
            done = _result(self.path) is not None
            if self.finished is None and (saved[-1] > steps or (saved[-1] == steps and done)):
                raise UserError(
                    f"--resume: {path} is at step {saved[-1]} already; give --steps above "
                    f"{saved[-1]} to train it further"
                )
            _check_run_files(self.path, path)
        elif held and not overwrite and work:
            raise UserError(
                f"{path} holds a run already: pass --resume to continue it, --overwrite to "
                "replace it, or --out to start elsewhere"
            )
        self.resume = resume
        self.restart = bool(held) and not resume and not overwrite  # a failed start's files
        self.overwrite = (overwrite or self.restart) and bool(held)
        self.held = held

    def open(self, config) -> None:
        """Lock the folder (`kit.lock`), check it again under the lock, and, for a run that
        starts, make it (replacing an earlier run's files with `--overwrite`, or a failed
        start's) and save the configuration. Call once every check has passed, before the
        work starts; a resumed run saves its configuration once restored (`save_config`).
        Opening an open folder does nothing."""
        if self.lock is not None:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        self.lock = Lock(self.path)
        self._decide(self.resume, self.overwrite and not self.restart)  # another run's work?
        self.check_resume(config)
        self.check_inputs(config)
        if self.resume:
            return
        for name in self.held if self.overwrite else ():
            if self.restart and name in CHAINED_ENTRIES:
                continue
            entry = self.path / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        self.save_config(config)
        if self.start_record is not None:
            (self.path / "start_model.json").write_text(json.dumps(self.start_record) + "\n")

    def check_start_model(self, folder: Path, digest: int) -> None:
        """On `--resume`, refuse a start model other than the one the run started from (its
        fingerprint, `tunelib.rollout.fingerprint` of its parameters, is `digest`): retrained
        or replaced in place, it would change the frozen reference under the resumed run. At
        a start, keep its fingerprint in `start_model.json` for that check."""
        record = {"model": str(folder), "fingerprint": digest}
        if not self.resume:
            self.start_record = record
            return
        saved = read_record(
            self.path / "start_model.json", lambda r: int(r["fingerprint"]),
            "the start model is not checked against the one the run started from",
        )  # fmt: skip
        if saved is not None and saved != digest:
            raise UserError(
                f"--resume: the start model {folder} is not the one {self.named} started from "
                f"(fingerprint {digest:#010x}, was {saved:#010x}): it was retrained or "
                "replaced since; restore it, or start the run again with --overwrite"
            )

    def save_config(self, config) -> None:
        """Write the configuration to `config.toml`."""
        (self.path / "config.toml").write_text(to_toml(config))

    def release(self) -> None:
        """Release the folder's lock, if `open` took it."""
        if self.lock is not None:
            self.lock.release()

    def check_inputs(self, config) -> None:
        """Refuse a start that would remove what it reads: with `--overwrite` (or a failed
        start's files replaced), an entry of the folder that holds, or lies inside, a path
        the run reads from (`--model`, `--data`, ... : the configuration's paths)."""
        if self.resume or not self.overwrite:
            return
        for field in dataclasses.fields(config):
            value = getattr(config, field.name)
            if field.name == "out" or not isinstance(value, Path):
                continue
            read = value.resolve()
            for name in self.held:
                entry = self.path / name
                if read == entry or entry in read.parents or read in entry.parents:
                    flag = "--" + field.name.replace("_", "-")
                    how = "starting again" if self.restart else "--overwrite"
                    raise UserError(
                        f"{flag} {value} is in what {how} would remove ({entry}): copy it "
                        "out of the run folder, or give another --out"
                    )

    def check_resume(self, config) -> None:
        """With `--resume`, refuse a configuration that differs from the saved `config.toml`
        in anything but `RESUMABLE_CHANGES`: another model, data or objective. The same for
        a failed start's folder that the run would start again in."""
        saved_file = self.path / "config.toml"
        if not (self.resume or self.restart):
            return
        if not saved_file.is_file():
            if self.restart:
                raise UserError(
                    f"{self.named} holds a run already: pass --resume to continue it, "
                    "--overwrite to replace it, or --out to start elsewhere"
                )
            raise _no_config(self.named)
        saved = _read_toml(saved_file)
        now = tomllib.loads(to_toml(config))
        for name in sorted((saved.keys() | now.keys()) - RESUMABLE_CHANGES):
            if saved.get(name) == now.get(name):
                continue
            flag = "--" + name.replace("_", "-")
            if self.restart:
                raise UserError(
                    f"{self.named} holds a run that stopped before its first checkpoint, "
                    f"with {flag} {saved.get(name)}, not {now.get(name)}: pass --overwrite "
                    "to replace it, or --out to start elsewhere"
                )
            raise UserError(
                f"--resume: {self.path} was trained with {flag} {saved.get(name)} (its "
                f"config.toml), not {now.get(name)}; a run resumes with the settings it "
                "started with, except --steps, --eval-every, --checkpoint-every, --mtti, "
                "--log-to, --no-progress, --no-plots, --devices, --logprobs, --remat, "
                "--sync-checkpoints and --compile-cache"
            )

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def records(self) -> list[dict]:
        """The metrics logged so far, one dict per line of `metrics.jsonl`."""
        return read_metrics(self.metrics_path)

    def seconds(self) -> float:
        return time.perf_counter() - self.started


def to_json(value: Any, **kwargs) -> str:
    """`value` as strict JSON (`json.dumps` with `kwargs`): a float that is not finite (a
    metric with nothing to average, such as the held-out loss of a run without held-out
    records) is written as null, which `read_metrics` reads back as NaN. Python's own NaN
    token is not JSON: other readers refuse it."""
    return json.dumps(_finite(value), allow_nan=False, **kwargs)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def read_metrics(path: Path) -> list[dict]:
    """The records of a `metrics.jsonl`, one dict per line. A last line without its newline
    that does not parse is a write cut short (the run was killed while logging that step,
    whose checkpoint holds the record): it is left out. Any other line that does not parse
    is a `UserError` naming it. A null value (`to_json`'s non-finite float) is NaN."""
    if not path.exists():
        return []
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append({k: math.nan if v is None else v for k, v in record.items()})
        elif number < len(lines):  # a complete line (the text goes on after it)
            raise UserError(
                f"{path} is damaged at line {number} (not a JSON record with its step): "
                "remove that line, or replace the run with --overwrite"
            )
    return records


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise UserError(
            f"{path} is damaged ({error}): put the run's settings back in it, or replace the "
            "run with --overwrite"
        ) from None


def _check_run_files(folder: Path, named: Path) -> None:
    """Refuse, before anything is written, to resume a run whose `config.toml` is missing or
    damaged, or whose `metrics.jsonl` is."""
    if not (folder / "config.toml").is_file():
        raise _no_config(named)
    _read_toml(folder / "config.toml")
    read_metrics(folder / "metrics.jsonl")


def _no_config(named: Path) -> UserError:
    return UserError(
        f"--resume: {named} has no config.toml, so the settings it was trained with are "
        "unknown; put its config.toml back to resume it"
    )


def _result(folder: Path) -> dict | None:
    """The `result.json` a finished run wrote, or None (none, or one cut short: the run did
    not finish writing it)."""
    try:
        result = json.loads((folder / "result.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return result if isinstance(result, dict) else None
