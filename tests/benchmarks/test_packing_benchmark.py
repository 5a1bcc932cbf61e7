"""The packing benchmark at its smoke size: packed and padded batches agree before timing,
and the packed rows carry more real tokens."""

import json
from pathlib import Path

import pytest

from tests._helpers import load_script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_smoke_size_checks_then_measures(tmp_path, capsys):
    bench = load_script(BENCHMARKS / "packing.py", "packing_benchmark")
    out = tmp_path / "r.json"
    result = bench.main(
        ["--size", "smoke", "--steps", "2", "--repeats", "1", "--json-out", str(out)]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert lines[0].startswith("packed equals padded: ")
    assert result["correctness"]["nll_relative_error"] < 1e-5
    assert result["correctness"]["grad_relative_error"] < 1e-4
    padded, packed = result["variants"]["padded"], result["variants"]["packed"]
    assert packed["fill"] > 2 * padded["fill"]  # the skewed lengths leave padded rows mostly empty
    speedup = packed["loss_tokens_per_s"] / padded["loss_tokens_per_s"]
    assert result["speedup"] == pytest.approx(speedup, abs=1e-3) and speedup > 0
