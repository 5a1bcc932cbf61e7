"""The RL recipes' held-out evaluation compared problem by problem with the run's first: the
counts turned right and wrong, kept across a resume, and the paired standard error."""

import json
import math
import types

import numpy as np
import pytest

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)

from kit import evaluate


def run_in(path, *, resume=False, records=()):
    return types.SimpleNamespace(path=path, resume=resume, records=lambda: list(records))


def rl_evaluation(monkeypatch, run, grades):
    """`for_rl`'s evaluate, each call grading the held-out problems as the next of `grades`."""
    queue = [np.array(g, bool) for g in grades]
    monkeypatch.setattr(evaluate, "graded", lambda *args: queue.pop(0))
    config = types.SimpleNamespace(eval_samples=0)
    task = types.SimpleNamespace(problems=[{}] * len(grades[0]))
    evaluate_fn = evaluate.for_rl(config, None, 0, lambda p: p, task, None, None, run)
    return lambda: evaluate_fn({})


def test_each_evaluation_counts_the_problems_turned_since_the_first(tmp_path, monkeypatch):
    start, later, last = [1, 1, 0, 0, 0], [1, 0, 1, 1, 0], [0, 0, 1, 1, 1]
    evaluate_once = rl_evaluation(monkeypatch, run_in(tmp_path), [start, later, last])
    assert evaluate_once() == {"accuracy": 0.4, "turned_right": 0.0, "turned_wrong": 0.0}
    assert json.loads((tmp_path / evaluate.START_GRADES).read_text()) == start
    assert evaluate_once() == {"accuracy": 0.6, "turned_right": 2.0, "turned_wrong": 1.0}
    assert evaluate_once() == {"accuracy": 0.6, "turned_right": 3.0, "turned_wrong": 2.0}


def test_a_resumed_run_counts_from_its_first_evaluation_or_logs_nan(tmp_path, monkeypatch):
    (tmp_path / evaluate.START_GRADES).write_text(json.dumps([0, 0, 1]))
    resumed = rl_evaluation(monkeypatch, run_in(tmp_path, resume=True), [[1, 1, 0]])
    assert resumed() == {"accuracy": 2 / 3, "turned_right": 2.0, "turned_wrong": 1.0}
    # A folder from before the grades were kept: the counts are unknown, never rewritten.
    (tmp_path / evaluate.START_GRADES).unlink()
    unknown = rl_evaluation(monkeypatch, run_in(tmp_path, resume=True), [[1, 1, 0]])()
    assert unknown["accuracy"] == 2 / 3
    assert math.isnan(unknown["turned_right"]) and math.isnan(unknown["turned_wrong"])
    assert not (tmp_path / evaluate.START_GRADES).exists()


@pytest.mark.parametrize(("right", "wrong"), [(101, 51), (54, 16), (0, 0), (500, 0)])
def test_the_paired_standard_error_is_mcnemars(tmp_path, right, wrong):
    """The standard error of the mean of the per-problem differences (+1, -1 or 0), with the
    population variance, computed in float64 from the differences themselves."""
    n = 500
    (tmp_path / evaluate.START_GRADES).write_text(json.dumps([0] * n))
    records = [
        {"step": 0, "turned_right": 0.0, "turned_wrong": 0.0},
        {"step": 5, "loss": 1.0},
        {"step": 10, "turned_right": float(right), "turned_wrong": float(wrong)},
    ]
    got = evaluate.paired_headline(run_in(tmp_path, records=records))
    differences = np.array([1.0] * right + [-1.0] * wrong + [0.0] * (n - right - wrong))
    expected = np.sqrt(differences.var() / n)
    assert (got["heldout_turned_right"], got["heldout_turned_wrong"]) == (right, wrong)
    assert got["heldout_paired_se"] == pytest.approx(expected, abs=5e-5)
    nan = {"step": 20, "turned_right": float("nan"), "turned_wrong": float("nan")}
    assert evaluate.paired_headline(run_in(tmp_path, records=[*records, nan])) == {}
    (tmp_path / evaluate.START_GRADES).unlink()  # removed by hand after the run
    assert evaluate.paired_headline(run_in(tmp_path, records=records)) == {}
