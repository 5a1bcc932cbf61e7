"""`benchmarks/weight_sync.py` end to end at its smallest settings, as a user runs it: the
synced weights are checked on the rollout mesh, then timed."""

import pytest

from tests.benchmarks._run import refusal, run_benchmark


@pytest.mark.slow
def test_smallest_settings_end_to_end(tmp_path):
    flags = ["--model-size", "student", "--repeats", "2"]
    result, output = run_benchmark("weight_sync.py", *flags, out=tmp_path)
    # Every leaf arrived with its source's values on its rollout sharding, in both dtypes.
    assert result["exact"] == {"float32": True, "bfloat16": True} and result["correct"] is True
    assert (result["model_size"], result["repeats"]) == ("student", 2)
    assert result["parameters"] > 100_000
    assert result["float32_bytes"] == 4 * result["parameters"]
    assert result["bfloat16_bytes"] == 2 * result["parameters"]
    assert result["float32_ms"] > 0 and result["bfloat16_ms"] > 0
    assert "rollout dtype" in output


def test_bad_repeats_end_in_one_line():
    assert refusal("weight_sync.py", "--repeats", "0").endswith("--repeats must be >= 1, got 0")
