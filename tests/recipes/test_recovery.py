"""Fast recovery: the compilation cache beside the run, asynchronous checkpoints, and
`--checkpoint-every auto` (Young/Daly)."""

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import user_env
from tests.recipes._scripts import RECIPES, recipe_module
from tests.recipes.test_recipes import SMALL, leaves, load_params, records_of, run_recipe

from kit import checkpoint_interval, compile_cache
from kit.checkpoint_interval import Interval, young_daly_steps
from kit.config import parse, to_toml

# ----------------------------------------------------------------------------- compilation cache


def test_the_cache_goes_beside_the_run_unless_jax_has_one_or_the_user_names_one(tmp_path):
    out = tmp_path / "run"
    beside = compile_cache.settings(None, out, None)
    assert beside == {
        "jax_enable_compilation_cache": True,
        "jax_compilation_cache_dir": str((out / "compile_cache").resolve()),
        "jax_persistent_cache_min_compile_time_secs": 0.0,  # every program, however quick
        "jax_persistent_cache_min_entry_size_bytes": -1,  # however small
        "jax_persistent_cache_enable_xla_caches": "none",  # keys that do not name the folder
    }
    on_gpu = compile_cache.settings(None, out, None, accelerator=True, gpu=True)
    assert "jax_persistent_cache_enable_xla_caches" not in on_gpu  # autotuning's cache kept
    assert compile_cache.settings(None, out, "/somewhere/jax") is None  # JAX's own is kept
    assert compile_cache.settings(None, None, None) is None  # --plan writes nothing
    named = compile_cache.settings(str(tmp_path / "shared"), out, "/somewhere/jax")
    assert named["jax_compilation_cache_dir"] == str((tmp_path / "shared").resolve())
    assert compile_cache.settings("none", out, "/somewhere/jax") == {
        "jax_enable_compilation_cache": False
    }


def test_on_an_accelerator_every_run_of_the_user_shares_one_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache-home"))
    assert compile_cache.default_folder() == tmp_path / "cache-home" / "tunelib" / "jax"
    shared = compile_cache.settings(None, tmp_path / "run", None, accelerator=True)
    assert shared["jax_compilation_cache_dir"] == str(compile_cache.default_folder().resolve())
    assert shared["jax_persistent_cache_min_compile_time_secs"] == 0.0
    # JAX's own cache and the user's folder still come first.
    assert compile_cache.settings(None, tmp_path / "run", "/jax", accelerator=True) is None
    named = compile_cache.settings(str(tmp_path / "mine"), tmp_path / "run", None, accelerator=True)
    assert named["jax_compilation_cache_dir"] == str((tmp_path / "mine").resolve())
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache.default_folder() == Path.home() / ".cache" / "tunelib" / "jax"


@pytest.mark.parametrize(
    ("platforms", "expected"), [("cpu", False), ("tpu", True), ("cuda,cpu", True), ("CPU", False)]
)
def test_the_platforms_setting_says_whether_jax_runs_on_an_accelerator(platforms, expected):
    assert compile_cache.accelerator_machine(platforms) is expected


def test_without_a_setting_the_installed_plugins_say_it(monkeypatch):
    """This machine's JAX has no TPU or GPU plugin (the tests run on CPU); libtpu installed
    makes it a TPU machine, told without starting JAX's backend."""
    import importlib.util

    assert compile_cache.accelerator_machine(None) is False
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "libtpu" else found(name)
    )
    assert compile_cache.accelerator_machine(None) is True


def test_used_caches_every_program_in_its_folder_and_puts_jax_back(tmp_path):
    import jax
    import jax.numpy as jnp

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_enable_compilation_cache")  # fmt: skip
    before = {name: getattr(jax.config, name) for name in names}
    folder = tmp_path / "cache"
    with compile_cache.used(str(folder), tmp_path / "run"):
        assert jax.config.jax_compilation_cache_dir == str(folder.resolve())
        jax.jit(lambda x: x * 3.0 + 1.0)(jnp.arange(5.0)).block_until_ready()
    assert [p.name for p in folder.iterdir() if p.name.startswith("jit__lambda")]
    assert {name: getattr(jax.config, name) for name in names} == before
    with compile_cache.used("none", tmp_path / "run"):
        assert not jax.config.jax_enable_compilation_cache
    assert {name: getattr(jax.config, name) for name in names} == before


def test_a_cache_copied_elsewhere_serves_the_same_programs(tmp_path):
    """The cache of a run folder copied or moved elsewhere: the same program is loaded from
    it, not compiled again (no entry added), where the folder's name was part of every key."""
    import shutil

    import jax
    import jax.numpy as jnp

    def entries(folder):
        return sorted(p.name for p in folder.iterdir() if p.name.startswith("jit__lambda"))

    def compile_in(folder):
        jax.clear_caches()  # nothing kept in memory: the program comes from `folder` or XLA
        with compile_cache.used(str(folder), tmp_path / "run"):
            jax.jit(lambda x: jnp.tanh(x) * 7.0 - 2.0)(jnp.arange(3.0)).block_until_ready()

    compile_in(tmp_path / "here")
    shutil.copytree(tmp_path / "here", tmp_path / "there")
    compile_in(tmp_path / "there")
    assert len(entries(tmp_path / "here")) == 1
    assert entries(tmp_path / "there") == entries(tmp_path / "here")


# ----------------------------------------------------------------------------- the interval


@given(
    cost=st.floats(1e-3, 1e3), mtti=st.floats(1.0, 1e6), step=st.floats(1e-3, 1e2)
)  # fmt: skip
def test_the_auto_interval_is_young_daly_in_steps(cost, mtti, step):
    steps = young_daly_steps(cost, mtti, step)
    tau = math.sqrt(2.0 * cost * mtti)  # Young (1974): the seconds between checkpoints
    assert steps == max(1, round(tau / step))
    assert steps >= 1


def test_the_interval_is_measured_then_said_and_agreed():
    interval = Interval("auto", mtti=3600.0)
    assert interval.due(1)  # the first step's checkpoint measures the cost
    assert interval.measured({"checkpoint": 0.5, "train": 9.0}, True, 1) is None
    assert not interval.due(2)
    line = interval.measured({"train": 0.08, "data": 0.02, "eval": 5.0, "compile": 9.0}, False, 1)
    assert interval.every == 600 == young_daly_steps(0.5, 3600.0, 0.1)  # eval, compile left out
    assert line.startswith("--checkpoint-every auto: every 600 steps: a checkpoint costs 0.5 s")
    assert "MTTI 3600 s (assumed, --mtti)" in line and "= 60 s of steps" in line
    assert [s for s in range(1, 1300) if interval.due(s)] == [600, 1200]
    fixed = Interval(5, mtti=3600.0)
    assert [s for s in range(1, 12) if fixed.due(s)] == [5, 10]
    assert fixed.measured({"checkpoint": 1.0}, True, 1) is None


def test_the_observed_mtti_replaces_the_assumed_one_after_an_interruption():
    step = {"time_train": 2.0, "time_checkpoint": 1.0, "time_eval": 1.0}
    interval = Interval("auto", mtti=3600.0)
    interval.observe([step] * 10, {"restarts": 0, "lost_seconds": 0.0})
    assert (interval.mtti, interval.observed) == (3600.0, False)  # never interrupted
    interval.observe([step] * 10, {"restarts": 2, "lost_seconds": 20.0})
    assert (interval.mtti, interval.observed) == ((10 * 4.0 + 20.0) / 2, True)
    assert checkpoint_interval.observed_mtti(60.0, 0) is None


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_async_auto_checkpoints_resume_to_the_weights_of_a_synchronous_run(tmp_path, capsys):
    """Asynchronous checkpoints at the auto interval (the first step's, then Young/Daly's),
    resumed after a kill that lost the rest, give the weights of a run that saved
    synchronously, bit for bit."""
    flags = ["--steps", "6", "--eval-every", "1000"]
    run_recipe("sft", *flags, "--sync-checkpoints", "--checkpoint-every", "2",
               "--out", str(tmp_path / "sync"))  # fmt: skip
    out = tmp_path / "async"
    command = [*flags, "--checkpoint-every", "auto", "--out", str(out), "--resume", "auto"]
    capsys.readouterr()
    run_recipe("sft", *command)
    line = next(x for x in capsys.readouterr().out.splitlines() if "auto: every" in x)
    every = int(re.search(r"auto: every (\d+) steps", line).group(1))
    cost, step = (float(x) for x in re.search(r"costs (\S+) s, a step (\S+) s", line).groups())
    # Young/Daly from the line's figures (rounded to 3 digits there).
    assert abs(every - math.sqrt(2 * cost * 3600.0) / step) <= 1 + 0.01 * every
    assert every > 6  # a tiny run's checkpoint is cheap against an hour's MTTI
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [1, 6]
    assert not (out / "compile_cache").exists()  # the tests' own JAX cache is kept
    # Killed after the first step's checkpoint: the rest of the run is lost.
    shutil.rmtree(out / "checkpoints" / "6")
    shutil.rmtree(out / "model")
    (out / "result.json").unlink()
    resumed = run_recipe("sft", *command)
    assert "resuming from the checkpoint of step 1" in capsys.readouterr().out
    assert resumed["restarts"] == 1
    for a, b in zip(leaves(load_params(tmp_path / "sync")), leaves(load_params(out)), strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit
    assert [r["step"] for r in records_of(out)] == list(range(7))


# A process that saves step 1, then starts an asynchronous save of step 2 and is killed
# (SIGKILL) while it is being written: at the moment Orbax would rename it into place.
_KILLED_MID_SAVE = """
import os, signal, sys
sys.path.insert(0, {recipes!r})
from pathlib import Path
import grain, jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from kit.checkpoints import Checkpoints

folder = Path({folder!r})
batches = iter(grain.MapDataset.range(8).batch(2).to_iter_dataset())
checkpoints = Checkpoints(folder, asynchronous=True)
checkpoints.save(1, {{"w": jnp.full((64, 64), 1.0)}}, batches, {{"step": 1}})
checkpoints.manager.wait_until_finished()
finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def killed(self):
    os.kill(os.getpid(), signal.SIGKILL)

atomicity.AtomicRenameTemporaryPath.finalize = killed
next(batches)
checkpoints.save(2, {{"w": jnp.full((64, 64), 2.0)}}, batches, {{"step": 2}})
(folder.parent / "save returned").write_text("")  # before the files were written
checkpoints.manager.wait_until_finished()
"""


def test_a_kill_during_an_asynchronous_save_leaves_the_previous_checkpoint(tmp_path, capsys):
    import grain
    import jax.numpy as jnp

    from kit.checkpoints import Checkpoints

    folder = tmp_path / "checkpoints"
    code = _KILLED_MID_SAVE.format(recipes=str(RECIPES), folder=str(folder))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env=user_env(), check=False,
    )  # fmt: skip
    assert proc.returncode == -9, proc.stderr[-3000:]  # killed
    assert (tmp_path / "save returned").exists()  # the save went on in the background
    assert [p.name for p in folder.iterdir() if p.name.startswith("2.")]  # half-written
    assert not (folder / "2").exists()
    checkpoints = Checkpoints(folder, asynchronous=True)
    batches = iter(grain.MapDataset.range(8).batch(2).to_iter_dataset())
    step, state, record = checkpoints.restore_latest({"w": jnp.zeros((64, 64))}, batches)
    assert (step, record, float(state["w"].sum())) == (1, {"step": 1}, 64.0 * 64.0)
    assert capsys.readouterr().err == ""  # nothing damaged: the last one was never renamed
    checkpoints.save(2, state, batches, {"step": 2})  # the run saves that step again
    checkpoints.close()
    assert Checkpoints(folder).manager.all_steps() == [1, 2]


def test_auto_and_the_recovery_settings_round_trip_through_config_toml(tmp_path):
    sft = recipe_module("sft").SFTConfig
    flags = [*SMALL, "--checkpoint-every", "auto", "--mtti", "600", "--sync-checkpoints",
             "--compile-cache", "none"]  # fmt: skip
    config = parse(sft, flags, description="", prog="sft.py")
    (tmp_path / "config.toml").write_text(to_toml(config))
    again = parse(sft, ["--config", str(tmp_path / "config.toml")], description="", prog="")
    assert again == config and config.checkpoint_every == "auto" and config.mtti == 600.0
    numbered = parse(sft, ["--checkpoint-every", "7"], description="", prog="sft.py")
    assert numbered.checkpoint_every == 7
