"""`kit.restores`: what a failed Orbax restore leaves behind is kept out of the output, and
nothing else is."""

import asyncio
import logging
import sys
import types

import pytest

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)

from kit import restores


def _unraisable(error: BaseException, obj=None):
    return types.SimpleNamespace(
        exc_type=type(error), exc_value=error, exc_traceback=error.__traceback__,
        err_msg=None, object=obj,
    )  # fmt: skip


def _closed_loop_callback() -> RuntimeError:
    """The error TensorStore's callbacks meet once Orbax's event loop is closed."""
    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError, match="Event loop is closed") as caught:
        loop.call_soon_threadsafe(print)
    return caught.value


async def _read_array_index_and_device_put():  # named as Orbax's read of one array
    return None


@pytest.fixture
def printed(monkeypatch):
    """What reaches the hook in place before the restore, and the asyncio log's filters as
    they were."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    log = logging.getLogger("asyncio")
    monkeypatch.setattr(log, "filters", list(log.filters))
    return seen


def test_a_restore_that_succeeds_leaves_the_hook_as_it_was(printed):
    hook = sys.unraisablehook
    with restores.quiet_restore():
        pass
    assert sys.unraisablehook is hook
    assert restores.after_restores(hook) is hook


def test_after_a_failed_restore_only_its_abandoned_reads_are_dropped(printed):
    with pytest.raises(ValueError), restores.quiet_restore():
        raise ValueError("OUT_OF_RANGE: Error reading ...")
    closed = _unraisable(_closed_loop_callback())
    elsewhere = _unraisable(RuntimeError("Event loop is closed"))  # not a loop's callback
    other = _unraisable(KeyError("k"))

    read = _read_array_index_and_device_put()
    abandoned = _unraisable(Exception("Encountered error while reading"), read)
    for unraisable in (closed, elsewhere, other, abandoned):
        sys.unraisablehook(unraisable)
    read.close()
    assert printed == [elsewhere, other]

    # The run's own hook, put back by kit.cli, drops them too; asyncio's log drops the
    # futures whose exceptions nobody retrieved, and nothing else.
    kept = []
    restored = restores.after_restores(kept.append)
    restored(closed)
    restored(other)
    assert kept == [other]
    assert restores.after_restores(restored) is restored  # not wrapped twice
    log = logging.getLogger("asyncio")

    def record(message):
        return log.makeRecord("asyncio", logging.ERROR, "f", 1, message, (), None)

    assert not log.filter(record("Future exception was never retrieved"))
    assert log.filter(record("Task was destroyed but it is pending!"))
