"""The train loop's parts, which a recipe's own loop calls: a run context (the run folder and
its lock, resuming, logs, checkpoints, heartbeats, faults, Ctrl-C, the time split), the PRNG
keys of a step, the initial state and the result line.

    state = loop.initial_state(params, optimizer, config.seed, placement)
    with loop.Steps(run, config, placement, state, batches) as steps:
        state = steps.state                        # the last checkpoint's, with --resume
        if steps.fresh:                            # before the first step, logged as step 0
            steps.log_start(steps.evaluate(evaluate_fn, state["params"]))
        for step in steps:                         # from the step after the checkpoint on
            batch = steps.next_batch()             # this process's rows, as global arrays
            state, metrics = steps.step(train_step, state, batch)
            if steps.evaluation_due(step):
                metrics |= steps.evaluate(evaluate_fn, state["params"])
            steps.done(step, state, metrics)       # log, checkpoint, heartbeat, stop
    return loop.finish(run, config, {"accuracy_after": ...})

The recipe's step and evaluation are its own functions, called by the recipe; `Steps` never
calls back into it. A checkpoint of the state and of the data iterator's position is saved
every `--checkpoint-every` steps and after the last step, so `--resume --steps N` can extend
a finished run, and a run killed after its last checkpoint, before its model was saved,
resumes at its last step to save it. Ctrl-C lets the current step finish, saves a
checkpoint of it and raises `kit.cli.Interrupted` out of the `with` block, which the entry
point turns into one line saying how to resume; a second Ctrl-C stops at once, and the last
periodic checkpoint is what remains.

Checkpoints are written in the background while the next steps run (unless
`--sync-checkpoints`), and the context waits for the last one when it closes;
`--checkpoint-every auto` picks the interval (`kit.checkpoint_interval`).

In a run of several processes (`kit.parallel`) every process runs the loop: the steps,
evaluations and checkpoints are collective, and the processes agree after each step whether
one of them was asked to stop. Process 0 alone writes the run folder's files and shows the
progress bar.
"""

import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from tunelib import distributed

from kit import checkpoint_interval, goodput, parallel, recovery
from kit.checkpoints import Checkpoints
from kit.cli import Interrupted, exit_if_terminated
from kit.errors import UserError
from kit.logs import open_writers
from kit.parallel import Placement
from kit.plots import plot
from kit.runs import RunFolder, read_record, to_json


def _number(value: Any) -> float:
    return float(np.asarray(value))


class Steps:
    """The run context of a recipe's loop (the module's docstring shows it in use).

    Entered, it opens the run folder (process 0; the lock is taken), restores the last
    checkpoint with `--resume` (`state`, `start`; `fresh` when there was none), opens the
    metric writers and takes Ctrl-C; iterated, it gives the steps from `start + 1` to
    `--steps`, each timed from its start (`kit.goodput`); closed, it waits for the last
    checkpoint, closes the writers and `batches` (a prefetching iterator's thread stops),
    and gives Ctrl-C back, however the block ends.

    `placed` is the run's `kit.parallel.Placement`; `state` a pytree holding at least
    `params`; `batches` a Grain iterator of this process's rows of each batch, checkpointed
    with the state. `checkpointed`, `(to_saved, from_saved)`, maps the state to what a
    checkpoint holds and back (every process calls both; `kit.disaggregated`'s roles save
    the trainer's state).
    """

    def __init__(
        self,
        run: RunFolder,
        config,
        placed: Placement,
        state: dict,
        batches: Iterator,
        *,
        checkpointed: tuple[Callable, Callable] | None = None,
    ):
        self.run, self.config, self.placed, self.batches = run, config, placed, batches
        self.state = state
        self.to_saved, self.from_saved = checkpointed or (lambda s: s, lambda s: s)
        self.name = config.run_name()
        self.main = placed.is_main
        self.start, self.fresh, self.current = 0, True, 0
        self.writers: list = []
        self.checkpoints = None
        self._stop: list[int] = []
        self._previous_handlers: dict = {}

    # ------------------------------------------------------------------------- entering

    def __enter__(self) -> "Steps":
        run, config, placed = self.run, self.config, self.placed
        try:
            if self.main:
                run.open(config)  # locks the folder; a resumed run saves its config once restored
            placed.barrier("run folder open")
            self.faults = run.faults()  # TUNELIB_FAULTS, parsed once
            self.checkpoints = Checkpoints(
                run.path / "checkpoints", asynchronous=not config.sync_checkpoints,
                faults=self.faults,
            )  # fmt: skip
            self.interval = checkpoint_interval.Interval(config.checkpoint_every, mtti=config.mtti)
            lost = self._restore() if run.resume else []
            self.attempt = recovery.Attempt(
                run.path, distributed.supervision(), resumed_from=self.start,
                devices=jax.device_count(), processes=jax.process_count(),
                lost_seconds=sum(map(goodput.logged_seconds, lost)),
                steady=recovery.steady_step(run.records()) if self.main else None,
            )  # fmt: skip
            if run.resume:
                self.attempt.restored(*self._restored_at)
            self.writers = open_writers(run.path, self.name, config) if self.main else []
            self.faults.inject("start", self.start)  # restored, not yet beating
            self.clock = goodput.clock()
            if self.fresh:
                self.clock.reset()  # the first evaluation's time is step 0's
            self.bar = tqdm(
                total=config.steps, initial=self.start, desc=self.name, dynamic_ncols=True,
                disable=config.no_progress or not self.main,
            )  # fmt: skip
            # Only the main thread may take signals (a recipe run from a thread keeps Ctrl-C).
            # SIGTERM (a scheduler's stop, a preemption) stops the run as Ctrl-C does: raised
            # wherever the step was, its exit could interrupt a checkpoint's write, and the
            # process then crashed in its shutdown (status 139).
            if threading.current_thread() is threading.main_thread():
                self._previous_handlers = {
                    s: signal.signal(s, self._request_stop) for s in (signal.SIGINT, signal.SIGTERM)
                }
        except BaseException:
            self._close()
            raise
        return self

    def _restore(self) -> list[dict]:
        """Restore the last checkpoint; the records of the steps it lost."""
        began = time.time()
        self.start, state, saved = self.checkpoints.restore_latest(
            self.to_saved(self.state), self.batches
        )
        self.state, self.fresh = self.from_saved(state), False
        self._restored_at = (began, time.time())
        lost = []
        if self.main:
            run = self.run
            print(f"{self.name}: resuming from the checkpoint of step {self.start}", flush=True)
            run.save_config(self.config)
            records = run.records()
            lost = [r for r in records if r["step"] > self.start]
            kept = [r for r in records if r["step"] < self.start]
            kept.append(next((r for r in records if r["step"] == self.start), saved))
            run.metrics_path.write_text("".join(to_json(r) + "\n" for r in kept))
            _add_badput(run, lost)
            self.interval.observe(kept, _badput(run))
        return lost

    def _request_stop(self, signum, frame) -> None:
        """Ctrl-C or SIGTERM: stop after this step, with a checkpoint of it; the second
        signal stops at once."""
        if self._stop:
            if signum == signal.SIGTERM:
                raise SystemExit(128 + signum)
            raise KeyboardInterrupt
        self._stop.append(signum)
        again = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        sys.stderr.write(f"\n{self.name}: stopping after this step ({again} again: at once)\n")

    # ------------------------------------------------------------------------- the steps

    def __iter__(self) -> Iterator[int]:
        for step in range(self.start + 1, self.config.steps + 1):
            self.clock.reset()
            self.current = step
            yield step

    def phase(self, name: str):
        """Time a block as `name`, one of `kit.goodput.PHASES`."""
        return self.clock.phase(name)

    def next_batch(self):
        """This process's rows of the next batch, as global arrays split over the devices
        (timed as the step's data)."""
        with self.clock.phase("data"):
            return self.placed.rows(next(self.batches))

    def step(self, step_fn: Callable, state, *args) -> tuple[Any, dict]:
        """`step_fn(state, *args) -> (state, metrics)`, timed as train until its metrics are
        on the host (the rollouts, log-probs and syncs it marks itself are theirs); the
        metrics as Python floats. After the first step, one line with its time and what the
        rest will take. A SIGTERM whose exit was lost (`kit.cli.exit_if_terminated`) ends
        the run here, before the step."""
        exit_if_terminated()
        with self.clock.phase("train"):
            state, metrics = step_fn(state, *args)
            metrics = {k: _number(v) for k, v in metrics.items()}
        step, steps = self.current, self.config.steps
        if not math.isfinite(metrics.get("loss", 0.0)):
            self._log({"step": step, **metrics})  # the step that diverged, in metrics.jsonl
            raise UserError(self._diverged(step, metrics["loss"]))
        if step == self.start + 1 and step < steps and self.main:
            line = estimate(self.name, step, steps, self.clock.split(), _devices(self.placed))
            self.bar.write(line, file=sys.stdout)
        return state, metrics

    def _diverged(self, step: int, loss: float) -> str:
        """The line for a step whose loss is not finite: the run stops there, before anything
        of that step is saved (no checkpoint, no model). Its earlier checkpoints are kept, but
        not offered for resuming: the update before a non-finite loss may already have made
        the weights non-finite."""
        saved = self.checkpoints.manager.latest_step() if self.checkpoints is not None else None
        kept = f" (its checkpoints up to step {saved} are kept)" if saved else ""
        return (
            f"the loss was {loss} at step {step}: the run stopped there without saving its "
            f"model{kept}. A learning rate too large for the model is the usual cause "
            f"(--learning-rate {self.config.learning_rate:g}): run again with a smaller one; "
            f"the step's metrics are the last line of {self.run.path / 'metrics.jsonl'}"
        )

    def evaluation_due(self, step: int) -> bool:
        """Every `--eval-every` steps and after the last."""
        return step % self.config.eval_every == 0 or step == self.config.steps

    def evaluate(self, evaluate_fn: Callable, *args) -> dict:
        """`evaluate_fn(*args) -> metrics`, timed as eval, the metrics as Python floats (the
        supervisor's clock starts again before one after a step: an evaluation is no hang)."""
        if self.current:
            distributed.heartbeat(self.current)
        with self.clock.phase("eval"):
            return {k: _number(v) for k, v in evaluate_fn(*args).items()}

    def log_start(self, metrics: dict) -> None:
        """Log the metrics taken before the first step (the evaluation of the start), as step
        0, with its time."""
        split = {goodput.PREFIX + k: round(v, 4) for k, v in self.clock.split().items()}
        self._log({"step": 0, **metrics, **split})

    def done(self, step: int, state, metrics: dict) -> None:
        """After the recipe's step: log its record, save a checkpoint when due (the last
        step's and a stopped run's too), beat the supervisor's heart, and stop the run
        (`Interrupted`) when Ctrl-C asked for it, in any process of the run."""
        config = self.config
        record = {"step": step, **metrics}
        self.bar.update(1)
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in record.items() if k != "step"},
                             refresh=False)  # fmt: skip
        if self.placed.process_count > 1 and _anyone_stopping(self._stop):
            self._stop.append(signal.SIGINT)  # another process was asked: stop together
        saving = self.interval.due(step) or step == config.steps or bool(self._stop)
        if saving:
            so_far = {goodput.PREFIX + k: round(v, 4) for k, v in self.clock.split().items()}
            distributed.heartbeat(step)
            with self.clock.phase("checkpoint"):  # with the record, should the log not follow
                saved = self.to_saved(state)
                self.checkpoints.save(step, saved, self.batches, {**record, **so_far})
        split = self.clock.split()
        chosen = self.interval.measured(split, saving, jax.process_count())
        if chosen is not None and self.main:
            self.bar.write(f"{self.name}: {chosen}", file=sys.stdout)
        record.update({goodput.PREFIX + k: round(v, 4) for k, v in split.items()})
        record.update(self.attempt.first_step(record, main=self.main))
        self._log(record)
        distributed.heartbeat(step)
        if self._stop:
            raise Interrupted(step, self._stop[0])
        self.faults.inject("step", step)

    def _log(self, record: dict) -> None:
        for writer in self.writers:
            writer.write(record)

    # ------------------------------------------------------------------------- closing

    def __exit__(self, kind, error, traceback) -> None:
        if isinstance(error, Interrupted | KeyboardInterrupt):
            self.bar.close()
            self.checkpoints.manager.wait_until_finished()  # the step just saved is written
            saved = self.checkpoints.manager.latest_step()
            self._close()
            raise Interrupted(saved, getattr(error, "signum", signal.SIGINT)) from None
        if error is None:  # the steps are done: no beat follows (saving the model, plots)
            distributed.heartbeat(self.config.steps, last=True)
        self._close()
        if error is None:  # the metrics are complete before any process reads them back
            self.placed.barrier("metrics written")

    def _close(self) -> None:
        """Give Ctrl-C back, close the bar, wait for the last checkpoint, close the writers
        and the batches."""
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers = {}
        if getattr(self, "bar", None) is not None:
            self.bar.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
        for writer in self.writers:
            writer.close()
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()


def estimate(name: str, step: int, steps: int, split: dict[str, float], devices: str) -> str:
    """The line a run prints after its first step: the steps planned, the devices they run on
    (a JAX without its TPU or GPU plugin runs on the CPU, which shows here) and the time they
    will take at that step's pace (its seconds per `kit.goodput` phase, compilation left
    out)."""
    seconds = sum(v for k, v in split.items() if k != "compile")
    left = steps - step
    return (
        f"{name}: {steps} steps planned on {devices}; step {step} took {seconds:.3g} s after "
        f"{split.get('compile', 0.0):.3g} s of compilation: about {_duration(left * seconds)} "
        f"for the {left} left"
    )


def _devices(placed: Placement | None) -> str:
    """`"1 TPU v5 lite"`, `"8 cpu"`: the run's devices, counted, and their kind."""
    devices = list(placed.mesh.devices.flat) if placed is not None else jax.local_devices()[:1]
    return f"{len(devices)} {devices[0].device_kind}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _anyone_stopping(stop: list) -> bool:
    """Whether another process of the run, and not this one, was asked to stop (a
    collective every process calls after each step, so all stop after the same one)."""
    asked = multihost_utils.process_allgather(np.array(bool(stop)))
    return not stop and bool(asked.any())


def step_keys(rng: Any, *streams: str) -> tuple:
    """The PRNG keys of one step from the key data in the train state: the next state's key
    data, then one independent key per named stream (`"dropout"`, `"rollouts"`, ...).

    Every key comes from one `jax.random.split`, so no two streams of a step, nor the next
    step's, ever share randomness.
    """
    keys = jax.random.split(jax.random.wrap_key_data(rng), 1 + len(streams))
    return (jax.random.key_data(keys[0]), *keys[1:])


def _rounded(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return round(value, 4)
    return value


def finish(run: RunFolder, config, headline: dict, *, chained: dict | None = None) -> dict:
    """Plot the curves and the time split (unless `--no-plots`), then write and print the
    final JSON line (process 0 of a run of several; every process returns it).

    The line holds the recipe, the seed, the steps, the seconds this run took and, with
    `chained`, the runs it trained first (`{"sft_seconds": ...}`), then `headline` (floats
    rounded to 4 decimals), then `time`: the seconds of every step per phase (compile, data,
    rollout, log-probs, train, sync, checkpoint, eval, idle; `kit.goodput`) with `goodput`,
    their productive share, and the badput: restarts and the seconds of the steps they
    lost (steps logged after the checkpoint a `--resume` went back to); then `recovery`,
    what interruptions cost (`kit.recovery.figures`: MTTR, MTTI, badput by cause, goodput
    over the wall time and capacity-aware goodput).
    """
    records = run.records()
    main = parallel.is_main()
    title = f"{config.run_name()} (seed {config.seed})"
    curves = [{k: v for k, v in r.items() if not k.startswith(goodput.PREFIX)} for r in records]
    if main and not config.no_plots:
        plot(curves, run.path / "curves.png", title)
        goodput.plot_split(records, run.path / "goodput.png", title)
    badput = _badput(run)
    figures = recovery.figures(run.path, records, distributed.supervision(), run.seconds())
    result = {
        "recipe": config.run_name(),
        "seed": config.seed,
        "steps": config.steps,
        "seconds": round(run.seconds(), 1),
        **(chained or {}),
        **{k: _rounded(v) for k, v in headline.items()},
        "time": goodput.totals(records),
        "badput_seconds": badput["lost_seconds"],
        "restarts": badput["restarts"],
        "recovery": figures,
    }
    if main:
        (run.path / "result.json").write_text(to_json(result, indent=2))
        print(to_json(result), flush=True)
    return result


def _badput(run: RunFolder) -> dict:
    """The run's count of restarts and the seconds of steps they lost (`badput.json`),
    counted afresh when the record is damaged."""
    record = read_record(
        run.path / "badput.json",
        lambda r: {"restarts": int(r["restarts"]), "lost_seconds": float(r["lost_seconds"])},
        "its count of restarts and their lost time start again",
    )
    return record or {"restarts": 0, "lost_seconds": 0.0}


def _add_badput(run: RunFolder, lost: list[dict]) -> None:
    """Count a restart, and the time of the steps it lost (logged after the checkpoint it
    resumes from), into the run's `badput.json`."""
    badput = _badput(run)
    seconds = sum(map(goodput.logged_seconds, lost))
    badput = {
        "restarts": badput["restarts"] + 1,
        "lost_seconds": round(badput["lost_seconds"] + seconds, 2),
    }
    (run.path / "badput.json").write_text(to_json(badput))


def first_and_last(run: RunFolder, key: str) -> tuple[float, float]:
    """The first and the last logged value of `key` (before and after training)."""
    values = [r[key] for r in run.records() if key in r]
    return values[0], values[-1]


def before_and_after(run: RunFolder, *keys: str) -> dict:
    """`{key}_before` and `{key}_after` of each of `keys` the run logged."""
    records = run.records()  # the metrics file, read once
    out = {}
    for key in keys:
        values = [r[key] for r in records if key in r]
        if values:
            out[f"{key}_before"], out[f"{key}_after"] = values[0], values[-1]
    return out


def initial_state(params, optimizer, seed: int, placed: Placement | None = None) -> dict:
    """The train state at step 0: the trainable parameters, the optimizer's state for them,
    and the PRNG key data of `seed` (checkpointed like any array), on every device of
    `placed` (without one, where the parameters are), each array a copy of its own.

    The recipes' train steps donate the state (its buffers become the next state's), so the
    state owns every buffer it holds: none is shared with the model the parameters came from
    (a frozen reference, the sampler's policy) or between two of its leaves."""
    state = {
        "params": params,
        "opt_state": optimizer.init(params),
        "rng": jax.random.key_data(jax.random.key(seed)),
    }
    if placed is not None:  # every array on every device of the run's mesh
        return owned(placed.replicate(state))
    # Arrays made without a placement (the optimizer's step count, the key) are committed
    # where the parameters are, as the train step's outputs will be: otherwise the second step
    # sees other input shardings than the first and compiles the whole step again.
    sharding = jax.tree.leaves(params)[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())

    def commit(x):
        return x if x.committed else jax.device_put(x, sharding)

    return owned(jax.tree.map(commit, state))


@jax.jit
def owned(state: dict) -> dict:
    """Every array of `state` copied (on its devices, in its layout; one program): buffers of
    its own, which a step that donates its state may consume (`initial_state`'s, and any
    array a recipe adds to it)."""
    return jax.tree.map(jax.numpy.copy, state)
