"""`benchmarks/grpo_routing_replay.py`: its summary of run folders written as the GRPO recipe
writes them. Its runs (an SFT start of the `moe` model, then GRPO with and without
`--replay-routing`) are not repeated in the suite: GRPO with routing replay on an MoE is
`tests/recipes/test_recipes.py`'s (`qwen3_moe`), the `moe` model size
`tests/recipes/test_kit_models.py`'s."""

import json
from pathlib import Path

import pytest

from tests._helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_routing_replay.py"


def _write_run(folder: Path, rewards: list[float], accuracy: list[float], kl: float) -> None:
    folder.mkdir(parents=True)
    records = []
    for i, reward in enumerate(rewards):
        records.append({"step": i + 1, "loss": 0.1, "reward": reward, "mismatch_kl": kl * (i + 1),
                        "mismatch_kl_max": 10 * kl, "is_ess": 1.0 - kl})  # fmt: skip
    records += [{"step": 10 * i, "accuracy": a} for i, a in enumerate(accuracy)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_summary_reads_each_arm_and_flags_collapse(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its modules beside it, as a run has them
    bench = load_script(SCRIPT, "grpo_routing_replay_benchmark")
    _write_run(tmp_path / "plain-seed0", [0.2] * 10 + [0.1] * 10, [0.6, 0.2], kl=1e-3)
    _write_run(tmp_path / "replay-seed0", [0.2] * 10 + [0.5] * 10, [0.6, 0.7], kl=1e-6)
    assert bench.main(["--out", str(tmp_path), "--seeds", "0", "--summarize-only"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    by_arm = {row["arm"]: row for row in summary["runs"]}
    assert by_arm["plain"]["collapsed"] and not by_arm["replay"]["collapsed"]
    assert by_arm["plain"]["reward_first"] == pytest.approx(0.2)
    assert by_arm["replay"]["reward_final"] == pytest.approx(0.5)
    assert by_arm["plain"]["mismatch_kl_mean"] == pytest.approx(1e-3 * 10.5)
    assert by_arm["replay"]["accuracy_after"] == 0.7
    assert summary["means"]["plain"]["collapsed_runs"] == 1
