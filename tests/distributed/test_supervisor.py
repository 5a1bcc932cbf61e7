"""`python -m tunelib.launch --max-restarts K`: its refusals, hangs detected and recovered,
capacity lost and regained; on a small program that beats and takes faults as a recipe's loop
does (the recipes themselves: tests/distributed/test_recipes_across_processes.py)."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests._helpers import user_env
from tunelib import launch

# Steps of 0.1 s, its progress in `--out`: a rerun with `--resume auto` goes on from there.
# Ctrl-C (the supervisor growing the run) stops it after a step, with code 130, as it stops a
# recipe: never between a step's two records (a step kept as done but missing from `steps`,
# as an interruption raised there could leave it under load).
PROGRAM = """
import signal, sys, time
from pathlib import Path
from tunelib import distributed

runtime = distributed.initialize()
out = Path(sys.argv[sys.argv.index("--out") + 1])
done = out / "step"
start = int(done.read_text()) if done.exists() else 0
print(f"from step {start} on {runtime.process_count}", flush=True)
stop = []  # (the supervisor sends Ctrl-C after every process's first beat only)
signal.signal(signal.SIGINT, lambda *_: stop.append(True))
distributed.inject_faults("start", start)
for step in range(start + 1, STEPS + 1):
    time.sleep(0.1)
    if runtime.is_main:
        done.write_text(str(step))
        with open(out / "steps", "a") as f:
            f.write(f"{step} {runtime.process_count}\\n")
    distributed.heartbeat(step)
    distributed.inject_faults("step", step)
    if stop:
        sys.exit(130)
"""


def supervised(tmp_path, faults: str, *flags: str, steps: int = 8):
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM).replace("STEPS", str(steps)))
    out = tmp_path / "run"
    out.mkdir()
    env = {**user_env(), "TUNELIB_FAULTS": faults}
    command = [sys.executable, "-m", "tunelib.launch", *flags, str(script), "--out", str(out),
               "--resume", "auto"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = [json.loads(line) for line in (out / "supervisor.jsonl").read_text().splitlines()]
    fired = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]
    steps_done = [line.split() for line in (out / "steps").read_text().splitlines()]
    return done, events, fired, [(int(s), int(n)) for s, n in steps_done]


@pytest.mark.parametrize(
    ("flags", "faults", "message"),
    [
        (["--max-restarts", "-1"], "", "--max-restarts must be >= 0, got -1."),
        (["--min-processes", "3"], "", "--min-processes must be in [1, 2] (-n 2), got 3."),
        ([], "kill@stp=3", "TUNELIB_FAULTS: cannot parse 'kill@stp=3': the trigger is"),
        (["--start-timeout", "0"], "", "--start-timeout must be > 0 seconds, got 0.0."),
        (["--max-restarts", "1", "--no-resume"], "", "give the program --resume auto"),
    ],
)
def test_bad_settings_are_refused_in_one_line_with_nothing_written(
    tmp_path, monkeypatch, capsys, flags, faults, message
):
    monkeypatch.setenv("TUNELIB_FAULTS", faults)
    script = tmp_path / "program.py"
    script.write_text("print('ran')\n")
    resume = [] if "--no-resume" in flags else ["--resume", "auto"]
    flags = [f for f in flags if f != "--no-resume"]
    out = tmp_path / "run"
    code = launch.main(["-n", "2", *flags, str(script), "--out", str(out), *resume])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["program.py"]


@pytest.mark.slow
def test_hangs_are_detected_within_their_timeouts_and_the_run_recovers(tmp_path):
    """A process stuck in its start-up (before its first heartbeat, which `--hang-timeout`
    does not watch) is hung `--start-timeout` seconds after it started; on the next attempt
    it stops beating after step 3 and the supervisor sees it `--hang-timeout` seconds after
    its last beat. Each time it stops the process and starts the run again, which ends every
    step once after the checkpoint."""
    hang_timeout, start_timeout, grace = 2.0, 5.0, 1.0
    done, events, fired, steps = supervised(
        tmp_path, "hang@start; hang@step=3", "-n", "1", "--max-restarts", "2",
        "--hang-timeout", str(hang_timeout), "--start-timeout", str(start_timeout),
        "--grace", str(grace),
    )  # fmt: skip
    kinds = [e["event"] for e in events]
    assert kinds == ["start", "restart", "start", "restart", "start", "end"], events
    first, in_start, _, in_step, third = events[:5]
    assert in_start["cause"].startswith("process 0 hung: no heartbeat for")
    assert in_start["cause"].endswith("s after it started")
    assert start_timeout <= in_start["detected_at"] - first["time"] <= start_timeout + 2.0
    assert in_step["cause"].startswith("process 0 hung: no heartbeat for")
    assert in_step["cause"].endswith("s after step 3")
    assert "restart 2 of 2: process 0 hung" in done.stderr
    start_hang, step_hang = fired
    assert (start_hang["trigger"], step_hang["trigger"]) == ("start", "step")
    # Detected within the timeout (and a poll) of the hang, restarted within the grace. The
    # supervisor counts from the step's last heartbeat, which the process sends just before
    # the fault fires and records its time (1.9998 s, not 2, on a loaded 2-core machine).
    assert hang_timeout - 0.5 <= in_step["detected_at"] - step_hang["time"] <= hang_timeout + 1.0
    assert third["time"] - in_step["detected_at"] <= grace + 1.0
    assert [s for s, _ in steps] == [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.mark.slow
def test_capacity_lost_goes_on_with_fewer_processes_and_grows_back(tmp_path):
    """Process 1's capacity is lost after step 2 for 2 s: the run goes on with 1 process
    (>= --min-processes), then is stopped after a step and grows back to 2."""
    done, events, fired, steps = supervised(
        tmp_path, "lose@step=2,rank=1,back=2", "-n", "2", "--max-restarts", "1",
        "--min-processes", "1", "--grace", "1", steps=40,
    )  # fmt: skip
    assert [(f["action"], f["rank"], f["step"]) for f in fired] == [("lose", 1, 2)]
    assert "capacity is back: stopping every process after its step" in done.stderr
    starts = [e["processes"] for e in events if e["event"] == "start"]
    assert starts == [2, 1, 2], events
    capacity = [e["processes"] for e in events if e["event"] == "capacity"]
    assert capacity == [1, 2]
    causes = [e["cause"] for e in events if e["event"] == "restart"]
    assert causes == ["process 1 was killed by SIGKILL", "capacity back"]
    counts = [n for _, n in steps]
    assert counts[0] == 2 and 1 in counts and counts[-1] == 2
    assert [s for s, _ in steps] == sorted({s for s, _ in steps}) == list(range(1, 41))


def test_a_program_that_refuses_its_settings_is_not_restarted(tmp_path):
    """Exit code 2 (a recipe's one-line refusal, e.g. `--resume auto` on another run's folder)
    would come back on every rerun: the supervisor stops at once with that code."""
    script = tmp_path / "program.py"
    script.write_text("import sys\nprint('refused', file=sys.stderr)\nsys.exit(2)\n")
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "tunelib.launch", "-n", "1", "--max-restarts", "3", str(script),
         "--out", str(out), "--resume", "auto"],
        capture_output=True, text=True, timeout=60, env=user_env(),
    )  # fmt: skip
    assert done.returncode == 2
    assert "process 0 refused its settings: not restarted." in done.stderr
    events = [
        json.loads(line)["event"] for line in (out / "supervisor.jsonl").read_text().splitlines()
    ]
    assert events == ["start", "end"]


def test_a_beat_caught_half_written_is_still_watched(tmp_path):
    """A process stopped between truncating its heartbeat file and writing it leaves the file
    empty: the supervisor watches it from the file's time (and a process past its last step
    not at all), so the stop is detected as a hang."""
    from tunelib.launch._processes import Launch

    beats = tmp_path / "beats"
    beats.mkdir()
    (beats / "0").write_text("")
    (beats / "1").write_text("5 0.0 last\n")
    old = time.time() - 60
    for name in ("0", "1"):
        os.utime(beats / name, (old, old))
    watch = Launch(["true"], 2, 0, None, 1.0, heartbeats=str(beats), hang_timeout=30)
    rank, beat, after = watch._hung([None, None], now=time.time())
    assert (rank, beat, after) == (0, pytest.approx(old), "its last beat, which is unreadable")
    (beats / "0").write_text("7 0.0\n")
    os.utime(beats / "0", (old, old))
    assert watch._hung([None, None], now=time.time())[2] == "step 7"


def test_a_heartbeat_is_written_whole_into_its_rank_file(tmp_path, monkeypatch):
    from tunelib import distributed

    monkeypatch.setenv("TUNELIB_HEARTBEATS", str(tmp_path))
    distributed.heartbeat(3)
    distributed.heartbeat(4, last=True)
    assert [p.name for p in tmp_path.iterdir()] == ["0"]  # no half-made file left beside it
    step, when, last = (tmp_path / "0").read_text().split()
    assert (step, last) == ("4", "last") and abs(float(when) - time.time()) < 600


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], launch.START_TIMEOUT),
        (["--start-timeout", "60"], 60.0),
        (["--start-timeout", "inf"], float("inf")),
    ],
)
def test_a_supervised_start_is_watched_by_default(tmp_path, monkeypatch, flags, expected):
    """Under a supervisor a start-up hang ends: without --start-timeout, a process that has
    not beaten START_TIMEOUT seconds after it started is hung (`inf` turns it off)."""
    seen = {}

    class Supervisor:
        def __init__(self, command, count, **settings):
            seen.update(settings)

        def run(self):
            return 0

    monkeypatch.setattr(launch._supervisor, "Supervisor", Supervisor)
    script = tmp_path / "program.py"
    script.write_text("")
    flags = ["-n", "2", "--max-restarts", "1", *flags, str(script), "--out", str(tmp_path)]
    flags += ["--resume", "auto"]
    assert launch.main(flags) == 0
    assert seen["start_timeout"] == expected
