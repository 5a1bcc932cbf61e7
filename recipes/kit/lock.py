"""A run folder's lock: one run writes a folder at a time.

The lock is the file `.lock` in the run folder, created atomically and complete (written
beside it, then hard-linked into place, which fails if it exists), holding its holder's pid,
host and process start time; while held, a thread renews its modification time every
`RENEW_SECONDS`. A second run into the folder is refused in one line naming the holder.

A lock whose holder is gone was left by a run killed before it could release it (SIGKILL,
out of memory, a lost host): the next run takes it over and says so in one line. On the
holder's host, gone means no process of that pid started at that time; from another host
(a shared file system, a job requeued elsewhere), a lock not renewed for `STALE_SECONDS`.
In a run of several processes, process 0 alone holds it (it alone writes the folder's
files). Nothing here imports JAX.
"""

import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from kit.errors import UserError

LOCK_FILE = ".lock"
# How often a held lock is renewed, and how long unrenewed a lock of another host is stale
# (ten renewals missed: room for a slow file system and clocks that differ a little).
RENEW_SECONDS = 30.0
STALE_SECONDS = 300.0


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, Linux's /proc), or None if there
    is no such process or no /proc to ask."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: starttime


def _alive(holder: dict) -> bool:
    """Whether the process that wrote `holder` (on this host) still runs."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    started = holder.get("started")
    return started is None or _start_time(pid) in (None, started)  # a reused pid: gone


def _me() -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "started": _start_time(pid)}


def _read(path: Path) -> dict | None:
    """The holder a lock file names; {} for a file cut short; None when there is none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return holder if isinstance(holder, dict) else {}


class Lock:
    """The lock of `folder` (which must exist), taken on construction; `release()` it."""

    def __init__(self, folder: Path):
        self.path = folder / LOCK_FILE
        self.held = False
        me = _me()
        written = folder / f"{LOCK_FILE}.{me['pid']}"
        written.write_text(json.dumps(me))
        try:
            for _ in range(3):  # a lock that changes hands while we look: look again
                try:
                    os.link(written, self.path)
                except FileExistsError:
                    holder = _read(self.path)
                    if holder is not None:
                        self._take_over(folder, holder, me)
                    continue
                self.held = True
                self._renewing = threading.Event()
                threading.Thread(target=self._renew, daemon=True).start()
                return
        finally:
            written.unlink()
        raise UserError(f"{folder}: could not lock the run folder ({self.path} keeps changing)")

    def _take_over(self, folder: Path, holder: dict, me: dict) -> None:
        """Remove a stale lock (its holder gone), or refuse in one line."""
        pid, host = holder.get("pid"), holder.get("host")
        if host == me["host"] and _alive(holder):
            raise UserError(
                f"{folder} is being written by another run (process {pid} on host {host}): "
                "wait for it to end, or give another --out"
            )
        renewed = time.time() - _modified(self.path)
        if holder and host != me["host"] and renewed < STALE_SECONDS:
            raise UserError(
                f"{folder} is being written by another run (process {pid} on host {host}, "
                f"its lock renewed {renewed:.0f} s ago): wait for it to end, or give another "
                f"--out; if that host is lost, the lock is taken over {STALE_SECONDS:.0f} s "
                "after its last renewal"
            )
        # The holder is gone: move its lock aside, and remove it if it is still the same one
        # (another run may have taken it over and locked the folder afresh meanwhile).
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{me['pid']}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if _read(aside) != holder:  # a fresh lock: put it back (unless yet another came)
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
            aside.unlink()
            return
        aside.unlink()
        who = f"process {pid} on host {host}" if holder else "a run (its lock file is damaged)"
        sys.stderr.write(
            f"{folder}: taking over the lock of {who}, which ended without releasing it\n"
        )

    def _renew(self) -> None:
        while not self._renewing.wait(RENEW_SECONDS):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Remove the lock file (once; later calls do nothing)."""
        if self.held:
            self.held = False
            self._renewing.set()
            self.path.unlink(missing_ok=True)


def _modified(path: Path) -> float:
    """When `path` was last modified (or renewed); 0 for a file that is gone."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
