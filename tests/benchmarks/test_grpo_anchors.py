"""`benchmarks/grpo_anchors.py` at its smoke size, tunelib's side only: the anchors (TRL,
Tunix) live in an environment of their own that the tests do not build, so their columns
are left out with one line saying why; the path through the checkpoint, the worker process,
the recipe's sampler and learner, the warm-up and the timed steps is the full run's."""

import json

import pytest

from tests.benchmarks._run import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("grpo_anchors.py", "grpo_anchors_benchmark")


@pytest.mark.slow
def test_smoke_size_without_anchors_times_tunelib_alone(bench, tmp_path, capsys):
    out = tmp_path / "result.json"
    missing = tmp_path / "no-such-python"
    argv = ["--size", "smoke", "--warmup", "1", "--rounds", "2"]
    code = bench.main([*argv, "--anchors-python", str(missing), "--json-out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0, "\n".join(lines[-10:])
    assert lines[0] == (
        f"anchors skipped: --anchors-python {missing} does not exist; tunelib measured alone."
    )
    result = json.loads(lines[-1])
    assert result == json.loads(out.read_text())
    assert result["anchors_skipped"] and result["meets_target"] is None
    assert result["logps_max_abs_diff"] == {} and result["ratios"] == {}
    assert list(result["libraries"]) == ["tunelib"] and result["tokens_per_step"] == 2 * 8 * 8
    (steps,) = result["steps"].values()
    assert len(steps) == 2
    for step in steps:
        assert step["logprobs"] == 0.0  # the reference's forward runs inside the update
        assert step["rollout"] > 0 and step["update"] > 0
        assert step["total"] == pytest.approx(step["rollout"] + step["update"])
        assert 0.0 <= step["reward"] <= 1.0
    row = result["libraries"]["tunelib"]
    assert row["tokens_per_s"] == pytest.approx(128 / row["total"])


def test_the_reward_is_the_fraction_of_even_ids(bench):
    assert bench.score("2 3 4 7") == 0.5
    assert bench.score("1 3", {"prompt": "5"}) == 0.0
    assert bench.score("") == 0.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--new-tokens", "0"], "--new-tokens must be >= 1, got 0."),
        (["--rounds", "0"], "--rounds must be >= 1, got 0."),
        (["--prompts", "0"], "--prompts must be >= 1, got 0."),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1."),
    ],
)
def test_bad_flags_end_in_one_line(bench, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--size", "smoke", *argv])
    assert str(exit_info.value) == message
