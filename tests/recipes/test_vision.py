"""The recipes on records with images: SFT then GRPO from its checkpoint on image records a
user writes, on the tiny Gemma 4 vision-language model SFT builds; and the bad inputs of
image records, each one line naming the record."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.recipes._scripts import recipe_main, snapshot
from tests.recipes.test_recipes import shared_compilation_cache
from tunelib.data import CharTokenizer, vision_counting_split, write_image_records

from kit import images, models

QUIET = ["--no-progress", "--no-plots", "--devices", "1"]


@pytest.fixture(autouse=True)
def _shared_compilation_cache():
    with shared_compilation_cache():
        yield


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> Path:
    """SFT records (`images`, `messages`) and RL records (`images`, `prompt`, `answer`) of
    the counting task, written as a user writes them: JSON lines and PNG files."""
    folder = tmp_path_factory.mktemp("images")
    train, heldout = vision_counting_split(
        num_train=16, num_heldout=4, seed=3, size=32, max_count=2, questions=("count",)
    )
    write_image_records([images.as_sft(r) for r in train + heldout], folder / "sft.jsonl")
    write_image_records(train + heldout, folder / "rl.jsonl")
    return folder


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    """The recipes' tiny Gemma 4 made smaller still (one text and one vision layer, fewer
    programs to compile), saved as the Hugging Face checkpoint a user would bring."""
    folder = tmp_path_factory.mktemp("small-vlm") / "model"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(models.VISION_TEXT, "num_hidden_layers", 1)
        patch.setitem(models.VISION_TEXT, "layer_types", ["full_attention"])
        patch.setitem(models.VISION_ENCODER, "num_hidden_layers", 1)
        model = models.new_vision_model(CharTokenizer(), seed=5)
    models.save_model(folder, model, model.params)
    return folder


def metrics_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_then_grpo_from_its_checkpoint_on_image_records(image_files, small_model, tmp_path):
    """SFT trains a Gemma 4 checkpoint on the image records, through its vision encoder
    (whose weights move: the images reached the model); GRPO starts from its checkpoint,
    samples groups over the prompts' images and recomputes their log-probs with the same
    images (the trainer/sampler mismatch is float rounding, not a model without images)."""
    sft = recipe_main(
        "sft", [*QUIET, "--model", str(small_model), "--data", str(image_files / "sft.jsonl"),
                "--steps", "3", "--eval-every", "3", "--batch-size", "4", "--num-heldout", "0",
                "--learning-rate", "1e-2", "--out", str(tmp_path / "sft")],
    )  # fmt: skip
    assert sft["recipe"] == "sft" and sft["tuning"] == "full"
    losses = [r["loss"] for r in metrics_of(tmp_path / "sft") if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]
    start, trained = models.load_model(small_model), models.load_model(tmp_path / "sft")
    assert trained.images == start.images == images.ImageLayout(82, 83, 84, 8, 2, 16)
    moved = [
        not np.allclose(a, b)
        for a, b in zip(*(_leaves(m.params["vision_tower"]) for m in (trained, start)), strict=True)
    ]
    assert sum(moved) > len(moved) // 2  # the gradients reached the vision encoder

    grpo = recipe_main(
        "grpo", [*QUIET, "--model", str(tmp_path / "sft"), "--data",
                 str(image_files / "rl.jsonl"), "--steps", "2", "--eval-every", "2",
                 "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "3",
                 "--eval-samples", "0", "--kl-coef", "0", "--out", str(tmp_path / "grpo")],
    )  # fmt: skip
    assert grpo["recipe"] == "grpo"
    for key in ("accuracy_before", "accuracy_after"):
        assert 0.0 <= grpo[key] <= 1.0
    steps = [r for r in metrics_of(tmp_path / "grpo") if "mismatch_kl" in r]
    assert len(steps) == 2
    for record in steps:  # the trainer's log-probs saw the sampler's images
        assert abs(record["mismatch_kl"]) < 1e-6 and record["is_ess"] > 0.999, record
    again = models.load_model(tmp_path / "grpo")
    assert again.images == trained.images


def _leaves(tree) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _record(image: str, markers: int = 1) -> dict:
    ask = [{"type": "image"}] * markers + [{"type": "text", "text": "How many circles?"}]
    reply = {"role": "assistant", "content": "2"}
    return {"images": [image], "messages": [{"role": "user", "content": ask}, reply]}


@pytest.fixture(scope="module")
def bad_world(tmp_path_factory) -> Path:
    """Image records with one bad record each, and a text-only model."""
    root = tmp_path_factory.mktemp("bad-images")
    Image.new("RGB", (32, 32), (255, 255, 255)).save(root / "white.png")
    (root / "broken.png").write_bytes(b"\x89PNG not really")
    files = {
        "missing.jsonl": [_record("white.png"), _record("gone.png")],
        "undecodable.jsonl": [_record("white.png"), _record("broken.png")],
        "count.jsonl": [_record("white.png"), _record("white.png", markers=2)],
        "good.jsonl": [_record("white.png")] * 4,
    }
    for name, records in files.items():
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    text_model = root / "text-model"
    model = models.new_model(CharTokenizer(), "student", seed=0)
    models.save_model(text_model, model, model.params)
    return root


@pytest.mark.parametrize(
    ("recipe", "flags", "message"),
    [
        ("sft", ["--data", "missing.jsonl"],
         "--data missing.jsonl: record 1: line 2 of missing.jsonl: images[0]: no image file"),
        ("sft", ["--data", "undecodable.jsonl"],
         "--data undecodable.jsonl: record 1: line 2 of undecodable.jsonl: images[0]:"),
        ("sft", ["--data", "count.jsonl"],
         "record 1: line 2 of count.jsonl: field 'images' holds 1 images but 'messages' has 2"),
        ("sft", ["--data", "good.jsonl", "--model", "text-model"],
         "--data good.jsonl: record 0 has images, but the model reads text only; give a Gemma 4"),
        ("sft", ["--task", "vision_counting", "--model", "text-model"],
         "--task vision_counting: the model reads text only"),
        ("grpo", ["--task", "vision_counting", "--model", "text-model"],
         "--task vision_counting: the model reads text only"),
        ("sft", ["--task", "vision_counting", "--data", "good.jsonl"],
         "--task vision_counting is a built-in task and --data a file of your own: pass one"),
    ],
)  # fmt: skip
def test_bad_image_inputs_give_one_line_naming_the_record(
    bad_world, recipe, flags, message, monkeypatch, capsys
):
    monkeypatch.chdir(bad_world)
    before = snapshot(bad_world)
    with pytest.raises(SystemExit) as stop:
        recipe_main(recipe, [*QUIET, *flags, "--out", "runs/bad", "--num-heldout", "0"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stop.value.code == 2, lines
    assert len(lines) == 1 and message in lines[0], lines
    assert snapshot(bad_world) == before
