"""The environment protocol of multi-turn episodes, and stepping environments under a timeout."""

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable


class Turn(NamedTuple):
    """One turn of the model, as an environment's `step` receives it.

    Attributes:
      tokens: the token ids the model sampled in this turn, exactly as sampled, its stop token
        or closing tag included.
      text: `tokenizer.decode(tokens)` when `run_episodes` was given a tokenizer, else None.
      truncated: True when the turn was cut by a limit (the turn's `max_new_tokens`, the
        episode's token budget or the cache) rather than ended by a stop token or a turn-end
        sequence.
    """

    tokens: tuple[int, ...]
    text: str | None
    truncated: bool


class Step(NamedTuple):
    """What an environment answers to a turn.

    Attributes:
      observation: the tokens appended after the turn for the model to read (never trained
        on): token ids, or text that `run_episodes` encodes with its tokenizer. Ignored when
        `done`. It may be empty: the model then simply continues.
      reward: this turn's reward, a finite real number.
      done: whether the episode ends here.
    """

    observation: Sequence[int] | str
    reward: float
    done: bool


@runtime_checkable
class Environment(Protocol):
    """What `tunelib.rollout.run_episodes` needs from an environment: one object per row.

    `reset(prompt)` starts an episode; `prompt` holds the row's real prompt token ids (the
    environment may also have been made for that row, with its task's answer, say). Then
    `step(turn)` receives each `Turn` of the model and returns a `Step`: the observation to
    append, the turn's reward and whether the episode is over. Both run on the host, in a
    thread of their own, under `run_episodes`' `step_timeout`; an exception, a timeout or an
    invalid answer ends that row's episode with a zero reward and its `failed` flag set, and
    the environment is not called again in that episode. An environment is not shared
    between rows.
    """

    def reset(self, prompt: tuple[int, ...]) -> None: ...

    def step(self, turn: Turn) -> Step: ...


class Outcome(NamedTuple):
    """A call's return value, or why there is none (`error` is None when it returned)."""

    value: Any
    error: str | None


def call_all(calls: Sequence[Callable[[], Any] | None], timeout: float | None) -> list[Outcome]:
    """Run the calls concurrently, each in a daemon thread, waiting up to `timeout` seconds.

    Each call's outcome is its return value, or an error that says it raised (with the
    exception) or did not return in time. A None call is skipped (its outcome is
    `Outcome(None, None)`). The threads are daemons rather than a `concurrent.futures` pool,
    whose threads the interpreter joins at exit: a step that never returns is abandoned
    (its thread runs on in the background) and cannot keep the process from ending.
    """
    outcomes: list[Outcome] = [Outcome(None, None)] * len(calls)
    threads: list[tuple[int, threading.Thread]] = []

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            outcomes[i] = Outcome(call(), None)
        except Exception as error:  # any failure of one environment ends its row only
            outcomes[i] = Outcome(None, f"raised {type(error).__name__}: {error}")

    for i, call in enumerate(calls):
        if call is not None:
            thread = threading.Thread(target=run, args=(i, call), daemon=True)
            thread.start()
            threads.append((i, thread))
    deadline = None if timeout is None else time.monotonic() + timeout
    for i, thread in threads:
        thread.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        if thread.is_alive():
            outcomes[i] = Outcome(None, f"did not return within {timeout} s")
    return outcomes
