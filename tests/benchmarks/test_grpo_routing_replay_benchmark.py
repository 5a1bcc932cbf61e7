"""`benchmarks/grpo_routing_replay.py`: its summary of run folders written as the GRPO recipe
writes them, and the script end to end at its smallest settings (an SFT start of the `moe`
model, then one GRPO run with and one without `--replay-routing`)."""

import json
from pathlib import Path

import pytest

from tests._helpers import load_script
from tests.benchmarks._run import run_benchmark

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


@pytest.mark.slow
def test_smallest_settings_end_to_end(tmp_path):
    result, output = run_benchmark(
        "grpo_routing_replay.py", "--size", "smoke", "--out", str(tmp_path / "runs"),
        out=tmp_path, timeout=900, compilation_cache=True,
    )  # fmt: skip
    assert [(r["arm"], r["seed"]) for r in result["runs"]] == [("plain", 0), ("replay", 0)]
    for row in result["runs"]:
        assert row["steps"] == 2 and 0.0 <= row["accuracy_after"] <= 1.0
        assert row["mismatch_kl_mean"] >= 0.0 and 0.0 < row["is_ess_min"] <= 1.0 + 1e-6
    config = json.loads((tmp_path / "runs" / "sft" / "model" / "config.json").read_text())
    assert config["num_experts"] == 8 and config["dtype"] == "bfloat16"
    assert "--replay-routing" in output
