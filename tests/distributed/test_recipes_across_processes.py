"""The recipes on JAX's multi-controller runtime: 2 processes of 2 CPU devices each (Gloo on
loopback, started by `tunelib.launch`) against 1 process of 4 devices, with the same global
batch; a run's checkpoint restored on other process and device counts.
(A process killed, then the run restarted on 2 processes by the supervisor and ending bit for
bit as the uninterrupted run, is `tests/benchmarks/test_chaos_benchmark.py`'s.)"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from filelock import FileLock

from tests._helpers import user_env

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
sys.path.insert(0, str(RECIPES))
from kit.runs import checkpoint_steps  # noqa: E402

pytestmark = pytest.mark.slow  # recipe runs

# A small task and model; 20 steps, with checkpoints to resume from on the way.
SMALL = [
    "--num-train", "128", "--num-heldout", "12", "--batch-size", "8", "--no-progress",
    "--no-plots", "--eval-every", "20",
]  # fmt: skip
SFT = [*SMALL, "--model-size", "student", "--steps", "20", "--checkpoint-every", "5"]
# Per logged value: relative, or absolute for values near zero that are differences of terms
# of order one (a GRPO loss), where one float32 rounding (1.2e-7 at 1) of a sum reduced in
# another order (across processes, through Gloo) is all that may differ.
RTOL, ATOL = 1e-6, 2e-7


def environment(devices: int) -> dict:
    env = user_env(compilation_cache=True)
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    )
    return env


def command(recipe: str, args, *, processes: int, devices: int) -> list[str]:
    script = str(RECIPES / f"{recipe}.py")
    if processes == 1:
        return [sys.executable, script, *args]
    launch = ["-m", "tunelib.launch", "-n", str(processes), "--devices-per-process", str(devices)]
    return [sys.executable, *launch, script, *args]


def run(recipe: str, *args: str, processes: int = 1, devices: int = 1) -> dict:
    """The recipe to the end; its final JSON line (printed once, by process 0)."""
    proc = subprocess.run(
        command(recipe, args, processes=processes, devices=devices),
        capture_output=True, text=True, timeout=600, env=environment(devices), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [line for line in proc.stdout.splitlines() if '"recipe"' in line]
    assert len(results) == 1, proc.stdout[-3000:]
    prefix = "[0] " if processes > 1 else ""
    assert results[0].startswith(prefix)
    return json.loads(results[0].removeprefix(prefix))


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def logged(folder: Path) -> dict[str, list[float]]:
    """Every logged value but the times, by name, in step order."""
    out: dict[str, list[float]] = {}
    for record in records(folder):
        for key, value in record.items():
            if not key.startswith("time_"):
                out.setdefault(key, []).append(value)
    return out


def params(folder: Path) -> list[np.ndarray]:
    """The saved model's weights, onto this process's first device (whichever devices and
    processes saved them)."""
    import jax

    path = (folder / "model" / "params").resolve()
    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as checkpointer:
        shapes = checkpointer.metadata(path).item_metadata
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), shapes
        )
        restored = checkpointer.restore(path, target)
    return [np.asarray(x) for x in jax.tree.leaves(restored)]


def assert_same_run(a: Path, b: Path) -> None:
    """The same steps, logged values within `RTOL` and the same final weights."""
    got, want = logged(a), logged(b)
    assert got.keys() == want.keys() and got["step"] == want["step"] == list(range(21))
    for key in got:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL, err_msg=key)
    for x, y in zip(params(a), params(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory) -> dict[str, Path]:
    """The same SFT run on 1 process of 4 devices and on 2 processes of 2. Made once for the
    whole session: the first xdist worker to need them makes them, under a lock, and the
    other finds them done."""
    base = tmp_path_factory.getbasetemp()  # an xdist worker's is in the session's folder
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "sft-runs"
    root.mkdir(exist_ok=True)
    runs = {"1x4": root / "1x4", "2x2": root / "2x2"}
    with FileLock(str(root / "lock")):
        if not (root / "done").exists():
            for folder in runs.values():
                shutil.rmtree(folder, ignore_errors=True)
            run("sft", *SFT, "--out", str(runs["1x4"]), devices=4)
            run("sft", *SFT, "--out", str(runs["2x2"]), processes=2, devices=2)
            (root / "done").touch()
    return runs


def stopped_at(folder: Path, step: int, out: Path) -> Path:
    """A copy of the finished run `folder` as a crash after its checkpoint of `step` leaves
    it: the later checkpoints, the model and the result gone (the metrics of the steps after
    it stay, to be replaced by the resumed run's)."""
    stopped = Path(shutil.copytree(folder, out))
    for later in [s for s in checkpoint_steps(stopped) if s > step]:
        shutil.rmtree(stopped / "checkpoints" / str(later))
    shutil.rmtree(stopped / "model")
    (stopped / "result.json").unlink()
    assert checkpoint_steps(stopped)[-1] == step
    return stopped


def test_sft_on_two_processes_equals_one_process_of_four_devices(sft_runs):
    assert_same_run(sft_runs["2x2"], sft_runs["1x4"])
    two = sft_runs["2x2"]
    # Every process saved its data position; process 0 alone wrote the run's own files.
    data = two / "checkpoints" / "20" / "data"
    assert sorted(p.name for p in data.glob("*.json")) == [
        "process_0-of-2.json", "process_1-of-2.json",
    ]  # fmt: skip
    assert len(records(two)) == 21 and (two / "result.json").is_file()


def test_a_checkpoint_resumes_on_other_process_and_device_counts(sft_runs, tmp_path):
    """Elastic restore: the checkpoint of step 15 that 2 processes of 2 devices left resumes
    on 1 process of 1 device; the run ends as the uninterrupted one of 1 process of 4 devices
    (to `RTOL`: the sums' order changes with the devices). (A process killed, then resumed,
    is `tests/benchmarks/test_chaos_benchmark.py`'s and `tests/recipes`'.)"""
    out = stopped_at(sft_runs["2x2"], 15, tmp_path / "stopped")
    result = run("sft", *SFT, "--out", str(out), "--resume", devices=1)
    assert result["restarts"] == 1
    assert_same_run(out, sft_runs["1x4"])


def test_grpo_on_two_processes_equals_one_process_of_four_devices(sft_runs, tmp_path):
    """GRPO from the SFT model: the same logged values on 2 processes of 2 devices as on 1
    process of 4 (its samples included: the sampler draws the same tokens); and GRPO
    disaggregated with staleness 0 (process 0 trains on its 2 devices, process 1 samples on
    its 2) as well. (DPO trains through the kit's data-parallel loop that the SFT tests
    cover: each process takes its rows of the global batch of pairs, as SFT's of sequences.)"""
    model = ["--model", str(sft_runs["1x4"] / "model")]
    grpo = ["--num-prompts", "64", "--steps", "3", "--eval-every", "3", "--group-size", "4",
            "--max-new-tokens", "6", "--updates-per-batch", "2", "--eval-samples", "0"]  # fmt: skip
    runs = {
        "grpo-2x2": ("grpo", grpo),
        "grpo-disaggregated": ("grpo", [*grpo, "--max-staleness", "0"]),
    }
    for name, (recipe, flags) in runs.items():
        args = [*SMALL, *model, *flags]
        one = tmp_path / f"{recipe}-1x4"
        if not one.exists():
            run(recipe, *args, "--out", str(one), devices=4)
        run(recipe, *args, "--out", str(tmp_path / name), processes=2, devices=2)
        got, want = logged(tmp_path / name), logged(one)
        if name == "grpo-disaggregated":  # every batch as fresh as the synchronous recipe's
            assert got.pop("staleness") == [0.0, 0.0, 0.0]
            assert min(got.pop("weight_push_mb_per_s")) > 0
            assert got.pop("weight_push_delta") == [0.0, 0.0, 0.0]  # --weight-push full
            assert len(set(got.pop("weight_push_mb"))) == 1  # the whole weights each time
        assert got.keys() == want.keys() and len(got["step"]) > 1
        for key in got:
            np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL, err_msg=key)


def test_asynchronous_grpo_resumes_with_its_batches_in_flight_bit_for_bit(sft_runs, tmp_path):
    """GRPO with staleness 1 (process 1 samples the next batch with the weights one update
    old while process 0 trains): a run stopped after its checkpoint of step 2 (its later
    checkpoint, model and result gone, as a crash leaves it) resumes with the batch that was
    in flight, as it was sampled, and ends bit for bit as the run that never stopped. (Sampled
    again with the restored weights, that batch left the final weights 3.9e-5 apart.) The
    weights go to the sampler in bfloat16, as deltas after the first push (at a learning rate
    small enough that few elements change); the resumed run's first push is whole, so the
    two runs' samplers got the same weights by both routes. A delta that rebuilt other
    weights would fail the sampler's fingerprint check, or the trainer's ledger."""
    flags = [*SMALL, "--model", str(sft_runs["1x4"] / "model"), "--num-prompts", "64",
             "--steps", "3", "--eval-every", "100", "--checkpoint-every", "2",
             "--group-size", "4", "--max-new-tokens", "6", "--eval-samples", "0",
             "--max-staleness", "1", "--push-dtype", "bfloat16", "--weight-push", "delta",
             "--learning-rate", "1e-6"]  # fmt: skip
    whole = tmp_path / "whole"
    run("grpo", *flags, "--out", str(whole), processes=2, devices=1)
    records = logged(whole)
    assert records["staleness"] == [0.0, 1.0, 1.0]
    assert records["weight_push_delta"] == [0.0, 1.0, 1.0]  # whole, then deltas
    assert max(records["weight_push_mb"][1:]) < records["weight_push_mb"][0]
    stopped = stopped_at(whole, 2, tmp_path / "stopped")
    result = run("grpo", *flags, "--out", str(stopped), "--resume", processes=2, devices=1)
    assert result["restarts"] == 1
    got, want = logged(stopped), logged(whole)
    assert got.pop("weight_push_delta") == [0.0, 1.0, 0.0]  # whole again after the restart
    for timing in ("weight_push_mb_per_s", "weight_push_mb"):
        got.pop(timing), want.pop(timing)
    want.pop("weight_push_delta")
    assert got == want
    for x, y in zip(params(stopped), params(whole), strict=True):
        np.testing.assert_array_equal(x, y)
