"""`benchmarks/recovery.py` refuses bad settings in one line. Its end-to-end run (SFT runs
killed and restarted, minutes of compilation it times on purpose, without the session's
cache) is not in the suite: the mechanisms it measures are tested in
`tests/recipes/test_recovery.py`, and its figures come from its documented runs."""

from tests.benchmarks._run import refusal


def test_intervals_must_be_positive():
    assert refusal("recovery.py", "--cost-every", "0").endswith("--cost-every must be >= 1, got 0")
