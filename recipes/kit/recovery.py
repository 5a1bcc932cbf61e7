"""What interruptions cost a run: MTTR per interruption split by cause, MTTI, badput by
cause, goodput and capacity-aware goodput (the figures of MaxText's elastic training talk;
their definitions are in docs/scale.md).

Every start of a run's processes (the first, a `--resume`, a supervisor's restart) appends
one line to the run folder's `attempts.jsonl` once its first step is done: the step it
resumed from, its devices and, after an interruption the supervisor recorded
(`tunelib.distributed.supervision()`), the seconds it cost:

    lost_work   the steps since the checkpoint it resumed from, done again (their logged
                time; all the failed start's time when no checkpoint was saved yet)
    detection   the failure to the supervisor noticing it (an exit: its poll; a hang: the
                last heartbeat to --hang-timeout later)
    restart     noticing it to the restore starting (stopping the other processes, waiting
                for capacity, starting Python, JAX and the model again)
    restore     reading the checkpoint
    recompile   the restore's end to the first step's end, less the productive time of a
                steady step (the median of the steps logged before, compilation-free):
                compilation, and the first collectives' connections

MTTR is the failure to the first productive step after it: detection + restart + restore +
recompile. The first step after a restart carries the same seconds in `metrics.jsonl`
(`time_detection`, ...), and `goodput.png` stacks them on its bar.
"""

import itertools
import json
import time
from pathlib import Path

from kit import goodput
from kit.runs import to_json

CAUSES = goodput.RECOVERY
FILE = "attempts.jsonl"


class Attempt:
    """This start of the run: `restored(begin, end)` when its checkpoint is read (Unix
    seconds), `first_step(record)` once its first step is done, which returns the record's
    recovery keys (none for a start that follows no interruption)."""

    def __init__(self, folder: Path, supervision: dict | None, *, resumed_from: int,
                 devices: int, processes: int, lost_seconds: float,
                 steady: float | None = None):  # fmt: skip
        self.folder, self.supervision = folder, supervision
        self.steady = steady
        self.resumed_from, self.devices, self.processes = resumed_from, devices, processes
        self.lost_seconds = lost_seconds
        self.restore = None
        self.logged = False

    def restored(self, begin: float, end: float) -> None:
        self.restore = (begin, end)

    def first_step(self, record: dict, *, main: bool) -> dict:
        """This start's line of `attempts.jsonl` (written by process 0), once; the recovery
        seconds (`time_<cause>`) for the first step's record."""
        if self.logged:
            return {}
        self.logged = True
        now = time.time()
        line = {
            "attempt": (self.supervision or {}).get("attempt", 0),
            "resumed_from": self.resumed_from,
            "devices": self.devices,
            "processes": self.processes,
        }
        failure = (self.supervision or {}).get("failure")
        if failure is not None:
            productive = self.steady
            if productive is None:
                productive = goodput.logged_seconds(record, goodput.PRODUCTIVE)
            begin, end = self.restore or (now - productive, now - productive)
            lost = self.lost_seconds
            if self.restore is None:  # no checkpoint: the failed start's time is all lost
                lost = failure["failed_at"] - failure["attempt_started_at"]
            costs = {
                "lost_work": lost,
                "detection": failure["detected_at"] - failure["failed_at"],
                "restart": begin - failure["detected_at"],
                "restore": end - begin,
                "recompile": now - end - productive,
            }
            costs = {k: round(max(0.0, v), 3) for k, v in costs.items()}
            mttr = sum(v for k, v in costs.items() if k != "lost_work")
            line.update(cause=failure["cause"], mttr=round(mttr, 3), **costs)
        if main:
            with open(self.folder / FILE, "a") as out:
                out.write(to_json(line) + "\n")
        return {goodput.PREFIX + k: line[k] for k in CAUSES if k in line}


def steady_step(records: list[dict]) -> float | None:
    """The median productive seconds of the logged steps that compiled nothing (None if
    none did)."""
    steady = sorted(
        goodput.logged_seconds(r, goodput.PRODUCTIVE)
        for r in records
        if r["step"] > 0 and not r.get(goodput.PREFIX + "compile")
    )
    return steady[len(steady) // 2] if steady else None


def attempts(folder: Path) -> list[dict]:
    """The lines of a run folder's `attempts.jsonl` (a last line cut short left out)."""
    path = folder / FILE
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def figures(folder: Path, records: list[dict], supervision: dict | None, seconds: float) -> dict:
    """The run's recovery figures, from its `attempts.jsonl`, its metrics `records`, the
    supervisor's record (None: not supervised) and `seconds`, this process's run time (the
    wall time without a supervisor).

    `interruptions`; `mttr_seconds` (mean, max); `mtti_seconds`, the wall time less the
    recoveries over the interruptions; `badput_seconds` by cause; `goodput`, the productive
    seconds of the logged steps over the wall time since the first start;
    `capacity_goodput`, the productive device-seconds over the device-seconds available
    (the supervisor's record of the processes available at each moment, times the devices
    of each)."""
    now = time.time()
    lines = attempts(folder)
    interruptions = [line for line in lines if "mttr" in line]
    mttr = [line["mttr"] for line in interruptions]
    if supervision is not None:
        first = supervision["first_started_at"]
        capacity = [*supervision["capacity"], [now, None]]
    else:
        first = now - seconds
        count = lines[-1]["processes"] if lines else 1
        capacity = [[first, count], [now, None]]
    wall = max(now - first, 1e-9)
    per_process = max(line["devices"] / line["processes"] for line in lines) if lines else 1
    spans = itertools.pairwise(capacity)
    available = sum(n * per_process * (t1 - t0) for (t0, n), (t1, _) in spans)
    productive = used = 0.0
    for record in records:
        seconds_productive = goodput.logged_seconds(record, goodput.PRODUCTIVE)
        productive += seconds_productive
        owners = [line for line in lines if line["resumed_from"] < record["step"]]
        used += seconds_productive * (owners[-1]["devices"] if owners else per_process)
    return {
        "interruptions": len(interruptions),
        "mttr_seconds": {
            "mean": round(sum(mttr) / len(mttr), 2) if mttr else None,
            "max": round(max(mttr), 2) if mttr else None,
        },
        "mtti_seconds": round((wall - sum(mttr)) / len(mttr), 2) if mttr else None,
        "badput_seconds": {
            cause: round(sum(line[cause] for line in interruptions), 2) for cause in CAUSES
        },
        "goodput": round(productive / wall, 4),
        "capacity_goodput": round(used / available, 4) if available > 0 else None,
    }
