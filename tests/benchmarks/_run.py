"""Running a benchmark script as a user does, for the smoke tests of tests/benchmarks/."""

import json
import subprocess
import sys
from pathlib import Path

from tests._helpers import load_script, user_env

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_benchmark(
    script: str, *args: str, out: Path, timeout: int = 600, compilation_cache: bool = True
) -> tuple[dict, str]:
    """`python benchmarks/<script> *args --json-out <out>/result.json` to a zero exit status;
    the result it prints as its last line (checked equal to the file it wrote) and its output.

    The benchmark shares the session's compilation cache (its worker processes compile many of
    the same programs, and the recipe runs' too), unless `compilation_cache=False`: for the
    benchmarks whose figures a test checks include compile times or the compiler's memory."""
    written = out / "result.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args, "--json-out", str(written)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=user_env(compilation_cache=compilation_cache),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads(written.read_text())
    return result, proc.stdout


def refusal(script: str, *args: str) -> str:
    """The one line a run refused at its flags ends with on stderr (exit status 2)."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=user_env(),
        check=False,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stderr.strip().splitlines()[-1]


def load_benchmark(script: str, name: str):
    """`benchmarks/<script>` imported as module `name`, as `python benchmarks/<script>` runs
    it: the folder first on the path while it imports the modules beside it (`_anchors`), and
    only then (the folder's `peft.py` is no package)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return load_script(BENCHMARKS / script, name)
    finally:
        sys.path.remove(str(BENCHMARKS))
