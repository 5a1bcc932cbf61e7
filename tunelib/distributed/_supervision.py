"""What a supervisor (`python -m tunelib.launch --max-restarts K`) and the processes it starts
tell each other: a heartbeat each step, and the record of the restarts so far."""

import json
import os
import time
from pathlib import Path

import jax

HEARTBEATS = "TUNELIB_HEARTBEATS"  # the folder each process beats in, one file per rank
SUPERVISION = "TUNELIB_SUPERVISION"  # JSON: the supervisor's record, for this attempt


def heartbeat(step: int, *, last: bool = False) -> None:
    """Say this process is alive at `step`: rewrite `<TUNELIB_HEARTBEATS>/<rank>` with the
    step and the time. Nothing without the variable (no supervisor watching).

    A supervisor that sees no beat from a process for `--hang-timeout` seconds takes it as
    hung. The kit's loop beats after every step, and before a step's evaluation and its
    checkpoint; with `last`, once its steps are done: no beat follows (saving the model,
    plotting), and the supervisor stops watching the process.

    Examples:
      >>> from tunelib import distributed
      >>> distributed.heartbeat(3)  # no supervisor: nothing is written
    """
    folder = os.environ.get(HEARTBEATS)
    if folder:
        rank = jax.process_index()
        written = Path(folder) / f".{rank}.writing"  # renamed into place: never read half-made
        written.write_text(f"{step} {time.time():.3f}{' last' if last else ''}\n")
        os.replace(written, Path(folder) / str(rank))


def supervision() -> dict | None:
    """The supervisor's record for this start of the run, or None when no supervisor
    started it.

    Keys: `attempt` (0 for the first start), `started_at` (when this start's processes
    were started, Unix seconds), `first_started_at` (the first start's), `capacity`
    (`[[time, processes available], ...]` since the first start), `devices_per_process`
    (or None), `failure` (None for the first start; else what ended the start before:
    `cause`, `rank`, `failed_at` (the exit seen, or the hung process's last beat),
    `detected_at`, `attempt_started_at`).

    Examples:
      >>> from tunelib import distributed
      >>> distributed.supervision() is None  # started without a supervisor
      True
    """
    text = os.environ.get(SUPERVISION)
    return json.loads(text) if text else None
