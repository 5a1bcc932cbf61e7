r"""The fused log-prob head's tile sizes on one backend, side by side: what its defaults and
`implementation="auto"` are chosen from.

    python benchmarks/fused_head_tiles.py                       # the Gemma-2-2B head, bf16
    python benchmarks/fused_head_tiles.py --size smoke          # seconds, any backend

Every variant computes the value and both gradients (hidden states and unembedding) of the
token-mean NLL $-\frac{1}{N}\sum_n \log \mathrm{softmax}(h_n W)_{y_n}$ through
`tunelib.logprobs.fused_token_logps` on the same inputs, in one process, one after another:
``naive`` (the materialised logits), ``chunked`` at each of `--chunks` vocabulary tile widths,
and, on a TPU or GPU, the Pallas kernel (`tunelib.kernels.fused_token_logps_pallas`) at each
of `--blocks` `block_n x block_v` blocks. For each: the compile seconds, the compiled
temporaries (`memory_analysis()`), the median of `--repeats` timed calls after one warm-up,
the throughput at $6 N H V$ flops, and its largest error against the naive path relative to
the naive path's largest value (loss, d hidden, d unembedding), which must stay within the
input dtype's rounding (`TOLERANCE`) or the variant is marked failed. A variant that does not
compile or run (a block too large for the core's memory) is reported with its error, and the
others go on. The naive path is the reference here because `benchmarks/logprobs.py` checks
every implementation against float64 at these shapes; this script only compares tilings.
"""

import argparse
import json
import statistics
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Size(NamedTuple):
    n: int
    h: int
    v: int
    dtype: str


SIZES = {
    "smoke": Size(n=64, h=32, v=1000, dtype="float32"),
    "gemma2-2b": Size(n=8192, h=2304, v=256_000, dtype="bfloat16"),
    "llama3-8b": Size(n=8192, h=4096, v=128_256, dtype="bfloat16"),
}
# How far a tiling may differ from the naive path, relative to its largest value: bf16
# gradients are rounded to 2^-8 of their size; float32 results agree to about 1e-6.
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}
LOGIT_SCALE = 2.0  # logits z = h W of standard deviation about 2: h ~ N(0, 1), W ~ N(0, 4 / H)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="gemma2-2b")
    p.add_argument("--chunks", default="512,1024,2048,4096", help="chunked tile widths")
    p.add_argument(
        "--blocks", default="128x128,256x256,256x512,512x512,512x1024,256x2048",
        help="Pallas blocks, block_n x block_v (TPU or GPU only)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    try:
        args.chunk_sizes = [int(c) for c in args.chunks.split(",") if c]
        args.block_sizes = [
            tuple(int(x) for x in b.split("x")) for b in args.blocks.split(",") if b
        ]
    except ValueError:
        p.error(f"--chunks and --blocks take integers (512,1024 and 256x512,...), got "
                f"{args.chunks!r} and {args.blocks!r}")  # fmt: skip
    if any(len(b) != 2 for b in args.block_sizes) or args.repeats < 1:
        p.error("--blocks are block_n x block_v pairs, and --repeats at least 1")
    return args


def inputs(size: Size):
    kh, kw, ky = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(kh, (size.n, size.h), jnp.float32).astype(size.dtype)
    scale = LOGIT_SCALE / size.h**0.5
    unembedding = (scale * jax.random.normal(kw, (size.h, size.v))).astype(size.dtype)
    targets = jax.random.randint(ky, (size.n,), 0, size.v)
    return jax.block_until_ready((hidden, unembedding, targets))


def value_and_grads(implementation: str, **options):
    from tunelib.kernels import fused_token_logps_pallas
    from tunelib.logprobs import fused_token_logps

    def nll(hidden, unembedding, targets):
        if implementation == "pallas":
            logps = fused_token_logps_pallas(hidden, unembedding, targets, **options)
        else:
            logps = fused_token_logps(
                hidden, unembedding, targets, implementation=implementation, **options
            )
        return -jnp.mean(logps)

    return jax.jit(jax.value_and_grad(nll, argnums=(0, 1)))


def relative_errors(outputs, reference) -> list[float]:
    """max |x - ref| / max |ref| of loss, d hidden and d unembedding, in float32 on the
    device (one number each comes back)."""
    errors = []
    for x, ref in zip(jax.tree.leaves(outputs), jax.tree.leaves(reference), strict=True):
        x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
        errors.append(float(jnp.max(jnp.abs(x - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)))
    return errors


def measure(size: Size, args, name, implementation, options, reference, data) -> dict:
    step = value_and_grads(implementation, **options)
    start = time.perf_counter()
    compiled = step.lower(*data).compile()
    compile_s = time.perf_counter() - start
    outputs = jax.block_until_ready(compiled(*data))
    errors = [0.0] * 3 if reference is None else relative_errors(outputs, reference)
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*data))
        seconds.append(time.perf_counter() - start)
    ms = 1e3 * statistics.median(seconds)
    return {
        "variant": name,
        "median_ms": round(ms, 2),
        "compile_s": round(compile_s, 1),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "tflops": round(6 * size.n * size.h * size.v / ms / 1e9, 1),
        "errors": errors,
        "passed": max(errors) <= TOLERANCE[size.dtype],
    }, outputs


def main(argv=None) -> dict:
    args = parse_args(argv)
    size = SIZES[args.size]
    backend = jax.default_backend()
    data = inputs(size)
    variants = [("naive", "naive", {})]
    variants += [(f"chunked {c}", "chunked", {"chunk_size": c}) for c in args.chunk_sizes]
    if backend in ("tpu", "gpu"):
        variants += [
            (f"pallas {bn}x{bv}", "pallas", {"block_n": bn, "block_v": bv})
            for bn, bv in args.block_sizes
        ]
    rows, reference = [], None
    for name, implementation, options in variants:
        try:
            row, outputs = measure(size, args, name, implementation, options, reference, data)
        except Exception as error:  # a block too large for the core's memory, say
            row = {"variant": name, "failed": f"{type(error).__name__}: {error}"[:400]}
            outputs = None
        if reference is None and outputs is not None:
            reference = outputs  # the naive path's
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    naive = rows[0].get("median_ms")
    print(f"{args.size}: N={size.n} H={size.h} V={size.v} {size.dtype}, {backend} "
          f"({jax.devices()[0].device_kind}), median of {args.repeats}")  # fmt: skip
    print(f"{'variant':>16} | {'ms':>8} | {'x naive':>7} | {'TFLOP/s':>7} | {'temp MB':>9} | "
          f"{'compile s':>9} | max error")  # fmt: skip
    for r in rows:
        if "failed" in r:
            print(f"{r['variant']:>16} | failed: {r['failed'][:90]}")
            continue
        ratio = r["median_ms"] / naive if naive else float("nan")
        print(f"{r['variant']:>16} | {r['median_ms']:8.1f} | {ratio:7.2f} | {r['tflops']:7.1f} | "
              f"{r['temp_bytes'] / 1e6:9.1f} | {r['compile_s']:9.1f} | {max(r['errors']):.2e}"
              + ("" if r["passed"] else "  FAILED the check"))  # fmt: skip
    result = {
        "size": args.size, "backend": backend, "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "rows": rows,
    }  # fmt: skip
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line)
    print(line)
    if not all(r.get("passed", True) for r in rows):
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
