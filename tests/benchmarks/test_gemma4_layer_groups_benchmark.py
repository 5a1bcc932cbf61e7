"""`benchmarks/gemma4_layer_groups.py` at its smallest depth: both layouts compile, give the
same log-probs, and report their times, sizes and ratios."""

import pytest

from tests.benchmarks._run import refusal, run_benchmark


@pytest.mark.slow
def test_small_depth_compiles_both_layouts(tmp_path):
    # A sliding and a full layer: two stacks of one layer each (`test_layer_groups` checks
    # the runs of deeper models).
    result, output = run_benchmark(
        "gemma4_layer_groups.py", "--layers", "2", "--repeats", "1", out=tmp_path,
        compilation_cache=False,
    )  # fmt: skip
    grouped, unrolled = result["layouts"]["grouped"], result["layouts"]["unrolled"]
    assert (grouped["layer_bodies"], unrolled["layer_bodies"]) == (2, 2)
    assert result["max_logp_difference"] < 1e-4
    assert all(row[k] > 0 for row in (grouped, unrolled) for k in ("compile_s", "hlo_chars"))
    assert result["unrolled_over_grouped"]["total_s"] == pytest.approx(
        unrolled["total_s"] / grouped["total_s"]
    )
    assert "| grouped | 2 |" in output


def test_bad_flags_are_refused_before_anything_loads():
    assert "--layers" in refusal("gemma4_layer_groups.py", "--layers", "1")
    assert "--repeats" in refusal("gemma4_layer_groups.py", "--repeats", "0")
