"""`benchmarks/sampler.py` end to end at its smoke size, as a user runs it, and its check."""

from pathlib import Path

import numpy as np
import pytest

from tests._helpers import load_script
from tests.benchmarks._run import run_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sampler.py"


@pytest.mark.slow
def test_smoke_size_end_to_end(tmp_path):
    result, output = run_benchmark(
        "sampler.py", "--size", "smoke", "--repeats", "1", out=tmp_path, compilation_cache=False
    )
    lines = output.strip().splitlines()
    assert result["correct"] is True and result["reason"] is None
    case = result["case"]
    assert (case["layers"], case["hidden"], case["new_tokens"], case["batch"]) == (2, 32, 16, 8)
    new, batch = case["new_tokens"], case["batch"]

    runs = {(r["variant"], r["batch"], r["group_size"]): r for r in result["runs"]}
    for (_, b, g), r in runs.items():
        assert r["rows"] == b * g and r["tokens"] == b * g * new
        assert len(r["runs_s"]) == 1 and r["median_s"] == r["runs_s"][0] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["median_s"])
        assert r["ms_per_token"] == pytest.approx(1e3 / r["tokens_per_s"])
        assert r["ms_per_step"] == pytest.approx(r["ms_per_token"] * r["rows"])
        # Each variant compiles once, in its warm-up call; jax.monitoring times that part.
        assert 0 < r["compile_s"] < r["first_call_s"]

    # The headline ratios, from the headline batch's tokens/s.
    tps = result["tokens_per_s"]
    assert set(tps) == {"no_cache", "greedy", "top_p"}
    for name, value in tps.items():
        assert value == runs[(name, batch, 1)]["tokens_per_s"] > 0
    assert result["speedup_vs_no_cache"] > 0
    assert result["speedup_vs_no_cache"] == pytest.approx(tps["greedy"] / tps["no_cache"])
    assert result["topp_cost_vs_greedy"] > 0
    assert result["topp_cost_vs_greedy"] == pytest.approx(
        runs[("top_p", batch, 1)]["ms_per_token"] / runs[("greedy", batch, 1)]["ms_per_token"]
    )

    # The same ratios round by round, from the runs each round timed one after the other.
    def seconds(name):
        return np.array(runs[(name, batch, 1)]["runs_s"])

    by_round = result["by_round"]
    assert by_round["speedup_vs_no_cache"] == list(seconds("no_cache") / seconds("greedy"))
    assert by_round["topp_cost_vs_greedy"] == list(seconds("top_p") / seconds("greedy"))
    assert "per round" in output

    # The batch table: greedy and no_cache at every batch, the speedup at each.
    assert [row["batch"] for row in result["batch_table"]] == [1, batch]
    for row in result["batch_table"]:
        greedy, naive = runs[("greedy", row["batch"], 1)], runs[("no_cache", row["batch"], 1)]
        assert row["greedy_tokens_per_s"] == greedy["tokens_per_s"]
        assert row["no_cache_tokens_per_s"] == naive["tokens_per_s"]
        assert row["speedup_vs_no_cache"] == pytest.approx(
            greedy["tokens_per_s"] / naive["tokens_per_s"]
        )

    # The group table: the same B * G rows, G completions of each prompt.
    groups = result["group_table"]
    assert [row["group_size"] for row in groups] == [1, 4]
    for row in groups:
        assert row["rows"] == row["prompts"] * row["group_size"] == case["group_rows"]
        assert (
            row["tokens_per_s"]
            == runs[("sample", row["prompts"], row["group_size"])]["tokens_per_s"]
        )

    assert result["meets_targets"] == {
        "speedup_vs_no_cache>=40": result["speedup_vs_no_cache"] >= 40,
        "topp_cost_vs_greedy<=1.3": result["topp_cost_vs_greedy"] <= 1.3,
    }
    assert "greedy tokens of sample == no_cache's: pass" in lines
    header = next(line for line in lines if line.lstrip().startswith("variant"))
    for column in ("batch", "G", "tokens/s", "ms/token", "compile s"):
        assert column in header.split(" | ") or f" {column} " in header


def test_check_compares_greedy_tokens_with_the_no_cache_generators():
    from tunelib.rollout import Rollout

    bench = load_script(SCRIPT, "sampler_benchmark")
    size = bench.SIZES["smoke"]._replace(new_tokens=4)
    tokens = np.array([[3, 1, 4, 1], [5, 9, 2, 6]], np.int32)
    where = np.ones(tokens.shape, bool)

    def rollout(tokens, where):
        return Rollout(
            tokens, where, np.zeros(tokens.shape), where.sum(-1), ~where.any(-1), np.float32(1)
        )

    assert bench.check(size, tokens, rollout(tokens, where)) == (True, None)
    other = tokens.copy()
    other[1, 2] = 7
    ok, reason = bench.check(size, tokens, rollout(other, where))
    assert not ok and "1 of 2 rows" in reason and "row 1, token 2: 7 against 2" in reason
    stopped = where.copy()
    stopped[0, 3] = False
    ok, reason = bench.check(size, tokens, rollout(tokens, stopped))
    assert not ok and "stopped" in reason


def test_variants_cover_the_three_tables_once():
    bench = load_script(SCRIPT, "sampler_benchmark")
    size = bench.SIZES["default"]
    listed = bench.variants(size)
    assert len(listed) == len(set(listed))
    labels = {v.label for v in listed}
    assert {"no_cache B=8 G=1", "greedy B=8 G=1", "top_p B=8 G=1"} <= labels
    for b in (1, 8, 32):
        assert {f"no_cache B={b} G=1", f"greedy B={b} G=1"} <= labels
    assert {"sample B=32 G=1", "sample B=8 G=4", "sample B=4 G=8"} <= labels
    assert all(v.rows == 32 for v in listed if v.name == "sample")
    assert len(listed) == 10
