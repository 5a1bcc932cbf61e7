"""`benchmarks/sampler_anchors.py` at its smoke size, tunelib's side only: the anchors (Tunix,
transformers) live in an environment of their own that the tests do not build, so their
columns are left out with one line saying why; the path through the checkpoint, the
worker process, the greedy check, the rounds and the step-time floor is the full run's."""

import json

import pytest

from tests.benchmarks._run import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("sampler_anchors.py", "sampler_anchors_benchmark")


@pytest.mark.slow
def test_smoke_size_without_anchors_times_tunelib_alone(bench, tmp_path, capsys):
    out = tmp_path / "result.json"
    missing = tmp_path / "no-such-python"
    argv = ["--size", "smoke", "--rounds", "1", "--anchors-python", str(missing)]
    code = bench.main([*argv, "--json-out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0, "\n".join(lines[-10:])
    assert lines[0] == (
        f"anchors skipped: --anchors-python {missing} does not exist; tunelib measured alone."
    )
    result = json.loads(lines[-1])
    assert result == json.loads(out.read_text())
    assert result["anchors_skipped"] and result["meets_target"] is None
    assert result["logits_max_abs_diff"] == {} and result["tokens_agree"] is True
    cases = [(row["mode"], row["batch"]) for row in result["table"]]
    assert cases == [("greedy", 1), ("greedy", 2), ("top_p", 1), ("top_p", 2)]
    for row in result["table"]:
        assert set(row) >= {"tunelib", "step_ms", "floor_ms"} and "tunix" not in row
        (seconds,) = row["seconds"]["tunelib"]
        assert row["tunelib"] == pytest.approx(row["batch"] * 8 / seconds)
        assert row["floor_ms"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--new-tokens", "1"], "--new-tokens must be >= 2, got 1."),
        (["--rounds", "0"], "--rounds must be >= 1, got 0."),
        (["--prompt", "0"], "--prompt must be >= 1, got 0."),
    ],
)
def test_bad_flags_end_in_one_line(bench, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--size", "smoke", *argv])
    assert str(exit_info.value) == message
