r"""Side by side: log-probs from hidden states with and without `[N, V]` logits.

    python benchmarks/logprobs.py                   # the `cpu` size on CPU, `llama3-8b` elsewhere
    python benchmarks/logprobs.py --size smoke      # seconds; what the tests run
    python benchmarks/logprobs.py --size gemma2-2b  # GPU: the Cut Cross-Entropy head
    python benchmarks/logprobs.py --size llama3-8b --n 8192

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

The parent process only orchestrates; each step below runs in a fresh worker subprocess
(`--variant X --size S --json-out FILE`), so that one variant's buffers, compilation caches
and peak RSS never leak into another's:

1. ``reference``: a float64 (JAX x64) loss and gradients on the same inputs, computed a
   vocabulary chunk at a time. At the GPU sizes it covers an evenly spaced subset of
   `CHECK_ROWS` rows: their token-mean NLL over those rows alone, whose gradients include the
   full `[H, V]` unembedding gradient of that sub-problem.
2. Correctness, for every variant before anything is measured: its loss and gradients on the
   reference's rows against the reference, as the relative error
   $\max |x - x_{ref}| / \max |x_{ref}|$ of each of loss, d hidden and d unembedding. At the
   GPU sizes the d hidden rows of the full-size run are checked too (each row's gradient
   depends on that row alone; they are rescaled by $N / $`CHECK_ROWS`). A variant passes when
   its error exceeds the naive path's own error by at most `TOLERANCE[dtype]`; the naive
   path must itself stay within `NAIVE_BOUND[dtype]`. A failing variant is not measured and
   the script exits with status 1.
3. Memory, for every variant that passed, each alone in its worker: `memory_analysis()` of
   the compiled executable (temporary, argument and output bytes) and, after one run, the
   worker's peak RSS (`ru_maxrss`, which on a GPU counts host memory only; the device's peak
   bytes in use are reported beside it).
4. Time, of every variant that passed, side by side in one ``timing`` worker: one warm-up
   run each, then `--repeats` rounds that run each variant once, the order reversed every
   other round (a slow spell of a shared machine hits every variant alike); the median of
   each. At the GPU sizes a plain bf16 GEMM `[N, H] x [H, V]` is timed too, and every variant's
   throughput is counted as $6 N H V$ flops per forward and backward (the chunked path
   executes $8 N H V$, the Pallas kernel $10 N H V$) against the GEMM's $2 N H V$.

The script prints a table and ends with one JSON line: `size`, `memory_ratio` (naive temp
bytes / chunked temp bytes), `time_ratio` (chunked median / naive median) and per-variant
figures. At the `cpu` size it also prints whether the CPU targets (`memory_ratio >= 24`,
`time_ratio <= 1.0`) are met; they are reported, never asserted.
"""

import argparse
import functools
import json
import resource
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
    gpu: bool  # a GPU size: reference on a row subset, TFLOP/s and the GEMM fraction


SIZES = {
    "smoke": Size(n=128, h=64, v=10_000, dtype="float32", gpu=False),
    "cpu": Size(n=4096, h=512, v=65_536, dtype="float32", gpu=False),
    "llama3-8b": Size(n=16_384, h=4096, v=128_256, dtype="bfloat16", gpu=True),
    "gemma2-2b": Size(n=8192, h=2304, v=256_000, dtype="bfloat16", gpu=True),
}
VARIANTS = ("naive", "chunked", "pallas")
# Rows of the float64 reference at the GPU sizes (all rows at the others).
CHECK_ROWS = 256
# How far a variant's relative error may exceed the naive path's, and the naive path's own
# bound, by input dtype. bf16 gradients are returned in bf16, rounded by up to 2^-8 (3.9e-3)
# of their size; float32 results carry errors near 1e-6 (a wrong gradient gives about 1).
TOLERANCE = {"float32": 1e-5, "bfloat16": 4e-3}
NAIVE_BOUND = {"float32": 1e-4, "bfloat16": 2e-2}
# Logits z = h W have a standard deviation of about this: h ~ N(0, 1), W ~ N(0, s^2 / H).
LOGIT_SCALE = 2.0
REFERENCE_CHUNK = 4096
CPU_TARGETS = {"memory_ratio": 24.0, "time_ratio": 1.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="default: cpu on CPU, else llama3-8b"
    )
    p.add_argument("--n", type=int, default=None, help="override the size's token count N")
    p.add_argument(
        "--chunk-size", type=int, default=None,
        help="vocabulary tile of 'chunked' (default: the library's, about 2^22 logits a tile)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=5, help="timed runs after one warm-up")
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


# ----------------------------------------------------------------------------- inputs


def shape_of(args: argparse.Namespace) -> Size:
    size = SIZES[args.size]
    return size._replace(n=args.n) if args.n is not None else size


def make_inputs(size: Size) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The same hidden states, unembedding and targets in every worker (fixed keys)."""

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
    if not size.gpu or size.n <= CHECK_ROWS:
        return np.arange(size.n)
    return np.linspace(0, size.n - 1, CHECK_ROWS).round().astype(np.int64)


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


def reference(size: Size, path: Path) -> dict:
    """Float64 loss and gradients on the check rows, a vocabulary chunk at a time.

    Written from the formula, independently of tunelib: with R rows,
    L = -(1/R) sum_n (z[n, y_n] - logsumexp_v z[n, v]), dL/dz = (softmax(z) - onehot(y)) / R,
    dL/dh = dL/dz W^T and dL/dW = h^T dL/dz.
    """
    hidden, unembedding, targets = make_inputs(size)
    rows = check_rows(size)
    jax.config.update("jax_enable_x64", True)
    h = jnp.asarray(np.asarray(hidden)[rows], jnp.float64)
    y = jnp.asarray(np.asarray(targets)[rows])
    chunks = [(a, min(a + REFERENCE_CHUNK, size.v)) for a in range(0, size.v, REFERENCE_CHUNK)]

    @jax.jit
    def chunk_lse(h, w):
        return jax.nn.logsumexp(h @ w.astype(jnp.float64), axis=1)

    @jax.jit
    def chunk_grads(h, y, w, start, lse):
        w = w.astype(jnp.float64)
        onehot = start + jnp.arange(w.shape[1]) == y[:, None]
        dz = (jnp.exp(h @ w - lse[:, None]) - onehot) / h.shape[0]
        return dz @ w.T, h.T @ dz

    lse = functools.reduce(jnp.logaddexp, [chunk_lse(h, unembedding[:, a:b]) for a, b in chunks])
    target_z = jnp.sum(h * unembedding[:, y].T.astype(jnp.float64), axis=1)
    loss = -jnp.mean(target_z - lse)
    d_hidden = jnp.zeros_like(h)
    d_unembedding = np.empty((size.h, size.v), np.float64)
    for a, b in chunks:
        dh, dw = chunk_grads(h, y, unembedding[:, a:b], a, lse)
        d_hidden = d_hidden + dh
        d_unembedding[:, a:b] = np.asarray(dw)
    np.savez(
        path,
        rows=rows,
        loss=np.asarray(loss),
        d_hidden=np.asarray(d_hidden),
        d_unembedding=d_unembedding,
    )
    return {"rows": len(rows)}


def relative_error(x, ref: np.ndarray) -> float:
    """max |x - ref| / max |ref| in float64, a block of rows at a time (no float64 copy of x)."""
    x, ref = np.asarray(x), np.asarray(ref)
    if x.shape != ref.shape:
        raise ValueError(f"shape {x.shape} does not match the reference's {ref.shape}.")
    x, ref = np.atleast_2d(x), np.atleast_2d(ref)
    block = max(1, 2**24 // x.shape[1])
    worst = scale = 0.0
    for i in range(0, x.shape[0], block):
        r = ref[i : i + block]
        worst = max(worst, float(np.max(np.abs(x[i : i + block].astype(np.float64) - r))))
        scale = max(scale, float(np.max(np.abs(r))))
    return worst / scale


def check(size: Size, variant: str, chunk_size: int | None, path: Path) -> dict:
    """The variant's relative errors against the float64 reference (see the module docstring)."""
    ref = np.load(path)
    rows = ref["rows"]
    hidden, unembedding, targets = make_inputs(size)
    step = loss_and_grads(variant, chunk_size)
    if len(rows) == size.n:
        loss, (d_hidden, d_unembedding) = step(hidden, unembedding, targets)
        full = None
    else:
        loss, (d_hidden, d_unembedding) = step(hidden[rows], unembedding, targets[rows])
        _, (full, _) = step(hidden, unembedding, targets)
    errors = {
        "loss": relative_error(loss, ref["loss"]),
        "d_hidden": relative_error(d_hidden, ref["d_hidden"]),
        "d_unembedding": relative_error(d_unembedding, ref["d_unembedding"]),
    }
    if full is not None:
        rescaled = np.asarray(full[rows], np.float64) * (size.n / len(rows))
        errors["d_hidden_full_run"] = relative_error(rescaled, ref["d_hidden"])
    return {"errors": errors, "max_error": max(errors.values())}


def step_and_args(size: Size, variant: str, chunk_size: int | None):
    hidden, unembedding, targets = make_inputs(size)
    if variant == "gemm":
        return jax.jit(jnp.matmul), (hidden, unembedding)
    return loss_and_grads(variant, chunk_size), (hidden, unembedding, targets)


def interleaved(size: Size, variants: list[str], chunk_size: int | None, repeats: int) -> dict:
    """Median wall time of every variant, timed in one process: one warm-up (compiling) run
    each, then `repeats` rounds that run each variant once, the order reversed every other
    round, so that a slow spell of a shared machine hits every variant alike."""
    steps = {}
    for variant in variants:
        step, args = step_and_args(size, variant, chunk_size)
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
    step, args = step_and_args(size, variant, chunk_size)
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


def probe() -> dict:
    """Backend, device and whether the Pallas kernel imports, asked of a throwaway process:
    the parent never starts a backend itself (on a GPU that would reserve its memory)."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_worker(
    args: argparse.Namespace, variant: str, folder: Path, reference=None, timed=None
) -> dict:
    """One worker subprocess: its JSON result, or {"failed": the end of its stderr}."""
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
    name = variant if timed is None else " and ".join(timed)
    print(f"[{name}] {mode} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"failed": proc.stderr.strip()[-2000:] or f"exit status {proc.returncode}"}
    return json.loads(out.read_text())


def judge(checks: dict[str, dict], dtype: str) -> dict[str, str | None]:
    """Per variant, why its check failed, or None when it passed.

    The naive path must stay within `NAIVE_BOUND`; every other variant's error in each
    quantity may exceed the naive path's error in it by at most `TOLERANCE`.
    """
    naive = checks["naive"]
    verdicts: dict[str, str | None] = {}
    for variant, result in checks.items():
        if "failed" in result:
            verdicts[variant] = "its check worker failed"
        elif "failed" in naive:
            verdicts[variant] = "the naive baseline's check worker failed"
        elif variant == "naive":
            bad = {q: e for q, e in result["errors"].items() if e > NAIVE_BOUND[dtype]}
            verdicts[variant] = (
                "; ".join(f"{q} error {e:.2e} > {NAIVE_BOUND[dtype]}" for q, e in bad.items())
                or None
            )
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
    """The result: ratios, per-variant figures and, at GPU sizes, TFLOP/s against the GEMM."""
    naive, chunked = variants["naive"], variants["chunked"]
    nhv = size.n * size.h * size.v
    if gemm is not None and "median_ms" in gemm:
        gemm["tflops"] = 2 * nhv / (gemm["median_ms"] * 1e-3) / 1e12
    gradient_bytes = (size.n * size.h + size.h * size.v) * jnp.dtype(size.dtype).itemsize
    for record in variants.values():
        record["memory_ratio"] = ratio(naive.get("temp_bytes"), record.get("temp_bytes"))
        record["temp_over_gradients"] = ratio(record.get("temp_bytes"), gradient_bytes)
        record["time_ratio"] = ratio(record.get("median_ms"), naive.get("median_ms"))
        if size.gpu and "median_ms" in record:
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
        "correct": all(r["passed"] for r in variants.values()),
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


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    def mb(x):
        return fmt(None if x is None else x / 1e6, ",.1f")

    gpu = SIZES[result["size"]].gpu
    head = ["variant", "check", "max error", "temp MB", "args MB", "out MB", "peak RSS MB"]
    head += ["median ms"] + (["device peak MB", "TFLOP/s", "of GEMM"] if gpu else [])
    lines = [head]
    for name, r in result["variants"].items():
        row = [name, "pass" if r["passed"] else "FAIL", fmt(r.get("max_error"), ".2e")]
        row += [mb(r.get(k)) for k in ("temp_bytes", "argument_bytes", "output_bytes")]
        row += [mb(r.get("peak_rss_bytes")), fmt(r.get("median_ms"), ",.1f")]
        if gpu:
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
        if v["reason"]:
            lines.append(f"{name}: check failed, not measured: {v['reason']}")
        if "failed" in v:
            lines.append(f"{name}: worker failed: {v['failed']}")
    if "failed" in r.get("gemm", {}):
        lines.append(f"bf16 GEMM: worker failed: {r['gemm']['failed']}")
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
    info = probe()
    args.size = args.size or ("cpu" if info["backend"] == "cpu" else "llama3-8b")
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
    if size.gpu:
        notes.append(
            "TFLOP/s count 6*N*H*V flops per forward+backward for every variant and 2*N*H*V "
            f"for the GEMM; the float64 reference covers {len(check_rows(size))} evenly spaced "
            "rows (see the module docstring)"
        )
    gemm = None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / "reference.npz"
        ref = run_worker(args, "reference", folder, reference=path)
        if "failed" in ref:
            print(f"the float64 reference failed:\n{ref['failed']}", file=sys.stderr)
            return 1
        checks = {name: run_worker(args, name, folder, reference=path) for name in names}
        variants = {
            name: {"passed": reason is None, "reason": reason, **checks[name]}
            for name, reason in judge(checks, size.dtype).items()
        }
        for name, record in variants.items():
            if record["passed"]:
                record.update(run_worker(args, name, folder))
        if size.gpu:
            gemm = run_worker(args, "gemm", folder)
        timed = [name for name, r in variants.items() if r["passed"] and "failed" not in r]
        timed += ["gemm"] if gemm is not None and "failed" not in gemm else []
        if timed:
            times = run_worker(args, "timing", folder, timed=timed)
            for name in timed:
                record = gemm if name == "gemm" else variants[name]
                record.update(times.get(name, {"failed": times.get("failed")}))
    result = summarise(args, size, info, variants, gemm, notes)
    print(report(result))
    line = json.dumps(result)
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    crashed = any("failed" in r for r in [*variants.values(), gemm or {}])
    return 0 if result["correct"] and not crashed else 1


if __name__ == "__main__":
    sys.exit(main())
