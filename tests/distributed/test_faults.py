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


def test_a_fault_on_a_process_the_run_does_not_have_is_refused_until_one_fired(tmp_path):
    """A fault on rank 2 of a run of 2 processes would never fire: refused when the plan is
    made (this process alone: `jax.process_count()` is 1). Once a fault of the run fired, a
    run restarted on fewer processes (after `lose`) may leave the lost ones' faults unfired."""
    with pytest.raises(ValueError, match=r"'kill@step=3,rank=2' fires on process 2, but the run "
                       r"has 2 processes \(rank 0 to 1\): it would never fire"):  # fmt: skip
        distributed.FaultPlan("kill@step=3,rank=2", None, rank=0, processes=2)
    with pytest.raises(ValueError, match=r"has 1 process \(rank 0 to 0\)"):
        distributed.FaultPlan("raise@step=1; lose@step=6,rank=1")
    assert distributed.FaultPlan("raise@step=1,rank=1", None, rank=1, processes=2).faults
    assert distributed.FaultPlan("raise@step=1,rank=5", None, rank=0).faults  # unchecked
    log = tmp_path / "faults.jsonl"
    with pytest.raises(RuntimeError, match="raise@step=1"):
        distributed.FaultPlan("raise@step=1; lose@step=6,rank=1", log, rank=0, processes=2).inject(
            "step", 1
        )
    restarted = distributed.FaultPlan("raise@step=1; lose@step=6,rank=1", log, rank=0, processes=1)
    restarted.inject("step", 6)  # rank 1's fault: not this process's, and nothing fires
