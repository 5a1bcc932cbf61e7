"""`benchmarks/moe.py` end to end at its smoke size, as a user runs it."""

import pytest

from tests.benchmarks._run import run_benchmark


@pytest.mark.slow
def test_smoke_size_end_to_end(tmp_path):
    flags = ["--size", "smoke", "--rounds", "1", "--repeats", "2"]
    result, _ = run_benchmark("moe.py", *flags, out=tmp_path)
    assert (result["tokens"], result["experts"], result["top_k"]) == (64, 4, 2)
    assert result["correct"] is True
    assert 0 < max(result["errors_vs_naive"].values()) < 1e-5
    variants = result["variants"]
    assert set(variants) == {"grouped", "blocked", "ragged_dot", "naive", "dense"}
    # The sparse variants compute the naive one's function: the same loss.
    for sparse in ("grouped", "blocked", "ragged_dot"):
        assert variants[sparse]["loss"] == pytest.approx(variants["naive"]["loss"], rel=1e-5)
    for record in variants.values():
        assert len(record["runs_ms"]) == 2 and record["median_ms"] > 0
        assert record["temp_bytes"] > 0 and record["peak_rss_bytes"] > 0
    grouped, naive, dense = (variants[k]["median_ms"] for k in ("grouped", "naive", "dense"))
    assert result["time_ratio_vs_naive"] == pytest.approx(naive / grouped)
    assert result["time_ratio_vs_dense"] == pytest.approx(grouped / dense)
    blocked, ragged = variants["blocked"]["median_ms"], variants["ragged_dot"]["median_ms"]
    assert result["blocked_time_vs_ragged_dot"] == pytest.approx(blocked / ragged)
