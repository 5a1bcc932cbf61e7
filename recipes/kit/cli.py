"""The entry point every recipe shares: parse, check the run folder, train, and turn every
failure the user can cause into one line.

    if __name__ == "__main__":
        kit.cli.main(SFTConfig, train, __doc__)

where `SFTConfig.RECIPE = "sft"` names the script and the default run folder.

`train(config, run)` is the recipe's own function; it imports JAX itself, so that `--help`
and flag errors never wait for it. The run folder's lock (taken when the loop opens the
folder) is released on every exit: done, an error, Ctrl-C, SIGTERM. Exit status: 0 done, 2
a bad flag, path or data file, 130 interrupted (after saving a checkpoint when there was a
step to save), 143 terminated (SIGTERM: the last checkpoint is what remains).

`train` runs with JAX's persistent compilation cache in the run folder (`kit.compile_cache`,
`--compile-cache`), and with Python's garbage collector run less often (`GC_THRESHOLDS`).
"""

import errno
import gc
import os
import shlex
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from kit import children, compile_cache, plan, restores
from kit.config import Run, parse
from kit.errors import UserError
from kit.runs import RunFolder, checkpoint_steps, default_out

# How long a process that hit a bad setting waits at exit for the others to hit it too.
PEER_WAIT_SECONDS = 30.0

# Tracing and lowering a step allocate hundreds of thousands of short-lived objects, and at
# Python's default thresholds (700, 10, 10) the collector runs thousands of times while they
# do, every hundredth time over every object the imports of JAX, Flax and Orbax left: 10 to
# 15 % of a short run (the `student` SFT of 20 steps, its compilation 2 of its 5 s, took
# 5.0-5.3 s, and 4.3-4.5 s with these; the same peak memory). Compiled steps allocate
# little, so it is the start that is shorter. Restored when `main` returns.
GC_THRESHOLDS = (10_000, 10, 10)


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM, `signum`) during training, after the loop saved a checkpoint of
    `step` (None: nothing)."""

    def __init__(self, step: int | None, signum: int = signal.SIGINT):
        super().__init__(step)
        self.step, self.signum = step, signum


def resume_command(argv: list[str]) -> str:
    """The command line that continues this run: the same flags, `--resume`, no `--overwrite`."""
    kept = [
        arg
        for before, arg in zip(["", *argv], argv, strict=False)
        if arg not in ("--overwrite", "--resume") and (before, arg) != ("--resume", "auto")
    ]
    return shlex.join(["python", sys.argv[0] or "recipe.py", *kept, "--resume"])


def main(
    config_type: type,
    train: Callable[[Any, RunFolder], Any],
    doc: str,
    *,
    argv: list[str] | None = None,
) -> Any:
    """Parse `argv` into `config_type`, open the run folder and call `train(config, run)`."""
    argv = sys.argv[1:] if argv is None else argv
    prog = f"{config_type.RECIPE}.py"
    config = parse(config_type, argv, description=doc.strip().splitlines()[0], prog=prog)
    run = None
    main_thread = threading.current_thread() is threading.main_thread()
    _terminating.clear()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    children.stop_with_parent()  # a chained run: it stops with the recipe that started it
    unraisable_hook, sys.unraisablehook = sys.unraisablehook, _unraisable(sys.unraisablehook)
    thresholds = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        if not isinstance(config, Run):  # a script without a run folder (generate.py)
            return train(config, None)
        out = config.out or default_out(config.run_name(), config.seed)
        if config.plan:  # writes nothing, so the folder's state does not matter
            run = plan.PlanFolder(out, steps=config.steps)
        else:
            run = RunFolder(
                out, resume=config.resume, overwrite=config.overwrite, steps=config.steps
            )
            run.check_resume(config)
            run.check_inputs(config)
            if run.finished is not None:  # `--resume auto` of a run that is done
                print(f"{prog}: {out} finished its {config.steps} steps already", flush=True)
                return run.finished
        # JAX's compilation cache, beside the run (`--plan` writes nothing): set before the
        # recipe compiles anything, so that a restart loads what the first start compiled.
        with compile_cache.used(config.compile_cache, None if config.plan else run.path):
            if config.plan or config.device_memory:
                return plan.guard(config, train, run)
            return train(config, run)
    except (UserError, OSError) as error:  # a bad setting, file or folder: one line
        _release(run)
        _refused(prog, error)
    except Interrupted as stop:
        _release(run)
        _interrupted(prog, stop.step, argv, stop.signum)
    except KeyboardInterrupt:  # outside the loop: before its first step or after its last
        _release(run)
        saved = checkpoint_steps(run.path) if run is not None else []
        _interrupted(prog, saved[-1] if saved else None, argv)
    except Exception:
        _release(run)
        _unexpected()
        raise
    finally:
        _release(run)
        gc.set_threshold(*thresholds)
        sys.unraisablehook = restores.after_restores(unraisable_hook)
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


# An OSError's errno for a file or folder this process may not write or read: its
# permissions, or a read-only file system.
NOT_PERMITTED = (errno.EACCES, errno.EPERM, errno.EROFS)


def _refused(prog: str, error: Exception) -> None:
    """One line and exit 2 for a bad setting, file or folder: a `UserError`, or an `OSError`
    of a path the run may not write or read (`NOT_PERMITTED`). Any other `OSError` is an
    unexpected error, raised again."""
    if isinstance(error, OSError):
        if error.errno not in NOT_PERMITTED:
            _unexpected()
            raise error
        error = (
            f"cannot write or read {error.filename}: {error.strerror}; a run writes in its "
            "folder (--out) and reads its inputs: check their permissions"
        )
    sys.stderr.write(f"{prog}: error: {error}\n")
    _exit(2, wait_for_peers=True)


def _unexpected() -> None:
    """On an unexpected error: a process of several prints it and leaves at once (the others
    wait in a collective for it); a process alone returns, for the error to be raised."""
    if not _alone():
        traceback.print_exc()
        _exit(1)


# The SIGTERM received, kept: the exit its handler raises can be lost (below).
_terminating: list[int] = []


def _terminated(signum, frame) -> None:
    """SIGTERM (a scheduler stopping or preempting the job): exit with 128 + 15 through the
    `finally` blocks, which release the run folder's lock."""
    _terminating.append(signum)
    raise SystemExit(128 + signum)


def exit_if_terminated() -> None:
    """Exit with 128 + 15 if SIGTERM arrived and its exit was lost. A signal's handler runs
    in whatever Python code is executing; when that is a garbage-collection callback or a
    `__del__` (JAX's `_xla_gc_callback` during start-up, say), Python prints the exception
    as ignored and goes on: the run trained to its end and exited 0. The run's loop asks
    here at every step (`kit.loop.Steps`), and `main` once the recipe returns."""
    if _terminating:
        raise SystemExit(128 + _terminating[0])


def _unraisable(hook):
    """`sys.unraisablehook` that leaves out the exit `_terminated` raised where it was lost
    (the loop exits at its next step) and passes everything else to `hook`."""

    def quiet(unraisable) -> None:
        if not (_terminating and unraisable.exc_type is SystemExit):
            hook(unraisable)

    return quiet


def _release(run: RunFolder | None) -> None:
    """Release the run folder's lock (on every exit: done, an error, Ctrl-C); `_exit` may
    leave without running `finally` blocks."""
    if run is not None:
        run.release()


def _alone() -> bool:
    """Whether this process runs alone (not one of a multi-process run's: those import JAX
    and join the others), from the launcher's variables: asking JAX would start its backend,
    which a process that failed before its first step has not started."""
    if sys.modules.get("jax") is None:  # not imported (or made unimportable)
        return True
    from tunelib import distributed

    try:
        return distributed.launched_process_count() == 1
    except ValueError:  # the launcher's variables are wrong: the error says so already
        return True


def _exit(code: int, *, wait_for_peers: bool = False) -> None:
    """Exit with `code`. One process of several leaves at once: a normal exit would wait in
    JAX's shutdown barrier (5 minutes) for processes that wait in a collective for it; the
    launcher (or the cluster) sees the exit and stops them.

    With `wait_for_peers` (a bad setting or file: every process meets the same check), the
    normal exit's barrier lets the others reach the check and say so too, one line each; a
    process that left alone goes after `PEER_WAIT_SECONDS` all the same."""
    if _alone():
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    if wait_for_peers:
        timer = threading.Timer(PEER_WAIT_SECONDS, os._exit, (code,))
        timer.daemon = True  # the exit does not wait for it; it ends a barrier that lasts
        timer.start()
        sys.exit(code)
    os._exit(code)


def _interrupted(prog: str, step: int | None, argv: list[str], signum: int = signal.SIGINT):
    """One line saying what was saved and how to continue; exit 128 + the signal's number
    (130 for Ctrl-C, 143 for SIGTERM)."""
    how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    if step is None:
        sys.stderr.write(f"\n{prog}: {how}; nothing was saved to resume from\n")
    else:
        sys.stderr.write(
            f"\n{prog}: {how}; step {step} is saved: continue with {resume_command(argv)}\n"
        )
    sys.exit(128 + signum)
