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

The parent process only orchestrates and never opens the accelerator. The steps below run
in worker subprocesses (`--worker W --variants ... --json-out FILE`), one after another (a TPU
lets one process at a time hold it): one ``check`` worker for the reference and every
variant's check, a ``memory`` worker per variant, and one ``timing`` worker. A worker appends
a JSON line to its file as each of its stages ends; the parent watches that file, prints on
stderr how long each stage took (the first one's time includes the worker's start: opening a
TPU takes 6-15 s), and stops a worker whose stage runs past `--stage-timeout` seconds (SIGINT,
then SIGKILL 15 s later): that stage is reported, and the stages after it run in a new worker
(a hang or a crash in one variant's check costs the others nothing but a fresh reference).

1. ``reference``: a float64 loss and gradients, in NumPy on the host, computed a vocabulary
   chunk at a time. The inputs are drawn on the default backend (fixed keys, the same in
   every worker) and come to the host once, converted to float32 on the device (exact for
   bfloat16 and float32 inputs); nothing float64 ever runs on the accelerator. At the
   accelerator sizes it covers an evenly spaced subset of `CHECK_ROWS` rows: the token-mean
   NLL over those rows alone, a small problem with the size's own H and V, whose gradients
   include the full `[H, V]` unembedding gradient.
2. Correctness, for every variant before anything is measured, in the same worker on the
   same inputs: its loss and gradients on the reference's rows against the reference, as the
   relative error $\max |x - x_{ref}| / \max |x_{ref}|$ of each of loss, d hidden and d
   unembedding; the variant's results come to the host once, converted to float32 on the
   device, and the errors are taken in NumPy a block of rows at a time, in the reference's
   precision (`relative_error`). At the accelerator sizes the full-size run goes first and
   its d hidden rows are checked too (each row's gradient depends on that row alone; they
   are rescaled by $N / $`CHECK_ROWS`). A variant passes when its error exceeds the naive
   path's own error by at most `TOLERANCE[dtype]`; the naive path must itself stay within
   `NAIVE_BOUND[dtype]`. A variant that runs out of device memory is reported as such and
   not measured, without failing the script; with the naive path out of memory, the others
   are held to the naive path's own bound. A variant that fails its check (or whose check
   raises or is stopped) is not measured and the script exits with status 1.
3. Memory, for every variant that passed: `memory_analysis()` of the compiled executable
   (temporary, argument and output bytes), taken in the timing worker; and each variant's
   process peaks, alone in a ``memory`` worker, after one run: the peak RSS (`ru_maxrss`,
   host memory only on a GPU or TPU) and the device's peak bytes in use. On a TPU the
   per-variant workers are not run (each would cost a start of the chip for a host-memory
   figure); the timing worker's peaks, over every variant, are reported instead
   (`timing_worker`).
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
figures and `stage_seconds` (each stage's wall time). At the `cpu` size it also prints
whether the CPU targets (`memory_ratio >= 24`, `time_ratio <= 1.0`) are met; they are
reported, never asserted.
"""

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from _measure import end_process, random_key  # beside this script, first on sys.path
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
# How often the parent looks at a worker's stages, seconds.
WATCH_SECONDS = 0.2


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
        help="seconds each stage (a worker's start and the reference, one variant's check, a "
        "memory figure, the timing) may take; a worker whose stage takes longer is stopped "
        "and the stage reported",
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
        help="write the result JSON to this file too (in worker mode: a JSON line per stage)",
    )
    worker = p.add_argument_group("worker mode (started by the parent)")
    worker.add_argument("--worker", choices=("check", "memory", "timing"), default=None)
    worker.add_argument(
        "--variants", default=None,
        help="comma-separated: the variants to check, or to measure (one), or to time "
        "(with 'gemm')",
    )  # fmt: skip
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
        kh, kw, ky = jax.random.split(random_key(0), 3)
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


def reference(inputs: tuple, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The float64 reference on the check rows of `inputs` (hidden, unembedding, targets).

    They come to the host as float32, converted on their device (exact for bfloat16 and
    float32 inputs); the float64 arithmetic is NumPy's, on the host. The gradients are kept in
    float64 for float32 inputs; for bfloat16 inputs in float32, whose rounding (2^-24 of each
    value) is far below the bfloat16 tolerance, which halves the host memory (a `[2304,
    256000]` gradient: 2.4 GB) and lets `relative_error` compare in float32.
    """
    hidden, unembedding, targets = inputs
    stored = np.float64 if hidden.dtype == jnp.float32 else np.float32
    y = np.asarray(targets)[rows].astype(np.int64)
    ref = reference_grads(to_host(hidden[rows]), to_host(unembedding), y, dtype=stored)
    ref["d_hidden"] = ref["d_hidden"].astype(stored)
    return ref


def relative_error(x, ref) -> float:
    """max |x - ref| / max |ref| on the host, a block of rows at a time, in the reference's
    precision: float64 against a float64 reference; float32 against one stored in float32
    (bfloat16 inputs: the rounding of the difference, 2^-24 of it, is far below their
    tolerance), ten times faster on the 590 M values of a Gemma-2-2B unembedding gradient."""
    x, ref = np.asarray(x), np.asarray(ref)
    if x.shape != ref.shape:
        raise ValueError(f"shape {x.shape} does not match the reference's {ref.shape}.")
    dtype = np.promote_types(ref.dtype, np.float32)
    x, ref = np.atleast_2d(x), np.atleast_2d(ref)
    block = max(1, ERROR_BLOCK // max(1, x.shape[1]))
    worst = scale = 0.0
    for i in range(0, x.shape[0], block):
        r = np.asarray(ref[i : i + block], dtype)
        worst = max(worst, float(np.max(np.abs(np.asarray(x[i : i + block], dtype) - r))))
        scale = max(scale, float(np.max(np.abs(r))))
    return worst / scale


def check(variant: str, chunk_size: int | None, inputs: tuple, rows, ref: dict) -> dict:
    """The variant's relative errors against the float64 reference (see the module docstring).

    The variant runs on the default backend; its results come to the host once, as float32.
    At the accelerator sizes the full-size run goes first (only the reference rows of its
    d hidden are kept), then the run on the reference's rows."""
    hidden, unembedding, targets = inputs
    n = hidden.shape[0]
    step = loss_and_grads(variant, chunk_size)
    full = None
    if len(rows) < n:
        _, (d_full, d_unembedding) = step(hidden, unembedding, targets)
        del d_unembedding
        full = to_host(d_full[rows]).astype(np.float64) * (n / len(rows))
        del d_full
        hidden, targets = hidden[rows], targets[rows]
    loss, (d_hidden, d_unembedding) = step(hidden, unembedding, targets)
    errors = {
        "loss": relative_error(to_host(loss), ref["loss"]),
        "d_hidden": relative_error(to_host(d_hidden), ref["d_hidden"]),
    }
    del d_hidden
    errors["d_unembedding"] = relative_error(to_host(d_unembedding), ref["d_unembedding"])
    if full is not None:
        errors["d_hidden_full_run"] = relative_error(full, ref["d_hidden"])
    return {"errors": errors, "max_error": max(errors.values())}


def skipped_variants(variants: list[str], backend: str) -> dict[str, str]:
    """Why each of `variants` that cannot run on `backend` is skipped."""
    if "pallas" not in variants:
        return {}
    if backend == "cpu":
        return {"pallas": "pallas skipped: its kernels need a GPU or TPU backend, this one is cpu"}
    try:
        from tunelib.kernels import fused_token_logps_pallas  # noqa: F401
    except Exception as e:
        return {
            "pallas": f"pallas skipped: tunelib.kernels did not import: {type(e).__name__}: {e}"
        }
    return {}


def check_worker(name: str, size: Size, variants: list[str], chunk_size: int | None, stage):
    """The float64 reference, then every variant's check against it, on one copy of the
    inputs in one process, each a stage of `stage_writer`'s: a variant whose check raises (out
    of device memory, or anything else) is reported and the next one is checked."""
    rows, held = check_rows(size), {}

    def prepare() -> dict:
        held["inputs"] = make_inputs(size)
        held["ref"] = reference(held["inputs"], rows)
        return {
            "size": name, "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "rows": len(rows),
            "key_impl": str(jax.random.key_impl(random_key(0))),
            "stored_dtype": held["ref"]["d_unembedding"].dtype.name,
        }  # fmt: skip

    if "failed" in stage("reference", prepare):
        return
    inputs, ref = held["inputs"], held["ref"]
    skipped = skipped_variants(variants, jax.default_backend())
    for variant in variants:
        if variant in skipped:
            stage(f"{variant} check", lambda v=variant: {"skipped": skipped[v]})
        else:
            stage(f"{variant} check", lambda v=variant: check(v, chunk_size, inputs, rows, ref))


def step_and_args(variant: str, chunk_size: int | None, inputs: tuple):
    hidden, unembedding, targets = inputs
    if variant == "gemm":
        return jax.jit(jnp.matmul), (hidden, unembedding)
    return loss_and_grads(variant, chunk_size), (hidden, unembedding, targets)


def interleaved(size: Size, variants: list[str], chunk_size: int | None, repeats: int) -> dict:
    """Compiled memory and median wall time of every variant, timed in one process on one copy
    of the inputs: one warm-up (compiling) run each, then `repeats` rounds that run each
    variant once, the order reversed every other round, so that a slow spell of a shared
    machine hits every variant alike."""
    inputs = make_inputs(size)
    steps, records = {}, {}
    for variant in variants:
        step, args = step_and_args(variant, chunk_size, inputs)
        compiled = step.lower(*args).compile()
        memory = compiled.memory_analysis()
        records[variant] = {
            "temp_bytes": memory.temp_size_in_bytes,
            "argument_bytes": memory.argument_size_in_bytes,
            "output_bytes": memory.output_size_in_bytes,
        }
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
    for variant, runs in seconds.items():
        records[variant]["median_ms"] = 1e3 * statistics.median(runs)
        records[variant]["runs_ms"] = [round(1e3 * s, 3) for s in runs]
    return records


def peaks() -> dict:
    """This process's peak RSS (host memory) and its device's peak bytes in use."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return {
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_device_bytes": stats.get("peak_bytes_in_use"),
    }


def measure(size: Size, variant: str, chunk_size: int | None) -> dict:
    """Peak RSS and device peak of one variant or the GEMM, alone in its process, after one
    run (its compiled memory and time are taken by `interleaved`, beside the others)."""
    step, args = step_and_args(variant, chunk_size, make_inputs(size))
    jax.block_until_ready(step(*args))
    return peaks()


def stage_writer(path: Path):
    """`stage(name, fn)`: runs `fn` and appends its record, or the `failure` it raised (its
    traceback on stderr too), to `path` as one JSON line named `name`; returns the record.
    The parent watches that file: a stage's line is its progress and its result."""

    def stage(name: str, fn) -> dict:
        try:
            record = fn()
        except Exception:
            traceback.print_exc()
            record = failure(1, traceback.format_exc())
        with path.open("a") as f:
            f.write(json.dumps({"stage": name, **record}) + "\n")
        return record

    return stage


def worker(args: argparse.Namespace) -> None:
    """A worker's stages, reported by `stage_writer` to `--json-out`."""
    stage = stage_writer(args.json_out)
    args.size = args.size or default_size(jax.default_backend())
    size = shape_of(args)
    variants = args.variants.split(",")
    if args.worker == "check":
        check_worker(args.size, size, variants, args.chunk_size, stage)
    elif args.worker == "timing":
        stage(
            timing_stage(variants),
            lambda: {
                "variants": interleaved(size, variants, args.chunk_size, args.repeats),
                **peaks(),
            },
        )
    else:
        (variant,) = variants
        stage(f"{variant} memory", lambda: measure(size, variant, args.chunk_size))


# ----------------------------------------------------------------------------- parent


def timing_stage(variants: list[str]) -> str:
    return f"timing ({', '.join(variants)})"


def failure(returncode: int, stderr: str) -> dict:
    """A failed stage's record: the end of its stderr (or traceback), and whether it ran out
    of memory."""
    text = stderr.strip()[-2000:] or f"exit status {returncode}"
    lowered = stderr.lower()
    return {"failed": text, "out_of_memory": any(s.lower() in lowered for s in OUT_OF_MEMORY)}


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End a worker past its time: SIGINT first (Python unwinds, printing where it was, and
    lets go of the accelerator, as a TPU wants); `grace` seconds later, a worker still there
    is stuck where SIGINT cannot reach (a native call, the runtime's teardown): SIGABRT, on
    which Python's fault handler (on in every worker) prints every thread's stack; SIGKILL 5
    s after that."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGABRT, 5.0)):
        proc.send_signal(sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait()


def outcome(record: dict) -> str:
    if "failed" not in record:
        return "ok"
    if record.get("timed_out"):
        return "stopped (--stage-timeout)"
    return "out of memory" if record["out_of_memory"] else "failed"


def run_worker(
    args: argparse.Namespace,
    worker: str,
    variants: list[str],
    names: list[str],
    folder: Path,
    stages: dict[str, float],
) -> dict[str, dict]:
    """One worker subprocess (`--worker W --variants ...`), watched stage by stage.

    `names` are the stages it will report, in order. Its records by stage name, up to the
    first stage that did not end: that one gets a `failure` record, `timed_out` when it ran
    past `--stage-timeout` seconds and the worker was stopped; the stages after it are
    absent. Each stage's wall time (from the end of the one before; the first's includes the
    worker's start) goes into `stages` and, with its outcome, on a line of stderr."""
    out = folder / f"{len(list(folder.glob('*.jsonl')))}-{worker}.jsonl"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", worker]
    command += ["--variants", ",".join(variants)]
    command += [] if args.size is None else ["--size", args.size]
    command += [] if args.chunk_size is None else ["--chunk-size", str(args.chunk_size)]
    command += ["--repeats", str(args.repeats), "--json-out", str(out)]
    command += [] if args.n is None else ["--n", str(args.n)]
    records: dict[str, dict] = {}
    last = time.perf_counter()

    def done(name: str, record: dict) -> None:
        """A stage's record: kept, and its time and outcome told."""
        nonlocal last
        records[name] = record
        if "skipped" in record:
            print(f"[{name}] {record['skipped']}", file=sys.stderr)
        else:
            key = name if name not in stages else f"{name} (again)"  # a second check worker
            stages[key] = round(time.perf_counter() - last, 2)
            print(f"[{name}] {outcome(record)} in {stages[key]:.1f} s", file=sys.stderr)
        last = time.perf_counter()

    def read() -> None:
        """The records the worker has written since the last look; the next stage's start."""
        lines = out.read_text().split("\n")[:-1] if out.exists() else []
        for line in lines[len(records) :]:
            record = json.loads(line)
            done(record.pop("stage"), record)
            if len(records) < len(names):
                print(f"[{names[len(records)]}] ...", file=sys.stderr)

    print(f"[{names[0]}] ...", file=sys.stderr)
    # The worker writes on this process's stderr (stdout too: it prints nothing else).
    env = os.environ | {"PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(command, stdout=sys.stderr.fileno(), env=env) as proc:
        stopped = False
        while proc.poll() is None:
            time.sleep(WATCH_SECONDS)
            read()
            if time.perf_counter() - last > args.stage_timeout:
                stopped = True  # what it writes from now on is not taken (SIGINT can be lost)
                stop(proc)
    if not stopped:
        read()
    if len(records) < len(names):
        name = names[len(records)]
        if stopped:
            record = {
                "failed": f"stopped after --stage-timeout {args.stage_timeout:g} s",
                "out_of_memory": False,
                "timed_out": True,
            }
        else:
            record = failure(proc.returncode, "")  # its output is above, on stderr
        done(name, record)
    return records


def run_checks(args: argparse.Namespace, folder: Path, stages: dict) -> tuple[dict, dict]:
    """The reference and every variant's check, in one check worker; after a variant whose
    check did not end (stopped at `--stage-timeout`, or its worker died), in one more for
    the variants after it. The reference's record (backend, device; `failed` when it did not
    end) and each variant's check record."""
    pending, checks = list(VARIANTS), {}
    while True:
        names = ["reference", *(f"{v} check" for v in pending)]
        records = run_worker(args, "check", pending, names, folder, stages)
        info = records["reference"]
        if "failed" in info:
            return info, checks
        done = [v for v in pending if f"{v} check" in records]
        checks.update({v: records[f"{v} check"] for v in done})
        pending = pending[len(done) :]
        if not pending:
            return info, checks


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
                "out of memory" if result.get("out_of_memory") else "its check failed"
            )
        elif variant == "naive" or naive_oom:
            bound = NAIVE_BOUND[dtype]
            bad = {q: e for q, e in result["errors"].items() if e > bound}
            verdicts[variant] = (
                "; ".join(f"{q} error {e:.2e} > {bound}" for q, e in bad.items()) or None
            )
        elif "failed" in naive:
            verdicts[variant] = "the naive baseline's check failed"
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
        "key_impl": info.get("key_impl"),
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


def mb(x: float | None) -> str:
    return fmt(None if x is None else x / 1e6, ",.1f")


def table(result: dict) -> str:
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
    if "timing_worker" in r:
        peaks = r["timing_worker"]
        lines.append(
            f"the timing worker's peaks (every variant in one process): device "
            f"{mb(peaks['peak_device_bytes'])} MB, RSS {mb(peaks['peak_rss_bytes'])} MB"
        )
    lines.append(
        "seconds per stage: " + ", ".join(f"{k} {s:.1f}" for k, s in r["stage_seconds"].items())
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
    if args.worker is not None:
        if args.variants is None or args.json_out is None:
            raise SystemExit("worker mode needs --variants and --json-out.")
        worker(args)
        return 0
    stages: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        info, checks = run_checks(args, folder, stages)
        if "failed" in info:
            print(f"the float64 reference failed:\n{info['failed']}", file=sys.stderr)
            return 1
        args.size = info["size"]
        size = shape_of(args)
        notes = [c["skipped"] for c in checks.values() if "skipped" in c]
        if size.accelerator:
            notes.append(
                "TFLOP/s count 6*N*H*V flops per forward+backward for every variant and "
                f"2*N*H*V for the GEMM; the float64 reference covers {info['rows']} evenly "
                "spaced rows (see the module docstring)"
            )
        checks = {name: c for name, c in checks.items() if "skipped" not in c}
        variants = {
            name: {"passed": reason is None, "reason": reason, **checks[name]}
            for name, reason in judge(checks, size.dtype).items()
        }
        gemm = {} if size.accelerator else None
        timed = [name for name, r in variants.items() if r["passed"]]
        timed += ["gemm"] if size.accelerator else []
        # Each variant's process peaks in a worker of its own, but on a TPU, where each
        # process that opens the chip costs 6-15 s: there the timing worker's are reported.
        if info["backend"] != "tpu":
            for name in timed:
                record = gemm if name == "gemm" else variants[name]
                stage = f"{name} memory"
                record.update(run_worker(args, "memory", [name], [stage], folder, stages)[stage])
            timed = [n for n in timed if "failed" not in (gemm if n == "gemm" else variants[n])]
        timing = {}
        if timed:
            stage = timing_stage(timed)
            timing = run_worker(args, "timing", timed, [stage], folder, stages)[stage]
            failed = {k: timing[k] for k in ("failed", "out_of_memory", "timed_out") if k in timing}
            for name in timed:
                record = gemm if name == "gemm" else variants[name]
                record.update(failed or timing["variants"][name])
    result = summarise(args, size, info, variants, gemm, notes)
    result["stage_seconds"] = stages
    if "peak_rss_bytes" in timing:
        result["timing_worker"] = {k: timing[k] for k in ("peak_rss_bytes", "peak_device_bytes")}
    print(report(result))
    line = json.dumps(result)
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    return exit_status(result)


if __name__ == "__main__":
    end_process(main())
