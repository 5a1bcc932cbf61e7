"""Fault injection for tests and benchmarks: kill, hang, raise or lose a process on cue.

The faults come from one variable, `TUNELIB_FAULTS`, a list separated by `;` of

    ACTION@TRIGGER[,OPTION=VALUE...]

    ACTION   kill   SIGKILL this process
             hang   stop here for good (no heartbeat: a supervisor's --hang-timeout sees it)
             raise  raise a RuntimeError
             lose   SIGKILL this process and take its capacity away (`back=` seconds, or
                    for good): the supervisor restarts the run on the processes left
    TRIGGER  step=N         after step N
             random=P       after any step, with probability P (drawn from seed and step)
             checkpoint     during a checkpoint write (the first at or after step=N, if given)
             push           during a weight push of asynchronous GRPO (same)
             start          in the start-up, before the first step's heartbeat (once
                            the run is restored; the first at or after step=N, if given)
    OPTION   rank=R   the process it fires on (default 0)
             seed=S   random's seed (default 0)
             step=N   checkpoint's and push's first step
             back=S   lose's seconds until the capacity returns

e.g. `TUNELIB_FAULTS="kill@step=3,rank=1; hang@step=5; raise@random=0.1,seed=0;
kill@checkpoint,step=4; kill@push; lose@step=6,rank=1,back=20; hang@start"`.

A fault fires once per run: before it acts it appends a line to the file
`TUNELIB_FAULTS_LOG` names (a recipe's run folder's `faults.jsonl` by default; the
launcher's log folder's under `python -m tunelib.launch`), and a fault found there does not
fire again after a restart (a random one: not again at that step).
"""

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np

FAULTS = "TUNELIB_FAULTS"
FAULTS_LOG = "TUNELIB_FAULTS_LOG"
ACTIONS = ("kill", "hang", "raise", "lose")
TRIGGERS = ("step", "random", "checkpoint", "push", "start")
_OPTIONS = {"rank": int, "seed": int, "step": int, "back": float}


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault of a `TUNELIB_FAULTS` spec.

    Attributes:
      action: "kill", "hang", "raise" or "lose".
      trigger: "step", "random", "checkpoint", "push" or "start".
      step: the step (trigger "step"), or the first step (checkpoint, push, start); None:
        any.
      probability: random's chance per step.
      rank: the process it fires on.
      seed: random's seed.
      back: lose's seconds until the capacity returns (None: never).
      text: the fault as written.
    """

    action: str
    trigger: str
    step: int | None = None
    probability: float | None = None
    rank: int = 0
    seed: int = 0
    back: float | None = None
    text: str = ""


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """The faults of a `TUNELIB_FAULTS` spec (see the module's grammar).

    Raises:
      ValueError: one line naming the fault that does not parse and why.

    Examples:
      >>> from tunelib import distributed
      >>> [f.action for f in distributed.parse_faults("kill@step=3,rank=1; hang@push")]
      ['kill', 'hang']
      >>> distributed.parse_faults("kill@step=3,rank=x")
      Traceback (most recent call last):
      ...
      ValueError: TUNELIB_FAULTS: cannot parse 'kill@step=3,rank=x': 'rank=x': 'x' is not a number
    """
    return tuple(_parse(text.strip()) for text in spec.split(";") if text.strip())


def _parse(text: str) -> Fault:
    def refuse(why: str) -> ValueError:
        return ValueError(f"{FAULTS}: cannot parse {text!r}: {why}")

    action, at, rest = text.partition("@")
    action = action.strip()
    if action not in ACTIONS:
        raise refuse(f"the action is one of {', '.join(ACTIONS)}")
    if not at:
        raise refuse("write ACTION@TRIGGER, e.g. kill@step=3")
    trigger, *options = [part.strip() for part in rest.split(",")]
    name, _, value = trigger.partition("=")
    fields: dict = {"action": action, "trigger": name, "text": text}
    if name in ("step", "random"):
        if not value:
            raise refuse(f"{name} needs a value: {name}=...")
        options.insert(0, trigger)
    elif name not in TRIGGERS or value:
        raise refuse("the trigger is step=N, random=P, checkpoint, push or start")
    for option in options:
        key, _, value = option.partition("=")
        key = key.strip()
        kind = float if key == "random" else _OPTIONS.get(key)
        if kind is None or not value:
            raise refuse(f"{option!r} is not one of step=N, random=P, rank=R, seed=S, back=S")
        try:
            number = kind(value)
        except ValueError:
            raise refuse(f"{option!r}: {value!r} is not a number") from None
        fields["probability" if key == "random" else key] = number
    probability = fields.get("probability")
    if probability is not None and not 0 <= probability <= 1:
        raise refuse("random=P needs 0 <= P <= 1")
    if fields.get("rank", 0) < 0 or fields.get("step", 0) < 0:
        raise refuse("rank and step are >= 0")
    if "back" in fields and (action != "lose" or not fields["back"] >= 0):
        raise refuse("back=S (seconds >= 0) goes with lose only")
    return Fault(**fields)


class FaultPlan:
    """The faults of this process, parsed once from a `TUNELIB_FAULTS` spec, with the file that
    records those that fired (`log`): a run's loop, checkpoints and weight pushes hold one
    and ask it at each point where a fault may fire.

    The records already in `log` are read once, when the plan is made: a fault found there
    fired in an earlier attempt of the run and does not fire again (a random one: not again
    at that step). A fault that fires is appended to `log` before it acts.

    Args:
      spec: a `TUNELIB_FAULTS` spec (see the module's grammar); empty: no fault.
      log: the file of the faults that fired; None: kept in memory only.
      rank: this process's index (default `jax.process_index()`).
      processes: how many processes the run has (default `jax.process_count()` when `rank`
        is not given, else unchecked).

    Raises:
      ValueError: for a spec that does not parse, and, before any fault of the run has
        fired, for a fault on a process the run does not have (it would never fire: a test
        of recovery that tests nothing). After a fault fired, a run restarted on fewer
        processes (`lose`) may leave the faults of the processes it lost unfired.

    Examples:
      >>> from tunelib import distributed
      >>> plan = distributed.FaultPlan("raise@step=3")
      >>> plan.inject("step", 2)  # not due: nothing happens
      >>> plan.inject("step", 3)
      Traceback (most recent call last):
      ...
      RuntimeError: injected fault 'raise@step=3' at step of step 3
    """

    def __init__(
        self,
        spec: str = "",
        log: Path | None = None,
        *,
        rank: int | None = None,
        processes: int | None = None,
    ):
        self.faults = parse_faults(spec) if spec.strip() else []
        self.log = None if log is None else Path(log)
        if rank is None and self.faults:
            rank, processes = jax.process_index(), processes or jax.process_count()
        self.rank = rank or 0
        self.fired = _fired(self.log) if self.faults else set()
        beyond = [f for f in self.faults if processes is not None and f.rank >= processes]
        if beyond and not self.fired:
            raise ValueError(
                f"TUNELIB_FAULTS: {beyond[0].text!r} fires on process {beyond[0].rank}, but the "
                f"run has {processes} process{'es' if processes > 1 else ''} (rank 0 to "
                f"{processes - 1}): it would never fire"
            )

    @classmethod
    def from_environment(cls, default_log: Path | None = None) -> "FaultPlan":
        """The plan `TUNELIB_FAULTS` asks for, logged to `TUNELIB_FAULTS_LOG` (a supervisor's
        log folder's) or else to `default_log` (a recipe's run folder's `faults.jsonl`)."""
        log = os.environ.get(FAULTS_LOG) or default_log
        return cls(os.environ.get(FAULTS, ""), log)

    def inject(self, where: str, step: int) -> None:
        """Fire the faults due on this process at `where` ("step" after a step, "start" in
        the start-up, with `step` the step the run starts from) of `step`."""
        for index, fault in self._due(where, step):
            self._fire(index, fault, where, step)

    @contextmanager
    def during(self, where: str, step: int, *, written: Path | None = None) -> Iterator[None]:
        """The block a fault at `where` ("checkpoint" during a write, "push" during a weight
        push) of `step` interrupts: a raise or a hang on entry; a kill (or lose) once the
        block has begun writing (a new entry in the folder `written`, the temporary folder
        Orbax writes a checkpoint into), else on entry."""
        killer = None
        for index, fault in list(self._due(where, step)):
            if fault.action in ("kill", "lose") and written is not None:
                before = set(os.listdir(written)) if written.is_dir() else set()
                done = threading.Event()
                killer = threading.Thread(
                    target=self._kill_once_written,
                    args=(index, fault, where, step, written, before, done), daemon=True,
                )  # fmt: skip
                killer.start()
            else:
                self._fire(index, fault, where, step)
        try:
            yield
        finally:
            if killer is not None:  # a write too quick to catch: the kill follows it at once
                done.set()
                killer.join()

    def _kill_once_written(self, index, fault, where, step, folder: Path, before, done) -> None:
        while not done.is_set():
            if folder.is_dir() and set(os.listdir(folder)) - before:
                break
            time.sleep(0.001)
        self._fire(index, fault, where, step)

    def _due(self, where: str, step: int) -> Iterator[tuple[int, Fault]]:
        for index, fault in enumerate(self.faults):
            key = (index, step if fault.trigger == "random" else None)
            if fault.rank != self.rank or key in self.fired:
                continue
            if fault.trigger == "random":
                chance = np.random.default_rng([fault.seed, step, index]).random()
                if where == "step" and chance < fault.probability:
                    yield index, fault
            elif fault.trigger == where and (
                fault.step is None
                or (step == fault.step if where == "step" else step >= fault.step)
            ):
                yield index, fault

    def _fire(self, index: int, fault: Fault, where: str, step: int) -> None:
        record = {
            "index": index, "fault": fault.text, "action": fault.action,
            "trigger": fault.trigger, "where": where, "step": step, "rank": self.rank,
            "time": time.time(), "back": fault.back,
        }  # fmt: skip
        self.fired.add((index, step if fault.trigger == "random" else None))
        if self.log is not None:
            with open(self.log, "a") as log:
                log.write(json.dumps(record) + "\n")
                log.flush()
                os.fsync(log.fileno())
        print(f"injected fault {fault.text!r} at {where} of step {step}", flush=True)
        if fault.action in ("kill", "lose"):
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.action == "hang":
            while True:
                time.sleep(60)
        if fault.action == "raise":
            raise RuntimeError(f"injected fault {fault.text!r} at {where} of step {step}")


def inject_faults(where: str, step: int) -> None:
    """Fire the faults of `TUNELIB_FAULTS` due on this process at `where` of `step`, as
    `FaultPlan.from_environment().inject(where, step)` (the variables read at each call).
    Nothing without the variable.

    Examples:
      >>> from tunelib import distributed
      >>> distributed.inject_faults("step", 3)  # TUNELIB_FAULTS unset: nothing happens
    """
    FaultPlan.from_environment().inject(where, step)


def faults_during(where: str, step: int, *, written: Path | None = None):
    """`FaultPlan.from_environment().during(where, step, written=written)`: the block a fault
    of `TUNELIB_FAULTS` at `where` of `step` interrupts; nothing without the variable."""
    return FaultPlan.from_environment().during(where, step, written=written)


def _fired(path: Path | None) -> set[tuple[int, int | None]]:
    if path is None or not path.exists():
        return set()
    out = set()
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the kill it recorded
            continue
        out.add((record["index"], record["step"] if record["trigger"] == "random" else None))
    return out


def fired_faults(path: Path) -> list[dict]:
    """The records of the faults that fired, from a `TUNELIB_FAULTS_LOG` file (none when it
    does not exist): index, fault, action, trigger, where, step, rank, time (Unix seconds),
    back."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
