"""`benchmarks/logprobs.py` end to end at its smoke size, as a user runs it, and its gate."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests._helpers import user_env
from tests.benchmarks._run import load_benchmark, run_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "logprobs.py"


@pytest.mark.slow
def test_smoke_size_end_to_end(tmp_path):
    # The library's default tile (about 2^22 logits) covers all of this small problem's
    # vocabulary, so a smaller tile is asked for to see the chunking at work.
    flags = ["--size", "smoke", "--repeats", "2", "--chunk-size", "1024"]
    result, output = run_benchmark("logprobs.py", *flags, out=tmp_path)
    lines = output.strip().splitlines()
    assert (result["size"], result["n"], result["h"], result["v"]) == ("smoke", 128, 64, 10_000)
    assert result["correct"] is True
    assert result["check_rows"] == 128  # the float64 reference covers every row here
    assert result["chunk_size"] == 1024

    naive, chunked = result["variants"]["naive"], result["variants"]["chunked"]
    for record in (naive, chunked):
        assert record["passed"] is True and record["reason"] is None
        assert set(record["errors"]) == {"loss", "d_hidden", "d_unembedding"}
        assert 0 < record["max_error"] == max(record["errors"].values()) < 1e-5
        assert record["peak_rss_bytes"] > 0 and record["median_ms"] > 0
        assert len(record["runs_ms"]) == 2
        # [128, 64] and [64, 10000] float32 inputs, the same shapes back as gradients.
        assert record["argument_bytes"] >= 4 * (128 * 64 + 64 * 10_000)
        assert record["output_bytes"] >= 4 * (128 * 64 + 64 * 10_000)
    # The naive path holds the [N, V] float32 logits; the chunked one only [N, chunk] tiles.
    assert naive["temp_bytes"] >= 4 * 128 * 10_000 > chunked["temp_bytes"]
    assert result["memory_ratio"] == pytest.approx(naive["temp_bytes"] / chunked["temp_bytes"])
    assert result["time_ratio"] == pytest.approx(chunked["median_ms"] / naive["median_ms"])

    # On CPU the Pallas kernel is skipped with a note, and there are no GPU-only figures.
    assert set(result["variants"]) == {"naive", "chunked"}
    assert any(n.startswith("pallas skipped") for n in result["notes"])
    assert "gemm" not in result and "tflops" not in chunked and "cpu_targets" not in result
    header = next(line for line in lines if line.lstrip().startswith("variant"))
    for column in ("temp MB", "peak RSS MB", "median ms", "max error"):
        assert column in header
    # Every stage's wall time, one after another: the reference and the checks in one worker.
    stages = result["stage_seconds"]
    assert list(stages) == [
        "reference", "naive check", "chunked check", "naive memory", "chunked memory",
        "timing (naive, chunked)",
    ]  # fmt: skip
    assert all(0 < seconds < 300 for seconds in stages.values())
    assert result["out_of_memory"] == []
    assert result["timing_worker"]["peak_rss_bytes"] > 0


def test_gate_compares_each_error_with_the_naive_paths_own():
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    naive = {"errors": {"loss": 1e-7, "d_hidden": 4e-7, "d_unembedding": 2e-7}}
    close = {"errors": {"loss": 1e-7, "d_hidden": 9e-6, "d_unembedding": 3e-7}}
    wrong = {"errors": {"loss": 1e-7, "d_hidden": 1e-7, "d_unembedding": 0.5}}
    verdicts = bench.judge({"naive": naive, "chunked": close, "pallas": wrong}, "float32")
    assert verdicts["naive"] is None and verdicts["chunked"] is None
    assert verdicts["pallas"].startswith("d_unembedding error 5.00e-01")

    # A bf16 variant gets one bf16 rounding more than the naive path, not two.
    assert bench.judge({"naive": naive, "chunked": close}, "bfloat16")["chunked"] is None
    loose = {"errors": {"loss": 1e-7, "d_hidden": 9e-3, "d_unembedding": 3e-7}}
    assert "d_hidden" in bench.judge({"naive": naive, "chunked": loose}, "bfloat16")["chunked"]

    # The naive path itself must stay near the float64 reference; nothing passes without it.
    bad = {"errors": {"loss": 1e-7, "d_hidden": 1e-3, "d_unembedding": 2e-7}}
    assert "d_hidden" in bench.judge({"naive": bad, "chunked": close}, "float32")["naive"]
    crashed = bench.judge({"naive": {"failed": "OOM"}, "chunked": close}, "float32")
    assert crashed["naive"] and crashed["chunked"]


def test_relative_error_is_normwise_and_streams_rows():
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    ref = np.arange(12.0).reshape(3, 4) - 5.0  # max |ref| = 6
    x = ref.astype(np.float32).copy()
    x[2, 3] += 0.3
    assert bench.relative_error(x, ref) == pytest.approx(0.05)
    assert bench.relative_error(np.float32(2.5), np.float64(2.0)) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="shape"):
        bench.relative_error(x[:2], ref)


def test_memory_only_compiles_abstract_inputs_without_running(tmp_path):
    written = tmp_path / "memory.json"
    command = [sys.executable, str(SCRIPT), "--memory-only", "--size", "smoke"]
    command += ["--chunk-size", "1024", "--json-out", str(written)]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=user_env(), check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(written.read_text())["memory_only"]}
    assert set(rows) == {"naive", "chunked"}
    # [128, 64] and [64, 10000] float32 gradients; the naive path holds [N, V] logits.
    assert rows["chunked"]["gradient_bytes"] == 4 * (128 * 64 + 64 * 10_000)
    assert rows["naive"]["temp_bytes"] >= 4 * 128 * 10_000 > rows["chunked"]["temp_bytes"]
    for row in rows.values():
        assert row["temp_over_gradients"] == row["temp_bytes"] / row["gradient_bytes"]
        assert row["output_bytes"] >= row["gradient_bytes"]


def dense_reference(h, w, y):
    """The token-mean NLL and its gradients in float64 from the whole logits at once."""
    z = h @ w
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    rows = np.arange(len(y))
    dz = np.exp(logp)
    dz[rows, y] -= 1.0
    dz /= len(y)
    return -logp[rows, y].mean(), dz @ w.T, h.T @ dz


def test_reference_grads_chunked_equal_the_dense_formula(monkeypatch):
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    monkeypatch.setattr(bench, "REFERENCE_CHUNK", 7)  # 50 columns: 8 chunks, the last short
    rng = np.random.default_rng(0)
    h = rng.normal(size=(6, 5))
    w = rng.normal(size=(5, 50)).astype(np.float32)  # as the worker has it on the host
    y = np.array([0, 6, 7, 13, 48, 49])  # targets at the chunks' edges
    ref = bench.reference_grads(h, w, y)
    loss, d_hidden, d_unembedding = dense_reference(h, w.astype(np.float64), y)
    assert ref["d_hidden"].dtype == ref["d_unembedding"].dtype == np.float64
    np.testing.assert_allclose(ref["loss"], loss, rtol=1e-12)
    np.testing.assert_allclose(ref["d_hidden"], d_hidden, rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(ref["d_unembedding"], d_unembedding, rtol=1e-10, atol=1e-15)


def test_reference_runs_float64_on_the_host_only():
    """At an accelerator size (bfloat16, a row subset) the reference computes from the inputs
    every worker draws, in NumPy: JAX never enables float64, so nothing float64 can run on
    the accelerator whatever the default backend is."""
    import jax

    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    size = bench.Size(n=300, h=8, v=40, dtype="bfloat16", accelerator=True)
    assert jax.config.jax_enable_x64 is False
    inputs = bench.make_inputs(size)
    rows = bench.check_rows(size)
    np.testing.assert_array_equal(rows, np.linspace(0, 299, 256).round())
    ref = bench.reference(inputs, rows)
    assert jax.config.jax_enable_x64 is False
    hidden, unembedding, targets = inputs
    h = np.asarray(hidden.astype("float32"), np.float64)[rows]
    w = np.asarray(unembedding.astype("float32"), np.float64)
    loss, d_hidden, d_unembedding = dense_reference(h, w, np.asarray(targets)[rows])
    # Kept rounded to float32: 2^-24, far below bfloat16's 4e-3.
    assert ref["d_unembedding"].dtype == ref["d_hidden"].dtype == np.float32
    np.testing.assert_allclose(ref["loss"], loss, rtol=1e-12)
    np.testing.assert_allclose(ref["d_hidden"], d_hidden, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(ref["d_unembedding"], d_unembedding, rtol=1e-6, atol=1e-12)


def test_errors_are_taken_in_the_references_precision():
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    ref = np.array([1.0, -4.0])
    x = ref + np.array([2.0**-40, 0.0])  # a difference float32 cannot hold beside 1
    assert bench.relative_error(x, ref) == 2.0**-42  # float64 against a float64 reference
    assert bench.relative_error(x, ref.astype(np.float32)) == 0.0  # float32 against float32
    x32 = ref.astype(np.float32) + np.float32(2.0**-8)
    assert bench.relative_error(x32, ref.astype(np.float32)) == pytest.approx(2.0**-10)


def test_results_come_to_the_host_as_float32():
    import jax.numpy as jnp

    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    x = jnp.asarray([[1.5, -2.0], [3.0e-3, 7.0]], jnp.bfloat16)
    host = bench.to_host(x)
    assert isinstance(host, np.ndarray) and host.dtype == np.float32
    np.testing.assert_array_equal(host, [[1.5, -2.0], [float(x[1, 0]), 7.0]])
    assert bench.to_host(jnp.float32(2.5)).dtype == np.float32


def test_default_size_by_backend():
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    assert bench.default_size("cpu") == "cpu"
    assert bench.default_size("tpu") == "gemma2-2b"  # fits one v5e chip with every variant
    assert bench.default_size("gpu") == "llama3-8b"
    assert bench.SIZES["gemma2-2b"].accelerator and not bench.SIZES["cpu"].accelerator


def test_a_worker_out_of_memory_is_told_from_other_failures():
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    tpu = "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Error allocating device"
    compiler = "XlaRuntimeError: ... Ran out of memory in memory space hbm. Used 17.5G of 15.75G"
    for stderr in (tpu, compiler):
        record = bench.failure(1, f"Traceback ...\n{stderr}\n")
        assert record == {"failed": f"Traceback ...\n{stderr}", "out_of_memory": True}
    assert bench.failure(1, "ValueError: bad shape") == {
        "failed": "ValueError: bad shape",
        "out_of_memory": False,
    }
    assert bench.failure(-9, "") == {"failed": "exit status -9", "out_of_memory": False}


def test_gate_with_the_naive_path_out_of_memory():
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    oom = {"failed": "RESOURCE_EXHAUSTED", "out_of_memory": True}
    close = {"errors": {"loss": 1e-3, "d_hidden": 1.5e-2, "d_unembedding": 3e-3}}
    wrong = {"errors": {"loss": 1e-3, "d_hidden": 1e-3, "d_unembedding": 0.5}}
    verdicts = bench.judge({"naive": oom, "chunked": close, "pallas": wrong}, "bfloat16")
    # Without the naive path's errors, the others meet its own bound (2e-2 in bfloat16).
    assert verdicts["naive"] == "out of memory" and verdicts["chunked"] is None
    assert verdicts["pallas"] == "d_unembedding error 5.00e-01 > 0.02"
    assert bench.judge({"naive": close, "chunked": oom}, "bfloat16")["chunked"] == "out of memory"


def fake_workers(bench, monkeypatch, failures: dict[str, dict], backend: str = "tpu"):
    """The parent's workers replaced by canned records (the stages named in `failures` by
    theirs; a failed stage ends its worker, as `run_worker` reports it); the workers started,
    in order, as (worker, variants)."""
    calls = []

    def run_worker(args, worker, variants, names, folder, stages):
        calls.append((worker, tuple(variants)))
        records = {}
        for name in names:
            if name in failures:
                records[name] = failures.pop(name)
                break
            if name == "reference":
                records[name] = {"size": args.size, "backend": backend, "device": "d", "rows": 256}
            elif name.endswith(" check"):
                records[name] = {"errors": {"loss": 1e-4, "d_hidden": 4e-3}, "max_error": 4e-3}
            elif name.endswith(" memory"):
                records[name] = {"peak_rss_bytes": 10**8, "peak_device_bytes": 10**9}
            else:
                times = {"median_ms": 2.0, "runs_ms": [2.0], "temp_bytes": 10**6}
                records[name] = {
                    "variants": {v: dict(times) for v in variants},
                    "peak_rss_bytes": 10**8,
                    "peak_device_bytes": 10**9,
                }
            stages[name] = 1.0
        return records

    monkeypatch.setattr(bench, "run_worker", run_worker)
    return calls


def test_a_check_that_raises_is_reported_and_the_next_variant_checked(tmp_path, monkeypatch):
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    real_check = bench.check

    def check(variant, *rest):
        if variant == "naive":
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return real_check(variant, *rest)

    monkeypatch.setattr(bench, "check", check)
    size = bench.Size(n=8, h=4, v=16, dtype="float32", accelerator=False)
    stage = bench.stage_writer(tmp_path / "stages.jsonl")
    bench.check_worker("x", size, ["naive", "chunked", "pallas"], None, stage)
    lines = (tmp_path / "stages.jsonl").read_text().splitlines()
    emitted = [json.loads(line) for line in lines]
    assert [r["stage"] for r in emitted] == [
        "reference", "naive check", "chunked check", "pallas check",
    ]  # fmt: skip
    assert emitted[0]["size"] == "x" and emitted[0]["backend"] == "cpu"
    assert emitted[1]["out_of_memory"] is True and "RESOURCE_EXHAUSTED" in emitted[1]["failed"]
    assert emitted[2]["max_error"] < 1e-5
    assert emitted[3]["skipped"].startswith("pallas skipped: its kernels need a GPU or TPU")


def test_a_variant_out_of_memory_is_reported_and_the_others_measured(tmp_path, monkeypatch):
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    oom = {"failed": "RESOURCE_EXHAUSTED: Out of memory", "out_of_memory": True}
    # Here the naive path's check ended its worker: the others are checked in a new one.
    calls = fake_workers(bench, monkeypatch, {"naive check": oom})
    written = tmp_path / "result.json"
    status = bench.main(["--size", "llama3-8b", "--json-out", str(written)])
    result = json.loads(written.read_text())
    assert status == 0  # reported, not fatal
    assert result["out_of_memory"] == ["naive"] and result["correct"] is True
    naive, chunked = result["variants"]["naive"], result["variants"]["chunked"]
    assert naive["passed"] is False and naive["reason"] == "out of memory"
    assert "median_ms" not in naive and naive["out_of_memory"] is True
    assert chunked["passed"] is True and chunked["median_ms"] == 2.0
    assert result["memory_ratio"] is None and result["time_ratio"] is None
    # On a TPU no memory worker runs; the timing worker times the others with the GEMM.
    assert calls == [
        ("check", ("naive", "chunked", "pallas")),
        ("check", ("chunked", "pallas")),
        ("timing", ("chunked", "pallas", "gemm")),
    ]
    assert result["timing_worker"] == {"peak_rss_bytes": 10**8, "peak_device_bytes": 10**9}


def test_a_stopped_check_is_reported_and_the_variants_after_it_checked(tmp_path, monkeypatch):
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    hung = {"failed": "stopped after --stage-timeout 60 s", "out_of_memory": False}
    calls = fake_workers(bench, monkeypatch, {"chunked check": hung | {"timed_out": True}}, "gpu")
    written = tmp_path / "result.json"
    assert bench.main(["--size", "gemma2-2b", "--json-out", str(written)]) == 1
    result = json.loads(written.read_text())
    assert result["variants"]["chunked"]["reason"] == "its check failed"
    assert result["variants"]["chunked"]["timed_out"] is True
    assert result["variants"]["pallas"]["median_ms"] == 2.0
    # Off a TPU each variant that passed (and the GEMM) has a memory worker of its own.
    assert calls == [
        ("check", ("naive", "chunked", "pallas")),
        ("check", ("pallas",)),
        ("memory", ("naive",)),
        ("memory", ("pallas",)),
        ("memory", ("gemm",)),
        ("timing", ("naive", "pallas", "gemm")),
    ]
    assert result["variants"]["pallas"]["peak_device_bytes"] == 10**9


def test_a_variant_that_crashes_otherwise_fails_the_run(tmp_path, monkeypatch):
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    crash = {"failed": "ValueError: bad", "out_of_memory": False}
    fake_workers(bench, monkeypatch, {"pallas check": crash})
    written = tmp_path / "result.json"
    assert bench.main(["--size", "gemma2-2b", "--json-out", str(written)]) == 1
    result = json.loads(written.read_text())
    assert result["correct"] is False and result["out_of_memory"] == []
    assert result["variants"]["pallas"]["reason"] == "its check failed"
    assert result["variants"]["chunked"]["median_ms"] == 2.0


def test_a_failed_reference_ends_the_run(tmp_path, monkeypatch, capsys):
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    fake_workers(
        bench, monkeypatch, {"reference": {"failed": "MemoryError", "out_of_memory": False}}
    )
    assert bench.main(["--size", "smoke"]) == 1
    assert "the float64 reference failed:\nMemoryError" in capsys.readouterr().err


def test_a_worker_past_its_stage_timeout_is_stopped(tmp_path):
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    args = bench.build_parser().parse_args(["--size", "smoke", "--stage-timeout", "0.5"])
    stages = {}
    names = ["reference", "naive check"]
    records = bench.run_worker(args, "check", ["naive"], names, tmp_path, stages)
    assert list(records) == ["reference"]  # the stage it was in; nothing after it
    assert records["reference"] == {
        "failed": "stopped after --stage-timeout 0.5 s",
        "out_of_memory": False,
        "timed_out": True,
    }
    assert 0.5 <= stages["reference"] < 30


def test_a_worker_reports_each_stage_as_it_ends(tmp_path):
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    args = bench.build_parser().parse_args(["--size", "smoke", "--chunk-size", "1024"])
    stages = {}
    names = ["reference", "naive check", "pallas check"]
    records = bench.run_worker(args, "check", ["naive", "pallas"], names, tmp_path, stages)
    assert list(records) == names
    assert records["reference"]["backend"] == "cpu" and records["reference"]["rows"] == 128
    assert records["naive check"]["max_error"] < 1e-5
    assert records["pallas check"]["skipped"].startswith("pallas skipped")
    assert list(stages) == ["reference", "naive check"]  # a skipped stage takes no time


def test_a_worker_deaf_to_sigint_prints_its_stacks_before_it_is_killed():
    """Stuck where SIGINT cannot reach it, a worker gets SIGABRT after the grace: Python's
    fault handler prints every thread's stack (the parent turns it on in each worker)."""
    bench = load_benchmark("logprobs.py", "logprobs_benchmark")
    deaf = (
        "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "print(1, flush=True); time.sleep(60)"
    )
    env = user_env() | {"PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(
        [sys.executable, "-c", deaf], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    ) as proc:
        proc.stdout.readline()  # its handler is in place
        bench.stop(proc, grace=0.5)
        stderr = proc.stderr.read().decode()
    assert proc.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in stderr and 'File "<string>", line 1' in stderr
