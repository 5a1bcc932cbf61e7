"""`benchmarks/scan_unroll.py` end to end at its smallest size: the train step and the sampler
at two unrolls of the same weights."""

import pytest

from tests.benchmarks._run import refusal, run_benchmark


@pytest.mark.slow
def test_smoke_size_times_each_unroll_on_the_same_weights(tmp_path):
    result, output = run_benchmark(
        "scan_unroll.py", "--size", "smoke", "--repeats", "2", "--no-warmup", out=tmp_path,
        compilation_cache=False,  # its figures are compile times
    )  # fmt: skip
    first, second = result["results"]
    assert (first["unroll"], second["unroll"]) == (1, 2) and not result["warmup"]
    # The same weights and values at every unroll: the loss up to float32's summation order.
    assert second["loss"] == pytest.approx(first["loss"], rel=1e-6)
    for row in result["results"]:
        assert len(row["train_runs_ms"]) == len(row["sampler_runs_ms"]) == 2
        assert row["train_compile_s"] > 0 and row["train_ms"] > 0 and row["sampler_ms"] > 0
        assert row["sampled_tokens_per_s"] == pytest.approx(2 * 4 / (row["sampler_ms"] / 1e3))
    assert first["train_ms_ratio"] == 1.0
    assert second["train_ms_ratio"] == pytest.approx(second["train_ms"] / first["train_ms"])
    assert output.splitlines()[-3].split()[0] == "1"  # the table's row of unroll 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--size", "smoke", "--unrolls", "1,3"], "--unrolls must lie in 1..2"),
        (["--size", "smoke", "--unrolls", "one"], "--unrolls: not whole numbers"),
        (["--size", "smoke", "--repeats", "0"], "--new-tokens and --repeats must be >= 1"),
    ],
)
def test_bad_flags_are_one_line(argv, message):
    assert message in refusal("scan_unroll.py", *argv)
