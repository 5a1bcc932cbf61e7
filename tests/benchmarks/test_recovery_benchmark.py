"""`benchmarks/recovery.py` at its smallest settings, as a user runs it: an SFT run killed
after its first checkpoints, restarted with `--resume auto` with and without the
compilation cache it left, then the step-time cost of a checkpoint, synchronous against
asynchronous. It starts five JAX processes, without the session's compilation cache (the
benchmark times compilation), so it takes a minute or two on a loaded machine."""

import pytest

from tests.benchmarks._run import refusal, run_benchmark


@pytest.mark.slow
def test_smallest_settings_end_to_end(tmp_path):
    result, output = run_benchmark("recovery.py", "--size", "smoke", out=tmp_path, timeout=900)
    assert result["benchmark"] == "recovery" and result["size"] == "smoke"
    sft = result["sft"]
    assert sft["cache_entries"] > 0  # the killed run left its compiled programs beside it
    assert sft["resumed_from"] >= 2 and sft["resumed_from"] % 2 == 0  # a checkpoint step
    assert sft["recovery_cache_s"] > 0 and sft["recovery_no_cache_s"] > 0
    ratio = sft["recovery_cache_s"] / sft["recovery_no_cache_s"]
    assert sft["cache_over_no_cache"] == pytest.approx(ratio, abs=1e-3)
    assert sft["step_s"] > 0 and sft["checkpoint_every"] == 25
    assert "| sft |" in output and "checkpoint cost, async (s)" in output


def test_intervals_must_be_positive():
    assert refusal("recovery.py", "--cost-every", "0").endswith("--cost-every must be >= 1, got 0")
