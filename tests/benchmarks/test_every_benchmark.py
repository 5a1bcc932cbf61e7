"""Every script in `benchmarks/` has a smoke test here that runs it at its smallest settings;
the modules beside them (`_*.py`) run inside the scripts that import them."""

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_benchmark_script_is_run_by_a_test():
    files = sorted(path.name for path in BENCHMARKS.glob("*.py"))
    scripts = [name for name in files if not name.startswith("_")]
    assert "moe.py" in scripts  # the folder is where it should be
    tests = "\n".join(path.read_text() for path in Path(__file__).parent.glob("test_*.py"))
    assert [name for name in scripts if f'"{name}"' not in tests] == []
    # A shared module is imported by a script, so the script's smoke test runs it.
    sources = "\n".join((BENCHMARKS / name).read_text() for name in scripts)
    modules = [name.removesuffix(".py") for name in files if name.startswith("_")]
    assert [m for m in modules if f"from {m} import" not in sources] == []
