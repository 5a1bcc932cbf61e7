"""A recipe trained on the accelerator, in this process (`kit.cli.main`, what
`python recipes/sft.py` runs): the test process holds the chip, so a recipe started as a
process of its own could not open it.

Part of the accelerator tier (docs/tpu.md): skipped where JAX has no GPU or TPU.
"""

import json

import numpy as np
import pytest

from tests.recipes._scripts import recipe_main

pytestmark = pytest.mark.accelerator

PHASES = {"compile", "data", "rollout", "logprobs", "train", "sync", "checkpoint", "eval", "idle"}


def test_sft_trains_a_small_model_in_this_process(tmp_path):
    """SFT of the recipes' smallest model on the arithmetic task, 40 steps on one device:
    the loss falls, the result and the metrics are written, every step's time is split."""
    out = tmp_path / "sft"
    flags = [
        "--model-size", "student", "--num-train", "512", "--num-heldout", "16",
        "--batch-size", "16", "--steps", "40", "--eval-every", "40", "--devices", "1",
        "--no-progress", "--no-plots", "--out", str(out),
    ]  # fmt: skip
    result = recipe_main("sft", flags)
    assert result["recipe"] == "sft"
    assert json.loads((out / "result.json").read_text()) == result
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(41))  # step 0: before training
    losses = np.array([r["loss"] for r in records[1:]])
    assert np.all(np.isfinite(losses))
    assert losses[-5:].mean() < 0.8 * losses[:5].mean(), losses
    assert set(result["time"]) == {*PHASES, "goodput"} and 0 < result["time"]["goodput"] < 1
    assert result["time"]["compile"] > 0 and result["time"]["train"] > 0
    assert all(all(f"time_{p}" in r for p in PHASES) for r in records[1:])
    assert (out / "model").is_dir()
