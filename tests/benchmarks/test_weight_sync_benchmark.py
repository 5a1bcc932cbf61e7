"""`benchmarks/weight_sync.py` end to end at its smallest settings, as a user runs it: the
synced weights are checked on the rollout mesh, then timed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers import user_env

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "weight_sync.py"


@pytest.mark.slow
def test_smallest_settings_end_to_end(tmp_path):
    written = tmp_path / "result.json"
    command = [sys.executable, str(SCRIPT), "--model-size", "student", "--repeats", "2"]
    proc = subprocess.run(
        [*command, "--json-out", str(written)],
        capture_output=True, text=True, timeout=300, env=user_env(), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads(written.read_text())
    # Every leaf arrived with its source's values on its rollout sharding, in both dtypes.
    assert result["exact"] == {"float32": True, "bfloat16": True} and result["correct"] is True
    assert (result["model_size"], result["repeats"]) == ("student", 2)
    assert result["parameters"] > 100_000
    assert result["float32_bytes"] == 4 * result["parameters"]
    assert result["bfloat16_bytes"] == 2 * result["parameters"]
    assert result["float32_ms"] > 0 and result["bfloat16_ms"] > 0
    assert "rollout dtype" in proc.stdout


def test_bad_repeats_end_in_one_line():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", "0"],
        capture_output=True, text=True, timeout=60, env=user_env(), check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--repeats must be >= 1, got 0")
