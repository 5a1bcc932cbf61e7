"""The RL recipes' watch over their evaluations: the collapse guard's warning lines, the best
model kept, and the learner's check that the sampler ran the policy it was handed."""

import json
import types

import jax.numpy as jnp
import numpy as np
import pytest

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)
from tunelib import rollout

from kit.errors import UserError
from kit.grpo import Learner
from kit.rollout_batch import RolloutBatch
from kit.watch import CollapseGuard, KeepBest


def evaluation(pass_1, pass_k, entropy=1.0):
    return {"pass_at_1": pass_1, "pass_at_k": pass_k, "sample_entropy": entropy}


def test_the_guard_warns_once_when_entropy_falls_below_the_floor():
    guard = CollapseGuard(entropy_floor=0.05, patience=2)
    assert guard.observe(0, evaluation(0.1, 0.5, entropy=0.9)) == []
    (line,) = guard.observe(10, evaluation(0.2, 0.5, entropy=0.01))
    assert line.startswith("step 10: entropy collapse?") and "below --collapse-entropy 0.05" in line
    assert guard.observe(20, evaluation(0.2, 0.5, entropy=0.02)) == []  # still holding: quiet
    assert guard.observe(30, evaluation(0.2, 0.5, entropy=0.5)) == []
    assert len(guard.observe(40, evaluation(0.2, 0.5, entropy=0.0))) == 1  # starts again


def test_the_guard_warns_when_pass_at_k_falls_while_pass_at_1_rises():
    guard = CollapseGuard(entropy_floor=0.0, patience=2)
    assert guard.observe(0, evaluation(0.30, 0.80)) == []
    assert guard.observe(10, evaluation(0.40, 0.70)) == []  # fell once: not yet
    (line,) = guard.observe(20, evaluation(0.50, 0.60))
    assert line == (
        "step 20: entropy collapse? pass@k fell at each of the last 2 evaluations "
        "(0.8 > 0.7 > 0.6) while pass@1 rose (0.3 to 0.5)"
    )
    both_fall = CollapseGuard(entropy_floor=0.0, patience=2)
    for step, (p1, pk) in enumerate([(0.5, 0.8), (0.4, 0.7), (0.3, 0.6)]):
        assert both_fall.observe(step, evaluation(p1, pk)) == []  # the policy got worse


def test_the_guard_reads_a_resumed_runs_evaluations():
    history = [{"step": 0, **evaluation(0.3, 0.8)}, {"step": 5, "loss": 1.0},
               {"step": 10, **evaluation(0.4, 0.7)}]  # fmt: skip
    guard = CollapseGuard(entropy_floor=0.0, patience=2, history=history)
    assert len(guard.observe(20, evaluation(0.5, 0.6))) == 1


def test_keep_best_saves_only_improvements_and_resumes_from_its_record(tmp_path):
    saved = []

    def save(folder, trainable):
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "weights.txt").write_text(str(trainable))
        saved.append(trainable)

    keep = KeepBest("pass_at_k", tmp_path, save, placed=None)
    assert keep.headline() == {}
    keep.observe(0, {"pass_at_k": 0.5}, "w0")
    keep.observe(10, {"pass_at_k": 0.4}, "w10")
    keep.observe(20, {"pass_at_k": float("nan")}, "w20")
    keep.observe(30, {"pass_at_k": 0.75}, "w30")
    assert saved == ["w0", "w30"]
    assert (tmp_path / "best" / "model" / "weights.txt").read_text() == "w30"
    assert not (tmp_path / "best.partial").exists()
    assert keep.headline() == {"best": {"metric": "pass_at_k", "value": 0.75, "step": 30}}
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] == 30
    resumed = KeepBest("pass_at_k", tmp_path, save, placed=None)
    resumed.observe(40, {"pass_at_k": 0.7}, "w40")
    assert saved == ["w0", "w30"] and resumed.headline()["best"]["step"] == 30
    with pytest.raises(UserError, match="does not log it"):
        resumed.observe(50, {"accuracy": 1.0}, "w50")


def _learner(max_staleness: int = 0) -> Learner:
    config = types.SimpleNamespace(mode="grpo", group_size=2, target_entropy=None)
    return Learner(None, None, None, None, None, config, max_length=4, max_staleness=max_staleness)


def _stamped(version: int, fingerprint: int) -> RolloutBatch:
    """A batch of one prompt's two completions, stamped as sampled by `version`."""
    return RolloutBatch(
        prompt_tokens=np.zeros((1, 3), np.int32), prompt_where=np.zeros((1, 3), bool),
        tokens=np.zeros((2, 4), np.int32), where=np.zeros((2, 4), bool),
        logps=np.zeros((2, 4), np.float32), scores=np.zeros(2, np.float32),
        right=np.zeros(2, bool), lengths=np.zeros(2, np.int32), version=np.int32(version),
        fingerprint=np.uint32(fingerprint),
    )  # fmt: skip


def test_the_learner_refuses_a_batch_the_sampler_made_with_other_weights():
    """The check runs before the batch is touched: a sampler still holding version 0's
    adapters after version 1 was handed out stops the run in one line."""
    learner = _learner()
    old, new = {"lora_a": jnp.zeros((2, 3))}, {"lora_a": jnp.ones((2, 3))}
    learner.hand_out(0, old)
    learner.hand_out(1, new)
    rows = _stamped(1, rollout.fingerprint(old))
    with pytest.raises(UserError) as caught:
        learner.learn({}, rows, None, version=1)
    assert str(caught.value).startswith(
        "step 2: rollout stamped policy version 1 was sampled with parameters the trainer "
        "never handed out"
    )


def test_the_learner_allows_its_staleness_and_no_more():
    learner = _learner(max_staleness=1)
    versions = [{"w": jnp.full(3, float(v))} for v in range(3)]
    for v, params in enumerate(versions):
        learner.hand_out(v, params)
    too_old = _stamped(0, rollout.fingerprint(versions[0]))
    with pytest.raises(UserError, match="2 updates behind the trainer's version 2"):
        learner.learn({}, too_old, None, version=2)
