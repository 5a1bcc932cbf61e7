"""`benchmarks/accelerator_suite.sh` and its scripts end to end at their smoke sizes, on CPU.

Their figures mean something only on a GPU or TPU (Pallas runs in its interpreter here); these
tests check that each runs as a user runs it, checks what it claims to check, and refuses bad
flags, and that the suite runs its parts one after another within their limits, skips what
cannot run, and gathers every result into a few files.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests._helpers import user_env
from tests.benchmarks._run import BENCHMARKS, load_benchmark, refusal, run_benchmark

SUITE = BENCHMARKS / "accelerator_suite.sh"
PARTS = [
    "logprobs-gemma2", "sampler", "nf4", "recipes-toy", "recipes-smollm2", "parity",
    "logprobs-llama3",
]  # fmt: skip
# The CPU record the parity part compares with, made with the flags of the suite's SMOKE mode.
PARITY_SMOKE = ["--steps", "3", "--batch", "2", "--group-size", "2"]


def run_suite(out: Path, budget: int, scratch: Path, **settings: str):
    """`bash benchmarks/accelerator_suite.sh OUT BUDGET` from the repository root at the smoke
    sizes, with `python3` the test's own Python; its exit status and output."""
    env = user_env(compilation_cache=True) | {"SMOKE": "1", "SUITE_TMP": str(scratch)}
    env |= settings
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(
        ["bash", str(SUITE), str(out), str(budget)], cwd=BENCHMARKS.parent, env=env,
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_suite_runs_the_parts_asked_and_packs_their_results(tmp_path):
    cpu = tmp_path / "grpo_cpu.npz"
    run_benchmark("grpo_parity.py", *PARITY_SMOKE, "--out", str(cpu), out=tmp_path)
    out = tmp_path / "out"
    status, output = run_suite(
        out, 600, tmp_path / "scratch", PACK="1", PARITY_CPU=str(cpu),
        PARTS="recipes-toy parity",
    )  # fmt: skip
    assert status == 0, output[-4000:]
    # Packed: three files for a channel that returns few, every result inside one of them.
    assert sorted(os.listdir(out)) == ["log.txt", "results.json", "summary.txt"]
    document = json.loads((out / "results.json").read_text())
    parts = document["parts"]
    assert list(parts) == PARTS
    assert document["suite"]["budget"] == 600 and "tunelib from" in document["suite"]["header"]
    for name in PARTS:
        ran = name in ("recipes-toy", "parity")
        assert parts[name]["status"] == ("ok" if ran else "skipped"), name
        assert parts[name]["exit"] == (0 if ran else None)
        assert parts[name]["note"] == ("" if ran else "not in PARTS")

    # The toy recipes' result.json, SFT then GRPO of that model, with their time split.
    recipes = parts["recipes-toy"]["results"]
    assert list(recipes) == ["recipe_sft_toy.json", "recipe_grpo_toy.json"]
    sft, grpo = recipes["recipe_sft_toy.json"], recipes["recipe_grpo_toy.json"]
    assert (sft["recipe"], sft["steps"], grpo["recipe"], grpo["steps"]) == ("sft", 4, "grpo", 1)
    for result in (sft, grpo):
        assert 0 < result["time"]["goodput"] <= 1 and result["time"]["compile"] > 0
    # The parity run trained on the CPU record's tokens at full float32 precision.
    parity = parts["parity"]["results"]["parity.json"]
    assert parity["mode"] == "compare" and parity["steps"] == 3
    assert parity["token_agreement"] == [1.0, 1.0, 1.0]
    assert max(parity["max_trainer_logp_diff"]) < 1e-5
    assert parts["parity"]["results"]["parity_run.json"]["matmul_precision"] == "highest"

    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].split() == ["part", "status", "s", "headline"]
    assert [line.split()[0] for line in summary[1:8]] == PARTS
    assert summary[4].split()[1] == "ok" and "sft" in summary[4] and "goodput" in summary[4]
    assert "tokens equal 100.0%" in summary[6]
    assert summary[8] == "2 of 7 parts ok, 2 run"
    log = (out / "log.txt").read_text()
    assert "== recipes-toy (limit 160 s" in log and "== parity: exit 0" in log


@pytest.mark.slow
def test_suite_stops_a_part_at_its_limit_and_skips_what_cannot_run(tmp_path):
    out = tmp_path / "out"
    status, output = run_suite(
        out, 120, tmp_path / "scratch", PART_LIMIT="3",
        PARITY_CPU=str(tmp_path / "none.npz"), PARTS="logprobs-gemma2 sampler parity",
    )  # fmt: skip
    assert status == 1, output[-4000:]  # a part that ran did not end well
    parts = json.loads((out / "results.json").read_text())["parts"]
    for name in ("logprobs-gemma2", "sampler"):
        # Stopped at 3 s by SIGINT, which Python ends on (status 124), workers and all.
        assert parts[name]["status"] == "time limit" and parts[name]["exit"] == 124
        # At most the limit, the 15 s before SIGKILL and the processes' reaping, however
        # loaded the machine is.
        assert parts[name]["limit"] == 3 and 3 <= parts[name]["seconds"] <= 3 + 15 + 15
    assert parts["parity"]["status"] == "skipped"
    assert parts["parity"]["note"].startswith(f"no CPU record {tmp_path / 'none.npz'}")
    assert parts["nf4"]["note"] == "not in PARTS"
    # Unpacked, each part's files lie in a folder of its own beside the three.
    assert {"log.txt", "results.json", "summary.txt", "parts"} <= set(os.listdir(out))
    log = (out / "log.txt").read_text()
    assert "== logprobs-gemma2: exit 124 after" in log and "KeyboardInterrupt" in log


def test_suite_report_headlines_and_statuses(tmp_path):
    report = load_benchmark("suite_report.py", "suite_report")
    folder = tmp_path / "parts"
    (folder / "head").mkdir(parents=True)
    (folder / "head" / "logprobs.json").write_text(json.dumps({
        "benchmark": "logprobs", "size": "llama3-8b", "n": 16384, "memory_ratio": None,
        "variants": {
            "naive": {"passed": False, "out_of_memory": True},
            "chunked": {"passed": True, "median_ms": 241.25},
        },
    }))  # fmt: skip
    (folder / "rl").mkdir()
    (folder / "rl" / "recipe.json").write_text(json.dumps({
        "recipe": "grpo", "seconds": 114.0, "accuracy_before": 0.25, "accuracy_after": 0.5,
        "time": {"compile": 66.4, "goodput": 0.3},
    }))  # fmt: skip
    (folder / "rl" / "notes.txt").write_text("not JSON")
    status = tmp_path / "status.tsv"
    status.write_text(
        "head\t0\t40\t180\t\nrl\t124\t150\t150\t\nslow\t137\t20\t150\t\n"
        "gone\t-\t0\t90\tnot in PARTS\nhung\t137\t165\t150\t\n"
    )
    text = report.report(status, folder, tmp_path / "out", {"budget": 480})
    lines = text.splitlines()
    assert lines[1].split()[:3] == ["head", "ok", "40"]
    assert lines[1].endswith("llama3-8b N=16384: naive OOM, chunked 241.2 ms; naive/chunked temp -")
    assert lines[2].split()[1:4] == ["time", "limit", "150"]  # interrupted at its limit
    assert lines[2].endswith("grpo 114.0 s (compile 66 s, goodput 30%), accuracy 0.25 -> 0.5")
    assert lines[3].split()[1:3] == ["exit", "137"]  # killed before its limit: not the limit
    assert lines[4].split()[:3] == ["gone", "skipped", "0"] and lines[4].endswith("not in PARTS")
    assert lines[5].split()[:4] == ["hung", "time", "limit", "165"]  # killed 15 s later
    assert lines[6] == "1 of 5 parts ok, 4 run"
    packed = json.loads((tmp_path / "out" / "results.json").read_text())
    assert packed["suite"] == {"budget": 480}
    assert packed["parts"]["rl"]["results"]["notes.txt"] == "not JSON"
    assert packed["parts"]["gone"]["exit"] is None
    assert (tmp_path / "out" / "summary.txt").read_text() == text
    assert report.all_ran_ok(tmp_path / "out" / "results.json") is False


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


def test_nf4_matmul_on_a_tpu_times_xla_and_says_why_not_pallas(tmp_path, monkeypatch, capsys):
    """On a TPU the Pallas kernel refuses to compile (a Triton lowering only): it is not run,
    and the table, the JSON and the suite's headline say so; the XLA path is checked and
    timed, and the run is correct."""
    import jax

    bench = load_benchmark("nf4_matmul.py", "nf4_matmul_benchmark")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    written = tmp_path / "nf4.json"
    flags = ["--size", "smoke", "--repeats", "1", "--inner", "1", "--json-out", str(written)]
    assert bench.main(flags) == 0
    result = json.loads(written.read_text())
    assert result["correct"] is True and result["backend"] == "tpu"
    for case in result["cases"]:
        assert list(case["variants"]) == ["xla", "pallas"]
        assert case["variants"]["pallas"] == {"skipped": bench.NOT_ON["pallas", "tpu"]}
        assert 0 < case["variants"]["xla"]["relative_error"] < 1e-2
        assert case["variants"]["xla"]["forward_ms"] > 0
        assert "pallas_speedup_forward" not in case
    assert bench.NOT_ON["pallas", "tpu"].startswith("not on TPU (refused")
    out = capsys.readouterr()
    assert "pallas not on TPU (refused" in out.out and "pallas: not on TPU (refused" in out.err
    headline = load_benchmark("suite_report.py", "suite_report").nf4_headline(result)
    assert headline.startswith("correct; xla forward ms: 128x64 M16 ")
    assert headline.endswith(f"; pallas {bench.NOT_ON['pallas', 'tpu']}")


@pytest.mark.parametrize(
    ("message", "status"),
    [("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 14.22G", 0), ("broken", 1)],
)
def test_nf4_matmul_reports_a_call_that_fails_and_times_the_rest(
    tmp_path, monkeypatch, capsys, message, status
):
    """A call that fails in its warm-up (here every forward-and-backward) is reported in the
    table and the JSON and left out of the timing; the forwards are still timed. Out of
    device memory leaves the run correct (exit 0); any other failure does not."""
    import jax

    bench = load_benchmark("nf4_matmul.py", "nf4_matmul_benchmark")

    def failing_value_and_grad(fn):
        def call(*args):
            raise RuntimeError(message)

        return call

    monkeypatch.setattr(jax, "value_and_grad", failing_value_and_grad)
    written = tmp_path / "nf4.json"
    flags = ["--size", "smoke", "--repeats", "1", "--inner", "1", "--json-out", str(written)]
    assert bench.main(flags) == status
    result = json.loads(written.read_text())
    assert result["correct"] is (status == 0)
    for case in result["cases"]:
        for variant in case["variants"].values():
            assert variant["forward_ms"] > 0 and "forward+backward_ms" not in variant
            assert variant["forward+backward_failed"] == f"RuntimeError: {message}"
            assert ("out_of_memory" in variant) is (status == 0)
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if " x " in line and "K x N" not in line]
    assert rows and all(line.split()[-1] == ("OOM" if status == 0 else "failed") for line in rows)


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
