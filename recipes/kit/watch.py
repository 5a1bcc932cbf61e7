"""Watching an RL run's evaluations (the `watch` an RL recipe calls after each): one warning
line at the signs of entropy collapse, and the model with the best value of a chosen metric
kept.

Entropy collapse: the policy's samples stop differing, so groups of completions carry no
signal and pass@k falls while pass@1 may still rise (Yue et al. 2025, "Does Reinforcement
Learning Really Incentivize Reasoning Capacity in LLMs Beyond the Base Model?",
https://arxiv.org/abs/2504.13837; Cui et al. 2025, "The Entropy Mechanism of Reinforcement
Learning for Reasoning Language Models", https://arxiv.org/abs/2505.22617). Two signals:

- the samples' entropy (`sample_entropy`, nats per token at the sampling temperature) below
  `--collapse-entropy`;
- pass@k lower at each of the last `--collapse-patience` evaluations than at the one before,
  while pass@1 is higher than at the first of them.

Each prints one line when it starts to hold (not again while it goes on holding).
"""

import itertools
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from kit import goodput, parallel
from kit.errors import UserError
from kit.runs import read_record, to_json


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


class CollapseGuard:
    """The two signals of entropy collapse over a run's evaluations (see the module)."""

    def __init__(self, entropy_floor: float, patience: int, history: list[dict] = ()):
        self.floor, self.patience = entropy_floor, patience
        self.history = [r for r in history if "pass_at_k" in r]  # a resumed run's evaluations
        self.holding: set[str] = set()

    def observe(self, step: int, evaluated: dict) -> list[str]:
        """The warning lines this evaluation starts (at most one per signal)."""
        signals = {}
        entropy = evaluated.get("sample_entropy")
        if _finite(entropy) and entropy < self.floor:
            signals["entropy"] = (
                f"step {step}: entropy collapse? the samples' entropy {entropy:.4g} nats/token "
                f"is below --collapse-entropy {self.floor:g}: a group's completions are nearly "
                "all alike, so few groups carry a signal"
            )
        if "pass_at_k" in evaluated:
            self.history.append(evaluated)
        recent = self.history[-(self.patience + 1) :]
        pass_k = [r.get("pass_at_k") for r in recent]
        pass_1 = [r.get("pass_at_1") for r in recent]
        if (
            len(recent) == self.patience + 1
            and all(_finite(x) for x in pass_k + pass_1)
            and all(b < a for a, b in itertools.pairwise(pass_k))
            and pass_1[-1] > pass_1[0]
        ):
            signals["pass_at_k"] = (
                f"step {step}: entropy collapse? pass@k fell at each of the last "
                f"{self.patience} evaluations ({' > '.join(f'{x:.3g}' for x in pass_k)}) "
                f"while pass@1 rose ({pass_1[0]:.3g} to {pass_1[-1]:.3g})"
            )
        started = [line for name, line in signals.items() if name not in self.holding]
        self.holding = set(signals)
        return started


class KeepBest:
    """`--keep-best METRIC`: after each evaluation whose `metric` is higher than every one
    before it, the model is saved in `OUT/best` (by `save(folder, trainable)`, as the final
    model is) with `best.json` naming the metric, its value and the step. A resumed run
    goes on from the `best.json` it finds."""

    def __init__(self, metric: str, run_path: Path, save: Callable[[Path, dict], None], placed):
        self.metric, self.save, self.placed = metric, save, placed
        self.folder = run_path / "best"
        self.best = _best_record(self.folder / "best.json")

    def observe(self, step: int, evaluated: dict, trainable) -> None:
        if self.metric not in evaluated:  # checked when the run starts; a guard all the same
            raise UserError(f"--keep-best {self.metric}: the evaluation does not log it")
        value = evaluated[self.metric]
        if not _finite(value) or (self.best is not None and value <= self.best["value"]):
            return
        partial = self.folder.with_name("best.partial")  # the old best stays until replaced
        main = parallel.is_main()
        if main and partial.exists():
            shutil.rmtree(partial)
        self.save(partial, trainable)
        self.best = {"metric": self.metric, "value": value, "step": step}
        if main:
            (partial / "best.json").write_text(to_json(self.best) + "\n")
            if self.folder.exists():
                shutil.rmtree(self.folder)
            partial.rename(self.folder)
        if self.placed is not None:
            self.placed.barrier("best model kept")

    def headline(self) -> dict:
        """`{"best": {"metric", "value", "step"}}` for the final JSON line (empty before
        any evaluation with a finite value)."""
        return {} if self.best is None else {"best": self.best}


def watcher(config, run, save, placed):
    """The `watch` of an RL recipe under `config` (`--collapse-entropy`,
    `--collapse-patience`, `--keep-best`) and its `KeepBest` (None without the flag)."""
    guard = CollapseGuard(config.collapse_entropy, config.collapse_patience, run.records())
    keep = KeepBest(config.keep_best, run.path, save, placed) if config.keep_best else None

    def watch(step: int, evaluated: dict, state: dict) -> None:
        with goodput.phase("eval"):  # part of the evaluation's time (a kept model's saving)
            for line in guard.observe(step, evaluated):
                if parallel.is_main():
                    print(f"{config.run_name()}: warning: {line}", file=sys.stderr, flush=True)
            if keep is not None:
                keep.observe(step, evaluated, state["params"])

    return watch, keep


def _best_record(path: Path) -> dict | None:
    """The best evaluation so far (`{"metric", "value", "step"}`) a resumed run finds, or None:
    none kept yet, or a damaged record (`kit.runs.read_record`; the next evaluation's model
    then replaces the one kept)."""

    def check(record: dict) -> dict:
        if not _finite(record["value"]) or not isinstance(record["step"], int):
            raise ValueError(f"value {record['value']!r}, step {record['step']!r}")
        return record

    return read_record(
        path, check, f"the model kept in {path.parent} is replaced at the next evaluation"
    )
