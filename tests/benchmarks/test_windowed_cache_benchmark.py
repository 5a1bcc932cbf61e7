"""`benchmarks/windowed_cache.py` at its smoke size: both caches' tokens agree, and the cache
bytes are those of the rings and the full layer's slots."""

import pytest

from tests.benchmarks._run import refusal, run_benchmark


@pytest.mark.slow
def test_smoke_size_compares_the_two_caches(tmp_path):
    result, output = run_benchmark(
        "windowed_cache.py", "--size", "smoke", "--repeats", "1", out=tmp_path
    )
    assert result["tokens_agree"] is True and result["max_logp_difference"] < 1e-4
    full, windowed = result["variants"]["full"], result["variants"]["windowed"]
    # 4 layers, 1 key/value head of width 16, float32, 8 + 56 = 64 slots: keys and values,
    # then the slot mask (64 bytes), the row's length and the index (4 bytes each).
    assert full["cache_bytes"] == 2 * 4 * 64 * 16 * 4 + 72
    # Three sliding layers in rings of the window (8 slots), the full layer in all 64.
    assert windowed["cache_bytes"] == 2 * (3 * 8 + 64) * 16 * 4 + 72
    assert result["full_over_windowed"]["cache_bytes"] == pytest.approx(
        full["cache_bytes"] / windowed["cache_bytes"]
    )
    assert all(row["ms_per_token"] > 0 and row["program_bytes"] > 0 for row in (full, windowed))
    assert "| windowed |" in output


def test_bad_flags_are_refused_before_anything_loads():
    assert "--repeats" in refusal("windowed_cache.py", "--repeats", "0")
    assert "--new-tokens" in refusal("windowed_cache.py", "--new-tokens", "0")
