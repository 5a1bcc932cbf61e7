"""`benchmarks/async_grpo.py` end to end at its smallest settings, as a user runs it: an SFT
start of the `student` size, then GRPO under `python -m tunelib.launch -n 2` (process 0
trains, process 1 samples) with staleness 0, with staleness 1 and its importance correction,
and with staleness 1 without it; 3 steps each, the first left out of the medians.

It starts seven JAX processes, so it takes minutes on a loaded machine, not seconds. The
recipe runs share the session's compilation cache: the benchmark leaves compilation out of
its step times, so the cache changes how long the test takes, not what it reports."""

import pytest

from tests.benchmarks._run import refusal, run_benchmark

SMOKE = [
    "--model-size", "student", "--sft-steps", "2", "--steps", "3", "--warmup-steps", "1",
    "--batch-size", "4", "--group-size", "2", "--max-new-tokens", "4",
]  # fmt: skip
RUNS = ("staleness_0", "staleness_1", "staleness_1_no_is")


@pytest.mark.slow
def test_smallest_settings_end_to_end(tmp_path):
    result, output = run_benchmark(
        "async_grpo.py", *SMOKE, out=tmp_path, timeout=900, compilation_cache=True
    )
    assert result["benchmark"] == "async_grpo"
    # Each run trained as its flags say: staleness 0 takes turns; staleness 1 trains on the
    # batch sampled before the last weight push, and recomputes its log-probs only with the
    # importance correction.
    staleness = {name: result[name]["staleness"] for name in RUNS}
    assert staleness == {"staleness_0": 0, "staleness_1": 1, "staleness_1_no_is": 1}
    assert result["staleness_1"]["logprobs"] > 0
    assert result["staleness_0"]["logprobs"] == result["staleness_1_no_is"]["logprobs"] == 0
    for name in RUNS:
        record = result[name]
        assert record["step"] > 0 and record["weight_push_mb_per_s"] > 0
        assert "compile" not in record and "eval" not in record and "checkpoint" not in record
    for name in ("staleness_1", "staleness_1_no_is"):
        ratio = result["staleness_0"]["step"] / result[name]["step"]
        assert result[f"speedup_{name}"] == pytest.approx(ratio)
    assert "staleness_1 / staleness_0 speed:" in output


def test_warmup_steps_must_leave_a_step_to_measure():
    line = refusal("async_grpo.py", "--steps", "3", "--warmup-steps", "3")
    assert line.endswith("--warmup-steps must lie in [0, --steps), got 3")
