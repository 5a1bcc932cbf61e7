"""`benchmarks/shared_prompts.py` end to end at its smoke size, as a user runs it."""

import pytest

from tests.benchmarks._run import refusal, run_benchmark


@pytest.mark.slow
def test_smoke_size_end_to_end(tmp_path):
    result, output = run_benchmark(
        "shared_prompts.py", "--size", "smoke", "--repeats", "2", "--scan-unroll", "2",
        out=tmp_path,
        compilation_cache=False,
    )  # fmt: skip
    assert (result["size"], result["repeats"], result["groups"]) == ("smoke", 2, [4])
    assert result["scan_unroll"] == 2
    (record,) = result["layouts"]["stacked"].values()
    assert record["rows"] == 4
    # One function in two summation orders: float32 rounding of a 32-wide model apart.
    assert record["max_abs_logp_diff"] < 1e-5 and record["grad_rel_diff"] < 1e-4
    for variant in ("shared", "concat"):
        assert len(record[f"{variant}_runs_s"]) == 2
        assert record[f"{variant}_median_s"] > 0 and record[f"{variant}_compile_s"] > 0
        assert record[f"{variant}_total_bytes"] > 0
    assert record["speedup"] == record["concat_median_s"] / record["shared_median_s"]
    assert "speedup" in output.splitlines()[0]


def test_bad_flags_end_in_one_line():
    assert "--repeats must be >= 1" in refusal("shared_prompts.py", "--repeats", "0")
    assert "--scan-unroll must be >= 1" in refusal("shared_prompts.py", "--scan-unroll", "0")
