"""`benchmarks/weight_delta.py` end to end at its smallest settings: the toy SFT's step, and
what a delta of its parameters would send."""

import pytest

from tests.benchmarks._run import refusal, run_benchmark


@pytest.mark.slow
def test_smallest_settings_measure_each_step(tmp_path):
    result, output = run_benchmark(
        "weight_delta.py", "--recipes", "sft", "--steps", "2", "--run-steps", "20", out=tmp_path
    )
    (sft,) = result["results"]
    assert (sft["recipe"], sft["params"], len(sft["steps"])) == ("sft", 404_480, 2)
    for step in sft["steps"]:
        for kind, itemsize in (("f32", 4), ("bf16", 2)):
            changed = round(step[f"{kind}_changed"] * sft["params"])
            assert step[f"{kind}_delta_bytes"] == changed * (itemsize + 4)  # int32 positions
            assert step[f"{kind}_full_bytes"] == sft["params"] * itemsize
        # An element whose bfloat16 rounding changed changed in float32 too.
        assert 0 < step["bf16_changed"] <= step["f32_changed"] <= 1
    assert "sft" in output.splitlines()[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--recipes", "sft,nope"], "--recipes: no recipe 'nope' in"),
        (["--steps", "3", "--run-steps", "3"], "--run-steps > --steps"),
        (["--learning-rates", "fast"], "--learning-rates: not numbers"),
    ],
)
def test_bad_flags_end_in_one_line(argv, message):
    assert message in refusal("weight_delta.py", *argv)
