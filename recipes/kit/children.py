"""The runs a recipe starts as processes of its own (`kit.chain`'s SFT start, teacher and
baseline), which stop with it.

    code = run_child([sys.executable, "recipes/sft.py", ...])   # in the recipe
    stop_with_parent()                                          # at the child's start

The child has a session of its own, so a Ctrl-C at the terminal reaches the recipe only,
which passes it on (SIGINT), as it does SIGTERM: the child saves its state and ends, then the
recipe stops too. On Linux a child that calls `stop_with_parent` (every recipe does, in
`kit.cli.main`) gets SIGTERM when the recipe dies without passing anything on (SIGKILL), so
no orphan trains on, holding its run folder's lock. No Python runs between fork and exec: the
child asks for the parent-death signal itself.
"""

import ctypes
import os
import signal
import subprocess
import sys

# Seconds a child may take to save its state and end once its recipe is stopped.
CHILD_GRACE = 120.0
# The variable that tells a child which process started it (its pid).
PARENT = "TUNELIB_PARENT_PID"
PR_SET_PDEATHSIG = 1  # prctl's option, <linux/prctl.h>


def run_child(command: list[str]) -> int:
    """Run `command` to its end and return its exit code; it stops with this process (the
    module's docstring says how). A child that has not ended `CHILD_GRACE` seconds after a
    stop was passed on is killed."""
    env = {**os.environ, PARENT: str(os.getpid())}
    child = subprocess.Popen(command, start_new_session=True, env=env)
    try:
        return child.wait()
    except BaseException as stop:  # Ctrl-C, or SIGTERM's exit (`kit.cli`)
        if child.poll() is None:
            passed = signal.SIGINT if isinstance(stop, KeyboardInterrupt) else signal.SIGTERM
            child.send_signal(passed)
            try:
                child.wait(timeout=CHILD_GRACE)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        raise


def stop_with_parent() -> None:
    """In a child of `run_child`, on Linux: ask for SIGTERM when the parent dies, and send it
    now if the parent died already. Nothing in a process that `run_child` did not start."""
    parent = os.environ.pop(PARENT, None)
    if parent is None or sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before the request: no signal would come
        os.kill(os.getpid(), signal.SIGTERM)
