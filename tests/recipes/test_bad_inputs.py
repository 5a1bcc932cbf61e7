"""Every bad input a user can give a recipe ends in one clear line, exit status 2, and
leaves every file as it was.

The cases that can be judged from the flags and the file system run in a process where JAX
and tunelib cannot be imported: that they pass proves `--help` and flag errors never wait for
JAX. The others (a data file's contents, a batch larger than the data) run in this process.
"""

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.recipes._scripts import (
    recipe_main,
    recipe_module,
    run_recipe_process,
    run_without_jax,
    snapshot,
)

from kit import runs


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A working folder as a user has it: a finished SFT run, a run folder without a run,
    data files good and bad, config files, a reward module and a stray file."""
    root = tmp_path_factory.mktemp("world")
    run = root / "runs" / "sft-seed0"
    (run / "checkpoints" / "10").mkdir(parents=True)
    (run / "model" / "params").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (run / "config.toml").write_text("steps = 10\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 1.0}) + "\n")
    (run / "result.json").write_text(json.dumps({"recipe": "sft", "steps": 10}))
    (root / "runs" / "empty").mkdir()
    damaged = {  # runs with a checkpoint and a damaged file
        "no-config": {"metrics.jsonl": "", "result.json": None, "config.toml": None},
        "bad-config": {"config.toml": "steps = = 10\n"},
        "bad-metrics": {"metrics.jsonl": '{"step": 0}\n{"step": 1, "loss": \n{"step": 10}\n'},
    }
    for name, files in damaged.items():
        (root / "runs" / name / "checkpoints" / "10").mkdir(parents=True)
        for file in ("config.toml", "metrics.jsonl"):
            text = files.get(file, (run / file).read_text())
            if text is not None:
                (root / "runs" / name / file).write_text(text)
    stub = root / "runs" / "stub"  # a start that failed before its first checkpoint
    (stub / "checkpoints").mkdir(parents=True)
    (stub / "config.toml").write_text("steps = 10\n")
    (stub / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    (root / "runs" / "model-only" / "model").mkdir(parents=True)
    hf = root / "hf-without-tokenizer"  # a Hugging Face checkpoint without tokenizer.json
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "model.safetensors").write_bytes(b"")
    data = root / "data"
    data.mkdir()
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    (data / "chats.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    (data / "table.csv").write_text("prompt,completion\n")
    (data / "rewards.py").write_text("def score(completion, record):\n    return 1.0\n")
    configs = {
        "unknown.toml": "stepz = 3\n",
        "wrong_type.toml": 'steps = "ten"\n',
        "overwrite.toml": "overwrite = true\n",
        "broken.toml": "steps = = 3\n",
        "nan.toml": "label_smoothing = nan\n",
        "often.toml": 'checkpoint_every = "often"\n',
    }
    for name, text in configs.items():
        (root / name).write_text(text)
    (root / "notes.txt").write_text("not a folder\n")
    (root / "broken.gguf").write_bytes(b"GGUF" + bytes(10))  # a header cut short
    return root


FINISHED = "runs/sft-seed0"
# (recipe, flags, what the one line must say)
WITHOUT_JAX = [
    ("sft", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("dpo", ["--steps", "-1"], "--steps must be >= 1, got -1"),
    ("grpo", ["--steps", "-1"], "--steps must be >= 1, got -1"),
    ("grpo_async", ["--max-staleness", "-1"], "--max-staleness must be >= 0, got -1"),
    ("grpo_async", ["--is-cap", "0"], "--is-cap must be > 0, got 0.0"),
    ("grpo_async", ["--weight-push", "delta"], "--weight-push delta sends more than the"),
    ("grpo", ["--is-cap", "0"], "--is-cap must be > 0, got 0.0"),
    ("grpo", ["--is-cap", "3"], "--is-cap is the cap of --is-correction tis; none corrects"),
    ("grpo", ["--is-correction", "icepop", "--is-cap", "3"], "icepop has its own thresholds"),
    ("grpo", ["--keep-best", "loss"], "--keep-best loss: not an evaluation metric"),
    (
        "grpo",
        ["--keep-best", "pass_at_k", "--eval-samples", "0"],
        "--keep-best pass_at_k is measured on sampled completions: give --eval-samples k > 0",
    ),
    ("grpo", ["--eval-samples", "-1"], "--eval-samples must be >= 0, got -1"),
    ("grpo", ["--collapse-entropy", "nan"], "--collapse-entropy must be a finite number, got nan"),
    ("grpo", ["--collapse-entropy", "-1"], "--collapse-entropy must be >= 0, got -1.0"),
    ("grpo", ["--target-entropy", "0"], "--target-entropy must be > 0, got 0.0"),
    ("grpo_async", ["--keep-best", "accuracy"], "--keep-best runs with recipes/grpo.py"),
    ("sft", ["--batch-size", "0"], "--batch-size must be >= 1"),
    ("sft", ["--learning-rate", "-1"], "--learning-rate must be > 0"),
    ("sft", ["--model", f"{FINISHED}/modl"], f"--model {FINISHED}/modl: no such file or folder"),
    ("dpo", ["--model", "/nonexistent/path"], "--model /nonexistent/path: no such file"),
    ("grpo", ["--model", "data"], "--model data is not a model"),
    ("sft", ["--model", "notes.txt"], "--model notes.txt: not a GGUF file nor a model folder"),
    ("sft", [], f"{FINISHED} holds a run already: pass --resume to continue it, --overwrite"),
    ("sft", ["--out", "runs/empty", "--resume"], "--resume: runs/empty has no run to resume"),
    ("sft", ["--out", "runs/none", "--resume"], "--resume: runs/none has no run to resume"),
    ("sft", ["--resume", "--overwrite"], "pass one"),
    ("sft", ["--resume", "--steps", "10"], f"--resume: {FINISHED} is at step 10 already"),
    ("sft", ["--out", "notes.txt"], "--out notes.txt is a file, not a folder"),
    ("sft", ["--seed", "abc"], "argument --seed: give a whole number, got 'abc'"),
    ("grpo", ["--temperature", "warm"], "argument --temperature: give a number, got 'warm'"),
    ("sft", ["--out", "notes.txt/run"], "--out notes.txt/run: notes.txt is a file, not a folder"),
    ("dpo", ["--out", "notes.txt/a/b"], "--out notes.txt/a/b: notes.txt is a file, not a folder"),
    ("sft", ["--model", FINISHED, "--data", "data/missing.jsonl"], "no such file"),
    ("sft", ["--model", FINISHED, "--data", "data/table.csv"], "must be a .jsonl, .json or"),
    ("sft", ["--data", "data/chats.jsonl", "--out", "runs/x"], "--data needs --model"),
    ("dpo", ["--data", "data/chats.jsonl"], "--data needs --model"),
    ("sft", ["--config", "missing.toml"], "--config missing.toml: no such file"),
    ("sft", ["--config", "data"], "--config data: not a file"),
    ("sft", ["--config", "broken.toml"], "is not valid TOML"),
    ("sft", ["--config", "unknown.toml"], "unknown setting 'stepz'"),
    ("sft", ["--config", "wrong_type.toml"], "steps must be int, got str"),
    ("sft", ["--config", "overwrite.toml"], "overwrite is a command-line flag only"),
    ("sft", ["--stepz", "3"], "unrecognized arguments: --stepz 3"),
    ("sft", ["--steps", "ten"], "argument --steps: give a whole number, got 'ten'"),
    ("dpo", ["--loss", "dpp"], "argument --loss: invalid choice: 'dpp'"),
    ("sft", ["--qlora"], "--qlora trains LoRA adapters on a quantised base: give --lora-rank too"),
    ("sft", ["--lora-rank", "4", "--lora-dropout", "1.5"], "--lora-dropout must lie in [0, 1)"),
    ("sft", ["--log-to", "jsonl,tensorbord"], "--log-to: unknown target 'tensorbord'"),
    ("sft", ["--operations", "+/"], "--operations must use only"),
    ("grpo", ["--temperature", "0"], "--temperature must be > 0"),
    ("grpo", ["--group-size", "1"], "--group-size must be >= 2"),
    ("grpo", ["--reward", "score"], "--reward score: give module:function"),
    ("grpo", ["--reward", "no_such_module:score"], "No module named 'no_such_module'"),
    ("grpo", ["--reward", "data/nothing.py:score"], "no such file data/nothing.py"),
    ("grpo", ["--reward", "data/rewards.py:missing"], "has no function 'missing'"),
    ("distill", ["--teacher", "runs/teacher"], "--teacher runs/teacher: no such file"),
    ("generate", ["--prompt", "1+1="], "--model is required"),
    ("generate", ["--model", FINISHED, "--prompt", "1+1=", "--chat"], "not both"),
    ("generate", ["--model", FINISHED, "--prompt", "x", "--top-p", "0"], "--top-p must lie"),
    # Settings that must be finite, in flags and TOML.
    ("sft", ["--learning-rate", "inf"], "--learning-rate must be a finite number, got inf"),
    ("grpo", ["--kl-coef", "nan"], "--kl-coef must be a finite number, got nan"),
    ("dpo", ["--beta=-inf"], "--beta must be a finite number, got -inf"),
    ("sft", ["--config", "nan.toml"], "--label-smoothing must be a finite number, got nan"),
    ("sft", ["--out", ""], "argument --out: an empty path: give a file or folder"),
    ("sft", ["--model", "hf-without-tokenizer"], "checkpoint without its tokenizer.json"),
    # Damaged or missing run files: refused before anything is rewritten.
    ("sft", ["--out", "runs/no-config", "--resume", "--steps", "20"], "has no config.toml"),
    ("sft", ["--out", "runs/bad-config", "--resume", "--steps", "20"], "config.toml is damaged"),
    ("sft", ["--out", "runs/bad-metrics", "--resume", "--steps", "20"], "damaged at line 2"),
    # A start that failed, with other settings; --resume auto.
    ("sft", ["--out", "runs/stub"], "holds a run that stopped before its first checkpoint"),
    ("sft", ["--out", "runs/stub", "--resume", "auto"], "stopped before its first checkpoint"),
    ("sft", ["--resume", "auto", "--steps", "20"], "was trained with --batch-size None"),
    ("sft", ["--out", "runs/model-only", "--resume", "auto"], "without a checkpoint to resume"),
    ("sft", ["--resume", "later"], "argument --resume: invalid choice: 'later'"),
    # Recovery settings: the checkpoint interval, the MTTI it assumes, the compilation cache.
    ("sft", ["--checkpoint-every", "often"], "--checkpoint-every: give a whole number or auto"),
    ("grpo", ["--checkpoint-every", "0"], "--checkpoint-every must be >= 1, got 0"),
    ("sft", ["--config", "often.toml"], "checkpoint_every must be int or 'auto', got 'often'"),
    ("sft", ["--mtti", "0"], "--mtti must be > 0 seconds, got 0.0"),
    ("sft", ["--mtti", "inf"], "--mtti must be a finite number, got inf"),
    ("sft", ["--compile-cache", ""], "--compile-cache is empty: give a folder, or none"),
    ("sft", ["--compile-cache", "notes.txt"], "--compile-cache notes.txt is a file: give a"),
]


@pytest.mark.parametrize(
    ("recipe", "flags", "message"), WITHOUT_JAX, ids=[" ".join([c[0], *c[1]]) for c in WITHOUT_JAX]
)
def test_bad_flags_paths_and_files_give_one_line_before_jax(world, recipe, flags, message):
    before = snapshot(world)
    proc = run_without_jax(recipe, *flags, cwd=world)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert lines[0].startswith(f"{recipe}.py: error: ")
    assert snapshot(world) == before
    assert not Path("/nonexistent").exists()


def test_grpo_with_max_staleness_runs_the_asynchronous_recipe(world):
    """`grpo.py --max-staleness` is `grpo_async.py`: its flags, checked before JAX."""
    proc = run_without_jax("grpo", "--max-staleness", "-1", cwd=world)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert lines == ["grpo_async.py: error: --max-staleness must be >= 0, got -1"], lines
    help_text = run_without_jax("grpo", "--max-staleness", "1", "--help", cwd=world).stdout
    assert "--max-staleness" in help_text and "--is-cap" in help_text


def test_help_answers_without_jax(world):
    for recipe in ("sft", "dpo", "grpo", "grpo_async", "orpo", "distill", "generate"):
        proc = run_without_jax(recipe, "--help", cwd=world)
        assert proc.returncode == 0, proc.stderr
        assert "--seed" in proc.stdout and "--config" in proc.stdout


@pytest.mark.parametrize(
    ("recipe", "old", "new", "value"),
    [
        ("dpo", "--sft-dir", "--model", "runs/sft-seed0"),
        ("grpo", "--sft-dir", "--model", "runs/sft-seed0"),
        ("grpo", "--kl-beta", "--kl-coef", "0.1"),
        ("orpo", "--lambda", "--odds-ratio-weight", "0.2"),
        ("distill", "--teacher-dir", "--teacher", "runs/sft-seed0"),
        ("distill", "--beta", "--mix", "0.3"),
        ("distill", "--alpha", "--soft-weight", "0.7"),
    ],
)
def test_old_flag_names_still_work_and_say_so(world, recipe, old, new, value):
    """An old flag name sets its new flag (the run then stops at a bad --steps) and says so."""
    proc = run_without_jax(recipe, old, value, "--steps", "0", cwd=world)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2
    assert lines[0] == f"{recipe}.py: {old} is deprecated; use {new}"
    assert lines[1] == f"{recipe}.py: error: --steps must be >= 1, got 0"


@pytest.fixture(scope="module")
def char_model(tmp_path_factory) -> Path:
    """A small, untrained recipe model folder with the character tokenizer."""
    from tunelib.data import CharTokenizer

    from kit import models

    folder = tmp_path_factory.mktemp("char-model") / "model"
    model = models.new_model(CharTokenizer(), "student", seed=0)
    models.save_model(folder, model, model.params)
    return folder


def run_here(recipe: str, flags: list[str], cwd: Path, monkeypatch, capsys):
    """The recipe's entry point in this process; returns (exit status, stderr lines)."""
    monkeypatch.chdir(cwd)
    with pytest.raises(SystemExit) as stop:
        recipe_main(recipe, flags)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return stop.value.code, lines


@pytest.mark.parametrize(
    ("recipe", "flags", "message"),
    [
        ("sft", ["--data", "data/empty.jsonl"], "--data: data/empty.jsonl holds no record"),
        ("sft", ["--data", "data/bad.jsonl"], "record 1: field 'completion' is missing"),
        ("sft", ["--data", "data/pairs.jsonl", "--batch-size", "8"], "larger than the 3 training"),
        ("dpo", ["--data", "data/empty.jsonl"], "data/empty.jsonl holds no record"),
        ("grpo", ["--data", "data/pairs.jsonl"], "field 'answer' is missing"),
        ("grpo", ["--replay-routing"], "--replay-routing replays the experts of mixture-of"),
        ("sft", ["--lora-rank", "100000"], "--lora-rank 100000 is above the model's hidden size"),
        ("grpo_async", ["--max-staleness", "1"], "--max-staleness runs on 2 processes"),
        ("generate", ["--chat"], "has no chat template; use --prompt"),
        ("generate", ["--prompts", "data/binary.txt"], "data/binary.txt: not UTF-8 text (byte"),
        (
            "generate",
            ["--prompt", "1+1=", "--max-new-tokens", "3000"],
            "--max-new-tokens 3000 are longer than the model's context of 2048 tokens",
        ),
        (
            "sft",
            ["--data", "data/pairs.jsonl", "--max-length", "4096"],
            "sequences of 4096 tokens (--max-length) are longer than the model's context of 2048",
        ),
    ],
)
def test_bad_data_files_give_one_line(
    world, char_model, recipe, flags, message, monkeypatch, capsys
):
    data = world / "data"
    (data / "empty.jsonl").write_text("\n")
    (data / "binary.txt").write_bytes(bytes([0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0xFF]))
    good = {"prompt": "1+1=", "completion": "2"}
    (data / "bad.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "2+2="}) + "\n")
    pair = {"prompt": "1+1=", "chosen": "2", "rejected": "3", "completion": "2"}
    (data / "pairs.jsonl").write_text("".join(json.dumps(pair) + "\n" for _ in range(3)))
    flags = ["--model", str(char_model), *flags]
    if recipe != "generate":
        flags += ["--out", "runs/bad-data", "--num-heldout", "0"]
    before = snapshot(world)
    status, lines = run_here(recipe, flags, world, monkeypatch, capsys)
    assert status == 2, lines
    assert len(lines) == 1 and message in lines[-1], lines
    assert snapshot(world) == before


def double_the_width(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * 128}))


def cut_the_parameters(folder: Path) -> None:
    for file in (folder / "params").rglob("d/*"):
        with open(file, "r+b") as f:
            f.truncate(10)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda m: (m / "params" / "_METADATA").unlink(), "its params/_METADATA is missing: the"),
        (lambda m: (m / "config.json").write_text("{"), "its config.json is damaged (Expecting"),
        (lambda m: (m / "config.json").write_text("[1]"), "config.json is damaged (it holds a"),
        (double_the_width, "its params/ are not the model its config.json describes: ['embed"),
        (lambda m: (m / "char_tokenizer.json").write_text("xx"), "tokenizer.json is not valid"),
    ],
)
def test_a_damaged_model_folder_is_one_line(
    tmp_path, char_model, damage, message, monkeypatch, capsys
):
    """A recipe model folder damaged in place (metadata or data files of its parameters, its
    config.json unreadable or not its parameters', its tokenizer) is refused in one line."""
    model = Path(shutil.copytree(char_model, tmp_path / "model"))
    damage(model)
    flags = ["--model", str(model), "--prompt", "1+1=", "--max-new-tokens", "2"]
    status, lines = run_here("generate", flags, tmp_path, monkeypatch, capsys)
    assert status == 2, lines
    assert len(lines) == 1 and message in lines[0], lines


def test_a_model_folder_with_its_parameters_cut_short_says_so_first(tmp_path, char_model):
    """Parameter files cut short fail the restore partway: one line with TensorStore's reason
    (which file of which array, and what is wrong), exit 2. Orbax's reads of the other arrays,
    abandoned with the restore, printed a traceback each as the process exited (in 3 of 7
    runs of a GRPO start before they were dropped; in none of 8 after): this runs in a
    process of its own, and nothing follows the line."""
    model = Path(shutil.copytree(char_model, tmp_path / "model"))
    cut_the_parameters(model)
    proc = run_recipe_process(
        "generate", "--model", str(model), "--prompt", "1+1=", "--max-new-tokens", "2",
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("generate.py: error")]
    assert len(said) == 1, proc.stderr[-2000:]
    assert said[0].startswith(f"generate.py: error: --model {model}: its params/ cannot be read")
    assert "Error reading" in said[0] and "TensorStore details" not in said[0], said[0]
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_held_out_record_too_long_is_refused_or_skipped_with_skip_invalid(
    tmp_path, char_model, monkeypatch, capsys
):
    """The held-out records are checked as the training ones are: one too long for
    --max-length is one line naming it, and --skip-invalid drops it (the run trains)."""
    rows = [{"prompt": "1+1=" * 40, "completion": "2"}]
    rows += [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(12)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = [
        "--model", str(char_model), "--data", "data.jsonl", "--max-length", "32",
        "--num-heldout", "2", "--batch-size", "4", "--steps", "1", "--devices", "1",
        "--no-progress", "--no-plots", "--out",
    ]  # fmt: skip
    status, lines = run_here("sft", [*flags, "runs/a"], tmp_path, monkeypatch, capsys)
    assert status == 2 and len(lines) == 1, lines
    assert "data.jsonl (held out): record 0: field 'completion' makes the sequence" in lines[0]
    assert "(--skip-invalid drops invalid records)" in lines[0]
    monkeypatch.chdir(tmp_path)
    result = recipe_main("sft", [*flags, "runs/b", "--skip-invalid"])
    assert result["steps"] == 1 and math.isfinite(result["heldout_loss_after"])


def test_a_run_without_held_out_records_writes_strict_json(tmp_path, char_model, monkeypatch):
    """`--num-heldout 0` leaves the held-out loss without a value: NaN in the run, null in
    metrics.jsonl and result.json (Python's NaN token is not JSON), NaN again when read back."""
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    result = recipe_main("sft", [
        "--model", str(char_model), "--data", "data.jsonl", "--num-heldout", "0",
        "--batch-size", "4", "--steps", "2", "--devices", "1", "--no-progress", "--no-plots",
        "--out", "runs/a",
    ])  # fmt: skip
    assert math.isnan(result["heldout_loss_after"]) and math.isfinite(result["final_loss"])

    def refuse(token):
        raise ValueError(f"{token} is not JSON")

    written = json.loads((tmp_path / "runs/a/result.json").read_text(), parse_constant=refuse)
    assert written["heldout_loss_before"] is None and written["final_loss"] is not None
    lines = (tmp_path / "runs/a/metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=refuse) for line in lines]
    assert [r["heldout_loss"] for r in records if "heldout_loss" in r] == [None, None]
    read = runs.read_metrics(tmp_path / "runs/a/metrics.jsonl")
    assert all(math.isnan(r["heldout_loss"]) for r in read if "heldout_loss" in r)


def test_wandb_without_a_login_is_one_line(tmp_path, char_model):
    """`--log-to wandb` where W&B has no API key (and is not offline) is one line saying how
    to log in or keep the run offline, before any step."""
    if "WANDB_API_KEY" in os.environ:
        pytest.skip("W&B is logged in here (WANDB_API_KEY)")
    env = {"HOME": str(tmp_path), "WANDB_MODE": "online"}  # no ~/.netrc: no login
    proc = run_recipe_process(
        "sft", "--model", str(char_model), "--log-to", "jsonl,wandb", "--steps", "1",
        "--devices", "1", "--out", str(tmp_path / "run"), "--no-progress", "--no-plots",
        timeout=120, env=env,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("sft.py: error: --log-to wandb: No API key configured")
    assert "WANDB_MODE=offline" in lines[0]


def grpo_with_reward(folder: Path, model: Path, module: str, returned: str, out: str) -> list:
    """Flags of a short GRPO run whose `--reward` is `module.py:score` written in `folder`,
    returning the expression `returned`."""
    (folder / f"{module}.py").write_text(f"def score(completion, record):\n    return {returned}\n")
    return [
        "--model", str(model), "--reward", f"{module}.py:score", "--out", out,
        "--steps", "2", "--batch-size", "2", "--group-size", "2", "--num-heldout", "4",
        "--max-new-tokens", "4", "--no-progress", "--no-plots", "--devices", "1",
    ]  # fmt: skip


@pytest.mark.slow
def test_a_reward_that_returns_nan_names_the_prompt_and_the_command_can_run_again(
    tmp_path, char_model, monkeypatch, capsys
):
    """A NaN reward stops GRPO in one line naming the prompt; the folder that failed start
    leaves (no checkpoint) does not block the same command, nor holds the lock."""
    flags = grpo_with_reward(tmp_path, char_model, "nan_reward", "float('nan')", "runs/nan")
    for _ in range(2):
        status, lines = run_here("grpo", flags, tmp_path, monkeypatch, capsys)
        assert status == 2, lines
        assert (
            len(lines) == 1
            and "--reward nan_reward.py:score returned nan for the prompt '" in lines[0]
        ), lines
        assert sorted(p.name for p in (tmp_path / "runs" / "nan").iterdir()) == [
            "checkpoints",
            "config.toml",
            "heldout_start.json",
            "metrics.jsonl",
            "start_model.json",
        ]


def test_a_loss_that_diverges_stops_the_run_in_one_line_without_saving_a_model(
    tmp_path, char_model, monkeypatch, capsys
):
    """A finite but absurd learning rate trains the loss to NaN within a few steps: the run
    stops at that step in one line (the step, the learning rate), with the
    step's record last in metrics.jsonl and no model or checkpoint of the diverged weights;
    the same command can run again and stops the same way."""
    flags = [
        "--model", str(char_model), "--learning-rate", "1e6", "--steps", "12",
        "--eval-every", "12", "--num-train", "64", "--num-heldout", "8", "--batch-size", "8",
        "--no-progress", "--no-plots", "--devices", "1", "--out", "runs/diverged",
    ]  # fmt: skip
    for _ in range(2):
        status, lines = run_here("sft", flags, tmp_path, monkeypatch, capsys)
        assert status == 2 and len(lines) == 1, lines
        assert "sft.py: error: the loss was nan at step " in lines[0], lines
        assert "without saving its model. A learning rate too large" in lines[0]
        assert "(--learning-rate 1e+06): run again with a smaller one" in lines[0]
        folder = tmp_path / "runs" / "diverged"
        assert not (folder / "model").exists() and not (folder / "result.json").exists()
        assert not any((folder / "checkpoints").iterdir())
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        step = int(lines[0].split("at step ")[1].split(":")[0])
        assert records[-1]["step"] == step and records[-1]["loss"] is None  # NaN, as JSON
        assert all(r["loss"] is not None for r in records[:-1] if "loss" in r)


def test_a_reward_that_raises_is_one_line_naming_the_error_its_line_and_the_prompt(
    tmp_path, char_model, monkeypatch, capsys
):
    flags = grpo_with_reward(
        tmp_path, char_model, "bad_reward", "record['no such key']", "runs/raise"
    )
    status, lines = run_here("grpo", flags, tmp_path, monkeypatch, capsys)
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(
        "grpo.py: error: --reward bad_reward.py:score raised KeyError('no such key') at "
    ), lines
    assert "bad_reward.py:2 for the prompt '" in lines[0], lines


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ("__import__('sys').exit(0)", "raised SystemExit(0) at "),
        ("1e30", "returned 1e+30 for the prompt '"),
    ],
)
def test_a_reward_that_exits_or_cannot_be_held_is_one_line(
    tmp_path, char_model, monkeypatch, capsys, returned, message
):
    """A reward function that calls sys.exit() would end the run with its status, silently;
    one that returns a finite float64 beyond float32's range, or whose squares overflow the
    group statistics, would train on infinite advantages: each is one line."""
    flags = grpo_with_reward(tmp_path, char_model, "odd_reward", returned, "runs/odd")
    status, lines = run_here("grpo", flags, tmp_path, monkeypatch, capsys)
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("grpo.py: error: --reward odd_reward.py:score "), lines
    assert message in lines[0], lines
    if returned == "1e30":
        assert "must be at most 3.3e+18 in magnitude with groups of 2" in lines[0], lines


def test_rewards_at_the_limit_train_on_finite_advantages(tmp_path, char_model, monkeypatch):
    """Rewards of the largest allowed magnitude, of both signs within a group, give finite
    advantages and a finite loss at every step."""
    import math

    import kit.grpo

    limit = kit.grpo.reward_limit(2)
    returned = f"{limit!r} * (1 if len(completion) % 2 else -1)"
    flags = grpo_with_reward(tmp_path, char_model, "big_reward", returned, "runs/big")
    monkeypatch.chdir(tmp_path)
    recipe_main("grpo", flags)
    records = (tmp_path / "runs" / "big" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in records][1:]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps), steps


def test_damaged_bookkeeping_files_are_one_line_each_and_the_run_resumes(
    tmp_path, char_model, monkeypatch, capsys
):
    """A resumed run whose restart count (`badput.json`), first held-out grades
    (`heldout_start.json`) or best-model record (`best/best.json`) is damaged says so in one
    line each and goes on: those are counted afresh, left out, or replaced at the next
    evaluation; the training itself resumes from its checkpoint."""
    flags = [
        "--model", str(char_model), "--out", "runs/books", "--batch-size", "2",
        "--group-size", "2", "--num-heldout", "4", "--max-new-tokens", "4", "--eval-every", "1",
        "--checkpoint-every", "1", "--keep-best", "accuracy", "--no-progress", "--no-plots",
        "--devices", "1",
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    recipe_main("grpo", [*flags, "--steps", "1"])
    run = tmp_path / "runs" / "books"
    (run / "badput.json").write_text('{"restarts": ')
    (run / "heldout_start.json").write_text("[1, 0, 7]")
    (run / "best" / "best.json").write_text('{"metric": "accuracy", "value": NaN, "step": 1}')
    capsys.readouterr()
    result = recipe_main("grpo", [*flags, "--steps", "2", "--resume"])
    lines = [line for line in capsys.readouterr().err.splitlines() if "is damaged" in line]
    assert sorted(line.split(" is damaged")[0] for line in lines) == [
        str(run / "badput.json"), str(run / "best" / "best.json"),
        str(run / "heldout_start.json"),
    ], lines  # fmt: skip
    assert result["restarts"] == 1 and result["steps"] == 2
    assert "heldout_turned_right" not in result
    assert json.loads((run / "best" / "best.json").read_text())["step"] == 2


def test_a_model_folder_without_its_tokenizer_is_one_line(tmp_path, monkeypatch, capsys):
    """A recipe model folder of another vocabulary than the character tokenizer's, without
    its tokenizer files, is refused in one line (it was decoded with the character
    tokenizer: nonsense in, nonsense out); an old recipe model of the character tokenizer's
    vocabulary still loads without them."""
    import dataclasses

    from flax import nnx

    from tunelib.data import CharTokenizer
    from tunelib.models import Decoder

    from kit import models

    char = models.new_model(CharTokenizer(), "student", seed=0)
    wider = {"vocab_size": 100}
    if char.config.vocab_size_per_layer_input:  # the recipes' model has per-layer inputs
        wider["vocab_size_per_layer_input"] = 100
    config = dataclasses.replace(char.config, **wider)
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
    other = models.Model(config, graphdef, nnx.to_pure_dict(params), None, None)
    for name, model in (("other", other), ("old", char)):
        models.save_model(tmp_path / name, model, model.params)
        for saved in (tmp_path / name).glob("*tokenizer*"):
            saved.unlink()
    assert models.load_model(tmp_path / "old").tokenizer.vocab_size == char.config.vocab_size
    flags = ["--model", "other", "--out", "runs/other", "--steps", "1", "--no-progress"]
    status, lines = run_here("sft", flags, tmp_path, monkeypatch, capsys)
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("sft.py: error: --model ") and "holds no tokenizer" in lines[0]
    assert "vocabulary of 100 tokens is not the recipes' character tokenizer's (82)" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_a_backend_jax_cannot_start_here_is_one_line(tmp_path):
    """`JAX_PLATFORMS` naming a backend this machine lacks (its plugin not installed: JAX's
    own assertion failed, a traceback) is one line, before the run folder is made."""
    proc = run_recipe_process(
        "sft", "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress",
        env={"JAX_PLATFORMS": "cuda"},
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("sft.py: error: JAX_PLATFORMS=cuda: JAX cannot start that "), lines
    assert not (tmp_path / "run").exists()


def test_a_damaged_gguf_file_is_one_line_and_writes_nothing(world, monkeypatch, capsys):
    before = snapshot(world)
    flags = ["--model", "broken.gguf", "--out", "runs/broken", "--lora-rank", "4"]
    status, lines = run_here("sft", flags, world, monkeypatch, capsys)
    assert status == 2, lines
    assert len(lines) == 1 and "broken.gguf is not a readable GGUF file" in lines[0], lines
    assert snapshot(world) == before


def test_an_installed_model_that_is_not_installed_says_how_to_install_it(monkeypatch):
    from kit import models
    from kit.errors import UserError

    monkeypatch.setitem(
        models.INSTALLED_MODELS, "tiny", ("no_such_package_x", "tiny.gguf", "pip install tiny")
    )
    with pytest.raises(
        UserError, match="--model tiny: the model is not installed; pip install tiny"
    ):
        models.model_folder(Path("tiny"))


def test_each_step_draws_independent_keys_for_its_streams():
    """The keys of a step (the next state's, the rollouts', dropout's) never coincide, within a
    step or with the next step's: one split gives them all."""
    import jax
    import numpy as np

    from kit.loop import step_keys

    rng = jax.random.key_data(jax.random.key(0))
    seen = []
    for _ in range(3):
        rng, rollouts, dropout = step_keys(rng, "rollouts", "dropout")
        seen += [
            np.asarray(rng),
            *(np.asarray(jax.random.key_data(k)) for k in (rollouts, dropout)),
        ]
    assert len({x.tobytes() for x in seen}) == len(seen)
    again = step_keys(jax.random.key_data(jax.random.key(0)), "rollouts", "dropout")
    np.testing.assert_array_equal(again[0], seen[0])  # deterministic


@pytest.mark.parametrize(
    ("target", "module"), [("tensorboard", "tensorboardX"), ("wandb", "wandb")]
)
def test_a_logger_that_is_not_installed_is_one_line(monkeypatch, capsys, target, module):
    """`--log-to` names the package to install, in one line, before anything runs."""
    from kit.config import parse

    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    sft = recipe_module("sft").SFTConfig
    with pytest.raises(SystemExit) as stop:
        parse(sft, ["--log-to", f"jsonl,{target}"], description="", prog="sft.py")
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"sft.py: error: --log-to {target} needs the {module} package: "
                     "pip install 'tunelib[logging]'"]  # fmt: skip


def test_a_checkpoint_of_other_shapes_is_refused_in_one_line(tmp_path):
    """Restoring a run's checkpoint into a state of other shapes (another model behind the
    same settings) is a `UserError` naming the step and the folder, not Orbax's traceback."""
    import grain
    import jax.numpy as jnp
    import numpy as np

    from kit.checkpoints import Checkpoints
    from kit.errors import UserError

    def data():
        return iter(grain.MapDataset.range(8).batch(2).to_iter_dataset())

    saved = Checkpoints(tmp_path / "checkpoints")
    saved.save(3, {"w": jnp.zeros((4, 2))}, data(), {"step": 3, "loss": 1.0})
    saved.close()
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    step, state, record = checkpoints.restore_latest({"w": jnp.ones((4, 2))}, data())
    assert (step, record["loss"], float(np.asarray(state["w"]).sum())) == (3, 1.0, 0.0)
    with pytest.raises(UserError, match=r"step 3 in .* does not fit this run's model: .*\(5, 2\)"):
        checkpoints.restore_latest({"w": jnp.ones((5, 2))}, data())
    checkpoints.close()


@pytest.mark.parametrize("lost", ["state/_METADATA", "data/process_0-of-1.json"])
def test_a_checkpoint_missing_a_file_is_skipped_for_the_one_before(tmp_path, capsys, lost):
    """A checkpoint without its state's metadata (which Orbax would read as a tree of another
    structure, another model) or without its data position is damaged: the one before it is
    restored, and it is moved aside with one line."""
    import grain
    import jax.numpy as jnp
    import optax

    from kit.checkpoints import Checkpoints

    def data():
        return iter(grain.MapDataset.range(8).batch(2).to_iter_dataset())

    params = {"w": jnp.zeros((4, 2))}
    state = {"params": params, "opt": optax.adamw(1e-3).init(params)}
    saved = Checkpoints(tmp_path / "checkpoints")
    for step in (1, 2):
        saved.save(step, state, data(), {"step": step})
    saved.close()
    (tmp_path / "checkpoints" / "2" / lost).unlink()
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    step, _, record = checkpoints.restore_latest(state, data())
    checkpoints.close()
    assert step == 1 and record == {"step": 1}
    assert (tmp_path / "checkpoints" / "damaged-2").is_dir()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "the checkpoint of step 2 is damaged" in lines[0], lines


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("16", "--device-memory '16': give a size with its unit, e.g. 16GiB"),
        ("lots", "--device-memory 'lots': give a size with its unit"),
        ("16 GiBs", "give a size with its unit"),
        ("0MB", "--device-memory '0MB': the size must be at least 1 byte"),
    ],
)
def test_a_bad_device_memory_is_one_line_before_jax(world, size, message):
    before = snapshot(world)
    proc = run_without_jax("sft", "--device-memory", size, cwd=world)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert lines == [f"sft.py: error: {lines[0].split('error: ', 1)[1]}"] and message in lines[0]
    assert snapshot(world) == before


def test_device_memory_sizes_take_decimal_and_binary_units():
    from kit.config import parse_size

    assert parse_size("16GiB") == 16 * 2**30
    assert parse_size("800MB") == 800 * 10**6
    assert parse_size("1.5 gb") == 1_500_000_000
    assert parse_size("64KiB") == 65536 and parse_size("7B") == 7


def test_plan_of_a_recipe_that_would_train_its_start_first_is_one_line(tmp_path):
    """`--plan` trains nothing: DPO without its SFT model stops before JAX, saying how."""
    proc = run_without_jax("dpo", "--plan", cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "--plan trains nothing" in lines[0], lines
    assert "python recipes/sft.py --out runs/sft-seed0" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_plan_prints_the_plan_and_exits_without_a_run_folder(world, char_model):
    """`--plan` compiles the step and prints its memory per device; it writes nothing, not
    even where a run already is (runs/sft-seed0 holds one)."""
    from tests.recipes._scripts import run_recipe_process

    before = snapshot(world)
    flags = ["--model", str(char_model), "--batch-size", "8", "--num-train", "40"]
    started = time.perf_counter()
    proc = run_recipe_process("sft", "--plan", *flags, "--num-heldout", "8", cwd=world)
    seconds = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("sft: memory plan per device (1 CPU device)"), proc.stdout
    assert "a batch of 8 rows and never run" in lines[0]
    rows = {line.split()[0]: line for line in lines[1:] if line.strip()}
    assert {"params", "optimizer", "outputs", "activations", "peak"} <= set(rows), proc.stdout
    assert "device memory: CPU reports none" in proc.stdout
    assert snapshot(world) == before
    assert seconds < 120, seconds  # seconds: a model made, a step compiled twice


def test_a_run_predicted_not_to_fit_is_refused_in_one_line(world, char_model, monkeypatch, capsys):
    before = snapshot(world)
    flags = ["--model", str(char_model), "--batch-size", "8", "--num-train", "40"]
    flags += ["--num-heldout", "8", "--out", "runs/too-big", "--device-memory", "1MB"]
    status, lines = run_here("sft", flags, world, monkeypatch, capsys)
    assert status == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("sft.py: error: the run needs ")
    assert "per device (predicted), more than --device-memory 1MB: " in lines[0]
    assert "no batch size fits" in lines[0] or "--batch-size" in lines[0]
    assert "--lora-rank 16" in lines[0]  # what else was compiled, with its peak
    assert "--remat would need" in lines[0]
    assert snapshot(world) == before


def test_a_run_that_fits_starts_and_its_first_batch_is_not_consumed(capsys):
    """With `--device-memory` the step is planned on the first batch, which the loop then
    reads again; too little memory stops the run with the plan (a `kit.plan.Planned`)."""
    import types

    import grain
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kit import plan

    batches = iter(
        grain.MapDataset.range(64)
        .map(lambda i: np.full((3,), i, np.float32))
        .batch(8)
        .to_iter_dataset()
    )
    state = {"params": {"w": jnp.ones((3, 3))}, "opt_state": {"m": jnp.zeros((3, 3))}}
    step = jax.jit(lambda state, x: (state, {"loss": jnp.sum(x @ state["params"]["w"])}))

    def config(memory):
        return types.SimpleNamespace(plan=False, device_memory=memory, run_name=lambda: "toy")

    assert plan.check(config("1GiB"), None, state=state, batches=batches, step_fn=step) is None
    assert "toy: predicted peak" in capsys.readouterr().out
    np.testing.assert_array_equal(next(batches)[:, 0], np.arange(8))  # the first batch
    stop = plan.check(config("100B"), None, state=state, batches=batches, step_fn=step)
    assert isinstance(stop, plan.Planned)
    planned = stop.plan
    assert planned.batch_size == 8 and planned.peak_bytes > 100
    assert planned.plans["step"].params_bytes == planned.plans["step"].opt_state_bytes == 36
    np.testing.assert_array_equal(next(batches)[:, 0], np.arange(8, 16))
