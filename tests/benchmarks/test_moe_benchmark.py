"""`benchmarks/moe.py` end to end at its smoke size, as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers import user_env

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe.py"


@pytest.mark.slow
def test_smoke_size_end_to_end(tmp_path):
    written = tmp_path / "result.json"
    command = [sys.executable, str(SCRIPT), "--size", "smoke", "--rounds", "1", "--repeats", "2"]
    proc = subprocess.run(
        [*command, "--json-out", str(written)],
        capture_output=True, text=True, timeout=300, env=user_env(), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads(written.read_text())
    assert (result["tokens"], result["experts"], result["top_k"]) == (64, 4, 2)
    assert result["correct"] is True
    assert 0 < max(result["errors_vs_naive"].values()) < 1e-5
    variants = result["variants"]
    assert set(variants) == {"grouped", "ragged_dot", "naive", "dense"}
    # The sparse variants compute the naive one's function: the same loss.
    assert variants["grouped"]["loss"] == pytest.approx(variants["naive"]["loss"], rel=1e-5)
    for record in variants.values():
        assert len(record["runs_ms"]) == 2 and record["median_ms"] > 0
        assert record["temp_bytes"] > 0 and record["peak_rss_bytes"] > 0
    grouped, naive, dense = (variants[k]["median_ms"] for k in ("grouped", "naive", "dense"))
    assert result["time_ratio_vs_naive"] == pytest.approx(naive / grouped)
    assert result["time_ratio_vs_dense"] == pytest.approx(grouped / dense)
