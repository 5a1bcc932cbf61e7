r"""Side by side: log-probs from hidden states with and without `[N, V]` logits.

    python benchmarks/logprobs.py                   # `cpu` on CPU, gemma2-2b on TPU, else llama3-8b
    python benchmarks/logprobs.py --size smoke      # seconds; what the tests run
    python benchmarks/logprobs.py --size gemma2-2b  # the Cut Cross-Entropy head (fits a v5e)
    python benchmarks/logprobs.py --size llama3-8b --n 8192   # a TPU v5e (16 GiB); see below

Every variant computes the forward and backward pass of a token-mean NLL,

$$
L = -\frac{1}{N} \sum_n \log \operatorname{softmax}(h_n W)_{y_n},
$$

with gradients with respect to the hidden states $h$ `[N, H]` and the unembedding $W$ `[H, V]`,
through `tunelib.logprobs.fused_token_logps(..., implementation=variant)`:

- ``naive``: materialise the logits, log-softmax, gather (the baseline);
- ``chunked``: the pure-JAX vocabulary tiles with a recomputing custom VJP (`--chunk-size`);
- ``pallas``: the Pallas kernel of `tunelib.kernels`, skipped with a note on the CPU backend
  or when it cannot be imported.

The parent process only orchestrates and never opens the accelerator (its backend is asked of
a throwaway `probe` process); each step below runs in a fresh worker subprocess
(`--variant X --size S --json-out FILE`), one after another (a TPU lets one process at a
time hold it), so that one variant's buffers, compilation caches and peak RSS never leak
into another's. A worker still running after `--stage-timeout` seconds is interrupted
(SIGINT, then SIGKILL 15 s later) and reported, and the parent prints on stderr how long
each one took:

1. ``reference``: a float64 loss and gradients on the same inputs, in NumPy on the host,
   computed a vocabulary chunk at a time. The inputs are drawn on the default backend as
   every worker draws them and come to the host once, converted to float32 on the device
   (exact for bfloat16 and float32 inputs); nothing float64 ever runs on the accelerator. At
   the accelerator sizes it covers an evenly spaced subset of `CHECK_ROWS` rows: their
   token-mean NLL over those rows alone, whose gradients include the full `[H, V]`
   unembedding gradient of that sub-problem.
2. Correctness, for every variant before anything is measured: its loss and gradients on the
   reference's rows against the reference, as the relative error
   $\max |x - x_{ref}| / \max |x_{ref}|$ of each of loss, d hidden and d unembedding; the
   variant's results come to the host once, converted to float32 on the device, and the
   errors are taken in NumPy a block of rows at a time. At the accelerator sizes the d hidden
   rows of the full-size run are checked too (each row's gradient depends on that row alone;
   they are rescaled by $N / $`CHECK_ROWS`). A variant passes when its error exceeds the
   naive path's own error by at most `TOLERANCE[dtype]`; the naive path must itself stay
   within `NAIVE_BOUND[dtype]`. A variant whose worker runs out of device memory is reported
   as such and not measured, without failing the script; with the naive path out of memory,
   the others are held to the naive path's own bound. A variant that fails its check is not
   measured and the script exits with status 1.
3. Memory, for every variant that passed, each alone in its worker: `memory_analysis()` of
   the compiled executable (temporary, argument and output bytes) and, after one run, the
   worker's peak RSS (`ru_maxrss`, which on a GPU or TPU counts host memory only; the
   device's peak bytes in use are reported beside it).
4. Time, of every variant that passed, side by side in one ``timing`` worker on one copy of
   the inputs: one warm-up run each, then `--repeats` rounds that run each variant once, the
   order reversed every other round (a slow spell of a shared machine hits every variant
   alike); the median of each. At the accelerator sizes a plain bf16 GEMM `[N, H] x [H, V]`
   is timed too, and every variant's throughput is counted as $6 N H V$ flops per forward
   and backward (the chunked path executes $8 N H V$, the Pallas kernel $10 N H V$) against
   the GEMM's $2 N H V$.

On one TPU v5e chip (15.7 GiB) `gemma2-2b` (N = 8192) fits every variant. `llama3-8b` at its
N = 16384 holds as many float32 logits in the naive path as `gemma2-2b` does (8.4 GB), beside
twice the hidden states: near the chip's limit. `--n 4096` to `--n 8192` (2.1 to 4.2 GB of
logits) are the range to use there; a variant that does not fit is reported as out of memory
while the others are measured.

The script prints a table and ends with one JSON line: `size`, `memory_ratio` (naive temp
bytes / chunked temp bytes), `time_ratio` (chunked median / naive median), per-variant
figures and `stage_seconds` (each worker's wall time). At the `cpu` size it also prints
whether the CPU targets (`memory_ratio >= 24`, `time_ratio <= 1.0`) are met; they are
reported, never asserted.
"""

import argparse
import json
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tunelib.logprobs import default_chunk_size


class Size(NamedTuple):
    n: int
    h: int
    v: int
    dtype: str
    accelerator: bool  # reference on a row subset, TFLOP/s and the GEMM fraction


SIZES = {
    "smoke": Size(n=128, h=64, v=10_000, dtype="float32", accelerator=False),
    "cpu": Size(n=4096, h=512, v=65_536, dtype="float32", accelerator=False),
    "llama3-8b": Size(n=16_384, h=4096, v=128_256, dtype="bfloat16", accelerator=True),
    "gemma2-2b": Size(n=8192, h=2304, v=256_000, dtype="bfloat16", accelerator=True),
}
# The size run without --size, by backend: the TPU's is the largest head that fits one v5e.
DEFAULT_SIZE = {"cpu": "cpu", "tpu": "gemma2-2b"}
DEFAULT_ACCELERATOR_SIZE = "llama3-8b"
VARIANTS = ("naive", "chunked", "pallas")
# Rows of the float64 reference at the accelerator sizes (all rows at the others).
CHECK_ROWS = 256
# How far a variant's relative error may exceed the naive path's, and the naive path's own
# bound, by input dtype. bf16 gradients are returned in bf16, rounded by up to 2^-8 (3.9e-3)
# of their size; float32 results carry errors near 1e-6 (a wrong gradient gives about 1).
TOLERANCE = {"float32": 1e-5, "bfloat16": 4e-3}
NAIVE_BOUND = {"float32": 1e-4, "bfloat16": 2e-2}
# Logits z = h W have a standard deviation of about this: h ~ N(0, 1), W ~ N(0, s^2 / H).
LOGIT_SCALE = 2.0
REFERENCE_CHUNK = 4096
# Elements of a block of rows in `relative_error` (a float64 block of 128 MiB).
ERROR_BLOCK = 2**24
CPU_TARGETS = {"memory_ratio": 24.0, "time_ratio": 1.0}
# What a worker that ran out of device memory says on stderr: XLA's status on every backend
# ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate ...", "... Ran out of memory
# in memory space hbm ..." from the TPU compiler).
OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "out of memory")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--size", choices=sorted(SIZES), default=None,
        help="default: cpu on CPU, gemma2-2b on a TPU, llama3-8b on a GPU",
    )  # fmt: skip
    p.add_argument("--n", type=int, default=None, help="override the size's token count N")
    p.add_argument(
        "--chunk-size", type=int, default=None,
        help="vocabulary tile of 'chunked' (default: the library's, about 2^22 logits a tile)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=5, help="timed runs after one warm-up")
    p.add_argument(
        "--stage-timeout", type=float, default=600.0,
        help="seconds each worker (reference, a check, a memory figure, the timing) may take; "
        "one that takes longer is stopped and reported",
    )  # fmt: skip
    p.add_argument(
        "--memory-only", action="store_true",
        help="compile naive and chunked on abstract inputs at every size (or --size) for this "
        "backend and print their temporaries against the gradients' size; runs nothing",
    )  # fmt: skip
    p.add_argument(
        "--json-out",
        type=Path,
        default=None,
        help="write the result JSON to this file too (the worker's result, in worker mode)",
    )
    worker = p.add_argument_group("worker mode (started by the parent)")
    worker.add_argument(
        "--variant", choices=(*VARIANTS, "reference", "gemm", "timing"), default=None
    )
    worker.add_argument(
        "--timed", default=None, help="with --variant timing: the variants to time, comma-separated"
    )
    worker.add_argument(
        "--reference",
        type=Path,
        default=None,
        help="the reference's .npz: written by --variant reference; a variant given it checks "
        "its correctness against it instead of being measured",
    )
    return p


def default_size(backend: str) -> str:
    """The size run without `--size` on `backend` (`jax.default_backend()`)."""
    return DEFAULT_SIZE.get(backend, DEFAULT_ACCELERATOR_SIZE)


# ----------------------------------------------------------------------------- inputs


def shape_of(args: argparse.Namespace) -> Size:
    size = SIZES[args.size]
    return size._replace(n=args.n) if args.n is not None else size


def make_inputs(size: Size) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The same hidden states, unembedding and targets in every worker (fixed keys), drawn on
    the default backend."""

    @jax.jit
    def draw():
        kh, kw, ky = jax.random.split(jax.random.key(0), 3)
        hidden = jax.random.normal(kh, (size.n, size.h), jnp.float32)
        scale = LOGIT_SCALE / np.sqrt(size.h)
        unembedding = scale * jax.random.normal(kw, (size.h, size.v), jnp.float32)
        targets = jax.random.randint(ky, (size.n,), 0, size.v)
        return hidden.astype(size.dtype), unembedding.astype(size.dtype), targets

    return jax.block_until_ready(draw())


def check_rows(size: Size) -> np.ndarray:
    if not size.accelerator or size.n <= CHECK_ROWS:
        return np.arange(size.n)
    return np.linspace(0, size.n - 1, CHECK_ROWS).round().astype(np.int64)


def to_host(x: jax.Array) -> np.ndarray:
    """`x` on the host as float32, converted on its device first: one transfer, and no
    element-by-element conversion of bfloat16 on the host."""
    return np.asarray(jax.device_get(jnp.asarray(x).astype(jnp.float32)))


# ----------------------------------------------------------------------------- workers


def loss_and_grads(variant: str, chunk_size: int | None):
    """The jitted token-mean NLL and its gradients w.r.t. hidden and unembedding."""
    from tunelib.logprobs import fused_token_logps

    def nll(hidden, unembedding, targets):
        logps = fused_token_logps(
            hidden, unembedding, targets, chunk_size=chunk_size, implementation=variant
        )
        return -jnp.mean(logps)

    return jax.jit(jax.value_and_grad(nll, argnums=(0, 1)))


def reference_grads(
    h: np.ndarray, w: np.ndarray, y: np.ndarray, dtype=np.float64
) -> dict[str, np.ndarray]:
    """Float64 loss and gradients of the token-mean NLL, in NumPy, a vocabulary chunk of `w`
    at a time.

    Written from the formula, independently of tunelib: with R rows,
    L = -(1/R) sum_n (z[n, y_n] - logsumexp_v z[n, v]), dL/dz = (softmax(z) - onehot(y)) / R,
    dL/dh = dL/dz W^T and dL/dW = h^T dL/dz.

    Args:
      h: `[R, H]` hidden states, w: `[H, V]` unembedding (any float dtype), y: `[R]` targets.
      dtype: the dtype the `[H, V]` gradient is kept in, each chunk rounded once from its
        float64 value (so that no float64 copy of the whole is held).
    """
    h = np.asarray(h, np.float64)
    rows, vocab = h.shape[0], w.shape[1]
    chunks = [(a, min(a + REFERENCE_CHUNK, vocab)) for a in range(0, vocab, REFERENCE_CHUNK)]
    lse = np.full(rows, -np.inf)
    for a, b in chunks:
        z = h @ np.asarray(w[:, a:b], np.float64)
        top = z.max(axis=1)
        lse = np.logaddexp(lse, top + np.log(np.exp(z - top[:, None]).sum(axis=1)))
    target_z = np.sum(h * np.asarray(w[:, y], np.float64).T, axis=1)
    d_hidden = np.zeros_like(h)
    d_unembedding = np.empty((h.shape[1], vocab), dtype)
    for a, b in chunks:
        wc = np.asarray(w[:, a:b], np.float64)
        dz = np.exp(h @ wc - lse[:, None])
        hit = (y >= a) & (y < b)
        dz[np.flatnonzero(hit), y[hit] - a] -= 1.0
        dz /= rows
        d_hidden += dz @ wc.T
        d_unembedding[:, a:b] = h.T @ dz
    loss = -np.mean(target_z - lse)
    return {"loss": np.float64(loss), "d_hidden": d_hidden, "d_unembedding": d_unembedding}


def reference(size: Size, path: Path) -> dict:
    """The float64 reference on the check rows, written to `path` (`.npz`).

    The inputs are drawn as every worker draws them, on the default backend, and come to the
    host as float32 (converted there: exact for bfloat16 and float32 inputs); the float64
    arithmetic is NumPy's, on the host. The gradients are stored in float64 for float32
    inputs; for bfloat16 inputs in float32, whose rounding (2^-24 of each value) is far below
    the bfloat16 tolerance and which halves the file (a `[2304, 256000]` gradient: 2.4 GB).
    """
    hidden, unembedding, targets = make_inputs(size)
    rows = check_rows(size)
    h = to_host(hidden[rows])
    w = to_host(unembedding)
    y = np.asarray(targets)[rows].astype(np.int64)
    del hidden, unembedding, targets
    stored = np.float64 if size.dtype == "float32" else np.float32
    ref = reference_grads(h, w, y, dtype=stored)
    np.savez(
        path,
        rows=rows,
        loss=ref["loss"],
        d_hidden=ref["d_hidden"].astype(stored),
        d_unembedding=ref["d_unembedding"],
    )
    return {"rows": len(rows), "stored_dtype": np.dtype(stored).name}


def relative_error(x, ref) -> float:
    """max |x - ref| / max |ref| in float64 on the host, a block of rows at a time (no float64
    copy of the whole of x)."""
    x, ref = np.asarray(x), np.asarray(ref)
    if x.shape != ref.shape:
        raise ValueError(f"shape {x.shape} does not match the reference's {ref.shape}.")
    x, ref = np.atleast_2d(x), np.atleast_2d(ref)
    block = max(1, ERROR_BLOCK // max(1, x.shape[1]))
    worst = scale = 0.0
    for i in range(0, x.shape[0], block):
        r = np.asarray(ref[i : i + block], np.float64)
        worst = max(worst, float(np.max(np.abs(np.asarray(x[i : i + block], np.float64) - r))))
        scale = max(scale, float(np.max(np.abs(r))))
    return worst / scale


def check(size: Size, variant: str, chunk_size: int | None, path: Path) -> dict:
    """The variant's relative errors against the float64 reference (see the module docstring).

    The variant runs on the default backend; its results come to the host once, as float32.
    At the accelerator sizes the full-size run goes first and alone (only the reference rows
    of its d hidden are kept), then the run on the reference's rows."""
    ref = np.load(path)
    rows = ref["rows"]
    hidden, unembedding, targets = make_inputs(size)
    step = loss_and_grads(variant, chunk_size)
    full = None
    if len(rows) < size.n:
        _, (d_full, _) = step(hidden, unembedding, targets)
        full = to_host(d_full[rows]).astype(np.float64) * (size.n / len(rows))
        del d_full
        hidden, targets = hidden[rows], targets[rows]
    loss, (d_hidden, d_unembedding) = step(hidden, unembedding, targets)
    del hidden, unembedding, targets
    errors = {
        "loss": relative_error(to_host(loss), ref["loss"]),
        "d_hidden": relative_error(to_host(d_hidden), ref["d_hidden"]),
    }
    del d_hidden
    errors["d_unembedding"] = relative_error(to_host(d_unembedding), ref["d_unembedding"])
    if full is not None:
        errors["d_hidden_full_run"] = relative_error(full, ref["d_hidden"])
    return {"errors": errors, "max_error": max(errors.values())}


def step_and_args(variant: str, chunk_size: int | None, inputs: tuple):
    hidden, unembedding, targets = inputs
    if variant == "gemm":
        return jax.jit(jnp.matmul), (hidden, unembedding)
    return loss_and_grads(variant, chunk_size), (hidden, unembedding, targets)


def interleaved(size: Size, variants: list[str], chunk_size: int | None, repeats: int) -> dict:
    """Median wall time of every variant, timed in one process on one copy of the inputs: one
    warm-up (compiling) run each, then `repeats` rounds that run each variant once, the order
    reversed every other round, so that a slow spell of a shared machine hits every variant
    alike."""
    inputs = make_inputs(size)
    steps = {}
    for variant in variants:
        step, args = step_and_args(variant, chunk_size, inputs)
        compiled = step.lower(*args).compile()
        jax.block_until_ready(compiled(*args))
        steps[variant] = (compiled, args)
    seconds = {variant: [] for variant in variants}
    for round_index in range(repeats):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for variant in order:
            compiled, args = steps[variant]
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            seconds[variant].append(time.perf_counter() - start)
    return {
        variant: {
            "median_ms": 1e3 * statistics.median(runs),
            "runs_ms": [round(1e3 * s, 3) for s in runs],
        }
        for variant, runs in seconds.items()
    }


def measure(size: Size, variant: str, chunk_size: int | None) -> dict:
    """Compiled memory, peak RSS and device peak of one variant or the GEMM, alone in its
    process (its time is taken by `interleaved`, beside the others)."""
    step, args = step_and_args(variant, chunk_size, make_inputs(size))
    compiled = step.lower(*args).compile()
    memory = compiled.memory_analysis()
    jax.block_until_ready(compiled(*args))  # one run: the peaks below are a step's
    stats = jax.local_devices()[0].memory_stats() or {}
    return {
        "temp_bytes": memory.temp_size_in_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_device_bytes": stats.get("peak_bytes_in_use"),
    }


def worker(args: argparse.Namespace) -> None:
    size = shape_of(args)
    if args.variant == "reference":
        result = reference(size, args.reference)
    elif args.reference is not None:
        result = check(size, args.variant, args.chunk_size, args.reference)
    elif args.variant == "timing":
        result = interleaved(size, args.timed.split(","), args.chunk_size, args.repeats)
    else:
        result = measure(size, args.variant, args.chunk_size)
    args.json_out.write_text(json.dumps(result))


# ----------------------------------------------------------------------------- parent

PROBE = """
import json, jax
try:
    from tunelib.kernels import fused_token_logps_pallas
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                  "pallas_import_error": error}))
"""


def probe(timeout: float) -> dict:
    """Backend, device and whether the Pallas kernel imports, asked of a throwaway process
    that exits before any worker starts: the parent never starts a backend itself (on a GPU
    that would reserve its memory; a TPU lets one process at a time hold it)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=timeout
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def failure(returncode: int, stderr: str) -> dict:
    """A failed worker's record: the end of its stderr, and whether it ran out of memory."""
    text = stderr.strip()[-2000:] or f"exit status {returncode}"
    lowered = stderr.lower()
    return {"failed": text, "out_of_memory": any(s.lower() in lowered for s in OUT_OF_MEMORY)}


def stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """End a worker past its time: SIGINT first (Python unwinds and lets go of the
    accelerator, as a TPU wants), SIGKILL after `grace` seconds."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def run_worker(
    args: argparse.Namespace,
    variant: str,
    folder: Path,
    stages: dict[str, float],
    reference=None,
    timed=None,
) -> dict:
    """One worker subprocess, at most `--stage-timeout` seconds: its JSON result, or a
    `failure` record (`timed_out` when it was stopped). Its wall time goes into `stages` and,
    with its outcome, on a line of stderr."""
    mode = "measure" if reference is None else "reference" if variant == "reference" else "check"
    mode = "time" if variant == "timing" else mode
    out = folder / f"{variant}-{mode}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--variant", variant]
    command += ["--size", args.size]
    command += [] if args.chunk_size is None else ["--chunk-size", str(args.chunk_size)]
    command += ["--repeats", str(args.repeats), "--json-out", str(out)]
    command += [] if args.n is None else ["--n", str(args.n)]
    command += [] if reference is None else ["--reference", str(reference)]
    command += [] if timed is None else ["--timed", ",".join(timed)]
    name = {"reference": "reference", "check": f"{variant} check", "measure": f"{variant} memory"}
    name = name.get(mode, f"timing ({', '.join(timed or [])})")
    print(f"[{name}] ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            _, stderr = proc.communicate(timeout=args.stage_timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            stderr = None
    if stderr is None:
        result = {
            "failed": f"stopped after --stage-timeout {args.stage_timeout:g} s",
            "out_of_memory": False,
            "timed_out": True,
        }
    elif proc.returncode != 0:
        result = failure(proc.returncode, stderr)
    else:
        result = json.loads(out.read_text())
    stages[name] = round(time.perf_counter() - start, 2)
    outcome = (
        "ok" if "failed" not in result
        else "stopped (--stage-timeout)" if result.get("timed_out")
        else "out of memory" if result["out_of_memory"]
        else "failed"
    )  # fmt: skip
    print(f"[{name}] {outcome} in {stages[name]:.1f} s", file=sys.stderr, flush=True)
    return result


def judge(checks: dict[str, dict], dtype: str) -> dict[str, str | None]:
    """Per variant, why its check failed, or None when it passed.

    The naive path must stay within `NAIVE_BOUND`; every other variant's error in each
    quantity may exceed the naive path's error in it by at most `TOLERANCE`. A variant whose
    check ran out of memory gets "out of memory"; with the naive path out of memory, the
    others are held to `NAIVE_BOUND`, the naive path's own bound.
    """
    naive = checks["naive"]
    naive_oom = naive.get("out_of_memory", False)
    verdicts: dict[str, str | None] = {}
    for variant, result in checks.items():
        if "failed" in result:
            verdicts[variant] = (
                "out of memory" if result.get("out_of_memory") else "its check worker failed"
            )
        elif variant == "naive" or naive_oom:
            bound = NAIVE_BOUND[dtype]
            bad = {q: e for q, e in result["errors"].items() if e > bound}
            verdicts[variant] = (
                "; ".join(f"{q} error {e:.2e} > {bound}" for q, e in bad.items()) or None
            )
        elif "failed" in naive:
            verdicts[variant] = "the naive baseline's check worker failed"
        else:
            limit = {q: e + TOLERANCE[dtype] for q, e in naive["errors"].items()}
            bad = {q: e for q, e in result["errors"].items() if e > limit[q]}
            verdicts[variant] = (
                "; ".join(
                    f"{q} error {e:.2e} > naive's {naive['errors'][q]:.2e} + {TOLERANCE[dtype]}"
                    for q, e in bad.items()
                )
                or None
            )
    return verdicts


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def summarise(args, size: Size, info: dict, variants: dict, gemm: dict | None, notes) -> dict:
    """The result: ratios, per-variant figures and, at accelerator sizes, TFLOP/s against the
    GEMM."""
    naive, chunked = variants["naive"], variants["chunked"]
    nhv = size.n * size.h * size.v
    if gemm is not None and "median_ms" in gemm:
        gemm["tflops"] = 2 * nhv / (gemm["median_ms"] * 1e-3) / 1e12
    gradient_bytes = (size.n * size.h + size.h * size.v) * jnp.dtype(size.dtype).itemsize
    for record in variants.values():
        record["memory_ratio"] = ratio(naive.get("temp_bytes"), record.get("temp_bytes"))
        record["temp_over_gradients"] = ratio(record.get("temp_bytes"), gradient_bytes)
        record["time_ratio"] = ratio(record.get("median_ms"), naive.get("median_ms"))
        if size.accelerator and "median_ms" in record:
            record["tflops"] = 6 * nhv / (record["median_ms"] * 1e-3) / 1e12
            record["gemm_fraction"] = ratio(record["tflops"], (gemm or {}).get("tflops"))
    result = {
        "benchmark": "logprobs",
        "size": args.size,
        "n": size.n,
        "h": size.h,
        "v": size.v,
        "dtype": size.dtype,
        "chunk_size": args.chunk_size or default_chunk_size(size.n),
        "repeats": args.repeats,
        "backend": info["backend"],
        "device": info["device"],
        "check_rows": len(check_rows(size)),
        "tolerance": TOLERANCE[size.dtype],
        "naive_bound": NAIVE_BOUND[size.dtype],
        "correct": all(r["passed"] or r.get("out_of_memory") for r in variants.values()),
        "out_of_memory": [name for name, r in variants.items() if r.get("out_of_memory")],
        "memory_ratio": ratio(naive.get("temp_bytes"), chunked.get("temp_bytes")),
        "time_ratio": ratio(chunked.get("median_ms"), naive.get("median_ms")),
        "rss_ratio": ratio(naive.get("peak_rss_bytes"), chunked.get("peak_rss_bytes")),
        "gradient_bytes": gradient_bytes,
        "variants": variants,
    }
    if gemm is not None:
        result["gemm"] = gemm
    if args.size == "cpu":
        m, t = result["memory_ratio"], result["time_ratio"]
        result["cpu_targets"] = {
            "memory_ratio>=24": m is not None and m >= CPU_TARGETS["memory_ratio"],
            "time_ratio<=1.0": t is not None and t <= CPU_TARGETS["time_ratio"],
        }
    result["notes"] = notes
    return result


def exit_status(result: dict) -> int:
    """0 when every variant passed its check or ran out of memory, no worker failed in any
    other way, and at least one variant was timed; else 1."""
    records = [*result["variants"].values(), result.get("gemm") or {}]
    crashed = any("failed" in r and not r.get("out_of_memory") for r in records)
    timed = any("median_ms" in r for r in result["variants"].values())
    return 0 if result["correct"] and not crashed and timed else 1


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    def mb(x):
        return fmt(None if x is None else x / 1e6, ",.1f")

    accelerator = SIZES[result["size"]].accelerator
    head = ["variant", "check", "max error", "temp MB", "args MB", "out MB", "peak RSS MB"]
    head += ["median ms"] + (["device peak MB", "TFLOP/s", "of GEMM"] if accelerator else [])
    lines = [head]
    for name, r in result["variants"].items():
        check = "OOM" if r.get("out_of_memory") else "pass" if r["passed"] else "FAIL"
        row = [name, check, fmt(r.get("max_error"), ".2e")]
        row += [mb(r.get(k)) for k in ("temp_bytes", "argument_bytes", "output_bytes")]
        row += [mb(r.get("peak_rss_bytes")), fmt(r.get("median_ms"), ",.1f")]
        if accelerator:
            row += [mb(r.get("peak_device_bytes")), fmt(r.get("tflops"), ".1f")]
            row += [fmt(r.get("gemm_fraction"), ".1%")]
        lines.append(row)
    if "gemm" in result:
        g = result["gemm"]
        row = ["bf16 GEMM", "", ""]
        row += [mb(g.get(k)) for k in ("temp_bytes", "argument_bytes", "output_bytes")]
        row += [mb(g.get("peak_rss_bytes")), fmt(g.get("median_ms"), ",.1f")]
        row += [mb(g.get("peak_device_bytes")), fmt(g.get("tflops"), ".1f"), "100.0%"]
        lines.append(row)
    widths = [max(len(x) for x in column) for column in zip(*lines, strict=True)]
    text = [" | ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


def report(result: dict) -> str:
    r = result
    lines = [
        f"size {r['size']}: N={r['n']} H={r['h']} V={r['v']} {r['dtype']}, chunk_size="
        f"{r['chunk_size']}, {r['backend']} ({r['device']}), median of {r['repeats']} runs; "
        f"float64 reference on {r['check_rows']} of {r['n']} rows",
        "",
        table(result),
        "",
        f"memory_ratio (naive temp / chunked temp) = {fmt(r['memory_ratio'], '.2f')}, "
        f"time_ratio (chunked median / naive median) = {fmt(r['time_ratio'], '.3f')}, "
        f"peak RSS ratio (naive / chunked) = {fmt(r['rss_ratio'], '.2f')}",
    ]
    lines.append(
        "temporaries / gradients' bytes: "
        + ", ".join(
            f"{name} {fmt(v.get('temp_over_gradients'), '.3f')}"
            for name, v in r["variants"].items()
        )
    )
    if "cpu_targets" in r:
        met = ", ".join(f"{k} {'met' if ok else 'NOT met'}" for k, ok in r["cpu_targets"].items())
        lines.append(f"CPU targets (reported, not asserted): {met}")
    for name, v in r["variants"].items():
        if v.get("out_of_memory"):
            last = v["failed"].splitlines()[-1] if v["failed"] else ""
            lines.append(f"{name}: out of device memory, not measured: {last}")
        elif v["reason"]:
            lines.append(f"{name}: check failed, not measured: {v['reason']}")
        elif "failed" in v:
            lines.append(f"{name}: worker failed: {v['failed']}")
    if "failed" in r.get("gemm", {}):
        lines.append(f"bf16 GEMM: worker failed: {r['gemm']['failed']}")
    lines.append(
        "seconds per worker: " + ", ".join(f"{k} {s:.1f}" for k, s in r["stage_seconds"].items())
    )
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def memory_only(args: argparse.Namespace) -> list[dict]:
    """Temporaries of the compiled forward and backward on abstract inputs (no allocation),
    against the gradients' own size, `[N, H]` and `[H, V]` in the inputs' dtype."""
    names = [args.size] if args.size else [name for name in SIZES if name != "smoke"]
    rows = []
    for name in names:
        size = shape_of(argparse.Namespace(size=name, n=args.n))
        specs = (
            jax.ShapeDtypeStruct((size.n, size.h), size.dtype),
            jax.ShapeDtypeStruct((size.h, size.v), size.dtype),
            jax.ShapeDtypeStruct((size.n,), jnp.int32),
        )
        gradients = (size.n * size.h + size.h * size.v) * jnp.dtype(size.dtype).itemsize
        for variant in ("naive", "chunked"):
            step = loss_and_grads(variant, args.chunk_size)
            memory = step.lower(*specs).compile().memory_analysis()
            rows.append({
                "size": name, "n": size.n, "h": size.h, "v": size.v, "dtype": size.dtype,
                "variant": variant, "temp_bytes": memory.temp_size_in_bytes,
                "output_bytes": memory.output_size_in_bytes, "gradient_bytes": gradients,
                "temp_over_gradients": memory.temp_size_in_bytes / gradients,
            })  # fmt: skip
            row = rows[-1]
            print(
                f"{name:>10} {size.dtype:>8} {variant:>7}: temporaries "
                f"{row['temp_bytes'] / 1e6:>9,.1f} MB, gradients {gradients / 1e6:>8,.1f} MB, "
                f"ratio {row['temp_over_gradients']:.3f}"
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.memory_only:
        print(f"backend {jax.default_backend()}, compiled on abstract inputs (nothing runs)")
        line = json.dumps({"benchmark": "logprobs", "memory_only": memory_only(args)})
        print(line)
        if args.json_out is not None:
            args.json_out.write_text(line + "\n")
        return 0
    if args.variant is not None:
        if args.size is None or args.json_out is None:
            raise SystemExit("worker mode needs --size and --json-out.")
        if args.variant == "reference" and args.reference is None:
            raise SystemExit("--variant reference needs --reference (the .npz to write).")
        worker(args)
        return 0
    started = time.perf_counter()
    info = probe(args.stage_timeout)
    stages = {"probe": round(time.perf_counter() - started, 2)}
    print(
        f"[probe] {info['backend']} ({info['device']}) in {stages['probe']:.1f} s", file=sys.stderr
    )
    args.size = args.size or default_size(info["backend"])
    size = shape_of(args)
    names, notes = ["naive", "chunked"], []
    if info["backend"] == "cpu":
        notes.append("pallas skipped: its kernels need a GPU or TPU backend, this one is cpu")
    elif info["pallas_import_error"]:
        notes.append(
            f"pallas skipped: tunelib.kernels did not import: {info['pallas_import_error']}"
        )
    else:
        names.append("pallas")
    if size.accelerator:
        notes.append(
            "TFLOP/s count 6*N*H*V flops per forward+backward for every variant and 2*N*H*V "
            f"for the GEMM; the float64 reference covers {len(check_rows(size))} evenly spaced "
            "rows (see the module docstring)"
        )
    gemm = None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / "reference.npz"
        ref = run_worker(args, "reference", folder, stages, reference=path)
        if "failed" in ref:
            print(f"the float64 reference failed:\n{ref['failed']}", file=sys.stderr)
            return 1
        checks = {name: run_worker(args, name, folder, stages, reference=path) for name in names}
        variants = {
            name: {"passed": reason is None, "reason": reason, **checks[name]}
            for name, reason in judge(checks, size.dtype).items()
        }
        for name, record in variants.items():
            if record["passed"]:
                record.update(run_worker(args, name, folder, stages))
        if size.accelerator:
            gemm = run_worker(args, "gemm", folder, stages)
        timed = [name for name, r in variants.items() if r["passed"] and "failed" not in r]
        timed += ["gemm"] if gemm is not None and "failed" not in gemm else []
        if timed:
            times = run_worker(args, "timing", folder, stages, timed=timed)
            failed = {k: times[k] for k in ("failed", "out_of_memory", "timed_out") if k in times}
            for name in timed:
                record = gemm if name == "gemm" else variants[name]
                record.update(times.get(name, failed))
    result = summarise(args, size, info, variants, gemm, notes)
    result["stage_seconds"] = stages
    print(report(result))
    line = json.dumps(result)
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    return exit_status(result)


if __name__ == "__main__":
    sys.exit(main())
