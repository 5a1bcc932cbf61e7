"""`benchmarks/weight_push.py` end to end at its smallest settings: the recipe's push between
two processes, whole and as a delta, on a tiny decoder's weights."""

import jax
import pytest

from tests.benchmarks._run import load_benchmark, refusal, run_benchmark


@pytest.mark.slow
def test_tiny_pushes_whole_and_as_deltas(tmp_path):
    result, output = run_benchmark(
        "weight_push.py", "--models", "tiny", "--changed", "0.05,0.98", "--repeats", "2",
        "--bucket-mb", "0.05", out=tmp_path,  # 52 KiB: the 0.2 MB weights in 5 buckets
    )  # fmt: skip
    leaves = jax.tree.leaves(load_benchmark("weight_push.py", "weight_push").weights("tiny"))
    whole = sum(x.size for x in leaves) * 2  # bfloat16
    header = 8 * (3 + len(leaves))  # kind, version, fingerprint, a count per leaf (int64)
    few, most = result["results"]
    for row in (few, most):
        assert row["whole_bytes"] == whole and row["whole_sampler_s"] > 0
    # 5 % changed: deltas, of a position (4 bytes) and a value (2) per changed element.
    assert few["pushes_as_delta"] == [True, True]
    assert header + 0.04 * whole / 2 * 6 < few["delta_bytes"] < header + 0.06 * whole / 2 * 6
    # 98 % changed: a delta would be larger than the weights, which go whole after the header.
    assert most["pushes_as_delta"] == [False, False]
    assert most["delta_bytes"] == whole + header
    assert few["bucket_mb"] == most["bucket_mb"] == 0.05
    assert output.splitlines()[1].split()[:3] == ["0.05", "tiny", "0.050"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--models", "tiny,huge"], "--models: one or more of"),
        (["--changed", "0"], "--changed takes shares in (0, 1]"),
        (["--changed", "half"], "--changed: not numbers"),
        (["--bucket-mb", "-1"], "--bucket-mb takes sizes >= 0"),
    ],
)
def test_bad_flags_are_one_line(argv, message):
    assert message in refusal("weight_push.py", *argv)
