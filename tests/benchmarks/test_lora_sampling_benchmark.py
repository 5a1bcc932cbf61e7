"""`benchmarks/lora_sampling.py` end to end at its smoke size, as a user runs it, and its flags."""

import pytest

from tests.benchmarks._run import refusal, run_benchmark


@pytest.mark.slow
def test_smoke_size_end_to_end(tmp_path):
    result, output = run_benchmark(
        "lora_sampling.py", "--size", "smoke", "--repeats", "2", out=tmp_path
    )
    assert result["benchmark"] == "lora_sampling" and result["size"] == "smoke"
    case = result["case"]
    assert (case["new_tokens"], case["batch"], case["rank"]) == (8, 2, 16)
    # The un-merged sampler's greedy tokens are the merged one's, on both bases.
    assert result["tokens_equal"] is True
    runs = {(r["base"], r["way"]): r for r in result["runs"]}
    assert set(runs) == {(b, w) for b in ("float", "gguf") for w in ("merged", "unmerged")}
    for r in runs.values():
        assert len(r["runs_s"]) == 2 and r["median_s"] == pytest.approx(sum(r["runs_s"]) / 2)
        assert r["ms_per_token"] == pytest.approx(1e3 * r["median_s"] / (8 * 2))
        assert r["peak_bytes"] == r["argument_bytes"] + r["temp_bytes"] > 0
        assert r["first_call_s"] > r["median_s"]
    for base, b in result["bases"].items():
        merged, unmerged = runs[(base, "merged")], runs[(base, "unmerged")]
        assert b["tokens_equal"] is True and b["first_difference"] is None
        assert b["time_unmerged_over_merged"] == pytest.approx(
            unmerged["median_s"] / merged["median_s"]
        )
        assert b["memory_unmerged_over_merged"] == pytest.approx(
            unmerged["peak_bytes"] / merged["peak_bytes"]
        )
        # The same weights and adapters go in; merging adds a dense copy of the adapted
        # weights to the temporaries.
        assert unmerged["argument_bytes"] == merged["argument_bytes"]
        assert unmerged["temp_bytes"] < merged["temp_bytes"]
    # The GGUF base stores its blocks: fewer argument bytes than float32.
    assert runs[("gguf", "merged")]["argument_bytes"] < runs[("float", "merged")]["argument_bytes"]
    assert "tokens equal True" in output


def test_bad_flags_are_refused_before_jax():
    assert "--rank must be >= 1" in refusal("lora_sampling.py", "--rank", "0")
    assert "--new-tokens must be >= 1" in refusal("lora_sampling.py", "--new-tokens", "-2")
