"""`benchmarks/grpo_collapse.py`: its runs are the GRPO recipe's (tested with the recipes);
here, its summary of them, on run folders written as the recipe writes them."""

import json
from pathlib import Path

from tests._helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_collapse.py"


def _write_run(folder: Path, entropies: list[float], warnings: int) -> None:
    folder.mkdir(parents=True)
    records = []
    for i, entropy in enumerate(entropies):
        records.append({"step": 10 * i, "loss": 0.1})
        records.append({
            "step": 10 * i, "accuracy": 0.5 + 0.1 * i, "pass_at_1": 0.4 + 0.1 * i,
            "pass_at_k": 0.9 - 0.1 * i, "sample_entropy": entropy,
        })  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = "grpo: warning: step 20: entropy collapse? ...\n" * warnings
    (folder.parent / f"{folder.name}.log").write_text(lines)


def test_the_summary_reads_each_arm_and_counts_the_guards_warnings(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its modules beside it, as a run has them
    bench = load_script(SCRIPT, "grpo_collapse_benchmark")
    _write_run(tmp_path / "pushed-seed0", [1.2, 0.3, 0.005], warnings=2)
    _write_run(tmp_path / "controlled-seed0", [1.2, 0.8, 0.6], warnings=0)
    assert bench.main(["--out", str(tmp_path), "--seeds", "0", "--summarize-only"]) == 0
    printed = capsys.readouterr().out.splitlines()
    summary = json.loads(printed[-1])
    by_arm = {row["arm"]: row for row in summary["runs"]}
    assert by_arm["pushed"]["warnings"] == 2 and by_arm["controlled"]["warnings"] == 0
    assert by_arm["pushed"]["steps"] == [0, 10, 20]
    assert by_arm["pushed"]["sample_entropy"] == [1.2, 0.3, 0.005]
    assert "0.900 -> 0.700" in printed[1]  # pass@8 first and last, in the table
    assert (tmp_path / "collapse.png").stat().st_size > 0
