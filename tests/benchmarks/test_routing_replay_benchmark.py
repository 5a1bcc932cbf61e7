"""`benchmarks/routing_replay.py` end to end at its smoke size, as a user runs it."""

import pytest

from tests.benchmarks._run import refusal, run_benchmark


@pytest.mark.slow
def test_smoke_size_end_to_end(tmp_path):
    result, output = run_benchmark("routing_replay.py", "--size", "smoke", "--seeds", "1",
                                   out=tmp_path)  # fmt: skip
    assert (result["experts"], result["top_k"], result["dtype"]) == (4, 2, "bfloat16")
    (run,) = result["runs"]
    assert run["tokens"] > run["completion_tokens"] > 0
    assert 0 <= run["flipped_token_fraction"] <= 1
    assert 0 <= run["affected_completion_fraction"] <= 1
    for name in ("plain", "replay"):
        record = run[name]
        assert 0 <= record["mismatch_kl_mean"] <= record["mismatch_kl_max"]
        assert record["max_abs_logp_diff"] >= 0
        assert result[f"{name}_max_abs_logp_diff"] == record["max_abs_logp_diff"]
    # Without flips the two recomputations route alike: replay changes nothing.
    if run["flipped_token_fraction"] == 0:
        assert run["replay"] == run["plain"]
    assert "| seed | tokens with a routing flip |" in output


def test_bad_flags_end_in_one_line():
    assert "--seeds must be >= 1" in refusal("routing_replay.py", "--seeds", "0")
