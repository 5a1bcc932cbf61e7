"""Every script in `benchmarks/` has a smoke test here that runs it at its smallest settings."""

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_benchmark_script_is_run_by_a_test():
    scripts = sorted(path.name for path in BENCHMARKS.glob("*.py"))
    assert "moe.py" in scripts  # the folder is where it should be
    tests = "\n".join(path.read_text() for path in Path(__file__).parent.glob("test_*.py"))
    assert [name for name in scripts if f'"{name}"' not in tests] == []
