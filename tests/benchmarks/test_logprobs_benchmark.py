"""`benchmarks/logprobs.py` end to end at its smoke size, as a user runs it, and its gate."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers import load_script, user_env
from tests.benchmarks._run import run_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "logprobs.py"


@pytest.mark.slow
def test_smoke_size_end_to_end(tmp_path):
    # The library's default tile (about 2^22 logits) covers all of this small problem's
    # vocabulary, so a smaller tile is asked for to see the chunking at work.
    flags = ["--size", "smoke", "--repeats", "2", "--chunk-size", "1024"]
    result, output = run_benchmark("logprobs.py", *flags, out=tmp_path)
    lines = output.strip().splitlines()
    assert (result["size"], result["n"], result["h"], result["v"]) == ("smoke", 128, 64, 10_000)
    assert result["correct"] is True
    assert result["check_rows"] == 128  # the float64 reference covers every row here
    assert result["chunk_size"] == 1024

    naive, chunked = result["variants"]["naive"], result["variants"]["chunked"]
    for record in (naive, chunked):
        assert record["passed"] is True and record["reason"] is None
        assert set(record["errors"]) == {"loss", "d_hidden", "d_unembedding"}
        assert 0 < record["max_error"] == max(record["errors"].values()) < 1e-5
        assert record["peak_rss_bytes"] > 0 and record["median_ms"] > 0
        assert len(record["runs_ms"]) == 2
        # [128, 64] and [64, 10000] float32 inputs, the same shapes back as gradients.
        assert record["argument_bytes"] >= 4 * (128 * 64 + 64 * 10_000)
        assert record["output_bytes"] >= 4 * (128 * 64 + 64 * 10_000)
    # The naive path holds the [N, V] float32 logits; the chunked one only [N, chunk] tiles.
    assert naive["temp_bytes"] >= 4 * 128 * 10_000 > chunked["temp_bytes"]
    assert result["memory_ratio"] == pytest.approx(naive["temp_bytes"] / chunked["temp_bytes"])
    assert result["time_ratio"] == pytest.approx(chunked["median_ms"] / naive["median_ms"])

    # On CPU the Pallas kernel is skipped with a note, and there are no GPU-only figures.
    assert set(result["variants"]) == {"naive", "chunked"}
    assert any(n.startswith("pallas skipped") for n in result["notes"])
    assert "gemm" not in result and "tflops" not in chunked and "cpu_targets" not in result
    header = next(line for line in lines if line.lstrip().startswith("variant"))
    for column in ("temp MB", "peak RSS MB", "median ms", "max error"):
        assert column in header


def test_gate_compares_each_error_with_the_naive_paths_own():
    bench = load_script(SCRIPT, "logprobs_benchmark")
    naive = {"errors": {"loss": 1e-7, "d_hidden": 4e-7, "d_unembedding": 2e-7}}
    close = {"errors": {"loss": 1e-7, "d_hidden": 9e-6, "d_unembedding": 3e-7}}
    wrong = {"errors": {"loss": 1e-7, "d_hidden": 1e-7, "d_unembedding": 0.5}}
    verdicts = bench.judge({"naive": naive, "chunked": close, "pallas": wrong}, "float32")
    assert verdicts["naive"] is None and verdicts["chunked"] is None
    assert verdicts["pallas"].startswith("d_unembedding error 5.00e-01")

    # A bf16 variant gets one bf16 rounding more than the naive path, not two.
    assert bench.judge({"naive": naive, "chunked": close}, "bfloat16")["chunked"] is None
    loose = {"errors": {"loss": 1e-7, "d_hidden": 9e-3, "d_unembedding": 3e-7}}
    assert "d_hidden" in bench.judge({"naive": naive, "chunked": loose}, "bfloat16")["chunked"]

    # The naive path itself must stay near the float64 reference; nothing passes without it.
    bad = {"errors": {"loss": 1e-7, "d_hidden": 1e-3, "d_unembedding": 2e-7}}
    assert "d_hidden" in bench.judge({"naive": bad, "chunked": close}, "float32")["naive"]
    crashed = bench.judge({"naive": {"failed": "OOM"}, "chunked": close}, "float32")
    assert crashed["naive"] and crashed["chunked"]


def test_relative_error_is_normwise_and_streams_rows():
    np = pytest.importorskip("numpy")
    bench = load_script(SCRIPT, "logprobs_benchmark")
    ref = np.arange(12.0).reshape(3, 4) - 5.0  # max |ref| = 6
    x = ref.astype(np.float32).copy()
    x[2, 3] += 0.3
    assert bench.relative_error(x, ref) == pytest.approx(0.05)
    assert bench.relative_error(np.float32(2.5), np.float64(2.0)) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="shape"):
        bench.relative_error(x[:2], ref)


def test_memory_only_compiles_abstract_inputs_without_running(tmp_path):
    written = tmp_path / "memory.json"
    command = [sys.executable, str(SCRIPT), "--memory-only", "--size", "smoke"]
    command += ["--chunk-size", "1024", "--json-out", str(written)]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=user_env(), check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(written.read_text())["memory_only"]}
    assert set(rows) == {"naive", "chunked"}
    # [128, 64] and [64, 10000] float32 gradients; the naive path holds [N, V] logits.
    assert rows["chunked"]["gradient_bytes"] == 4 * (128 * 64 + 64 * 10_000)
    assert rows["naive"]["temp_bytes"] >= 4 * 128 * 10_000 > rows["chunked"]["temp_bytes"]
    for row in rows.values():
        assert row["temp_over_gradients"] == row["temp_bytes"] / row["gradient_bytes"]
        assert row["output_bytes"] >= row["gradient_bytes"]
