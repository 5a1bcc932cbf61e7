"""A TPU host's rule, for the tests on CPU: one process at a time may open JAX's backend.

On a TPU host the first process that starts JAX's TPU backend takes libtpu's lockfile and
holds it until it exits; another process that starts its backend meanwhile fails with
"Unable to initialize backend 'tpu': ... libtpu multi-process lockfile". A process started
with this folder first on `PYTHONPATH` and `TUNELIB_TEST_ONE_HOLDER` naming a lock file does
the same with its CPU backend: the backend's start takes the file's lock, without waiting,
and holds it until the process exits (`tests/recipes/test_one_holder.py`).

Python imports `sitecustomize` at start-up, before the program; JAX is imported here only
when the variable is set.
"""

import fcntl
import os

_held: list[int] = []


def _take_the_lock(backend) -> None:
    path = os.environ["TUNELIB_TEST_ONE_HOLDER"]
    descriptor = os.open(path, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise RuntimeError(
            f"another process holds the devices ({path} is locked): the emulated libtpu "
            "multi-process lockfile"
        ) from None
    _held.append(descriptor)  # held until this process exits; its children do not inherit it


if os.environ.get("TUNELIB_TEST_ONE_HOLDER"):
    from jax._src import xla_bridge  # JAX's only hook into a backend's start

    xla_bridge.register_backend_initialization_hook(_take_the_lock)
