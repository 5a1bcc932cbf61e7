"""`benchmarks/chaos.py` at its smallest settings, as a user runs it: SFT on 2 processes, once
uninterrupted and once supervised with a kill during a checkpoint write, which the run
recovers from by itself, to the same weights bit for bit, with the interruption's figures.
(A hang detected and recovered is `tests/distributed/test_supervisor.py`'s.)

It starts six JAX processes, so it takes a minute or more on a loaded machine; the recipe
runs share the session's compilation cache."""

import pytest

from tests.benchmarks._run import run_benchmark


@pytest.mark.slow
def test_smallest_settings_end_to_end(tmp_path):
    result, output = run_benchmark(
        "chaos.py", "--size", "smoke", "--hang-timeout", "30", out=tmp_path, timeout=1200,
    )  # fmt: skip
    assert result["benchmark"] == "chaos" and list(result) == [
        "benchmark", "size", "hang_timeout", "compile_cache", "sft",
    ]  # fmt: skip
    sft = result["sft"]
    assert result["compile_cache"] == sft["compile_cache"] == "run"
    assert sft["fired"] == ["kill@checkpoint step 8 rank 1"]
    assert sft["causes"] == ["process 1 was killed by SIGKILL"] and sft["restarts"] == 1
    assert sft["process_counts"] == [2] and sft["weights"]["bit_for_bit"]
    assert sft["interruptions"] == sft["restarts"]
    assert sft["mttr_seconds"]["max"] == sft["mttr_seconds"]["mean"] > 0
    assert sft["badput_seconds"]["restart"] > 0 and sft["badput_seconds"]["restore"] > 0
    assert 0 < sft["capacity_goodput"] <= 1 and 0 < sft["goodput"] <= 1
    assert "| sft | 1 |" in output
