"""The train loop every recipe shares: resume, step, evaluate, log, checkpoint, finish.

    state = kit.loop.train(run, config, placement, state=state, batches=batches,
                           step_fn=train_step, evaluate=evaluate)
    return kit.loop.finish(run, config, {"accuracy_after": ...})

`step_fn(state, batch) -> (state, metrics)` is the recipe's step; `evaluate(params) -> metrics`
its held-out evaluation, run before the first step (logged as step 0), every `--eval-every`
steps and after the last. A checkpoint of the state and of the data iterator's position is
saved every `--checkpoint-every` steps and after the last step, so `--resume --steps N` can
extend a finished run, and a run killed after its last checkpoint, before its model was
saved, resumes at its last step to save it. Ctrl-C lets the current step finish, saves a
checkpoint of it and raises `Interrupted`, which the entry point turns into one line saying
how to resume; a second Ctrl-C stops at once, and the last periodic checkpoint is what
remains.

Checkpoints are written in the background while the next steps run (unless
`--sync-checkpoints`), and the loop waits for the last one before it returns;
`--checkpoint-every auto` picks the interval (`kit.checkpoint_interval`).

In a run of several processes (`kit.parallel`) every process runs the loop: the steps,
evaluations and checkpoints are collective, and the processes agree after each step whether
one of them was asked to stop. Process 0 alone writes the run folder's files and shows the
progress bar.
"""

import json
import math
import os
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

from kit import checkpoint_interval, goodput, parallel, plan, recovery
from kit.checkpoints import Checkpoints
from kit.cli import Interrupted
from kit.logs import open_writers
from kit.parallel import Placement
from kit.plots import plot
from kit.runs import RunFolder


def _number(value: Any) -> float:
    return float(np.asarray(value))


def train(
    run: RunFolder,
    config,
    placed: Placement | None,
    *,
    state: dict,
    batches: Iterator,
    step_fn: Callable[[dict, Any], tuple[dict, dict]],
    evaluate: Callable[[Any], dict],
    checkpointed: tuple[Callable, Callable] | None = None,
    pieces: Callable | None = None,
    watch: Callable[[int, dict, dict], None] | None = None,
) -> dict | plan.Planned:
    """Run `step_fn` from step 0 (or the last checkpoint, with `--resume`) to `--steps`.

    `placed` is the run's `kit.parallel.Placement` (None: one device, batches as they come);
    `state` is a pytree holding at least `params` (what `evaluate` receives); `batches` a
    Grain iterator of this process's rows of each batch, checkpointed with the state;
    `step_fn` receives the global batch of them, split over the run's devices.
    `checkpointed`, `(to_saved, from_saved)`, maps the state to what a checkpoint holds and
    back (every process calls both; `kit.disaggregated`'s roles save the trainer's state).
    With `--plan` or `--device-memory` the step is planned first (`kit.plan.check`): as one
    jitted function of `(state, batch)`, or, for a step that runs several or branches on
    the host, as the parts `pieces(state, batch) -> {name: kit.plan.Piece}` say; the plan,
    a `kit.plan.Planned`, is then returned in place of the state, and the recipe returns it.
    `watch(step, evaluated, state)`, if given, is called in every process after each
    evaluation (step 0's included) with its metrics (`kit.watch`). Once the steps start,
    `batches` is closed when the loop ends, however it ends (a prefetching iterator's thread
    stops); a plan leaves it open.
    """
    planned = plan.check(
        config, placed, state=state, batches=batches, step_fn=step_fn, pieces=pieces
    )
    if planned is not None:  # --plan, or a run that does not fit --device-memory: no step
        return planned
    try:
        return _train(run, config, placed, state, batches, step_fn, evaluate, checkpointed, watch)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def _train(run, config, placed, state, batches, step_fn, evaluate, checkpointed, watch):
    name = config.run_name()
    main = parallel.is_main()
    if main:
        run.open(config)  # locks the folder; a resumed run saves its config.toml once restored
    if placed is not None:
        placed.barrier("run folder open")
    if os.environ.get(distributed.FAULTS) and not os.environ.get(distributed.FAULTS_LOG):
        os.environ[distributed.FAULTS_LOG] = str(run.path / "faults.jsonl")  # fired once a run
    checkpoints = Checkpoints(run.path / "checkpoints", asynchronous=not config.sync_checkpoints)
    interval = checkpoint_interval.Interval(config.checkpoint_every, mtti=config.mtti)
    to_saved, from_saved = checkpointed or (lambda state: state, lambda state: state)
    start, lost = 0, []
    if run.resume:
        began = time.time()
        start, state, saved = checkpoints.restore_latest(to_saved(state), batches)
        state = from_saved(state)
        restored = (began, time.time())
        if main:
            print(f"{name}: resuming from the checkpoint of step {start}", flush=True)
            run.save_config(config)
            records = run.records()
            lost = [r for r in records if r["step"] > start]
            kept = [r for r in records if r["step"] < start]
            kept.append(next((r for r in records if r["step"] == start), saved))
            run.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            _add_badput(run, lost)
            interval.observe(kept, _badput(run))
    attempt = recovery.Attempt(
        run.path, distributed.supervision(), resumed_from=start, devices=jax.device_count(),
        processes=jax.process_count(), lost_seconds=sum(map(goodput.logged_seconds, lost)),
        steady=recovery.steady_step(run.records()) if main else None,
    )  # fmt: skip
    if run.resume:
        attempt.restored(*restored)
    writers = open_writers(run.path, name, config) if main else []

    def log(record: dict) -> None:
        for writer in writers:
            writer.write(record)

    distributed.inject_faults("start", start)  # restored, not yet beating: a start-up fault
    clock = goodput.clock()
    if not run.resume:
        clock.reset()
        with clock.phase("eval"):
            before = {k: _number(v) for k, v in evaluate(state["params"]).items()}
            if watch is not None:
                watch(0, before, state)
        split = {goodput.PREFIX + k: round(v, 4) for k, v in clock.split().items()}
        log({"step": 0, **before, **split})
    bar = tqdm(
        total=config.steps, initial=start, desc=name, disable=config.no_progress or not main,
        dynamic_ncols=True,
    )  # fmt: skip
    stop = []

    def request_stop(signum, frame):
        if stop:  # the second Ctrl-C: at once
            raise KeyboardInterrupt
        stop.append(signum)
        sys.stderr.write(f"\n{name}: stopping after this step (Ctrl-C again to stop at once)\n")

    # Only the main thread may take signals (a recipe run from a thread keeps Ctrl-C as is).
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, request_stop) if main_thread else None
    try:
        for step in range(start + 1, config.steps + 1):
            clock.reset()
            with clock.phase("data"):  # this process's rows, then the global batch of them
                batch = next(batches)
                batch = placed.rows(batch) if placed is not None else batch
            with clock.phase("train"):  # less the rollouts, log-probs and syncs it marks
                state, metrics = step_fn(state, batch)
                record = {"step": step, **{k: _number(v) for k, v in metrics.items()}}
            if step == start + 1 and step < config.steps and main:  # the budget, in time
                line = estimate(name, step, config.steps, clock.split(), _devices(placed))
                bar.write(line, file=sys.stdout)
            if step % config.eval_every == 0 or step == config.steps:
                distributed.heartbeat(step)  # the supervisor's clock starts again for it
                with clock.phase("eval"):
                    evaluated = {k: _number(v) for k, v in evaluate(state["params"]).items()}
                    record.update(evaluated)
                    if watch is not None:
                        watch(step, evaluated, state)
            bar.update(1)
            bar.set_postfix(
                {k: f"{v:.3g}" for k, v in record.items() if k != "step"}, refresh=False
            )
            if placed is not None and placed.process_count > 1 and _anyone_stopping(stop):
                stop.append(signal.SIGINT)  # another process was asked: stop together
            saving = interval.due(step) or step == config.steps or bool(stop)
            if saving:
                so_far = {goodput.PREFIX + k: round(v, 4) for k, v in clock.split().items()}
                distributed.heartbeat(step)
                with clock.phase("checkpoint"):  # with the record, should the log not follow
                    checkpoints.save(step, to_saved(state), batches, {**record, **so_far})
            split = clock.split()
            chosen = interval.measured(split, saving, jax.process_count())
            if chosen is not None and main:
                bar.write(f"{name}: {chosen}", file=sys.stdout)
            record.update({goodput.PREFIX + k: round(v, 4) for k, v in split.items()})
            record.update(attempt.first_step(record, main=main))
            log(record)
            distributed.heartbeat(step)
            if stop:
                raise Interrupted(step)
            distributed.inject_faults("step", step)
    except (Interrupted, KeyboardInterrupt):
        bar.close()
        checkpoints.manager.wait_until_finished()  # the step just saved is written, or failed
        saved = checkpoints.manager.latest_step()
        checkpoints.close()
        for writer in writers:
            writer.close()
        raise Interrupted(saved) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    distributed.heartbeat(config.steps, last=True)
    bar.close()
    checkpoints.close()
    for writer in writers:
        writer.close()
    if placed is not None:  # the metrics are complete before any process reads them back
        placed.barrier("metrics written")
    return state


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
        (run.path / "result.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result), flush=True)
    return result


def _badput(run: RunFolder) -> dict:
    path = run.path / "badput.json"
    return json.loads(path.read_text()) if path.exists() else {"restarts": 0, "lost_seconds": 0.0}


def _add_badput(run: RunFolder, lost: list[dict]) -> None:
    """Count a restart, and the time of the steps it lost (logged after the checkpoint it
    resumes from), into the run's `badput.json`."""
    badput = _badput(run)
    seconds = sum(map(goodput.logged_seconds, lost))
    badput = {
        "restarts": badput["restarts"] + 1,
        "lost_seconds": round(badput["lost_seconds"] + seconds, 2),
    }
    (run.path / "badput.json").write_text(json.dumps(badput))


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
    `placed` (without one, where the parameters are)."""
    state = {
        "params": params,
        "opt_state": optimizer.init(params),
        "rng": jax.random.key_data(jax.random.key(seed)),
    }
    if placed is not None:  # every array on every device of the run's mesh
        return placed.replicate(state)
    # Arrays made without a placement (the optimizer's step count, the key) are committed
    # where the parameters are, as the train step's outputs will be: otherwise the second step
    # sees other input shardings than the first and compiles the whole step again.
    sharding = jax.tree.leaves(params)[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())

    def commit(x):
        return x if x.committed else jax.device_put(x, sharding)

    return jax.tree.map(commit, state)
