"""`benchmarks/fused_head_tiles.py`, the sweep the fused head's defaults are chosen from, at its
smoke size on CPU (no Pallas kernel there: the naive path and the chunked tiles)."""

from tests.benchmarks._run import refusal, run_benchmark


def test_the_tilings_agree_with_the_naive_path_and_are_measured(tmp_path):
    result, output = run_benchmark(
        "fused_head_tiles.py", "--size", "smoke", "--chunks", "128,384", "--repeats", "2",
        out=tmp_path,
    )  # fmt: skip
    assert result["size"] == "smoke" and result["backend"] == "cpu"
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == ["naive", "chunked 128", "chunked 384"]  # no Pallas on a CPU
    assert rows["naive"]["errors"] == [0.0, 0.0, 0.0]
    for row in rows.values():
        assert row["passed"] and max(row["errors"]) < 1e-4 and row["median_ms"] > 0
        assert row["temp_bytes"] >= 0 and row["compile_s"] >= 0
    # A tile of 128 columns holds a quarter of the [N, 384] tile's logits.
    assert rows["chunked 128"]["temp_bytes"] < rows["chunked 384"]["temp_bytes"]
    assert "x naive" in output


def test_bad_sizes_are_one_line():
    assert "--chunks and --blocks take integers" in refusal("fused_head_tiles.py", "--chunks", "a")
