"""`tunelib.distributed.FaultPlan`: a `TUNELIB_FAULTS` spec parsed once, each fault firing
once per run across restarts (its record in the log), on its own rank only."""

import pytest

from tunelib import distributed


def test_the_spec_is_read_once_when_the_plan_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv(distributed.FAULTS, "raise@step=2")
    monkeypatch.delenv(distributed.FAULTS_LOG, raising=False)
    plan = distributed.FaultPlan.from_environment(default_log=tmp_path / "faults.jsonl")
    monkeypatch.setenv(distributed.FAULTS, "")  # the run's plan holds what it was given
    with pytest.raises(RuntimeError, match="injected fault 'raise@step=2' at step of step 2"):
        plan.inject("step", 2)
    assert distributed.FaultPlan.from_environment().faults == []


def test_a_fault_that_fired_is_logged_and_does_not_fire_again_after_a_restart(tmp_path):
    log, spec = tmp_path / "faults.jsonl", "raise@step=3; raise@random=1.0,seed=0"

    def restarted():  # a new process of the run: the spec, and the log of what fired
        return distributed.FaultPlan(spec, log, rank=0)

    with pytest.raises(RuntimeError, match="random"):
        restarted().inject("step", 1)
    restarted().inject("step", 1)  # the random fault fired at step 1: nothing
    with pytest.raises(RuntimeError, match="step=3"):
        restarted().inject("step", 3)
    with pytest.raises(RuntimeError, match="random"):  # the step fault fired; the random one
        restarted().inject("step", 3)  # had not at step 3
    restarted().inject("step", 3)
    fired = [(r["fault"], r["step"]) for r in distributed.fired_faults(log)]
    assert fired == [(spec.split("; ")[1], 1), (spec.split("; ")[0], 3), (spec.split("; ")[1], 3)]


def test_a_fault_fires_on_its_rank_only_and_checkpoint_faults_from_their_step(tmp_path):
    spec = "raise@checkpoint,step=4,rank=1"
    distributed.FaultPlan(spec, tmp_path / "a.jsonl", rank=0).inject("step", 4)
    with distributed.FaultPlan(spec, None, rank=0).during("checkpoint", 5):
        pass  # rank 0: nothing
    with distributed.FaultPlan(spec, None, rank=1).during("checkpoint", 3):
        pass  # before its step
    due = distributed.FaultPlan(spec, None, rank=1).during("checkpoint", 5)
    with pytest.raises(RuntimeError, match="at checkpoint of step 5"), due:
        pass
