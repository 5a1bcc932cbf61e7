"""`benchmarks/logp_mismatch.py` end to end at its smoke size, as a user runs it."""

import pytest

from tests.benchmarks._run import run_benchmark


@pytest.mark.slow
def test_smoke_size_end_to_end(tmp_path):
    result, _ = run_benchmark("logp_mismatch.py", "--size", "smoke", out=tmp_path)
    assert (result["batch"], result["new_tokens"], result["size"]) == (2, 4, "smoke")
    models = result["models"]
    assert set(models) == {"tiny-llama", "tiny-qwen3-moe"}
    for records in models.values():
        assert set(records) == {"float32", "bfloat16"}
        for dtype, record in records.items():
            assert record["tokens"] == 8
            assert 0 <= record["mean_abs"] <= record["max_abs"]
            assert 0 <= record["kl_k3_mean"] <= record["kl_k3_max"]
            assert 0 < record["ess"] <= 1 + 1e-6  # rounding may pass 1
            # The sampler and the trainer compute one function: in float32 they agree to
            # the rounding of these 64-wide models' products (a few 1e-7 each), on any CPU.
            if dtype == "float32":
                assert record["max_abs"] < 1e-5 and record["ess"] > 1 - 1e-9
                parts = record["parts"]
                assert parts["head_max_abs"] < 1e-5
                assert 0 < parts["product_rounding_max_abs"] < 1e-5
                assert parts["product_shape"] == [2, 32, 64, 64]
