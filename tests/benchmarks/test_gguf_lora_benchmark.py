"""`benchmarks/gguf_lora.py` end to end at its smallest settings, on a tiny Q8_0 GGUF file the
test writes (`--model`): the real SmolLM2 file takes minutes; the tiny one runs the script's
whole path (the check worker, a measuring worker per variant, the table and the JSON line) in
seconds."""

import pytest

from tests._gguf import TOKENIZER_SIZE, write_tiny_gguf
from tests.benchmarks._run import refusal, run_benchmark

TEXTS = tuple(f"What is {a} + {b}? {a + b}" for a in range(0, 100, 7) for b in range(9))


@pytest.mark.slow
def test_smallest_settings_end_to_end(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", TEXTS, dtype="Q8_0")
    flags = ["--model", str(tiny), "--rank", "2", "--batch", "2"]
    flags += ["--tokens", "16", "--prompt", "4", "--repeats", "1"]
    result, output = run_benchmark("gguf_lora.py", *flags, out=tmp_path)
    # The check ran: the blocks' loss and adapter gradients equal the float32 base's.
    assert result["correct"] is True and 0 <= result["error"] <= 1e-4
    assert (result["rank"], result["batch"], result["tokens"]) == (2, 2, 16)
    assert result["file_bytes"] == tiny.stat().st_size

    # write_tiny_gguf's decoder: hidden 64, MLP 128, 2 layers, 4 heads and 2 key/value heads
    # of 16. Its 2-D weights are Q8_0 blocks (34 bytes per 32 values), its norms float32.
    h, f, kv, layers = 64, 128, 32, 2
    matrices = TOKENIZER_SIZE * h + layers * (2 * h * h + 2 * h * kv + 3 * h * f)
    norms = layers * 2 * h + h
    assert result["base_bytes"] == {
        "gguf_blocks": matrices // 32 * 34 + 4 * norms,
        "float32": 4 * (matrices + norms),
        "bfloat16": 2 * (matrices + norms),
    }
    blocks, dense = result["variants"]["gguf_blocks"], result["variants"]["float32"]
    assert result["blocks_over_float32_base"] == pytest.approx(
        blocks["base_bytes"] / dense["base_bytes"]
    )
    # Rank 2 on the 7 projections of each layer: r (d_in + d_out) float32 values each.
    adapters = layers * 2 * (2 * (h + h) + 2 * (h + kv) + 3 * (h + f))
    for record in (blocks, dense):
        assert record["adapter_bytes"] == 4 * adapters
        assert len(record["runs_ms"]) == 1 and record["median_ms"] > 0
        assert record["temp_bytes"] > 0 and record["peak_rss_bytes"] > 0
    assert blocks["base_bits_per_param"] < 9 and dense["base_bits_per_param"] == 32
    assert result["blocks_over_float32_time"] == pytest.approx(
        blocks["median_ms"] / dense["median_ms"]
    )
    assert "correct (at most 0.0001): True" in output


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rank", "0"], "--rank must be >= 1, got 0"),
        (["--tokens", "8", "--prompt", "8"], "--prompt must be in [0, --tokens), got 8 of 8"),
        (["--model", "no-such.gguf"], "--model no-such.gguf: no such file"),
    ],
)
def test_bad_flags_end_in_one_line(argv, message):
    assert refusal("gguf_lora.py", *argv).endswith(message)
