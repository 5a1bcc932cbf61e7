"""End-to-end runs of the recipes.

Most runs call a recipe's entry point in this process (`kit.cli.main`, exactly what
`python recipes/<name>.py` runs, without starting Python and JAX again); the runs that test
what only a process shows (its output and exit status, Ctrl-C, a logger's own service) start
`python recipes/<name>.py` as a user does. Each run is as short as still proves its point.
"""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from tests._helpers import user_env
from tests.recipes._scripts import (
    RECIPES,
    recipe_main,
    recipe_module,
    run_recipe_process,
    snapshot,
)

from kit.evaluate import SAMPLED

ONE_HOLDER = Path(__file__).resolve().parents[1] / "one_holder"  # its sitecustomize.py

# A small, fast slice of the task; the model is the recipes' own. One device, as a user's
# process has, not the test session's eight (tests/distributed runs the recipes on several).
SMALL = [
    "--num-train", "256", "--num-heldout", "32", "--batch-size", "8", "--no-progress",
    "--no-plots", "--devices", "1",
]  # fmt: skip
# The same with the plots a user gets by default (one test looks at them).
PLOTTED = [flag for flag in SMALL if flag != "--no-plots"]
# One budget for the short runs: the optimizer's schedule is compiled into each step, so runs
# with the same steps share their compiled programs through the session's cache.
STEPS = ["--steps", "4", "--eval-every", "4"]


@contextlib.contextmanager
def shared_compilation_cache():
    """The SFT runs a recipe starts as processes share the session's compilation cache, and
    the runs in this process keep every program there too: the recipes build their steps
    afresh each run, so a rerun with the same shapes finds them on disk instead of compiling."""
    import jax

    with pytest.MonkeyPatch.context() as patch:
        for name, value in user_env(compilation_cache=True).items():
            if name.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")):
                patch.setenv(name, value)
        previous = jax.config.jax_persistent_cache_min_compile_time_secs
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        try:
            yield patch
        finally:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", previous)


@pytest.fixture(autouse=True)
def _shared_compilation_cache():
    with shared_compilation_cache():
        yield


RL = ("grpo", "grpo_async", "distill", "tool_use")  # the recipes with sampled held-out metrics


def quick_evaluation(name: str, args: tuple[str, ...]) -> list[str]:
    """The RL recipes sample 8 completions of every held-out problem at each evaluation by
    default; a test that does not look at those metrics evaluates greedy accuracy alone."""
    asked = any(arg.split("=")[0] == "--eval-samples" for arg in args)
    return ["--eval-samples", "0"] if name in RL and not asked else []


def run_recipe(name: str, *args: str, headline: str | None = None) -> dict:
    """The recipe run in this process; its final JSON line as a dict."""
    try:
        result = recipe_main(name, [*SMALL, *quick_evaluation(name, args), *args])
    except SystemExit as stop:
        pytest.fail(f"{name}.py exited with status {stop.code}")
    assert result["recipe"] == (headline or name)
    return result


def one_holder_env(folder: Path) -> dict:
    """The variables that make a recipe process, and every process it starts, follow a TPU
    host's rule on CPU: one process at a time may start JAX's backend, the others fail
    (`tests/one_holder/sitecustomize.py`). A recipe that started its backend before a chained
    run of its own ends fails with them."""
    path = [str(ONE_HOLDER), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), "TUNELIB_TEST_ONE_HOLDER": str(folder / "lock")}


def run_process(name: str, *args: str, env=None) -> dict:
    """`python recipes/<name>.py` as a user runs it; the last line it prints, as JSON."""
    proc = run_recipe_process(name, *SMALL, *quick_evaluation(name, args), *args, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["recipe"] == name
    return last


def records_of(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def load_params(folder: Path) -> dict:
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore((folder / "model" / "params").resolve())


def leaves(tree) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def chained(tmp_path_factory) -> dict:
    """DPO without --model: it trains the seed's SFT run at its default place first (and only
    there), then QLoRA adapters on it, on packed rows; as a process on a host where one
    process at a time may open the devices, as on a TPU host (`one_holder_env`). The SFT run
    is the start model of the other recipe tests of this module."""
    root = tmp_path_factory.mktemp("chained")
    env = {"TUNELIB_RUNS": str(root / "runs"), **one_holder_env(root)}
    result = run_process(
        "dpo", "--sft-steps", "4", "--num-prompts", "64", *STEPS, "--lora-rank", "4",
        "--qlora", "--packing", "--out", str(root / "dpo"), env=env,
    )  # fmt: skip
    return {"sft": root / "runs" / "sft-seed0", "dpo": root / "dpo", "result": result}


@pytest.fixture(scope="module")
def sft_start(chained) -> Path:
    return chained["sft"]


@pytest.mark.slow
def test_sft_logs_plots_saves_its_config_and_reproduces_from_it(tmp_path):
    out = tmp_path / "sft"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    flags = [*PLOTTED, "--steps", "4", "--eval-every", "2", "--out", str(out), "--log-to",
             "jsonl,tensorboard,wandb"]  # fmt: skip
    proc = run_recipe_process("sft", *flags, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"seconds", "accuracy_before", "accuracy_after", "heldout_loss_after"} <= set(result)
    assert all(round(v, 4) == v for v in result.values() if isinstance(v, float))
    records = records_of(out)
    assert [r["step"] for r in records] == list(range(5))  # step 0: before training
    assert all(("accuracy" in r) == (r["step"] % 2 == 0) for r in records)
    assert all(np.isfinite(r["loss"]) for r in records[1:])
    assert (out / "curves.png").stat().st_size > 0
    # Every step's time split; their sums in the final line; the split's own plot.
    phases = ("compile", "data", "rollout", "logprobs", "train", "sync", "checkpoint", "eval",
              "idle")  # fmt: skip
    assert all(all(f"time_{p}" in r for p in phases) for r in records[1:])
    assert set(result["time"]) == {*phases, "goodput"} and 0 < result["time"]["goodput"] < 1
    assert result["time"]["compile"] > 0 and result["time"]["train"] > 0
    assert result["restarts"] == 0 and result["badput_seconds"] == 0
    assert (out / "goodput.png").stat().st_size > 0
    assert any((out / "tensorboard").glob("events.out.tfevents.*"))
    assert any((out / "wandb").rglob("*.wandb"))  # an offline W&B run
    assert json.loads((out / "model" / "char_tokenizer.json").read_text())
    # The saved configuration is the run's: loaded with --config, it gives the same settings.
    from kit.config import parse

    sft = recipe_module("sft").SFTConfig
    original = parse(sft, flags, description="", prog="sft.py")
    assert parse(sft, ["--config", str(out / "config.toml")], description="", prog="") == original


@pytest.mark.slow
def test_interrupt_then_resume_equals_an_uninterrupted_run(tmp_path, capsys):
    """Ctrl-C saves the last finished step and says how to continue; a checkpoint left
    half-written by a crash is ignored; the resumed run equals the straight one bit for bit,
    and `--resume` with more `--steps` extends a finished run."""
    flags = ["--steps", "20", "--checkpoint-every", "5", "--eval-every", "1000"]
    run_recipe("sft", *flags, "--out", str(tmp_path / "straight"))
    assert not list((tmp_path / "straight").glob("*.png"))  # --no-plots

    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(
        [sys.executable, str(RECIPES / "sft.py"), *SMALL, *flags, "--out", str(stopped)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=user_env(compilation_cache=True),
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not ((stopped / "metrics.jsonl").exists() and len(records_of(stopped)) > 6):
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    last_line = stderr.strip().splitlines()[-1]
    assert "interrupted; step" in last_line and last_line.endswith("--resume"), stderr
    saved = int(last_line.split("step ")[1].split()[0])
    assert 6 <= saved < 20 and not (stopped / "model").exists()
    # A later checkpoint that a crash left half-written: a temporary folder Orbax never renamed.
    partial = stopped / "checkpoints" / f"{saved + 1}.orbax-checkpoint-tmp-1234567"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\x00" * 64)

    resumed_result = run_recipe("sft", *flags, "--out", str(stopped), "--resume")
    assert f"resuming from the checkpoint of step {saved}" in capsys.readouterr().out
    # Ctrl-C saved the step it finished: a restart, and no step lost.
    assert (resumed_result["restarts"], resumed_result["badput_seconds"]) == (1, 0.0)
    straight, resumed = leaves(load_params(tmp_path / "straight")), leaves(load_params(stopped))
    assert len(straight) == len(resumed) > 0
    for a, b in zip(straight, resumed, strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit
    assert [r["step"] for r in records_of(stopped)] == list(range(21))
    longer = ["--steps", "22", "--checkpoint-every", "5", "--eval-every", "1000"]
    run_recipe("sft", *longer, "--out", str(stopped), "--resume")
    assert [r["step"] for r in records_of(stopped)][-3:] == [20, 21, 22]


@pytest.mark.slow
def test_resume_auto_starts_finishes_a_run_killed_before_its_model_and_reruns_as_done(
    tmp_path, capsys
):
    """`--resume auto` starts a run in an empty folder; a run killed after its last
    checkpoint, before its model was saved, is finished by it from that checkpoint; the
    command rerun on a finished run prints its result again and writes nothing."""
    out = tmp_path / "run"
    command = [*STEPS, "--out", str(out), "--resume", "auto"]
    first = run_recipe("sft", *command)
    params = leaves(load_params(out))
    shutil.rmtree(out / "model")  # killed after the final checkpoint, before the model
    (out / "result.json").unlink()
    capsys.readouterr()
    finished = run_recipe("sft", *command)
    assert "sft: resuming from the checkpoint of step 4" in capsys.readouterr().out
    for a, b in zip(params, leaves(load_params(out)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert finished["restarts"] == 1 and finished["final_loss"] == first["final_loss"]
    assert [r["step"] for r in records_of(out)] == [0, 1, 2, 3, 4]
    before = snapshot(out)
    again = run_recipe("sft", *command)
    assert f"sft.py: {out} finished its 4 steps already" in capsys.readouterr().out
    assert again == finished and snapshot(out) == before
    assert not (out / ".lock").exists()


def losses_of(folder: Path) -> list[float]:
    return [r["loss"] for r in records_of(folder) if "loss" in r]


@pytest.mark.slow
def test_fused_and_naive_log_probs_give_the_same_training_curves(tmp_path, sft_start):
    """The recipes' fused head against materialised logits: DPO (the fused head on both sides
    of every pair, for policy and reference), same seed, same steps."""
    for impl in ("chunked", "naive"):
        run_recipe(
            "dpo", *STEPS, "--logprobs", impl, "--num-prompts", "64", "--model", str(sft_start),
            "--rejected", "near_miss", "--out", str(tmp_path / f"dpo-{impl}"),
        )  # fmt: skip
    fused, naive = losses_of(tmp_path / "dpo-chunked"), losses_of(tmp_path / "dpo-naive")
    assert len(fused) == len(naive) == 4
    np.testing.assert_allclose(fused, naive, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_dpo_trains_its_sft_start_then_runs_packed_with_qlora(chained):
    """See the `chained` fixture: the SFT run exists where DPO owns it, DPO took its time
    into account, and the first step's policy is the NF4 base, so the loss is log 2."""
    out = chained["result"]
    assert (chained["sft"] / "model" / "config.json").exists()
    assert out["sft_seconds"] > 0 and out["tuning"] == "qlora" and out["base_bits_per_param"] < 8
    assert abs(records_of(chained["dpo"])[1]["loss"] - np.log(2)) < 1e-5


@pytest.mark.slow
def test_orpo_runs_with_its_sft_baseline(tmp_path):
    """The baseline trains in the run's folder before the run opens its devices (one process
    at a time may, as on a TPU host); a rerun of the finished run with more steps resumes
    both."""
    run, env = tmp_path / "orpo", one_holder_env(tmp_path)
    out = run_process("orpo", *STEPS, "--out", str(run), env=env)
    assert {"accuracy_after", "sft_accuracy_after", "baseline_seconds"} <= set(out)
    assert json.loads((run / "baseline" / "result.json").read_text())["steps"] == 4
    more = run_process("orpo", "--steps", "5", "--eval-every", "4", "--out", str(run),
                       "--resume", env=env)  # fmt: skip
    assert more["steps"] == 5 and [r["step"] for r in records_of(run)][-1] == 5
    assert json.loads((run / "baseline" / "result.json").read_text())["steps"] == 5


@pytest.mark.slow
def test_distill_trains_its_teacher_and_runs_with_the_fused_divergence(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNELIB_RUNS", str(tmp_path / "runs"))
    teacher = tmp_path / "runs" / "teacher-seed0"
    out = run_recipe(
        "distill", *STEPS, "--teacher-steps", "4",
        "--teacher-demonstrations", "64", "--num-prompts", "64", "--divergence", "jsd",
        "--no-baseline", "--on-policy", "0.5", "--out", str(tmp_path / "distill"),
    )  # fmt: skip
    assert (teacher / "model" / "config.json").exists(), "distill trains the missing teacher"
    assert {"teacher_accuracy", "accuracy_after", "teacher_seconds"} <= set(out)
    records = records_of(tmp_path / "distill")[1:]
    assert all(np.isfinite(r["soft"]) and r["soft"] >= 0 for r in records)
    # Every other step on the student's samples, with the divergence alone; the others on
    # the teacher's answers, half divergence and half cross-entropy (--soft-weight 0.5).
    assert [r["on_policy"] for r in records] == [0.0, 1.0, 0.0, 1.0]
    for r in records:
        expected = r["soft"] if r["on_policy"] else 0.5 * (r["soft"] + r["hard"])
        assert abs(r["loss"] - expected) < 1e-5 * max(1.0, abs(expected))


@pytest.mark.slow
def test_grpo_with_the_entropy_controller_tis_and_two_updates_a_batch(tmp_path, sft_start):
    """The update donates the train state: the entropy controller's weight goes into the batch
    as a copy, its state holds buffers of its own, and the trainer's log-probs before the
    update (`--is-correction tis`) and each of two updates a batch see live weights. Below
    its target entropy (5 nats, above any of this model's) the controller raises the
    weight after the first step."""
    out = run_recipe(
        "grpo", "--model", str(sft_start), "--num-prompts", "64", "--group-size", "2",
        "--steps", "2", "--eval-every", "2", "--eval-samples", "0", "--target-entropy", "5",
        "--is-correction", "tis", "--updates-per-batch", "2", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    records = records_of(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2] and np.isfinite(out["final_reward"])
    weights = [r["entropy_weight"] for r in records[1:]]
    assert all(np.isfinite(w) and w >= 0 for w in weights) and weights[0] != weights[1]
    assert all(np.isfinite(r["loss"]) for r in records[1:])


REWARD = """
def score(completion, record):
    return 0.25 if completion == record["answer"] else -0.5
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grpo", "dapo", "dr_grpo"])
def test_grpo_modes(tmp_path, sft_start, mode):
    """Each mode end to end from a shared SFT start; Dr. GRPO with LoRA adapters (the sampler
    runs them beside the base, un-merged); GRPO with a reward function of the user's own;
    DAPO with IcePop's rollout correction (a preset's kept mask and weights in the update)."""
    lora = ["--lora-rank", "4"] if mode == "dr_grpo" else []
    correction = ["--is-correction", "icepop"] if mode == "dapo" else []
    reward = []
    if mode == "grpo":
        (tmp_path / "my_rewards.py").write_text(REWARD)
        reward = ["--reward", f"{tmp_path / 'my_rewards.py'}:score"]
    out = run_recipe(
        "grpo", "--mode", mode, "--model", str(sft_start), "--num-prompts", "64",
        "--group-size", "4", "--steps", "2", "--eval-every", "2", "--eval-samples", "4",
        "--out", str(tmp_path / mode),
        *lora, *reward, *correction, headline="grpo" if mode == "grpo" else f"grpo-{mode}",
    )  # fmt: skip
    assert out["tuning"] == ("lora" if lora else "full") and out["sft_seconds"] is None
    records = records_of(tmp_path / mode)
    assert [r["step"] for r in records] == [0, 1, 2]
    if correction:  # the trainer's log-probs before the update are the sampler's weights'
        for r in records[1:]:
            assert r["rc_rejected_tokens"] == 0.0 and r["rc_rejected_sequences"] == 0.0
            assert r["rc_ess"] > 0.9999 and r["rc_truncated"] == 0.0
    else:
        assert "rc_ess" not in records[1]
    for key in ("reward", "sample_accuracy", "entropy", "clip_fraction", "kept_groups"):
        assert all(np.isfinite(r[key]) for r in records[1:]), key
    # On-policy first step: the ratio is 1 (nothing clipped); with GRPO's KL penalty the
    # policy is the reference (DAPO and Dr. GRPO have none, and skip the reference's pass).
    assert records[1]["clip_fraction"] == 0.0
    # The first update's log-probs are the sampler's, to float32 rounding: no mismatch.
    assert records[1]["mismatch_kl"] < 1e-6 and records[1]["is_ess"] > 0.9999
    # Held-out at steps 0 and 2: greedy accuracy, and pass@1/pass@k/maj@k of 4 samples,
    # their entropy and diversity.
    for r in (records[0], records[2]):
        assert set(SAMPLED) | {"accuracy"} <= set(r)
        assert 0 <= r["pass_at_1"] <= r["pass_at_k"] <= 1 and r["sample_entropy"] > 0
    if mode == "grpo":
        assert abs(records[1]["kl"]) < 1e-5
    else:
        assert "kl" not in records[1]
    if reward:  # every reward is the user's: 0.25 for a right answer, -0.5 otherwise
        for r in records[1:]:
            expected = 0.25 * r["sample_accuracy"] - 0.5 * (1 - r["sample_accuracy"])
            assert abs(r["reward"] - expected) < 1e-6


@pytest.mark.slow
def test_a_reward_model_trains_on_pairs_then_scores_grpo_rollouts(tmp_path, sft_start):
    """RLHF end to end: a reward model from the SFT start, then GRPO on its rewards, which
    are no longer the verifier's (0 or 1, plus 0.1 for form): they are real numbers."""
    out = run_recipe(
        "reward_model", *STEPS, "--model", str(sft_start), "--num-prompts", "64",
        "--out", str(tmp_path / "rm"),
    )  # fmt: skip
    assert 0 <= out["heldout_pair_accuracy_after"] <= 1
    losses = [r["loss"] for r in records_of(tmp_path / "rm") if "loss" in r]
    assert len(losses) == 4 and all(0 < x < 5 for x in losses)  # log 2 give or take
    assert (tmp_path / "rm" / "model" / "score.safetensors").exists()
    run_recipe(
        "grpo", "--model", str(sft_start), "--reward-model", str(tmp_path / "rm"),
        "--num-prompts", "64", "--group-size", "4", "--steps", "2", "--eval-every", "2",
        "--out", str(tmp_path / "grpo"),
    )  # fmt: skip
    rewards = [r["reward"] for r in records_of(tmp_path / "grpo")[1:]]
    assert len(rewards) == 2 and all(np.isfinite(rewards))
    assert not any(np.isclose(r * 10, round(r * 10)) for r in rewards)  # not k / 10


@pytest.mark.slow
def test_lora_sft_changes_the_projections_only_and_generate_reads_any_run(
    tmp_path, sft_start, capsys
):
    """SFT with LoRA from a trained model: only the projections change, the adapters are
    saved alone and in the PEFT format; generate.py completes prompts from the run."""
    from tunelib import peft

    out = run_recipe(
        "sft", *STEPS, "--model", str(sft_start),
        "--lora-rank", "4", "--operations=-", "--out", str(tmp_path / "lora"),
    )  # fmt: skip
    # Rank 4 on 7 projections of 2 layers (H = 128, F = 384, K D = 64): r (d_in + d_out) each.
    per_layer = 4 * ((128 + 128) * 2 + (128 + 64) * 2 + (128 + 384) * 2 + (384 + 128))
    assert (out["tuning"], out["trainable_params"]) == ("lora", 2 * per_layer)
    import jax

    before, after = load_params(sft_start), load_params(tmp_path / "lora")
    changed = {
        jax.tree_util.keystr(path)
        for (path, x), y in zip(
            jax.tree_util.tree_leaves_with_path(before), leaves(after), strict=True
        )
        if not np.array_equal(np.asarray(x), y)
    }
    assert changed and all("_proj" in p and "kernel" in p for p in changed), changed
    adapters = peft.restore_adapters(tmp_path / "lora" / "adapters")
    assert adapters["layers"][0]["mlp"]["up_proj"]["kernel"].rank == 4
    config = json.loads((tmp_path / "lora" / "peft_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)

    lines = recipe_main(
        "generate",
        ["--model", str(tmp_path / "lora"), "--prompt", "12-7=", "--prompt", "3-1=", "--jsonl",
         "--max-new-tokens", "6"],
    )  # fmt: skip
    assert [x["prompt"] for x in lines] == ["12-7=", "3-1="]
    assert all(isinstance(x["completion"], str) for x in lines)
    printed = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()[-2:]]
    assert printed == lines


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.slow
def test_recipes_on_a_hugging_face_checkpoint_and_data_files(tmp_path, capsys, monkeypatch):
    """SFT, DPO and GRPO (its rollouts in the per-layer decoding layout) from a transformers
    checkpoint on JSON-lines files; the fine-tuned checkpoints (LoRA merged, or the PEFT
    adapter on the base) load in transformers; a chat with the result."""
    from tests._hf import hf_logits, hf_modules, write_chat_jsonl, write_tiny_checkpoint
    from tunelib.formats import load_hf_checkpoint

    torch, transformers = hf_modules()
    peft_hf = pytest.importorskip("peft", reason="the Hugging Face peft package")
    source = write_tiny_checkpoint(tmp_path / "model", "qwen2", seed=1)
    chats = write_chat_jsonl(tmp_path / "chats.jsonl", 40)
    flags = ["--model", str(source), "--batch-size", "4", "--eval-every", "4"]

    lora = run_recipe(
        "sft", *flags, "--data", str(chats), "--steps", "8", "--lora-rank", "8",
        "--learning-rate", "1e-2", "--packing", "--out", str(tmp_path / "lora"),
    )  # fmt: skip
    assert lora["tuning"] == "lora"
    assert lora["heldout_loss_after"] < lora["heldout_loss_before"] - 1.0  # it learned

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=(2, 9))
    where = np.ones((2, 9), bool)
    where[1, 6:] = False
    ours = load_hf_checkpoint(tmp_path / "lora" / "hf_model")
    model = nnx.merge(ours.graphdef, ours.params)
    logits = np.asarray(model.unembed(model(tokens, where=where)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "hf_model")
    np.testing.assert_allclose(
        hf_logits(theirs.eval(), tokens, where)[where], logits[where], atol=1e-4
    )
    # The PEFT adapter on the original checkpoint is the merged LoRA model.
    base = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    adapted = peft_hf.PeftModel.from_pretrained(base, tmp_path / "lora" / "peft_adapter").eval()
    np.testing.assert_allclose(hf_logits(adapted, tokens, where)[where], logits[where], atol=1e-4)

    pairs = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": f"{a} + {a} = ", "chosen": str(2 * a), "rejected": str(2 * a + 1)}
            for a in range(20)
        ],
    )
    dpo = run_recipe(
        "dpo", *flags, "--data", str(pairs), "--steps", "2", "--out", str(tmp_path / "dpo")
    )
    assert 0.0 <= dpo["heldout_reward_accuracy_after"] <= 1.0
    problems = write_jsonl(
        tmp_path / "problems.jsonl",
        [
            {"prompt": [{"role": "user", "content": f"{a} + {a}?"}], "answer": str(2 * a)}
            for a in range(20)
        ],
    )
    # The scanned model's rollouts decode its layers in place, with plain products: the
    # trainer's first log-probs are still the sampler's.
    grpo = run_recipe(
        "grpo", *flags, "--data", str(problems), "--steps", "2", "--group-size", "2",
        "--max-new-tokens", "6", "--decoding-layout", "per_layer", "--decoding-products", "plain",
        "--out", str(tmp_path / "grpo"),
    )  # fmt: skip
    assert 0.0 <= grpo["accuracy_after"] <= 1.0 and (tmp_path / "grpo" / "hf_model").is_dir()
    assert records_of(tmp_path / "grpo")[1]["mismatch_kl"] < 1e-6
    # The held-out problems turned right and wrong account for the change in accuracy.
    n = len(json.loads((tmp_path / "grpo" / "heldout_start.json").read_text()))
    turned = grpo["heldout_turned_right"] - grpo["heldout_turned_wrong"]
    assert grpo["accuracy_after"] - grpo["accuracy_before"] == pytest.approx(turned / n)
    assert grpo["heldout_paired_se"] >= 0.0

    # A chat on standard input, two turns.
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.StringIO("what is 2 + 2?\nand 3 + 3?\n\n"))
    chat = recipe_main(
        "generate", ["--model", str(tmp_path / "grpo"), "--chat", "--max-new-tokens", "4"]
    )
    assert [m["role"] for m in chat] == ["user", "assistant"] * 2
    assert chat[2]["content"] == "and 3 + 3?"  # the second turn sees the first
    assert len(capsys.readouterr().out.splitlines()) >= 2  # one answer printed per turn


# Gemma 4 as its small dense models are: a sliding and a full layer (wider, values from the
# keys, proportional RoPE), per-layer inputs; layers of two widths are never stacked. Its
# experts and shared keys and values are left to the model and peft tests (compiling them
# unstacked here would cost another minute).
GEMMA4 = dict(
    num_hidden_layers=2,
    layer_types=["sliding_attention", "full_attention"],
    num_kv_shared_layers=0,
    final_logit_softcapping=30.0,
)

# DeepSeek-V3 with a dense layer, then one of experts (its layers are never stacked: a third
# layer would be compiled as well).
DEEPSEEK = dict(num_hidden_layers=2)
OVERRIDES = {"gemma4_text": GEMMA4, "deepseek_v3": DEEPSEEK}


@pytest.mark.slow
@pytest.mark.parametrize(
    "family",
    ["qwen3_5_moe_text", "gemma2", "gemma3_text", "gemma4_text", "gpt_oss", "deepseek_v3"],
)
def test_recipes_on_the_newer_families(tmp_path, family):
    """SFT (LoRA on the projections: attention, MLP or experts) from a transformers
    Qwen3.5-MoE (a Gated DeltaNet layer, then a gated attention one, both with experts),
    Gemma 2 (soft-capped logits in every head), Gemma 3, Gemma 4 (two widths of layer,
    per-layer inputs), gpt-oss (sinks, biased experts) or DeepSeek-V3 (latent
    attention, grouped sigmoid routing) checkpoint, the SFT model, merged, loading in
    transformers with equal logits (every family's sampler is its model tests'); then DPO
    from the Gemma 2 and gpt-oss checkpoints (both sides of each pair through the fused head:
    soft caps, sinks; the SFT runs take every family's layers through the same head, so DPO
    on the DeltaNet and latent-attention families would repeat them at 15-25 s each), and
    GRPO with routing replay from the mixtures of experts (Qwen3.5's sampler cache holding
    the DeltaNet layer's convolution and recurrent states beside the attention layer's keys
    and values), the trainer's first log-probs the sampler's. Gemma 4's SFT and GRPO with
    images are `tests/recipes/test_vision.py`'s; Qwen3-MoE's recipes are
    `tests/recipes/test_tool_use.py`'s and the `moe` model size's."""
    from tests._hf import hf_logits, hf_modules, write_tiny_checkpoint
    from tunelib.formats import load_hf_checkpoint

    _, transformers = hf_modules()
    source = write_tiny_checkpoint(tmp_path / "model", family, seed=2, **OVERRIDES.get(family, {}))
    flags = ["--model", str(source), "--batch-size", "4", "--num-heldout", "8", *STEPS]
    # The random Gemma 4 is far from uniform (held-out loss 7.7 > log 320): 4 steps are not
    # always enough for its held-out loss to fall; 8 are.
    longer = ["--steps", "8", "--eval-every", "8"] if family == "gemma4_text" else []
    sft = run_recipe("sft", *flags, *longer, "--lora-rank", "4", "--out", str(tmp_path / "sft"))
    assert sft["tuning"] == "lora" and np.isfinite(sft["final_loss"])
    assert sft["heldout_loss_after"] < sft["heldout_loss_before"]
    ours = load_hf_checkpoint(tmp_path / "sft" / "hf_model")
    experts = {"qwen3_5_moe_text": 4, "gpt_oss": 4, "deepseek_v3": 8}
    assert ours.config.num_experts == experts.get(family, 0)
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, 9))
    where = np.ones((2, 9), bool)
    model = nnx.merge(ours.graphdef, ours.params)
    logits = np.asarray(model.unembed(model(tokens, where=where)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sft" / "hf_model")
    np.testing.assert_allclose(hf_logits(theirs.eval(), tokens, where), logits, atol=1e-4)
    if family in ("gemma2", "gpt_oss"):
        # Pairs from 16 prompts: the model's own wrong replies (chat messages) as rejected.
        dpo = run_recipe("dpo", *flags, "--num-prompts", "16", "--out", str(tmp_path / "dpo"))
        assert 0.0 <= dpo["heldout_reward_accuracy_after"] <= 1.0
    if family not in experts:
        return
    # A mixture of experts: the sampler records each token's experts and the trainer routes
    # by them. (Without the KL penalty: the reference's pass is the policy's, and compiling
    # it here would only repeat `test_grpo_modes`.)
    grpo = run_recipe(
        "grpo", *flags, "--replay-routing", "--kl-coef", "0", "--group-size", "2",
        "--max-new-tokens", "4", "--out", str(tmp_path / "grpo"),
    )  # fmt: skip
    assert 0.0 <= grpo["accuracy_after"] <= 1.0 and (tmp_path / "grpo" / "hf_model").is_dir()
    first = records_of(tmp_path / "grpo")[1]
    assert first["mismatch_kl"] < 1e-6 and first["is_ess"] > 0.9999  # float32, one program


@pytest.mark.slow
def test_recipes_on_a_gguf_file_with_qlora_on_its_own_blocks(tmp_path):
    """SFT straight from a GGUF file (its tokenizer and chat template: the built-in task asked
    in words), QLoRA on the file's Q8_0 blocks; GRPO from that run. The run's Hugging Face
    export carries the tokenizer and the template, and loads in transformers with equal
    logits."""
    from tests._gguf import write_tiny_gguf
    from tests._hf import hf_logits, hf_modules
    from tunelib.data import load_tokenizer, render_chat_template
    from tunelib.formats import load_hf_checkpoint

    texts = tuple(f"What is {a} + {b}? {a + b}" for a in range(0, 100, 7) for b in range(9))
    model = write_tiny_gguf(tmp_path / "tiny.gguf", texts, dtype="Q8_0")
    sft = run_recipe(
        "sft", "--model", str(model), "--lora-rank", "4", "--qlora", *STEPS,
        "--out", str(tmp_path / "sft"),
    )  # fmt: skip
    assert sft["tuning"] == "qlora-gguf" and sft["base_bits_per_param"] < 32
    assert {"accuracy_before", "accuracy_after"} <= set(sft)
    export = tmp_path / "sft" / "hf_model"
    tokenizer = load_tokenizer(export)
    assert tokenizer.chat_template and tokenizer.eos_id == 2
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    rendered = render_chat_template(tokenizer.chat_template, messages, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
    _, transformers = hf_modules()
    ours = load_hf_checkpoint(export)
    decoder = nnx.merge(ours.graphdef, ours.params)
    tokens = np.array([[1, 40, 41, 42, 2, 3], [1, 50, 51, 52, 53, 54]])
    where = np.ones(tokens.shape, bool)
    where[0, :2] = False
    logits = np.asarray(decoder.unembed(decoder(tokens, where=where)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    np.testing.assert_allclose(hf_logits(theirs, tokens, where)[where], logits[where], atol=1e-4)

    grpo = run_recipe(
        "grpo", "--model", str(tmp_path / "sft"), "--lora-rank", "4", "--steps", "2",
        "--group-size", "2", "--max-new-tokens", "4", "--out", str(tmp_path / "grpo"),
    )  # fmt: skip
    assert {"accuracy_before", "accuracy_after"} <= set(grpo)
