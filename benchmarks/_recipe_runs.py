"""How a benchmark runs the recipes: each run its own process, as a user types it, its output
in a log file.

A module beside the scripts, not a script: `python benchmarks/<script>.py` puts this folder
first on `sys.path`, so the scripts import it as `_recipe_runs`.
"""

import subprocess
import sys
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def run_recipe(recipe: str, args: list[str], log: Path) -> None:
    """`python recipes/<recipe>.py ARGS`, its output to `log`, to a zero exit status (else
    the script stops naming the log)."""
    command = [sys.executable, str(RECIPES / f"{recipe}.py"), *args]
    print("$", " ".join(command[1:]), flush=True)
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{recipe}.py failed (exit {done.returncode}); see {log}")
