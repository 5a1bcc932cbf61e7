"""Start N processes of one program on this machine as one multi-controller JAX run.

    python -m tunelib.launch -n 2 [--devices-per-process 2] SCRIPT [ARGS ...]
    python -m tunelib.launch -n 2 -m MODULE [ARGS ...]

Each process gets the coordinator's loopback address (`JAX_COORDINATOR_ADDRESS`), the process
count and its rank (`TUNELIB_NUM_PROCESSES`, `TUNELIB_PROCESS_ID`), which
`tunelib.distributed.initialize()` reads. Every line a process prints is prefixed with its
rank (`[0] ...`). Ctrl-C (SIGINT) and SIGTERM are passed on to every process. When one process
fails, the others are stopped (SIGTERM, then SIGKILL after `--grace` seconds), the launcher
says which one failed and exits with its code. For development and tests: on clusters use
the cluster's own launcher (`srun`, `mpirun`, a TPU pod's `--worker=all`; see
`docs/scale.md`).

As a supervisor (`tunelib/launch/_supervisor.py`):

    python -m tunelib.launch -n 2 --max-restarts 3 --hang-timeout 60 [--start-timeout 900] \
        [--min-processes 1] recipes/sft.py --out runs/a --resume auto

`--max-restarts K` starts the whole run again when a process fails or hangs, up to K times;
the command must be safe to run again, so it must carry `--resume auto` (a recipe then
continues from its last complete checkpoint), or the launcher refuses it. A process that
exits with code 2 (a recipe's refusal of its settings or files) is not restarted: it would
refuse again. `--hang-timeout S`: a process whose heartbeat (`tunelib.distributed
.heartbeat`, after every step of the kit's loop) is older than S seconds is hung; its clock
starts at its first beat, which comes after the first step and its compilation.
`--start-timeout S`: a process that has not beaten S seconds after it started (stuck in its
imports, its restore, a collective of its start-up or its first compilation) is hung too;
give S above the longest start-up the run may have (default under a supervisor:
`START_TIMEOUT`, 1,800 s, so that a start-up hang ends; `inf`: not watched).
`--min-processes M`: when capacity is lost (a `lose` fault of `TUNELIB_FAULTS`, see
`tunelib.distributed.parse_faults`), the run goes on with the processes left, as long as
they are at least M, and grows back to N (stopped with SIGINT after a step: a checkpoint,
then a restart) when the capacity returns. Each restart is one line on stderr with its
cause, and a line of `supervisor.jsonl` in `--log-dir` (default: the command's `--out`),
where `faults.jsonl` records the injected faults that fired.
"""

import argparse
import os
import sys
from collections.abc import Sequence

from tunelib.distributed import FAULTS, parse_faults
from tunelib.launch import _supervisor
from tunelib.launch._processes import PROG, Launch, free_port

# Seconds a supervised process may take to its first heartbeat (imports, restore, first
# compilation) before it is taken as hung, unless --start-timeout says otherwise.
START_TIMEOUT = 1800.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run N processes of a program on this machine as one JAX run.",
    )
    parser.add_argument("-n", "--num-processes", type=int, required=True,
                        help="processes to start (>= 1)")  # fmt: skip
    parser.add_argument(
        "--devices-per-process", type=int, default=None,
        help="simulate this many CPU devices in each process (XLA's host device count)",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=None,
                        help="the coordinator's port (default: a free one)")  # fmt: skip
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds from SIGTERM to SIGKILL when stopping processes")  # fmt: skip
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the run up to K times when a process fails or hangs "
                             "(the command must carry --resume auto; default 0: none)")  # fmt: skip
    parser.add_argument("--hang-timeout", type=float, default=None,
                        help="seconds without a heartbeat after which a process is hung "
                             "(counted from its first beat; default: not watched)")  # fmt: skip
    parser.add_argument("--start-timeout", type=float, default=None,
                        help="seconds after a process's start by which it must beat "
                             f"once, or it is hung (default {START_TIMEOUT:.0f}; inf: "
                             "not watched)")  # fmt: skip
    parser.add_argument("--min-processes", type=int, default=None,
                        help="go on with at least M processes when capacity is lost, and grow "
                             "back when it returns (default: -n, no shrinking)")  # fmt: skip
    parser.add_argument("--log-dir", default=None,
                        help="where supervisor.jsonl and faults.jsonl go (default: the "
                             "command's --out)")  # fmt: skip
    parser.add_argument("-m", dest="module", default=None,
                        help="run a module (as python -m) instead of a script")  # fmt: skip
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the script and its arguments (or the module's)")  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Launch, wait, and return the exit code (0 when every process succeeded)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        parser.error(f"-n must be >= 1, got {args.num_processes}.")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        parser.error(f"--devices-per-process must be >= 1, got {args.devices_per_process}.")
    if args.grace < 0:
        parser.error(f"--grace must be >= 0, got {args.grace}.")
    if args.module is not None:
        command = [sys.executable, "-m", args.module, *args.command]
    else:
        if not args.command:
            parser.error("give the script to run (or -m MODULE).")
        script, *rest = args.command
        if not os.path.isfile(script):
            parser.error(f"no such script: {script}")
        command = [sys.executable, script, *rest]
    refused = _refused(args, command)
    if refused:  # one line, nothing written
        print(f"{PROG}: error: {refused}", file=sys.stderr, flush=True)
        return 2
    if _supervised(args):
        return _supervisor.Supervisor(
            command, args.num_processes, devices=args.devices_per_process, port=args.port,
            grace=args.grace, max_restarts=args.max_restarts, hang_timeout=args.hang_timeout,
            start_timeout=START_TIMEOUT if args.start_timeout is None else args.start_timeout,
            min_processes=args.min_processes or args.num_processes,
            log_dir=args.log_dir or _supervisor.out_folder(command),
        ).run()  # fmt: skip
    port = args.port if args.port is not None else free_port()
    return Launch(command, args.num_processes, port, args.devices_per_process, args.grace).run()


def _supervised(args) -> bool:
    watched = (args.hang_timeout, args.start_timeout, args.min_processes)
    return bool(args.max_restarts) or any(value is not None for value in watched)


def _refused(args, command: list[str]) -> str | None:
    """Why the supervisor's settings cannot run, in one line, or None."""
    if args.max_restarts < 0:
        return f"--max-restarts must be >= 0, got {args.max_restarts}."
    if args.hang_timeout is not None and not args.hang_timeout > 0:
        return f"--hang-timeout must be > 0 seconds, got {args.hang_timeout}."
    if args.start_timeout is not None and not args.start_timeout > 0:
        return f"--start-timeout must be > 0 seconds, got {args.start_timeout}."
    n, m = args.num_processes, args.min_processes
    if m is not None and not 1 <= m <= n:
        return f"--min-processes must be in [1, {n}] (-n {n}), got {m}."
    try:
        parse_faults(os.environ.get(FAULTS, ""))
    except ValueError as error:
        return str(error)
    if args.max_restarts and not _supervisor.resumes_auto(command):
        return (
            "--max-restarts runs the command again after a failure, so it must be safe to "
            "rerun: give the program --resume auto (a recipe then continues from its last "
            "checkpoint)."
        )
    if _supervised(args) and args.log_dir is None and _supervisor.out_folder(command) is None:
        return "a supervised run keeps its log in --log-dir, or in the program's --out: give one."
    return None
