"""`benchmarks/sampler_anchors.py`'s refusals. Its runs need the anchors' environment (Tunix,
transformers), which the tests do not build; tunelib's side of it is the sampler that
`tests/benchmarks/test_sampler_benchmark.py` runs end to end, and `grpo_anchors.py`'s
smoke test covers the anchors' shared path (the checkpoint, the worker process, the
anchors skipped in one line)."""

import pytest

from tests.benchmarks._run import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("sampler_anchors.py", "sampler_anchors_benchmark")


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
