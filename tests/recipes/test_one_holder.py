"""The emulation of a TPU host's rule that the recipe tests run under
(`tests/one_holder/sitecustomize.py`): it must stop a second process that starts its backend
while another holds it, or the recipe tests run under it would prove nothing."""

import subprocess
import sys

from tests._helpers import user_env
from tests.recipes.test_recipes import one_holder_env

# A process that starts its backend, then a child that does the same while it holds it.
PARENT = """
import subprocess, sys
import jax
jax.devices()
child = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                       capture_output=True, text=True)
print(child.returncode)
print(child.stderr.strip().splitlines()[-1])
"""


def test_a_second_process_cannot_start_its_backend_while_one_holds_it(tmp_path):
    env = {**user_env(), **one_holder_env(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", PARENT], capture_output=True, text=True, env=env, timeout=120,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    status, last_line = proc.stdout.strip().splitlines()[-2:]
    assert status == "1"
    assert "another process holds the devices" in last_line
    # Once it has exited, the next process starts its backend.
    after = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert after.returncode == 0 and after.stdout.strip() == "cpu", after.stderr[-2000:]
