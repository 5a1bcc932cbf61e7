"""Run folders that never lose work: the lock, failed starts, damaged files and checkpoints,
`--resume auto`, and a run killed before its model was saved."""

import errno
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.recipes._scripts import recipe_module

from kit import lock
from kit.cli import resume_command
from kit.config import to_toml
from kit.errors import UserError
from kit.lock import LOCK_FILE, STALE_SECONDS, Lock
from kit.runs import RunFolder, read_metrics


def config(**values):
    return recipe_module("sft").SFTConfig(**{"steps": 4, **values})


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


def write_lock(folder: Path, **holder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps(holder))


def test_a_locked_folder_is_refused_naming_the_holder_until_it_is_released(tmp_path):
    held = Lock(tmp_path)
    host = socket.gethostname()
    with pytest.raises(UserError, match=f"process {os.getpid()} on host {host}"):
        Lock(tmp_path)
    held.release()
    assert not (tmp_path / LOCK_FILE).exists()
    Lock(tmp_path).release()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_stale_lock_of_a_dead_process_is_taken_over_in_one_line(tmp_path, capsys):
    pid = dead_pid()
    write_lock(tmp_path, pid=pid, host=socket.gethostname(), started="1")
    lock = Lock(tmp_path)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"{tmp_path}: taking over the lock of process {pid} on host {socket.gethostname()}, "
        "which ended without releasing it"
    ]
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_live_process_of_another_start_time_is_a_reused_pid(tmp_path, capsys):
    write_lock(tmp_path, pid=os.getpid(), host=socket.gethostname(), started="-1")
    Lock(tmp_path).release()
    assert "taking over the lock" in capsys.readouterr().err


def test_a_lock_of_another_host_is_refused_while_renewed_and_taken_over_after(tmp_path, capsys):
    write_lock(tmp_path, pid=1, host="elsewhere", started="1")
    with pytest.raises(UserError, match="process 1 on host elsewhere, its lock renewed 0 s ago"):
        Lock(tmp_path)
    assert (tmp_path / LOCK_FILE).exists()
    long_ago = time.time() - STALE_SECONDS - 1
    os.utime(tmp_path / LOCK_FILE, (long_ago, long_ago))
    Lock(tmp_path).release()
    assert "taking over the lock of process 1 on host elsewhere" in capsys.readouterr().err


def test_a_held_lock_is_renewed_until_released(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "RENEW_SECONDS", 0.01)
    held = Lock(tmp_path)
    os.utime(tmp_path / LOCK_FILE, (0, 0))
    deadline = time.monotonic() + 10
    while (tmp_path / LOCK_FILE).stat().st_mtime == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    held.release()
    assert held._renewing.is_set() and not (tmp_path / LOCK_FILE).exists()


def test_a_damaged_lock_file_is_taken_over(tmp_path, capsys):
    (tmp_path / LOCK_FILE).write_text('{"pid": 1')
    Lock(tmp_path).release()
    assert "taking over the lock of a run (its lock file is damaged)" in capsys.readouterr().err


def test_a_run_into_a_folder_another_run_writes_writes_nothing(tmp_path):
    out = tmp_path / "run"
    write_lock(out, pid=os.getpid(), host=socket.gethostname())
    run = RunFolder(out, resume=False, overwrite=False, steps=4)
    with pytest.raises(UserError, match="being written by another run"):
        run.open(config())
    assert sorted(os.listdir(out)) == [LOCK_FILE]


def test_open_locks_the_folder_and_release_frees_it(tmp_path):
    run = RunFolder(tmp_path / "run", resume=False, overwrite=False, steps=4)
    run.open(config())
    assert (tmp_path / "run" / LOCK_FILE).exists() and (tmp_path / "run" / "config.toml").exists()
    run.release()
    run.release()  # every exit path releases: twice is harmless
    assert not (tmp_path / "run" / LOCK_FILE).exists()


@pytest.mark.parametrize("denied", ["parent", "run", "checkpoints", "metrics.jsonl"])
def test_a_folder_the_run_cannot_write_is_refused_before_it_starts(tmp_path, monkeypatch, denied):
    """Where the folder would be made, the folder, its checkpoints and a file the run adds
    to: one line naming the place, before anything is written. The suite may run as root,
    whose writes no permission stops: `os.access` is made to say no, as it does to a user
    without the permission or on a read-only file system."""
    import kit.runs

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # a start that failed before its first step
    (run / "metrics.jsonl").write_text("")
    places = {"parent": tmp_path, "run": run, "checkpoints": run / "checkpoints"}
    place = places.get(denied, run / denied)
    out = tmp_path / "new" / "run" if denied == "parent" else run
    access = os.access
    monkeypatch.setattr(kit.runs.os, "access", lambda p, mode: Path(p) != place and access(p, mode))
    before = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError) as refused:
        RunFolder(out, resume=False, overwrite=False, steps=4)
    assert str(refused.value) == (
        f"--out {out}: cannot write {place} (its permissions, or a read-only file system): "
        "make it writable, or give --out a folder you can write"
    )
    assert sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before
    monkeypatch.setattr(kit.runs.os, "access", access)
    RunFolder(out, resume=False, overwrite=False, steps=4)  # writable: no complaint


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.ENOSPC])
def test_a_path_the_run_may_not_write_is_one_line_and_other_os_errors_are_raised(
    tmp_path, monkeypatch, capsys, code
):
    """Met during the run (a file the checks before it could not foresee): a permission or a
    read-only file system is one line naming the path, exit 2; any other `OSError` (a full
    disk) is an unexpected error, raised as it was."""
    import kit
    import kit.loop

    sft = recipe_module("sft")
    error = OSError(code, os.strerror(code), str(tmp_path / "elsewhere" / "file"))

    def initial_state(*args, **kwargs):
        raise error

    monkeypatch.setattr(kit.loop, "initial_state", initial_state)
    argv = ["--out", str(tmp_path / "run"), "--steps", "2", "--num-heldout", "8",
            "--no-progress", "--no-plots", "--devices", "1"]  # fmt: skip
    if code == errno.ENOSPC:
        with pytest.raises(OSError) as raised:
            kit.cli.main(sft.SFTConfig, sft.train, sft.__doc__, argv=argv)
        assert raised.value is error
        return
    with pytest.raises(SystemExit) as stop:
        kit.cli.main(sft.SFTConfig, sft.train, sft.__doc__, argv=argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"sft.py: error: cannot write or read {error.filename}: {os.strerror(code)}; a run "
        "writes in its folder (--out) and reads its inputs: check their permissions\n"
    )


def test_overwrite_removes_everything_a_run_wrote_and_nothing_else(tmp_path):
    """A replaced run leaves nothing the next one would read as its own: not --keep-best's
    model and record (compared with, and named as the new run's best), not the injected
    faults that fired (which would not fire again); the user's own files stay."""
    out = tmp_path / "run"
    for folder in ("checkpoints/4", "model", "best", "best.partial"):
        (out / folder).mkdir(parents=True)
    (out / "best" / "best.json").write_text('{"metric": "accuracy", "value": 1.0, "step": 4}')
    for name in ("result.json", "faults.jsonl", "config.toml", "metrics.jsonl", "notes.txt"):
        (out / name).write_text("{}\n")
    run = RunFolder(out, resume=False, overwrite=True, steps=4)
    run.open(config())
    assert sorted(os.listdir(out)) == sorted([LOCK_FILE, "config.toml", "notes.txt"])
    run.release()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("kill@step=2,rank=1", "'kill@step=2,rank=1' fires on process 1, but the run has 1 "),
        ("kill@stepp=2", "TUNELIB_FAULTS: cannot parse 'kill@stepp=2'"),
    ],
)
def test_a_fault_spec_that_cannot_fire_here_is_one_line(tmp_path, monkeypatch, spec, message):
    monkeypatch.setenv("TUNELIB_FAULTS", spec)
    monkeypatch.delenv("TUNELIB_FAULTS_LOG", raising=False)
    run = RunFolder(tmp_path / "run", resume=False, overwrite=False, steps=4)
    with pytest.raises(UserError, match=message):
        run.faults()


def failed_start(folder: Path, settings) -> Path:
    """What a start that failed before its first checkpoint leaves."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.toml").write_text(to_toml(settings))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    return folder


@pytest.mark.parametrize("resume", [False, "auto"])
def test_a_failed_start_is_started_again_by_the_same_command(tmp_path, resume):
    out = failed_start(tmp_path / "run", config())
    run = RunFolder(out, resume=resume, overwrite=False, steps=4)
    run.check_resume(config())
    run.open(config())
    assert not run.resume
    assert sorted(os.listdir(out)) == [LOCK_FILE, "config.toml"]
    run.release()


def test_a_failed_start_with_other_settings_or_a_model_is_kept(tmp_path):
    out = failed_start(tmp_path / "run", config(seed=1))
    run = RunFolder(out, resume=False, overwrite=False, steps=4)
    with pytest.raises(UserError, match="stopped before its first checkpoint, with --seed 1"):
        run.check_resume(config())
    (out / "model").mkdir()
    with pytest.raises(UserError, match="holds a run already"):
        RunFolder(out, resume=False, overwrite=False, steps=4)
    with pytest.raises(UserError, match="holds a run without a checkpoint to resume from"):
        RunFolder(out, resume="auto", overwrite=False, steps=4)


def saved_run(folder: Path, step: int, *, finished: bool) -> Path:
    (folder / "checkpoints" / str(step)).mkdir(parents=True)
    (folder / "config.toml").write_text(to_toml(config()))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": step}) + "\n")
    if finished:
        (folder / "result.json").write_text(json.dumps({"recipe": "sft", "steps": step}))
    return folder


def test_resume_auto_resumes_starts_or_finds_the_run_finished(tmp_path):
    fresh = RunFolder(tmp_path / "new", resume="auto", overwrite=False, steps=4)
    assert (fresh.resume, fresh.finished) == (False, None)
    unfinished = RunFolder(saved_run(tmp_path / "a", 2, finished=False), resume="auto",
                           overwrite=False, steps=4)  # fmt: skip
    assert (unfinished.resume, unfinished.finished) == (True, None)
    done = RunFolder(saved_run(tmp_path / "b", 4, finished=True), resume="auto",
                     overwrite=False, steps=4)  # fmt: skip
    assert (done.resume, done.finished) == (True, {"recipe": "sft", "steps": 4})
    longer = RunFolder(tmp_path / "b", resume="auto", overwrite=False, steps=6)
    assert (longer.resume, longer.finished) == (True, None)
    with pytest.raises(UserError, match="is at step 4 already; give --steps above 4"):
        RunFolder(tmp_path / "b", resume="auto", overwrite=False, steps=3)


def test_resume_at_the_last_step_finishes_a_run_killed_before_its_model_was_saved(tmp_path):
    out = saved_run(tmp_path / "run", 4, finished=False)
    assert RunFolder(out, resume=True, overwrite=False, steps=4).resume
    (out / "result.json").write_text('{"recipe": "sf')  # cut short: the run did not finish
    assert RunFolder(out, resume="auto", overwrite=False, steps=4).finished is None
    (out / "result.json").write_text("{}")
    with pytest.raises(UserError, match="is at step 4 already; give --steps above 4"):
        RunFolder(out, resume=True, overwrite=False, steps=4)


def test_a_resumed_run_keeps_its_config_toml_until_restored(tmp_path):
    out = saved_run(tmp_path / "run", 2, finished=False)
    before = (out / "config.toml").read_text()
    run = RunFolder(out, resume=True, overwrite=False, steps=8)
    run.open(config(steps=8))
    assert (out / "config.toml").read_text() == before
    run.save_config(config(steps=8))
    assert "steps = 8" in (out / "config.toml").read_text()
    run.release()


def test_metrics_cut_short_by_a_kill_lose_their_last_line_and_damaged_ones_are_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(UserError, match=r"metrics\.jsonl is damaged at line 2"):
        read_metrics(path)
    path.write_text('{"step": 0}\nnot json\n')
    with pytest.raises(UserError, match="damaged at line 2"):
        read_metrics(path)


RECIPES_WITH_RUNS = ["sft", "dpo", "grpo", "grpo_async", "orpo", "reward_model", "distill",
                     "tool_use"]  # fmt: skip


@pytest.mark.parametrize("recipe", RECIPES_WITH_RUNS)
def test_every_recipe_takes_resume_auto_and_plain_resume(recipe):
    from kit.config import Run, parse

    module = recipe_module(recipe)
    config_type = next(
        v for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, Run) and getattr(v, "RECIPE", None) == recipe
    )  # fmt: skip
    for argv, resume in ((["--resume", "auto"], "auto"), (["--resume"], True), ([], False)):
        config = parse(config_type, argv, description="", prog=f"{recipe}.py")
        assert config.resume == resume
        assert "resume" not in to_toml(config)


def test_the_resume_command_of_resume_auto():
    command = resume_command(["--resume", "auto", "--steps", "4", "--overwrite"])
    assert command.endswith("--steps 4 --resume") and "auto" not in command


def checkpoints_of(folder: Path):
    import grain
    import jax.numpy as jnp

    from kit.checkpoints import Checkpoints

    def data():
        return iter(grain.MapDataset.range(8).batch(2).to_iter_dataset())

    saved = Checkpoints(folder)
    for step in (2, 4):
        saved.save(step, {"w": jnp.full((4, 2), float(step))}, data(), {"step": step})
    saved.close()
    return Checkpoints, data, {"w": jnp.zeros((4, 2))}


def cut_short(step_folder: Path) -> None:
    """Truncate the state's data file of a checkpoint to half its size."""
    data = sorted((step_folder / "state" / "d").iterdir())[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def test_a_damaged_checkpoint_is_skipped_for_the_latest_intact_one(tmp_path, capsys):
    import numpy as np

    folder = tmp_path / "checkpoints"
    checkpoints_type, data, template = checkpoints_of(folder)
    cut_short(folder / "4")
    checkpoints = checkpoints_type(folder)
    step, state, record = checkpoints.restore_latest(template, data())
    assert (step, record["step"], float(np.asarray(state["w"])[0, 0])) == (2, 2, 2.0)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "the checkpoint of step 4 is damaged (" in lines[0], lines
    assert lines[0].endswith("resuming from step 2, the latest intact one")
    assert (folder / "damaged-4").is_dir()  # kept aside, never deleted
    checkpoints.save(4, state, data(), {"step": 4})  # the run saves that step again
    checkpoints.close()
    assert checkpoints_type(folder).restore_latest(template, data())[0] == 4


def test_with_no_intact_checkpoint_resume_is_one_line(tmp_path):
    folder = tmp_path / "checkpoints"
    checkpoints_type, data, template = checkpoints_of(folder)
    cut_short(folder / "4")
    (folder / "2" / "data" / "process_0-of-1.json").write_text('{"next')
    with pytest.raises(UserError, match=r"no checkpoint in .* is intact \(step 4: .*; step 2: "):
        checkpoints_type(folder).restore_latest(template, data())
    assert sorted(os.listdir(folder)) == ["2", "4"]


def _opens_then(outcome: str, seen: list):
    """A recipe's `train` that opens its run folder, then ends as `outcome` says; it notes the
    garbage collector's thresholds in `seen`. A signal is raised in this (the main) thread,
    and Python runs its handler before `raise_signal` returns: nothing waits for it."""

    def train(config, run):
        seen.append(gc.get_threshold())
        run.open(config)
        assert (run.path / LOCK_FILE).exists()
        if outcome == "done":
            return {"recipe": "sft"}
        if outcome == "bad input":
            raise UserError("a bad data file")
        if outcome == "crash":
            raise RuntimeError("a bug")
        signal.raise_signal(signal.SIGTERM if outcome == "SIGTERM" else signal.SIGINT)
        raise AssertionError("the signal did not stop the run")

    return train


@pytest.fixture
def terminal_signals():
    """Ctrl-C and SIGTERM as a recipe gets them from a terminal: SIGINT raises
    KeyboardInterrupt and neither is blocked. pytest started in the background by a shell
    without job control (`pytest &` in a script) inherits SIGINT ignored, its workers too, and
    Python then leaves it ignored; an earlier test in the process may have replaced it."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    signal.signal(signal.SIGINT, handler)


@pytest.mark.parametrize(
    ("outcome", "status"),
    [("done", None), ("bad input", 2), ("crash", RuntimeError), ("SIGTERM", 143), ("Ctrl-C", 130)],
)
def test_the_lock_is_released_on_every_exit(tmp_path, outcome, status, terminal_signals):
    """The lock, the SIGTERM handler and the garbage collector's thresholds (the recipe's
    own while it trains) are the caller's again after every exit."""
    import kit

    sft = recipe_module("sft")
    argv = ["--out", str(tmp_path / "run"), "--steps", "4"]
    handler, thresholds, seen = signal.getsignal(signal.SIGTERM), gc.get_threshold(), []
    train = _opens_then(outcome, seen)
    assert thresholds != kit.cli.GC_THRESHOLDS
    if status is None:
        kit.cli.main(sft.SFTConfig, train, sft.__doc__, argv=argv)
    elif status is RuntimeError:
        with pytest.raises(RuntimeError):
            kit.cli.main(sft.SFTConfig, train, sft.__doc__, argv=argv)
    else:
        with pytest.raises(SystemExit) as stop:
            kit.cli.main(sft.SFTConfig, train, sft.__doc__, argv=argv)
        assert stop.value.code == status
    assert (tmp_path / "run" / "config.toml").exists()
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    assert signal.getsignal(signal.SIGTERM) is handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert seen == [kit.cli.GC_THRESHOLDS] and gc.get_threshold() == thresholds


class _TermOnCollect:
    """An object whose `__del__` gets SIGTERM: the handler runs inside it, where Python prints
    the exit it raises as ignored and goes on (as it did inside JAX's garbage-collection
    callback when a recipe got SIGTERM in its first second)."""

    def __del__(self):
        signal.raise_signal(signal.SIGTERM)


def test_a_sigterm_whose_exit_is_lost_ends_the_run_before_its_next_step(
    tmp_path, monkeypatch, capsys, terminal_signals
):
    """The run exits 143 at its first step, having saved nothing, without printing the lost
    exit; the unraisable hook and the SIGTERM handler are the caller's again after it."""
    import kit
    import kit.loop

    sft = recipe_module("sft")
    hook, handler = sys.unraisablehook, signal.getsignal(signal.SIGTERM)
    original = kit.loop.initial_state

    def initial_state(*args, **kwargs):  # just before the loop
        _TermOnCollect()  # collected at once: SIGTERM inside its __del__
        return original(*args, **kwargs)

    monkeypatch.setattr(kit.loop, "initial_state", initial_state)
    argv = ["--out", str(tmp_path / "run"), "--steps", "4", "--num-heldout", "8",
            "--no-progress", "--no-plots", "--devices", "1"]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        kit.cli.main(sft.SFTConfig, sft.train, sft.__doc__, argv=argv)
    assert stop.value.code == 143
    assert not (tmp_path / "run" / "model").exists()
    assert not any((tmp_path / "run" / "checkpoints").iterdir())
    assert "Exception ignored" not in capsys.readouterr().err
    assert sys.unraisablehook is hook and signal.getsignal(signal.SIGTERM) is handler
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_sigterm_in_the_loop_saves_the_step_and_says_how_to_continue(
    tmp_path, monkeypatch, capsys, terminal_signals
):
    """SIGTERM (a scheduler's stop, a preemption) during training stops the run as Ctrl-C
    does: the step finishes, a checkpoint of it is saved, one line says how to continue, and
    the exit status is 143; `--resume` continues from that step. (Raised wherever the step
    was, its exit could cut a checkpoint's write short and crash the process's shutdown.)"""
    import kit
    import kit.loop

    sft = recipe_module("sft")
    original, handler = kit.loop.Steps.step, signal.getsignal(signal.SIGTERM)

    def step(self, *args):
        if self.current == 3:
            signal.raise_signal(signal.SIGTERM)  # in the step: the handler asks for a stop
        return original(self, *args)

    monkeypatch.setattr(kit.loop.Steps, "step", step)
    argv = ["--out", str(tmp_path / "run"), "--steps", "6", "--checkpoint-every", "100",
            "--num-heldout", "8", "--no-progress", "--no-plots", "--devices", "1"]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        kit.cli.main(sft.SFTConfig, sft.train, sft.__doc__, argv=argv)
    assert stop.value.code == 143
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("sft.py: stopped by SIGTERM; step 3 is saved: continue with ")
    assert last.endswith("--resume")
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["3"]
    assert signal.getsignal(signal.SIGTERM) is handler  # the caller's again
    monkeypatch.setattr(kit.loop.Steps, "step", original)
    result = kit.cli.main(sft.SFTConfig, sft.train, sft.__doc__, argv=[*argv, "--resume"])
    assert result["restarts"] == 1 and result["steps"] == 6


@pytest.mark.parametrize("start", ["run", "run/model", "run/model/params", "run/best"])
def test_overwrite_refuses_to_remove_what_the_run_reads(tmp_path, start):
    """A start model inside what `--overwrite` removes (the folder itself, its model, a file
    of it, its best model) is refused before anything is removed, naming the flag."""
    out = tmp_path / "run"
    for folder in ("checkpoints/4", "model/params", "best"):
        (out / folder).mkdir(parents=True)
    (out / "result.json").write_text("{}\n")
    settings = config(model=tmp_path / start)
    run = RunFolder(out, resume=False, overwrite=True, steps=4)
    refusal = f"--model {tmp_path / start} is in what --overwrite would remove"
    with pytest.raises(UserError, match=refusal):
        run.check_inputs(settings)
    with pytest.raises(UserError, match=refusal):
        run.open(settings)  # under the lock, as the folder may have changed meanwhile
    run.release()
    assert sorted(os.listdir(out)) == ["best", "checkpoints", "model", "result.json"]
    assert (out / "model" / "params").is_dir()


def test_overwrite_keeps_a_start_model_beside_the_run_entries(tmp_path):
    out = tmp_path / "run"
    (out / "mine" / "model").mkdir(parents=True)  # the user's own folder: never removed
    (out / "result.json").write_text("{}\n")
    run = RunFolder(out, resume=False, overwrite=True, steps=4)
    run.open(config(model=out / "mine" / "model"))
    assert sorted(os.listdir(out)) == sorted([LOCK_FILE, "config.toml", "mine"])
    run.release()


# A chained run's parent (`kit.children.run_child`) and a child that says which signal stopped
# it, which asks to stop with its parent as every recipe does.
CHAIN_PARENT = """
import signal, sys
sys.path.insert(0, {recipes!r})
from kit.children import run_child
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as kit.cli does
run_child([sys.executable, "-c", {child!r}, {folder!r}])
"""
CHAIN_CHILD = """
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, {recipes!r})
from kit.children import stop_with_parent
stop_with_parent()
folder = Path(sys.argv[1])
def say(name, text):  # whole: written beside, then renamed into place
    (folder / (name + ".part")).write_text(text)
    os.replace(folder / (name + ".part"), folder / name)
def stop(signum, _):
    say("stopped", signal.Signals(signum).name)
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
say("child", str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def wait_for(path: Path, seconds: float = 60.0) -> str:
    """The text of `path` once written (the child writes it whole and renames it into place),
    waiting up to `seconds`."""
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.read_text()


@pytest.mark.parametrize(
    ("sent", "stopped_by", "parent_code"),
    [
        (signal.SIGTERM, "SIGTERM", 143),
        (signal.SIGINT, "SIGINT", -signal.SIGINT),  # KeyboardInterrupt, not caught here
        (signal.SIGKILL, "SIGTERM", -signal.SIGKILL),  # no orphan: Linux stops the child
    ],
)
def test_a_chained_run_stops_with_its_parent(tmp_path, sent, stopped_by, parent_code):
    """A recipe stopped while its chained SFT run trains passes the stop on (the child saves
    its state and ends) and, killed, leaves no orphan training on."""
    from tests.recipes._scripts import RECIPES

    if sent == signal.SIGKILL and sys.platform != "linux":
        pytest.skip("the parent-death signal is Linux's")
    child_program = CHAIN_CHILD.replace("{recipes!r}", repr(str(RECIPES)))
    program = CHAIN_PARENT.format(recipes=str(RECIPES), child=child_program, folder=str(tmp_path))
    parent = subprocess.Popen([sys.executable, "-c", program], stderr=subprocess.DEVNULL)
    child = int(wait_for(tmp_path / "child"))
    parent.send_signal(sent)
    assert parent.wait(timeout=120) == parent_code
    assert wait_for(tmp_path / "stopped") == stopped_by
    with pytest.raises(ProcessLookupError):  # ended (and reaped by init when orphaned)
        for _ in range(1200):
            os.kill(child, 0)
            time.sleep(0.05)


def test_a_resumed_run_refuses_a_start_model_retrained_in_place(tmp_path, capsys):
    """The start model's fingerprint is kept when the run starts and checked on `--resume`:
    retrained or replaced in place, it would change the frozen reference under the run."""
    start = tmp_path / "sft" / "model"
    run = RunFolder(tmp_path / "run", resume=False, overwrite=False, steps=4)
    run.check_start_model(start, 0x1234)
    run.open(config())
    run.release()
    record = json.loads((tmp_path / "run" / "start_model.json").read_text())
    assert record == {"model": str(start), "fingerprint": 0x1234}
    (tmp_path / "run" / "checkpoints" / "2").mkdir(parents=True)
    resumed = RunFolder(tmp_path / "run", resume=True, overwrite=False, steps=4)
    resumed.check_start_model(start, 0x1234)
    refusal = r"not the one .* started from .*0x00001235, was 0x00001234"
    with pytest.raises(UserError, match=refusal):
        resumed.check_start_model(start, 0x1235)
    (tmp_path / "run" / "start_model.json").write_text("{")  # damaged: said, not refused
    resumed.check_start_model(start, 0x1235)
    assert "start_model.json is damaged" in capsys.readouterr().err
