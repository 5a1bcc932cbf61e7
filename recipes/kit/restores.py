"""The noise of a failed Orbax restore, kept out of a run's output.

When a restore fails (a parameter file cut short or damaged), the reads of the checkpoint's
other arrays are abandoned, and Python printed a traceback for each, before and after the one
line that says why: "Event loop is closed" as TensorStore's callbacks found Orbax's event loop
gone (58 for a recipe model whose files were all cut short), and "Exception ignored in:
<coroutine object _read_array_index_and_device_put>" as their coroutines were closed, and
"Future exception was never retrieved" on asyncio's log for the reads that failed after the
first (Orbax reports the first only). This module imports
nothing heavy: `kit.cli` uses it before JAX is imported.
"""

import contextlib
import logging
import sys

# Orbax's coroutine reading one array of a checkpoint.
_READ = "_read_array_index_and_device_put"


@contextlib.contextmanager
def quiet_restore():
    """Around an Orbax restore (or a read of a checkpoint's metadata): the unraisable
    exceptions of the reads a failure abandons (the module's notes), and nothing else, are
    dropped during it and, after a failure, until the process exits (`kit.cli.main` leaves
    `after_restores`'s hook in place); after a restore that succeeded, the hook is the
    caller's again."""
    previous = sys.unraisablehook
    sys.unraisablehook = _without_abandoned_reads(previous)
    try:
        yield
    except BaseException:  # the hook stays: the abandoned reads go on finishing
        asyncio_log = logging.getLogger("asyncio")
        if _gathered_abandoned_read not in asyncio_log.filters:
            asyncio_log.addFilter(_gathered_abandoned_read)
        raise
    sys.unraisablehook = previous


def after_restores(hook):
    """`hook`, or, where a failed restore left its hook in place, `hook` without the
    unraisable exceptions of the reads it abandoned: they go on arriving until the process
    exits."""
    left = getattr(sys.unraisablehook, "drops_abandoned_reads", False)
    return _without_abandoned_reads(hook) if left else hook


def _without_abandoned_reads(hook):
    if getattr(hook, "drops_abandoned_reads", False):  # one wrapper, however many failures
        return hook

    def quiet(unraisable):
        if not _abandoned_read(unraisable):
            hook(unraisable)

    quiet.drops_abandoned_reads = True
    return quiet


def _abandoned_read(unraisable) -> bool:
    """An unraisable exception of a read a failed Orbax restore abandoned."""
    if getattr(unraisable.object, "__qualname__", None) == _READ:
        return True  # Orbax's coroutine reading one array, closed unfinished
    if (
        unraisable.exc_type is not RuntimeError
        or str(unraisable.exc_value) != "Event loop is closed"
    ):
        return False
    frame = unraisable.exc_traceback
    while frame is not None:  # a callback into Orbax's event loop, after it was closed
        if frame.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        frame = frame.tb_next
    return False


def _gathered_abandoned_read(record: logging.LogRecord) -> bool:
    """False (drop it) for asyncio's record of a future whose exception nobody retrieved:
    after a failed restore, the reads that failed after the first (Orbax's gatherings of
    them, or TensorStore's futures under them); True for every other record. A recipe
    process runs no asyncio code of its own."""
    return "exception was never retrieved" not in str(record.msg)
