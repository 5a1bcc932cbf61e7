"""The accelerator tier's command (docs/tpu.md) on this CPU: it starts without pytest-xdist's
options, collects the tier, and skips every test with the reason."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "tpu.md"


def documented_command() -> str:
    """The tier's command: the first shell block of docs/tpu.md's section on it."""
    section = PAGE.read_text().split("## The accelerator test tier", 1)[1]
    return re.search(r"```bash\n(.*?)\n```", section, re.S).group(1)


@pytest.mark.slow
def test_the_documented_command_skips_every_test_on_cpu_naming_the_backend():
    command = documented_command()
    assert command.startswith("JAX_PLATFORMS=tpu python ")
    # As a user runs it here, on a CPU: without asking for the TPU, with this Python.
    command = command.removeprefix("JAX_PLATFORMS=tpu python ")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_PLATFORMS", "PYTEST_", "TUNELIB_ACCELERATOR"))
    }
    proc = subprocess.run(
        f"{sys.executable} {command}", shell=True, cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    summary = output.strip().splitlines()[-1]
    skipped = int(re.search(r"(\d+) skipped", summary).group(1))
    assert skipped >= 10 and re.fullmatch(r"=+ \d+ skipped in .*", summary), summary
    reasons = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    assert reasons and all("needs a GPU or TPU; JAX's backend is cpu" in r for r in reasons)
    assert sum(int(re.search(r"SKIPPED \[(\d+)\]", r).group(1)) for r in reasons) == skipped
