"""`benchmarks/async_grpo.py` end to end at its smallest settings, as a user runs it: an SFT
start of the `student` size, then GRPO under `python -m tunelib.launch -n 2` (process 0
trains, process 1 samples) with staleness 0 and with staleness 1 and its importance
correction (`--runs`: the third run, staleness 1 without the correction, only drops the
recomputation); 3 steps each, the first left out of the medians.

It starts five JAX processes, so it takes a minute or more on a loaded machine. The
recipe runs share the session's compilation cache: the benchmark leaves compilation out of
its step times, so the cache changes how long the test takes, not what it reports."""

import pytest

from tests.benchmarks._run import refusal, run_benchmark

SMOKE = [
    "--model-size", "student", "--sft-steps", "2", "--steps", "3", "--warmup-steps", "1",
    "--batch-size", "4", "--group-size", "2", "--max-new-tokens", "4", "--runs", "staleness_1",
]  # fmt: skip
RUNS = ("staleness_0", "staleness_1")


@pytest.mark.slow
def test_smallest_settings_end_to_end(tmp_path):
    result, output = run_benchmark("async_grpo.py", *SMOKE, out=tmp_path, timeout=900)
    assert result["benchmark"] == "async_grpo"
    # Each run trained as its flags say: staleness 0 takes turns; staleness 1 trains on the
    # batch sampled before the last weight push, and recomputes its log-probs for the
    # importance correction.
    assert "staleness_1_no_is" not in result
    staleness = {name: result[name]["staleness"] for name in RUNS}
    assert staleness == {"staleness_0": 0, "staleness_1": 1}
    assert result["staleness_1"]["logprobs"] > 0 and result["staleness_0"]["logprobs"] == 0
    for name in RUNS:
        record = result[name]
        assert record["step"] > 0 and record["weight_push_mb_per_s"] > 0
        assert "compile" not in record and "eval" not in record and "checkpoint" not in record
    ratio = result["staleness_0"]["step"] / result["staleness_1"]["step"]
    assert result["speedup_staleness_1"] == pytest.approx(ratio)
    assert "staleness_1 / staleness_0 speed:" in output


def test_warmup_steps_must_leave_a_step_to_measure():
    line = refusal("async_grpo.py", "--steps", "3", "--warmup-steps", "3")
    assert line.endswith("--warmup-steps must lie in [0, --steps), got 3")


def test_runs_are_named():
    line = refusal("async_grpo.py", "--runs", "staleness_2")
    assert line.endswith("--runs: no run 'staleness_2'; choose from staleness_0, staleness_1, "
                         "staleness_1_no_is")  # fmt: skip
