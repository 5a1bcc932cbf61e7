"""The supervisor of `python -m tunelib.launch --max-restarts K`: start the run, and start it
again when a process fails, hangs or loses its capacity, on the processes available.

Every start (an attempt) is one `Launch` of the same command, which must be idempotent (a
recipe's `--resume auto`). Between attempts the supervisor writes one line on stderr and one
JSON line in `<log-dir>/supervisor.jsonl` (events `start`, `restart`, `capacity`, `end`),
and hands the next attempt its record (`tunelib.distributed.supervision()`), from which
the run computes its recovery figures (MTTR, MTTI, badput by cause).
"""

import itertools
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

from tunelib.distributed import FAULTS_LOG, HEARTBEATS, SUPERVISION, fired_faults
from tunelib.launch._processes import Launch, free_port, say

REFUSED = 2  # a program's exit code for settings or files it refuses: a rerun refuses again


def out_folder(command: list[str]) -> str | None:
    """The value of the program's `--out`, if it has one."""
    for before, arg in itertools.pairwise(command):
        if before == "--out":
            return arg
        if arg.startswith("--out="):
            return arg.removeprefix("--out=")
    return None


def resumes_auto(command: list[str]) -> bool:
    """Whether the program is given `--resume auto` (safe to start again and again)."""
    pairs = itertools.pairwise(command)
    return "--resume=auto" in command or any(p == ("--resume", "auto") for p in pairs)


class Supervisor:
    """Start `command` on `count` processes, and again after each failure, at most
    `max_restarts` times; with capacity lost, on at least `min_processes`."""

    def __init__(self, command, count, *, devices, port, grace, max_restarts, hang_timeout,
                 min_processes, log_dir, start_timeout=None):  # fmt: skip
        self.command, self.count, self.devices = command, count, devices
        self.port, self.grace = port, grace
        self.max_restarts, self.hang_timeout = max_restarts, hang_timeout
        self.start_timeout = start_timeout
        self.min_processes = min_processes
        self.log_dir = Path(log_dir)
        self.lost: list[float] = []  # when each lost process's capacity returns (inf: never)

    def run(self) -> int:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        faults = self.log_dir / "faults.jsonl"
        heartbeats = Path(tempfile.mkdtemp(prefix="tunelib-heartbeats-"))
        first = time.time()
        capacity = [[first, self.count]]
        failure, restarts, attempt = None, 0, 0
        try:
            while True:
                available = self._available(capacity)
                if available < self.min_processes and not self._wait_for_capacity(capacity):
                    return _code(failure)
                available = self._available(capacity)
                for beat in heartbeats.iterdir():
                    beat.unlink()
                started = time.time()
                record = {
                    "attempt": attempt, "started_at": started, "first_started_at": first,
                    "capacity": capacity, "devices_per_process": self.devices,
                    "failure": failure,
                }  # fmt: skip
                self._log({"event": "start", "time": started, "attempt": attempt,
                           "processes": available})  # fmt: skip
                returns = [t for t in self.lost if t > started and math.isfinite(t)]
                launch = Launch(
                    self.command, available,
                    self.port if self.port is not None else free_port(),
                    self.devices, self.grace, heartbeats=heartbeats,
                    hang_timeout=self.hang_timeout, start_timeout=self.start_timeout,
                    grow_at=min(returns) if available < self.count and returns else None,
                    env={SUPERVISION: json.dumps(record), HEARTBEATS: str(heartbeats),
                         FAULTS_LOG: str(faults)},
                )  # fmt: skip
                code = launch.run()
                if launch.stopping in ("SIGINT", "SIGTERM"):  # the user's, passed on
                    self._log({"event": "end", "time": time.time(), "code": code})
                    return code
                failure = launch.failure
                if launch.grew and failure is None:
                    now = time.time()
                    failure = {"rank": None, "code": None, "failed_at": now, "detected_at": now,
                               "cause": "capacity back"}  # fmt: skip
                elif failure is None:  # done
                    self._log({"event": "end", "time": time.time(), "code": code})
                    return code
                else:
                    failure = _injected(failure, faults, started)
                    self._take_lost_capacity(faults, started, capacity)
                    if failure["code"] == REFUSED:
                        say(f"process {failure['rank']} refused its settings: not restarted.")
                        self._log({"event": "end", "time": time.time(), "code": code,
                                   "cause": failure["cause"]})  # fmt: skip
                        return code
                    if restarts >= self.max_restarts:
                        say(f"{failure['cause']}; no restart left (--max-restarts "
                            f"{self.max_restarts}).")  # fmt: skip
                        self._log({"event": "end", "time": time.time(), "code": code,
                                   "cause": failure["cause"]})  # fmt: skip
                        return code
                    restarts += 1
                failure = {**failure, "attempt_started_at": started}
                attempt += 1
                available = self._available(capacity)
                counted = "restart" if launch.grew else f"restart {restarts} of {self.max_restarts}"
                say(f"{counted}: {failure['cause']} (detected in "
                    f"{failure['detected_at'] - failure['failed_at']:.1f} s); {available} of "
                    f"{self.count} processes available.")  # fmt: skip
                self._log({"event": "restart", "time": time.time(), "attempt": attempt,
                           "restarts": restarts, **failure})  # fmt: skip
        finally:
            shutil.rmtree(heartbeats, ignore_errors=True)

    def _available(self, capacity: list) -> int:
        """The processes available now (the lost ones whose capacity has returned are back),
        noting a change in `capacity`."""
        now = time.time()
        self.lost = [t for t in self.lost if t > now]
        available = self.count - len(self.lost)
        if capacity[-1][1] != available:
            capacity.append([now, available])
            self._log({"event": "capacity", "time": now, "processes": available})
        return available

    def _take_lost_capacity(self, faults: Path, since: float, capacity: list) -> None:
        """The capacity the `lose` faults fired since `since` took away."""
        for record in fired_faults(faults):
            if record["action"] == "lose" and record["time"] >= since:
                back = record["back"]
                self.lost.append(record["time"] + back if back is not None else math.inf)
        self._available(capacity)

    def _wait_for_capacity(self, capacity: list) -> bool:
        """Wait until at least `min_processes` are available; False if they never will be."""
        returns = sorted(self.lost)
        needed = self.min_processes - (self.count - len(returns))
        until = returns[needed - 1]
        if not math.isfinite(until):
            left = self.count - len(returns)
            say(f"{left} processes left, fewer than --min-processes {self.min_processes}, "
                "and the capacity lost does not return: stopping.")  # fmt: skip
            return False
        say(f"waiting {until - time.time():.0f} s for the capacity of "
            f"{self.min_processes} processes to return.")  # fmt: skip
        time.sleep(max(0.0, until - time.time()))
        self._available(capacity)
        return True

    def _log(self, event: dict) -> None:
        with open(self.log_dir / "supervisor.jsonl", "a") as log:
            log.write(json.dumps(event) + "\n")


def _injected(failure: dict, faults: Path, since: float) -> dict:
    """The failure, at the time of the injected fault that caused it (the fault's record:
    the process's own clock, before the supervisor saw its exit), if one did."""
    times = [
        record["time"]
        for record in fired_faults(faults)
        if record["rank"] == failure["rank"] and since <= record["time"] <= failure["failed_at"]
    ]
    return {**failure, "failed_at": max(times)} if times else failure


def _code(failure: dict | None) -> int:
    code = (failure or {}).get("code")
    if code is None:
        return 1
    return 128 - code if code < 0 else code
