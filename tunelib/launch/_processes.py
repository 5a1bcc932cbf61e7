"""N processes of one program as one run: started, their output prefixed, watched (exits and
heartbeats), stopped together."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tunelib.distributed import COORDINATOR, NUM_PROCESSES, PROCESS_ID

PROG = "python -m tunelib.launch"
HUNG = 124  # the exit code of a run stopped because a process hung (as timeout(1)'s)


def say(message: str) -> None:
    """One line of the launcher's on stderr."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """`count` processes of `command`, from start to the last exit (`run`).

    When one fails, the others are stopped (SIGTERM, SIGKILL after `grace` s). With
    `heartbeats` (the folder of `tunelib.distributed.heartbeat`'s files) and `hang_timeout`,
    a process whose last beat is older than that is hung, and every process is stopped (one
    past its last beat is not watched); with `start_timeout`, so is a process that has not
    beaten that many seconds after it started (stuck in its start-up); at `grow_at` (Unix
    seconds), once each has beaten once, every process is sent SIGINT, to stop after a step
    (a recipe saves a checkpoint) and be started again on more processes. `failure` then
    says what ended the run (rank, code, cause, failed_at, detected_at), `grew` whether it
    was stopped to grow. `env` is added to every process's environment."""

    def __init__(self, command, count, port, devices, grace, *, env=None, heartbeats=None,
                 hang_timeout=None, start_timeout=None, grow_at=None):  # fmt: skip
        self.command, self.count, self.grace = command, count, grace
        self.address = f"127.0.0.1:{port}"
        self.devices = devices
        self.env = env or {}
        self.heartbeats, self.hang_timeout, self.grow_at = heartbeats, hang_timeout, grow_at
        self.start_timeout = start_timeout
        self.started_at: list[float] = []  # each process's start (Unix seconds)
        self.lock = threading.Lock()
        self.stopping: str | None = None  # why the processes are being stopped
        self.processes: list[subprocess.Popen] = []
        self.failure: dict | None = None
        self.grew = False

    def _environment(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            COORDINATOR: self.address,
            NUM_PROCESSES: str(self.count),
            PROCESS_ID: str(rank),
            "PYTHONUNBUFFERED": "1",
            **self.env,
        })  # fmt: skip
        if self.devices is not None:
            flag = f"--xla_force_host_platform_device_count={self.devices}"
            kept = [f for f in env.get("XLA_FLAGS", "").split() if "device_count=" not in f]
            env["XLA_FLAGS"] = " ".join([*kept, flag])
        return env

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        pumps = []
        try:
            for rank in range(self.count):
                process = subprocess.Popen(
                    self.command,
                    env=self._environment(rank),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # signals reach them through the launcher only
                )
                self.processes.append(process)
                self.started_at.append(time.time())
                pump = threading.Thread(target=self._pump, args=(rank, process), daemon=True)
                pump.start()
                pumps.append(pump)
            code = self._wait()
        finally:
            self._stop_all(signal.SIGKILL)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        for pump in pumps:
            pump.join(timeout=5)
        return code

    def _pump(self, rank: int, process: subprocess.Popen) -> None:
        for raw in iter(process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self.lock:
                print(f"[{rank}] {line}", flush=True)

    def _say(self, message: str) -> None:
        with self.lock:
            say(message)

    def _forward(self, sig, frame) -> None:
        name = signal.Signals(sig).name
        if self.stopping is None:
            self.stopping = name
            self._say(f"{name}: passed on to all {self.count} processes.")
            self._stop_all(sig)
        else:  # a second Ctrl-C: no more waiting
            self._say(f"{name} again: killing every process.")
            self._stop_all(signal.SIGKILL)

    def _stop_all(self, sig) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)

    def _wait(self) -> int:
        failed: tuple[int, int] | None = None
        deadline = None
        while True:
            codes = [p.poll() for p in self.processes]
            now = time.time()
            failures = [(rank, code) for rank, code in enumerate(codes)
                        if code not in (None, 0) and not (self.grew and code == 130)]  # fmt: skip
            if failed is None and self.stopping in (None, "grow") and failures:
                # A process killed by a signal is named first: the others' errors (a peer's
                # closed connection) follow from it, often within the same poll.
                failed = rank, code = min(failures, key=lambda f: (f[1] >= 0, f[0]))
                self._say(f"process {rank} {described(code)}; stopping the others.")
                cause = f"process {rank} {described(code)}"
                self.failure = {"rank": rank, "code": code, "failed_at": now,
                                "detected_at": now, "cause": cause}  # fmt: skip
                self.stopping = f"process {rank} failed"
                self._stop_all(signal.SIGTERM)
            hung = self._hung(codes, now) if failed is None else None
            if hung is not None and self.stopping in (None, "grow"):
                rank, beat, after = hung
                cause = f"process {rank} hung: no heartbeat for {now - beat:.1f} s after {after}"
                self._say(f"{cause}; stopping every process.")
                failed = rank, -HUNG
                self.failure = {"rank": rank, "code": None, "failed_at": beat,
                                "detected_at": now, "cause": cause}  # fmt: skip
                self.stopping = cause
                self._stop_all(signal.SIGTERM)
            growing = self.grow_at is not None and now >= self.grow_at and self._started(codes)
            if growing and self.stopping is None:
                self.stopping, self.grew = "grow", True
                self._say("capacity is back: stopping every process after its step, to grow.")
                self._stop_all(signal.SIGINT)
            if self.stopping not in (None, "grow") and deadline is None:
                deadline = time.monotonic() + self.grace
            if deadline is not None and time.monotonic() > deadline:
                alive = [r for r, c in enumerate(codes) if c is None]
                if alive:
                    self._say(f"processes {alive} still running after {self.grace} s: killed.")
                    self._stop_all(signal.SIGKILL)
                    deadline = float("inf")
            if all(c is not None for c in codes):
                break
            time.sleep(0.05)
        if failed is not None:
            return HUNG if failed[1] == -HUNG else exit_code(failed[1])
        if self.stopping in ("SIGINT", "SIGTERM"):
            return 128 + signal.Signals[self.stopping].value
        if self.grew:
            return 0
        return next((exit_code(c) for c in codes if c != 0), 0)

    def _started(self, codes) -> bool:
        """Whether every running process has beaten once (is past its start-up, which a
        SIGINT would break without a checkpoint to show for it)."""
        beats = Path(self.heartbeats) if self.heartbeats is not None else None
        return beats is None or all(
            (beats / str(rank)).exists() for rank, code in enumerate(codes) if code is None
        )

    def _hung(self, codes, now: float) -> tuple[int, float, str] | None:
        """A running process that is hung: `(rank, time of its last beat, "step <its step>")`
        for the one whose beat is the oldest, if older than `hang_timeout`; else `(rank, its
        start, "it started")` for one that has not beaten `start_timeout` seconds after it
        started. A process that has not beaten yet is otherwise not watched (its start-up may
        compile for long)."""
        if self.heartbeats is None:
            return None
        beats, silent = [], []
        for rank, code in enumerate(codes):
            path = Path(self.heartbeats) / str(rank)
            if code is not None:
                continue
            if not path.exists():
                silent.append((self.started_at[rank], rank, None))
                continue
            with contextlib.suppress(OSError):  # the file removed meanwhile: next poll
                beat, fields = path.stat().st_mtime, path.read_text().split()[::2]
                # "step time [last]"; a beat that does not parse (a process stopped between
                # truncating the file and writing it) is watched from the file's time.
                step = f"step {fields[0]}" if fields else "its last beat, which is unreadable"
                if fields[1:] != ["last"]:  # a process past its last step is not watched
                    beats.append((beat, rank, step))
        if beats and self.hang_timeout is not None:
            beat, rank, step = min(beats)
            if now - beat > self.hang_timeout:
                return rank, beat, step
        if silent and self.start_timeout is not None:
            start, rank, _ = min(silent)
            if now - start > self.start_timeout:
                return rank, start, "it started"
        return None


def described(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def exit_code(code: int) -> int:
    return 128 - code if code < 0 else code
