"""`benchmarks/peft.py` at its smoke size, its workers run in this process."""

from pathlib import Path

import numpy as np
import pytest

from tests._helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peft.py"


@pytest.mark.slow
def test_smoke_size_measures_what_it_says():
    bench = load_script(SCRIPT, "peft_benchmark")
    size = bench.SIZES["smoke"]
    full, qlora = (bench.measure(size, v, 4, repeats=1) for v in ("full", "qlora"))
    config = size.config
    # The full fine-tune trains every weight: AdamW keeps two float32 moments of each.
    assert full["trainable_params"] == full["stored_param_bytes"] // 4
    assert full["optimizer_bytes"] >= 8 * full["trainable_params"]
    # Rank 4 on 7 projections a layer: r (d_in + d_out) each.
    h, f, kv = config["hidden_size"], config["intermediate_size"], 2 * config["head_dim"]
    per_layer = 4 * (2 * (h + h) + 2 * (h + kv) + 3 * (h + f))
    assert qlora["trainable_params"] == config["num_hidden_layers"] * per_layer
    assert qlora["optimizer_bytes"] < full["optimizer_bytes"] / 4
    assert qlora["stored_param_bytes"] < full["stored_param_bytes"]
    assert 0 < qlora["total_bytes"] < full["total_bytes"]
    bits = bench.bits(size)
    assert bits["nf4_all_bits"] < bits["nf4_projections_bits"] < 16
    assert bits["bf16_over_nf4_all"] == pytest.approx(16 / bits["nf4_all_bits"])
    for record in (full, qlora):
        assert record["median_ms"] > 0 and record["temp_bytes"] > 0

    ours, naive = bench.check(size, "lora", 4), bench.check(size, "lora_merged", 4)
    assert bench.relative_error(ours, naive) < 1e-5
    assert not np.allclose(ours["grads"][0], 0.0)  # the check compares something
