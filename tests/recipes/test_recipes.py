"""End-to-end runs of the recipes as a user runs them: `python recipes/<name>.py`."""

import json
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

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# A small, fast configuration of the task; the model is the recipes' own.
SMALL = ["--num-train", "256", "--num-heldout", "32", "--batch-size", "8", "--no-progress"]


def run_recipe(name: str, *args: str, timeout: float = 300, headline: str | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, str(RECIPES / f"{name}.py"), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=user_env(compilation_cache=True),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["recipe"] == (headline or name)
    return last


def load_params(folder: Path) -> dict:
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore((folder / "model" / "params").resolve())


def leaves(tree) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_sft_smoke(tmp_path):
    out = run_recipe("sft", "--steps", "6", "--eval-every", "3", "--out", str(tmp_path / "sft"))
    assert {"recipe", "seconds", "accuracy_before", "accuracy_after"} <= set(out)
    assert 0.0 <= out["accuracy_after"] <= 1.0
    records = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(np.isfinite(r["loss"]) for r in records)
    assert "accuracy" in records[2] and "accuracy" in records[5]
    assert (tmp_path / "sft" / "curves.png").stat().st_size > 0


@pytest.mark.slow
def test_dpo_trains_its_sft_start_and_runs_with_qlora(tmp_path):
    """DPO trains its missing SFT start, then QLoRA adapters on it (full DPO runs in
    `test_fused_and_naive_log_probs_give_the_same_training_curves`)."""
    sft_dir = tmp_path / "sft" / "model"
    out = run_recipe(
        "dpo", "--sft-steps", "6", "--num-prompts", "256", "--steps", "4", "--eval-every", "2",
        "--sft-dir", str(sft_dir), "--lora-rank", "4", "--qlora", "--out", str(tmp_path / "dpo"),
    )  # fmt: skip
    assert (sft_dir / "config.json").exists(), "DPO must train the missing SFT model first"
    assert out["steps"] == 4 and np.isfinite(out["final_reward_accuracy"])
    assert out["tuning"] == "qlora" and out["base_bits_per_param"] < 8
    records = [json.loads(x) for x in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    # The policy is the reference at the first step: with QLoRA, the NF4 base itself.
    assert abs(records[0]["loss"] - np.log(2)) < 1e-5


@pytest.mark.slow
def test_orpo_smoke_with_baseline(tmp_path):
    out = run_recipe("orpo", "--steps", "4", "--eval-every", "2", "--out", str(tmp_path / "orpo"))
    assert {"accuracy_after", "sft_accuracy_after"} <= set(out)


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path):
    args = ["--steps", "150", "--checkpoint-every", "10", "--eval-every", "1000"]
    run_recipe("sft", *args, "--out", str(tmp_path / "straight"))

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, str(RECIPES / "sft.py"), *SMALL, *args, "--out", str(killed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=user_env(compilation_cache=True),
    )
    checkpoints = killed / "checkpoints"
    deadline = time.monotonic() + 240
    while not (checkpoints.exists() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "model").exists(), "the run must have been killed mid-way"
    saved = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    # A checkpoint the crash left half-written: a temporary folder of a later step.
    partial = checkpoints / f"{saved[-1] + 10}.orbax-checkpoint-tmp-1234567"
    partial.mkdir()
    (partial / "state").mkdir()
    (partial / "state" / "garbage").write_bytes(b"\x00" * 64)

    proc = subprocess.run(
        [sys.executable, str(RECIPES / "sft.py"), *SMALL, *args, "--out", str(killed), "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
        env=user_env(compilation_cache=True),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed_from = int(proc.stdout.split("resuming from the checkpoint of step ")[1].split()[0])
    assert 0 < resumed_from < 150 and resumed_from in saved

    straight, resumed = leaves(load_params(tmp_path / "straight")), leaves(load_params(killed))
    assert len(straight) == len(resumed) > 0
    for a, b in zip(straight, resumed, strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit
    steps = [json.loads(x)["step"] for x in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 151))


def losses_of(folder: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fused_and_naive_log_probs_give_the_same_training_curves(tmp_path):
    """The recipes' default fused head against materialised logits, same seed, same steps."""
    common = ["--steps", "12", "--eval-every", "12"]
    for impl in ("chunked", "naive"):
        run_recipe("sft", *common, "--logprobs", impl, "--out", str(tmp_path / f"sft-{impl}"))
        run_recipe(
            "dpo", *common, "--logprobs", impl, "--num-prompts", "256",
            "--sft-dir", str(tmp_path / "sft-chunked" / "model"),
            "--out", str(tmp_path / f"dpo-{impl}"),
        )  # fmt: skip
    for recipe in ("sft", "dpo"):
        fused, naive = (
            losses_of(tmp_path / f"{recipe}-chunked"),
            losses_of(tmp_path / f"{recipe}-naive"),
        )
        assert len(fused) == len(naive) == 12
        np.testing.assert_allclose(fused, naive, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_distill_trains_its_teacher_and_runs_with_the_fused_head(tmp_path):
    teacher = tmp_path / "teacher" / "model"
    out = run_recipe(
        "distill", "--steps", "4", "--eval-every", "2", "--teacher-steps", "6",
        "--teacher-demonstrations", "256", "--num-prompts", "256", "--divergence", "jsd",
        "--teacher-dir", str(teacher), "--out", str(tmp_path / "distill"),
    )  # fmt: skip
    assert (teacher / "config.json").exists(), "distill must train the missing teacher first"
    assert {"teacher_accuracy", "accuracy_after", "sft_accuracy_after"} <= set(out)
    records = [
        json.loads(x) for x in (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(np.isfinite(r["soft"]) and r["soft"] >= 0 for r in records)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grpo", "dapo", "dr_grpo"])
def test_grpo_modes_train_their_sft_start_and_run(tmp_path, mode):
    """Each mode end to end; Dr. GRPO with LoRA adapters, merged for the sampler each step."""
    sft_dir = tmp_path / "sft" / "model"
    lora = ["--lora-rank", "4"] if mode == "dr_grpo" else []
    out = run_recipe(
        "grpo", "--mode", mode, "--sft-steps", "6", "--sft-dir", str(sft_dir),
        "--num-prompts", "256", "--group-size", "4", "--steps", "3", "--eval-every", "3",
        "--out", str(tmp_path / mode), *lora,
        headline="grpo" if mode == "grpo" else f"grpo-{mode}",
    )  # fmt: skip
    assert (sft_dir / "config.json").exists(), "GRPO must train the missing SFT model first"
    assert out["tuning"] == ("lora" if lora else "full")
    assert {"seconds", "accuracy_before", "accuracy_after", "final_entropy"} <= set(out)
    lines = (tmp_path / mode / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("reward", "sample_accuracy", "entropy", "kl", "clip_fraction", "kept_groups"):
        assert all(np.isfinite(r[key]) for r in records), key
    # On-policy first step: the policy is the reference, the ratio is 1 (nothing clipped).
    assert abs(records[0]["kl"]) < 1e-5 and records[0]["clip_fraction"] == 0.0
    assert (tmp_path / mode / "curves.png").stat().st_size > 0


@pytest.mark.slow
def test_lora_sft_from_a_trained_model_changes_the_projections_only(tmp_path):
    """SFT with LoRA from a trained model: only the projections change, the adapters are
    saved alone and in the PEFT format (DPO with QLoRA and GRPO with LoRA run above)."""
    from tunelib import peft

    run_recipe("sft", "--steps", "6", "--eval-every", "6", "--out", str(tmp_path / "start"))
    start = tmp_path / "start" / "model"
    out = run_recipe(
        "sft", "--steps", "6", "--eval-every", "6", "--model", str(start),
        "--lora-rank", "4", "--operations=-", "--out", str(tmp_path / "lora"),
    )  # fmt: skip
    # Rank 4 on 7 projections of 2 layers (H = 128, F = 384, K D = 64): r (d_in + d_out) each.
    per_layer = 4 * ((128 + 128) * 2 + (128 + 64) * 2 + (128 + 384) * 2 + (384 + 128))
    assert (out["tuning"], out["trainable_params"]) == ("lora", 2 * per_layer)
    assert 0.0 <= out["accuracy_before"] <= 1.0 and 0.0 <= out["accuracy_after"] <= 1.0
    before, after = load_params(tmp_path / "start"), load_params(tmp_path / "lora")
    import jax

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


def test_qlora_without_a_rank_is_refused():
    proc = subprocess.run(
        [sys.executable, str(RECIPES / "sft.py"), "--qlora"],
        capture_output=True,
        text=True,
        timeout=120,
        env=user_env(compilation_cache=True),
        check=False,
    )
    assert proc.returncode == 2 and "--lora-rank" in proc.stderr


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.slow
def test_recipes_on_a_hugging_face_checkpoint_and_data_files(tmp_path):
    """SFT, DPO and GRPO from a transformers checkpoint on JSON-lines files; the fine-tuned
    checkpoints (LoRA merged, or the PEFT adapter on the base) load in transformers."""
    from tests._hf import hf_logits, hf_modules, write_chat_jsonl, write_tiny_checkpoint
    from tunelib.models import load_hf_checkpoint

    torch, transformers = hf_modules()
    peft_hf = pytest.importorskip("peft", reason="the Hugging Face peft package")
    source = write_tiny_checkpoint(tmp_path / "model", "qwen2", seed=1)
    chats = write_chat_jsonl(tmp_path / "chats.jsonl", 40)
    flags = ["--model", str(source), "--batch-size", "4", "--eval-every", "4"]

    lora = run_recipe(
        "sft", *flags, "--data", str(chats), "--steps", "8", "--lora-rank", "8",
        "--learning-rate", "1e-2", "--out", str(tmp_path / "lora"),
    )  # fmt: skip
    assert lora["tuning"] == "lora"
    assert lora["heldout_loss_after"] < lora["heldout_loss_before"] - 1.0  # it learned

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=(2, 9))
    where = np.ones((2, 9), bool)
    where[1, 6:] = False
    for name in ("lora",):
        ours = load_hf_checkpoint(tmp_path / name / "hf_model")
        model = nnx.merge(ours.graphdef, ours.params)
        logits = np.asarray(model.unembed(model(tokens, attention_where=where)))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name / "hf_model")
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
    grpo = run_recipe(
        "grpo", *flags, "--data", str(problems), "--steps", "2", "--group-size", "2",
        "--max-new-tokens", "6", "--out", str(tmp_path / "grpo"),
    )  # fmt: skip
    assert 0.0 <= grpo["accuracy_after"] <= 1.0 and (tmp_path / "grpo" / "hf_model").is_dir()
    # A data file needs a checkpoint with a tokenizer.
    with pytest.raises(AssertionError, match="needs --model"):
        run_recipe("dpo", "--data", str(pairs), "--sft-dir", str(tmp_path / "none"))
    with pytest.raises(AssertionError, match="needs --model"):
        run_recipe("sft", "--data", str(chats), "--out", str(tmp_path / "no-model"))
