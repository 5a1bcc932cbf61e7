"""`python -m tunelib.launch` and `tunelib.distributed.initialize`: processes on loopback that
act as hosts (Gloo collectives), their output, failures and signals."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests._helpers import raises_naming, user_env
from tunelib import distributed

# Each process contributes its rank + 1 on each of its devices to an array sharded over
# every process's devices; the sum is computed across processes.
GLOBAL_SUM = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tunelib import distributed

runtime = distributed.initialize()
mesh = jax.make_mesh((len(runtime.devices),), ("data",),
                     axis_types=(jax.sharding.AxisType.Auto,))
local = np.full((len(runtime.local_devices), 3), runtime.process_index + 1.0, np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
print(f"rank {runtime.process_index} of {runtime.process_count}, "
      f"{len(runtime.local_devices)} of {len(runtime.devices)} devices, sum {float(total)}")
"""


def launch(tmp_path, body: str, *flags: str, timeout: float = 120, **kwargs):
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(body))
    command = [sys.executable, "-m", "tunelib.launch", *flags, str(script)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


def test_two_processes_of_two_devices_sum_across_processes(tmp_path):
    done = launch(tmp_path, GLOBAL_SUM, "-n", "2", "--devices-per-process", "2")
    assert done.returncode == 0, done.stderr + done.stdout
    lines = [line for line in done.stdout.splitlines() if "sum" in line]
    # 2 devices x 3 entries x 1 from rank 0, and the same x 2 from rank 1.
    assert sorted(lines) == [
        "[0] rank 0 of 2, 2 of 4 devices, sum 18.0",
        "[1] rank 1 of 2, 2 of 4 devices, sum 18.0",
    ]


def test_a_failing_process_stops_the_others_and_is_named(tmp_path):
    body = """
    import os, sys, time
    if os.environ["TUNELIB_PROCESS_ID"] == "1":
        print("giving up", flush=True)
        sys.exit(3)
    time.sleep(60)
    """
    start = time.monotonic()
    done = launch(tmp_path, body, "-n", "3", "--grace", "5")
    assert done.returncode == 3
    assert "[1] giving up" in done.stdout
    assert "process 1 exited with code 3; stopping the others" in done.stderr
    assert time.monotonic() - start < 30  # not the sleeping processes' 60 s


def test_ctrl_c_reaches_every_process(tmp_path):
    """SIGINT to the launcher is passed on; each process handles its KeyboardInterrupt."""
    body = """
    import time
    try:
        print("ready", flush=True)  # inside: a Ctrl-C right after it is still handled
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted, saving", flush=True)
        raise SystemExit(130)
    """
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(body))
    process = subprocess.Popen(
        [sys.executable, "-m", "tunelib.launch", "-n", "2", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ready = 0
    while ready < 2:
        line = process.stdout.readline()
        assert line, process.stderr.read()
        ready += line.endswith("ready\n")
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130
    assert sorted(line for line in out.splitlines() if "interrupted" in line) == [
        "[0] interrupted, saving",
        "[1] interrupted, saving",
    ]
    assert "SIGINT: passed on to all 2 processes" in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["-n", "0", "x.py"], "-n must be >= 1"),
        (["-n", "2", "no_such_script.py"], "no such script: no_such_script.py"),
        (["-n", "2"], "give the script"),
        (["-n", "2", "--devices-per-process", "0", "x.py"], "--devices-per-process"),
    ],
)
def test_bad_flags_get_one_line(tmp_path, flags, named):
    (tmp_path / "x.py").write_text("")
    done = subprocess.run([sys.executable, "-m", "tunelib.launch", *flags], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and named in done.stderr
    assert "Traceback" not in done.stderr


def test_unreachable_coordinator_is_named_with_the_rank(tmp_path):
    """Rank 1 of 2, with nothing listening at the address: a ConnectionError naming both,
    after the timeout (3 s), not JAX's default 5 minutes."""
    body = """
    from tunelib import distributed
    try:
        distributed.initialize("127.0.0.1:9", 2, 1, timeout_s=3)
    except ConnectionError as error:
        print("ERROR", error)
    """
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(body))
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert "ERROR process 1 could not join the run at 127.0.0.1:9 within 3 s" in done.stdout, (
        done.stdout + done.stderr
    )
    assert time.monotonic() - start < 60


def test_alone_and_partial_settings():
    runtime = distributed.initialize()
    assert (runtime.process_index, runtime.process_count, runtime.coordinator) == (0, 1, None)
    assert distributed.initialize() == runtime  # a second call: the same run
    with raises_naming("coordinator_address", "num_processes", "process_id"):
        distributed.initialize("127.0.0.1:1234")


def test_partial_environment_is_named(monkeypatch):
    monkeypatch.setitem(os.environ, distributed.NUM_PROCESSES, "2")
    monkeypatch.delitem(os.environ, distributed.PROCESS_ID, raising=False)
    with raises_naming(distributed.PROCESS_ID, distributed.COORDINATOR):
        distributed.initialize()


_LAUNCH_VARIABLES = ("TUNELIB_NUM_PROCESSES", "TUNELIB_PROCESS_ID", "JAX_COORDINATOR_ADDRESS",
                     "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")  # fmt: skip
_LAUNCHED = {"TUNELIB_NUM_PROCESSES": "3", "TUNELIB_PROCESS_ID": "1",
             "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234"}  # fmt: skip


@pytest.mark.parametrize(
    "variables, count",
    [({}, 1), (_LAUNCHED, 3), ({"SLURM_NTASKS": "4"}, 4), ({"SLURM_NTASKS": "1"}, 1),
     ({"OMPI_COMM_WORLD_SIZE": "2"}, 2)],
)  # fmt: skip
def test_the_launched_process_count_is_the_one_initialize_joins(monkeypatch, variables, count):
    for name in _LAUNCH_VARIABLES:
        monkeypatch.delitem(os.environ, name, raising=False)
    for name, value in variables.items():
        monkeypatch.setitem(os.environ, name, value)
    assert distributed.launched_process_count() == count


def test_the_launched_process_count_does_not_start_the_backend():
    """A process that asks it can still start a JAX program of its own before it opens its
    devices (on a TPU host, one process at a time holds them)."""
    code = (
        "from tunelib import distributed; from jax._src import xla_bridge; "
        "print(distributed.launched_process_count(), xla_bridge.backends_are_initialized())"
    )
    env = {**{k: v for k, v in user_env().items() if k not in _LAUNCH_VARIABLES}, **_LAUNCHED}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env)  # fmt: skip
    assert done.stdout.split() == ["3", "False"], done.stderr[-2000:]


def test_a_partial_launch_is_named_by_the_launched_process_count(monkeypatch):
    monkeypatch.setitem(os.environ, distributed.NUM_PROCESSES, "2")
    monkeypatch.delitem(os.environ, distributed.PROCESS_ID, raising=False)
    with raises_naming(distributed.PROCESS_ID, distributed.COORDINATOR):
        distributed.launched_process_count()


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch-size", "6"], "--batch-size 6 does not split over 4 devices"),
        (["--devices", "2"], "uses all 4 of their devices"),
    ],
)
def test_a_recipe_whose_batch_does_not_split_over_the_processes_says_so(tmp_path, flags, message):
    """Before any work, in one line per process, with nothing written."""
    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "sft.py")
    done = subprocess.run(
        [sys.executable, "-m", "tunelib.launch", "-n", "2", "--devices-per-process", "2", recipe,
         "--out", str(tmp_path / "r"), *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:]
    errors = [line for line in done.stdout.splitlines() if "error:" in line]
    assert len(errors) == 2 and all(message in line for line in errors), done.stdout[-2000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "r").exists()


def test_a_process_killed_by_a_signal_is_named_before_the_peers_it_broke(capsys):
    """A SIGKILLed process and a peer that exited on the closed connection, both seen in one
    poll: the launcher names the killed one, whatever its rank."""
    from tunelib.launch._processes import Launch

    class Exited:
        def __init__(self, code):
            self.code, self.pid = code, -1

        def poll(self):
            return self.code

    launcher = Launch([], 3, 0, None, grace=1)
    launcher.processes = [Exited(0), Exited(1), Exited(-signal.SIGKILL)]
    assert launcher._wait() == 128 + signal.SIGKILL
    assert "process 2 was killed by SIGKILL; stopping the others" in capsys.readouterr().err
