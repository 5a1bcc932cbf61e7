"""`benchmarks/chaos.py` at its smallest settings, as a user runs it: SFT on 2 processes, once
uninterrupted and once supervised with a kill during a checkpoint write and a hang, which the
run recovers from by itself, to the same weights bit for bit.

It starts at least eight JAX processes and waits out a hang timeout, so it takes minutes on a
loaded machine; the recipe runs share the session's compilation cache."""

import pytest

from tests.benchmarks._run import run_benchmark


@pytest.mark.slow
def test_smallest_settings_end_to_end(tmp_path):
    result, output = run_benchmark(
        "chaos.py", "--size", "smoke", "--hang-timeout", "30", out=tmp_path, timeout=1200,
        compilation_cache=True,
    )  # fmt: skip
    assert result["benchmark"] == "chaos" and list(result) == [
        "benchmark", "size", "hang_timeout", "sft",
    ]  # fmt: skip
    sft = result["sft"]
    assert sft["fired"] == ["kill@checkpoint step 8 rank 1", "hang@step step 10 rank 0"]
    assert sft["causes"][0] == "process 1 was killed by SIGKILL"
    # The hung process's peer, waiting for it in a collective, stops beating at the same
    # step: either may be the one named.
    assert " hung: no heartbeat for " in sft["causes"][1] and sft["restarts"] >= 2
    assert sft["process_counts"] == [2] and sft["weights"]["bit_for_bit"]
    assert sft["interruptions"] == sft["restarts"]
    assert sft["mttr_seconds"]["max"] >= sft["mttr_seconds"]["mean"] > 0
    assert sft["badput_seconds"]["detection"] >= 30  # the hang's, at least
    assert 0 < sft["capacity_goodput"] <= 1 and 0 < sft["goodput"] <= 1
    assert "| sft | 2 |" in output
