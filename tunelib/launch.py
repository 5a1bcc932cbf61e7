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
"""

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from tunelib.distributed import COORDINATOR, NUM_PROCESSES, PROCESS_ID

_PROG = "python -m tunelib.launch"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
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
    port = args.port if args.port is not None else _free_port()
    return _Launch(command, args.num_processes, port, args.devices_per_process, args.grace).run()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Launch:
    def __init__(self, command, count, port, devices, grace):
        self.command, self.count, self.grace = command, count, grace
        self.address = f"127.0.0.1:{port}"
        self.devices = devices
        self.lock = threading.Lock()
        self.stopping: str | None = None  # why the processes are being stopped
        self.processes: list[subprocess.Popen] = []

    def _environment(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            COORDINATOR: self.address,
            NUM_PROCESSES: str(self.count),
            PROCESS_ID: str(rank),
            "PYTHONUNBUFFERED": "1",
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
            print(f"{_PROG}: {message}", file=sys.stderr, flush=True)

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
            failures = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed is None and self.stopping is None and failures:
                # A process killed by a signal is named first: the others' errors (a peer's
                # closed connection) follow from it, often within the same poll.
                failed = rank, code = min(failures, key=lambda f: (f[1] >= 0, f[0]))
                self._say(f"process {rank} {_described(code)}; stopping the others.")
                self.stopping = f"process {rank} failed"
                self._stop_all(signal.SIGTERM)
            if self.stopping is not None and deadline is None:
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
            return _exit_code(failed[1])
        if self.stopping in ("SIGINT", "SIGTERM"):
            return 128 + signal.Signals[self.stopping].value
        return next((_exit_code(c) for c in codes if c != 0), 0)


def _described(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
