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


def test_an_interruption_is_split_by_cause_and_the_figures_follow(tmp_path, monkeypatch):
    """Made-up times: failure at 100, seen at 102 (a hang), the restore from 110 to 111, the
    first step after it ends at 116 with 1 s of productive work (a steady step: 1 s), and 3 s
    of steps lost. The run's capacity: 2 processes of 2 devices, 1 of them from 100 to 130."""
    from kit import recovery

    now = [116.0]
    monkeypatch.setattr(recovery.time, "time", lambda: now[0])
    supervision = {
        "attempt": 1, "started_at": 105.0, "first_started_at": 0.0, "devices_per_process": 2,
        "capacity": [[0.0, 2], [100.0, 1], [130.0, 2]],
        "failure": {"cause": "process 1 hung", "rank": 1, "failed_at": 100.0,
                    "detected_at": 102.0, "attempt_started_at": 0.0},
    }  # fmt: skip
    first = recovery.Attempt(tmp_path, None, resumed_from=0, devices=4, processes=2,
                             lost_seconds=0.0)  # fmt: skip
    assert first.first_step({"step": 1, "time_train": 1.0}, main=True) == {}
    attempt = recovery.Attempt(tmp_path, supervision, resumed_from=10, devices=2, processes=1,
                               lost_seconds=3.0, steady=1.0)  # fmt: skip
    attempt.restored(110.0, 111.0)
    keys = attempt.first_step({"step": 11, "time_train": 6.0}, main=True)
    assert keys == {"time_lost_work": 3.0, "time_detection": 2.0, "time_restart": 8.0,
                    "time_restore": 1.0, "time_recompile": 4.0}  # fmt: skip
    assert attempt.first_step({"step": 12}, main=True) == {}  # once per start
    lines = recovery.attempts(tmp_path)
    assert [line["attempt"] for line in lines] == [0, 1] and lines[1]["mttr"] == 15.0

    now[0] = 200.0
    records = [{"step": 0, "time_eval": 1.0}, {"step": 5, "time_train": 10.0},
               {"step": 15, "time_train": 20.0, "time_rollout": 10.0}]  # fmt: skip
    figures = recovery.figures(tmp_path, records, supervision, seconds=50.0)
    assert figures["interruptions"] == 1
    assert figures["mttr_seconds"] == {"mean": 15.0, "max": 15.0}
    assert figures["mtti_seconds"] == 185.0  # the 200 s less the 15 s recovery, over 1
    assert figures["badput_seconds"] == {
        "lost_work": 3.0, "detection": 2.0, "restart": 8.0, "restore": 1.0, "recompile": 4.0,
    }  # fmt: skip
    assert figures["goodput"] == pytest.approx(40.0 / 200.0)
    # Productive device-seconds: 10 s on 4 devices (step 5), 30 s on 2 (step 15); available:
    # 2 devices per process, 2 processes for 170 s and 1 for 30 s.
    assert figures["capacity_goodput"] == pytest.approx((40 + 60) / (2 * (2 * 170 + 30)), abs=1e-4)
