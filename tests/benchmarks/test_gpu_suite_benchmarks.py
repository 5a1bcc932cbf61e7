"""The scripts of `benchmarks/gpu_suite.sh` end to end at their smoke sizes, on CPU.

Their figures mean something only on a GPU (Pallas runs in its interpreter here); these tests
check that each runs as a user runs it, checks what it claims to check, and refuses bad flags.
"""

import numpy as np
import pytest

from tests.benchmarks._run import refusal, run_benchmark


@pytest.mark.slow
def test_nf4_matmul_smoke_size_end_to_end(tmp_path):
    result, _ = run_benchmark(
        "nf4_matmul.py", "--size", "smoke", "--repeats", "1", "--inner", "1", out=tmp_path
    )
    assert result["correct"] is True
    assert [(c["n_in"], c["n_out"], c["m"]) for c in result["cases"]] == [
        (128, 64, 16),
        (128, 64, 48),
    ]
    for case in result["cases"]:
        xla, pallas = case["variants"]["xla"], case["variants"]["pallas"]
        # Both paths compute the same bfloat16 product: errors of bf16 rounding, not of a wrong
        # decode (which gives about 1).
        assert 0 < xla["relative_error"] < 1e-2 and 0 < pallas["relative_error"] < 1e-2
        assert pallas["weight_bytes_read"] < xla["weight_bytes_read"]
        for part in ("forward", "forward+backward"):
            assert case[f"pallas_speedup_{part}"] == pytest.approx(
                xla[f"{part}_ms"] / pallas[f"{part}_ms"]
            )


@pytest.mark.slow
def test_sampler_roofline_smoke_size_end_to_end(tmp_path):
    result, _ = run_benchmark(
        "sampler_roofline.py", "--size", "smoke", "--repeats", "1", out=tmp_path
    )
    assert [row["batch"] for row in result["batches"]] == [1, 2]
    assert result["bandwidth_bytes_per_s"] > 0
    for row in result["batches"]:
        # The floor counts every weight once and the cache's filled positions at each step.
        kv = 2 * 2 * row["batch"] * 2 * 8 * (4 + 4.5) * 4  # L, B, K, D, mean filled, float32
        assert row["bytes_per_step"] == pytest.approx(result["param_bytes"] + kv)
        assert row["floor_ms_per_step"] == pytest.approx(
            1e3 * row["bytes_per_step"] / result["bandwidth_bytes_per_s"]
        )
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * 8 / (row["sample_ms"] / 1e3))


def test_sampler_roofline_refuses_bad_batches():
    assert "--batches" in refusal("sampler_roofline.py", "--batches", "1,x")
    assert "--batches" in refusal("sampler_roofline.py", "--batches", "0")


@pytest.mark.slow
def test_grpo_parity_runs_replays_and_compares(tmp_path):
    steps = ["--steps", "3", "--batch", "2", "--group-size", "2"]
    first, _ = run_benchmark(
        "grpo_parity.py", *steps, "--out", str(tmp_path / "a.npz"), out=tmp_path
    )
    assert first["mode"] == "run" and first["steps"] == 3
    # A replay on the same backend trains on the same tokens: the same run, bit for bit.
    run_benchmark(
        "grpo_parity.py", *steps, "--out", str(tmp_path / "b.npz"),
        "--replay", str(tmp_path / "a.npz"), out=tmp_path,
    )  # fmt: skip
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert a["tokens"].shape == (3, 4, 16)
    np.testing.assert_array_equal(b["own_token_agreement"], 1.0)
    for name in ("tokens", "trainer_logps", "loss", "grad_norm", "param_norm"):
        np.testing.assert_array_equal(a[name], b[name])
    compared, _ = run_benchmark(
        "grpo_parity.py", "--compare", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"),
        out=tmp_path,
    )  # fmt: skip
    assert compared["first_step_with_differing_tokens"] is None
    assert compared["token_agreement"] == [1.0, 1.0, 1.0]
    assert max(compared["grad_norm_relative_diff"]) == 0.0


def test_grpo_parity_compare_finds_the_first_differing_step(tmp_path):
    rng = np.random.default_rng(0)
    a = {
        "tokens": rng.integers(0, 32, (3, 4, 16)),
        "sampler_logps": rng.normal(size=(3, 4, 16)),
        "trainer_logps": rng.normal(size=(3, 4, 16)),
        **{name: rng.uniform(1, 2, 3) for name in ("loss", "grad_norm", "reward", "param_norm")},
    }
    b = {name: value.copy() for name, value in a.items()}
    b["tokens"][1, 2, 5] += 1
    b["grad_norm"][2] *= 1.5
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    result, _ = run_benchmark(
        "grpo_parity.py", "--compare", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"),
        out=tmp_path,
    )  # fmt: skip
    assert result["first_step_with_differing_tokens"] == 1
    assert result["token_agreement"] == [1.0, 63 / 64, 1.0]
    assert result["grad_norm_relative_diff"] == pytest.approx([0.0, 0.0, 0.5])


def test_grpo_parity_refuses_bad_flags(tmp_path):
    assert "--out" in refusal("grpo_parity.py")
    assert "is not a file" in refusal(
        "grpo_parity.py", "--out", str(tmp_path / "x.npz"), "--replay", str(tmp_path / "none")
    )
    assert "--group-size" in refusal(
        "grpo_parity.py", "--out", str(tmp_path / "x.npz"), "--group-size", "1"
    )
