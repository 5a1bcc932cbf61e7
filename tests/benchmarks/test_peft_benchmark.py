"""`benchmarks/peft.py` end to end at its smoke size, as a user runs it: the check and
reference workers (every LoRA variant), a measuring worker for each of the full fine-tune
and QLoRA, the table and the JSON line."""

import pytest

from tests.benchmarks._run import refusal, run_benchmark


@pytest.mark.slow
def test_smoke_size_end_to_end(tmp_path):
    flags = ["--size", "smoke", "--rank", "4", "--repeats", "1", "--measure", "full,qlora"]
    result, output = run_benchmark("peft.py", *flags, out=tmp_path)
    assert (result["size"], result["rank"]) == ("smoke", 4)

    # The check ran before the measurements: every LoRA variant and its naive twin against the
    # float64 reference, within float32 rounding (and not equal to it: something was compared).
    assert result["correct"] is True
    assert set(result["errors"]) == {"lora", "lora_merged", "qlora", "qlora_dequantized"}
    assert all(0 < error < 1e-5 for error in result["errors"].values())

    variants = result["variants"]
    assert list(variants) == ["full", "qlora"]
    full, qlora = variants["full"], variants["qlora"]
    # The full fine-tune trains every weight: AdamW keeps two float32 moments of each.
    assert full["trainable_params"] == full["stored_param_bytes"] // 4
    assert full["optimizer_bytes"] >= 8 * full["trainable_params"]
    # Rank 4 on 7 projections a layer: r (d_in + d_out) each.
    config = result["config"]
    h, f, kv = config["hidden_size"], config["intermediate_size"], 2 * config["head_dim"]
    per_layer = 4 * (2 * (h + h) + 2 * (h + kv) + 3 * (h + f))
    for name in ("qlora",):
        assert variants[name]["trainable_params"] == config["num_hidden_layers"] * per_layer
    assert qlora["optimizer_bytes"] < full["optimizer_bytes"] / 4
    assert qlora["stored_param_bytes"] < full["stored_param_bytes"]
    assert 0 < qlora["total_bytes"] < full["total_bytes"]
    bits = result["bits"]
    assert bits["nf4_all_bits"] < bits["nf4_projections_bits"] < 16
    assert bits["bf16_over_nf4_all"] == pytest.approx(16 / bits["nf4_all_bits"])
    for record in variants.values():
        assert len(record["runs_ms"]) == 1 and record["median_ms"] > 0
        assert record["temp_bytes"] > 0 and record["peak_rss_bytes"] > 0
    assert result["lora_time_over_full"] is None  # LoRA not measured
    assert result["qlora_total_over_full"] == pytest.approx(
        qlora["total_bytes"] / full["total_bytes"]
    )
    assert "correct (at most 2 x the naive error + 1e-05): True" in output


def test_measured_variants_are_named():
    line = refusal("peft.py", "--measure", "full,dora")
    assert line.endswith("--measure: no variant 'dora'; choose from full, lora_merged, lora, "
                         "qlora_dequantized, qlora")  # fmt: skip
