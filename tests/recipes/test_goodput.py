"""The time split of a step (`kit.goodput`) and the badput of restarts, on made-up times."""

import json

import pytest

from tests.recipes import _scripts  # noqa: F401  (puts the recipes' kit on the path)


def test_nested_phases_count_once_and_compile_is_taken_out(monkeypatch):
    from kit import goodput

    now = [100.0]  # a clock the test moves by hand
    monkeypatch.setattr(goodput.time, "perf_counter", lambda: now[0])
    clock = goodput.Clock()
    clock.reset()
    with clock.phase("train"):
        now[0] += 5.0
        with clock.phase("rollout"):
            now[0] += 5.0
            clock._on_event("/jax/core/compile/backend_compile_duration", 3.0)
        clock._on_event("/jax/core/compile/jaxpr_trace_duration", 1.0)
        clock._on_event("/jax/some/other/event", 50.0)  # not a compile: ignored
    now[0] += 2.0
    assert clock.split() == {
        **dict.fromkeys(goodput.PHASES, 0.0),
        "compile": 4.0,
        "rollout": 2.0,  # 5 s, 3 of them compiling
        "train": 4.0,  # 10 s, less the rollout's 5 and its own 1 s of compiling
        "idle": 2.0,
    }
    with pytest.raises(ValueError, match="unknown phase 'sleep'"), clock.phase("sleep"):
        pass


def test_totals_and_goodput():
    from kit import goodput

    records = [
        {"step": 0, "time_eval": 2.0, "time_compile": 1.0},
        {"step": 1, "time_train": 3.0, "time_rollout": 1.0, "time_data": 0.5, "time_idle": 0.5},
        {"step": 2, "time_train": 3.0, "time_checkpoint": 1.0},
    ]
    totals = goodput.totals(records)
    assert totals["train"] == 6.0 and totals["eval"] == 2.0 and totals["sync"] == 0.0
    assert totals["goodput"] == pytest.approx(7.0 / 12.0, abs=1e-4)


def test_badput_counts_restarts_and_the_lost_steps(tmp_path):
    from kit import loop

    class Run:
        path = tmp_path

    lost = [{"step": 7, "time_train": 2.0, "time_idle": 0.5}, {"step": 8, "time_train": 2.0}]
    loop._add_badput(Run, lost)
    loop._add_badput(Run, [])
    assert json.loads((tmp_path / "badput.json").read_text()) == {
        "restarts": 2,
        "lost_seconds": 4.5,
    }
