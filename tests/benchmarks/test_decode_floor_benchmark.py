"""`benchmarks/decode_floor.py` at its smallest settings on a tiny GGUF file the test writes
(`--model`): its worker processes, the token check, the rounds and the report."""

import pytest

from tests._gguf import write_tiny_gguf
from tests.benchmarks._run import load_benchmark, refusal, run_benchmark


@pytest.mark.slow
def test_smallest_settings_time_the_samplers_and_the_floors(tmp_path):
    messages = load_benchmark("sampler_smollm2.py", "sampler_smollm2_benchmark").MESSAGES
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", messages)
    args = ["--model", str(tiny), "--batches", "2", "--new-tokens", "3", "--repeats", "1"]
    result, output = run_benchmark("decode_floor.py", *args, out=tmp_path, compilation_cache=False)
    assert result["tokens_agree"] is True
    case = result["case"]
    assert (case["model"], case["layers"], case["new_tokens"]) == ("tiny.gguf", 2, 3)
    # The floor's bytes: 2 layers of q, k, v, o, gate, up, down plus the unembedding.
    h, vocab = case["hidden"], case["vocab"]
    assert case["floor_bytes_batch_1"] > 4 * h * vocab
    batch = result["batches"]["2"]
    samplers = {"per_layer", "stacked", "plain"}
    assert set(batch["step_ms"]) == set(batch["compile_s"]) == samplers
    assert batch["floor_ms"] > 0 and all(s > 0 for s in batch["compile_s"].values())
    assert batch["merged_floor_ms"] > 0 and batch["torch_floor_ms"] > 0
    assert 0 <= batch["plain_rows_differ"] <= 2
    assert set(case["cpu"]) == {"model", "avx512"}
    assert len(batch["runs_s"]["per_layer/3"]) == 1
    assert "floor reads" in output


def test_bad_flags_are_refused_before_anything_loads():
    assert "--new-tokens" in refusal("decode_floor.py", "--new-tokens", "1")
    assert "--batches" in refusal("decode_floor.py", "--batches", "x")
