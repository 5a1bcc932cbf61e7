"""Environments: the protocol, stepping under a timeout, and failures that end only their row."""

import dataclasses
import functools
import logging
import threading
import time

import jax
import numpy as np
import pytest

from tests.rollout.test_episodes import CONFIG, GROUP, Scripted, check_layout, environments
from tests.rollout.test_sampler import PROMPT_WHERE, PROMPTS, make_model
from tunelib.data import CharTokenizer
from tunelib.rollout import Environment, Role, Step, run_episodes
from tunelib.rollout._environments import call_all


def test_call_all_returns_values_errors_and_timeouts_without_waiting_for_hung_calls():
    release = threading.Event()
    calls = [
        lambda: 7,
        None,
        lambda: 1 / 0,
        lambda: release.wait(30) and "late",
        lambda: time.sleep(0.05) or "slow but in time",
    ]
    start = time.monotonic()
    outcomes = call_all(calls, timeout=0.5)
    elapsed = time.monotonic() - start
    release.set()  # the abandoned call's thread may end now
    assert 0.5 <= elapsed < 5
    assert outcomes[0] == (7, None) and outcomes[1] == (None, None)
    assert outcomes[2].value is None
    assert outcomes[2].error == "raised ZeroDivisionError: division by zero"
    assert outcomes[3] == (None, "did not return within 0.5 s")
    assert outcomes[4] == ("slow but in time", None)
    # The timeout is shared: calls run side by side, not one after another.
    start = time.monotonic()
    outcomes = call_all([lambda i=i: time.sleep(0.3) or i for i in range(8)], timeout=2.0)
    assert [o.value for o in outcomes] == list(range(8))
    assert time.monotonic() - start < 1.5
    assert call_all([lambda: 1], timeout=None) == [(1, None)]


class Raises(Scripted):
    def step(self, turn):
        if len(self.turns) == 1:
            raise RuntimeError("the sandbox crashed")
        return super().step(turn)


class Hangs(Scripted):
    def __init__(self, sizes, release):
        super().__init__(sizes)
        self.release = release

    def step(self, turn):
        if self.turns:
            self.release.wait(30)
        return super().step(turn)


class Answers(Scripted):
    """Answers its first turn with `step` as given (an invalid one, say)."""

    def __init__(self, sizes, answer):
        super().__init__(sizes)
        self.answer = answer

    def step(self, turn):
        step = super().step(turn)
        return self.answer if len(self.turns) == 1 else step


class FailsReset(Scripted):
    def reset(self, prompt):
        raise OSError("no container")


def test_failing_environments_end_only_their_own_row(caplog):
    graphdef, params = make_model(seed=11)
    release = threading.Event()
    good = environments()
    bad = environments()
    bad[1] = Raises(bad[1].sizes)
    bad[2] = Hangs(bad[2].sizes, release)
    bad[3] = Answers(bad[3].sizes, Step((1, 2), float("nan"), False))
    bad[4] = FailsReset(bad[4].sizes)
    config = dataclasses.replace(CONFIG, step_timeout=0.5)
    run = functools.partial(run_episodes, graphdef, params, PROMPTS, PROMPT_WHERE,
                                jax.random.key(3), config, group_size=GROUP)  # fmt: skip
    expected = run(good)
    with caplog.at_level(logging.WARNING, logger="tunelib.rollout._episodes"):
        out = run(bad)
    release.set()
    check_layout(out, config)
    failed = np.asarray(out.failed)
    np.testing.assert_array_equal(failed, [False, True, True, True, True, False])
    assert not np.asarray(out.truncated).any()
    # A failed row keeps the tokens it got before failing and loses every reward.
    assert (np.asarray(out.rewards)[failed] == 0).all()
    assert (np.asarray(out.turn_rewards)[failed] == 0).all()
    np.testing.assert_array_equal(out.num_turns, [3, 2, 2, 1, 0, 2])
    assert int(out.lengths[4]) == 0 and not np.asarray(out.where)[4].any()
    # The other rows: the very episodes of a batch without failures.
    for r in (0, 5):
        for name in ("tokens", "roles", "turn_ids", "turn_rewards", "num_turns"):
            np.testing.assert_array_equal(getattr(out, name)[r], getattr(expected, name)[r])
        np.testing.assert_allclose(out.logps[r], expected.logps[r], rtol=1e-5, atol=1e-5)
    # Each row says why, and the failed environments were not called again.
    messages = [record.getMessage() for record in caplog.records]
    assert any("row 1" in m and "RuntimeError: the sandbox crashed" in m for m in messages)
    assert any("row 2" in m and "did not return within 0.5 s" in m for m in messages)
    assert any("row 3" in m and "reward must be a finite real number" in m for m in messages)
    assert any("row 4" in m and "reset raised OSError: no container" in m for m in messages)
    assert len(bad[1].turns) == 1 and len(bad[3].turns) == 1


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("not a step", "expected a Step"),
        ((1, 2), "expected a Step"),
        (Step((1,), 1.0, 1), "done must be a bool"),
        (Step((1,), "1.0", False), "reward must be a finite real number"),
        (Step((1, 99), 1.0, False), "observation ids must lie in [0, 24)"),
        (Step((1.5,), 1.0, False), "1-D token ids"),
        (Step(((1, 2),), 1.0, False), "1-D token ids"),
        (Step("text", 1.0, False), "no tokenizer"),
    ],
)
def test_invalid_steps_fail_their_row(answer, reason, caplog):
    graphdef, params = make_model(seed=11)
    envs = environments()
    envs[0] = Answers(envs[0].sizes, answer)
    with caplog.at_level(logging.WARNING, logger="tunelib.rollout._episodes"):
        out = run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(3), CONFIG,
                           envs, group_size=GROUP)  # fmt: skip
    np.testing.assert_array_equal(out.failed, [True] + [False] * 5)
    assert any(reason in record.getMessage() for record in caplog.records)


def test_text_observations_are_encoded_and_turns_decoded():
    graphdef, params = make_model(seed=11)
    tok = CharTokenizer("abcdefghijklmnopqrstu")  # ids 3..23: the model's 24 ids

    class Talks:
        def reset(self, prompt):
            self.texts = []

        def step(self, turn):
            self.texts.append(turn.text)
            return Step("ok", 0.0, len(self.texts) == 2)

    envs = [Talks() for _ in range(len(PROMPTS))]
    assert isinstance(envs[0], Environment)
    out = run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0), CONFIG, envs,
                       tokenizer=tok)  # fmt: skip
    tokens, roles = np.asarray(out.tokens), np.asarray(out.roles)
    for r, env in enumerate(envs):
        end = int(out.turn_ends[r, 0])
        assert tokens[r, end : end + 2].tolist() == tok.encode("ok")
        assert (roles[r, end : end + 2] == Role.OBSERVATION).all()
        first = tokens[r, :end].tolist()
        assert env.texts[0] == tok.decode(first)
