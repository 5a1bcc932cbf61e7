r"""Side by side: the NF4 Pallas matmul against XLA's dequantise-then-matmul.

    python benchmarks/nf4_matmul.py                 # the `accelerator` shapes (GPU or TPU)
    python benchmarks/nf4_matmul.py --size smoke    # seconds, in the Pallas interpreter on CPU

For a frozen weight stored in NF4 (`tunelib.peft.nf4_quantize(kernel, transpose=True)`: the
`[in, out]` kernel stored `[out, in]` in blocks of 64 with double quantisation, as QLoRA and
bitsandbytes keep it), `y = x W` with `x` `[M, in]` in bfloat16, in two ways:

- ``xla``: the weight dequantised to bfloat16 in the step, then XLA's matmul (what an
  `NF4Tensor` built with `matmul="xla"` does, the default);
- ``pallas``: `tunelib.kernels.nf4_matmul_pallas`, which decodes the codes tile by tile in
  the kernel and never forms the dense weight (`matmul="pallas"`). It has a Triton (GPU)
  lowering only and refuses a TPU (kernels/_nf4_matmul.py): there it is not run, and the
  table and the JSON say so (`"skipped"`) beside the ``xla`` figures; on CPU it runs in the
  Pallas interpreter.

Each weight is quantised once per shape, in one jitted call (run op by op, the quantisation
compiled a program per operation: 36 s for a 4,096 x 4,096 weight on a TPU v5e).

Each is timed as users call it, through `tunelib.peft.lora` on the `NF4Tensor`: the forward
`y`, and the forward and backward with respect to `x` (the weight is frozen; a LoRA step needs
only the input's gradient through it). Before timing, each path's forward is checked against
the float32 product with the dequantised weight: $\|y - y_{ref}\| / \|y_{ref}\|$ at most
`TOLERANCE` (bfloat16 inputs and output; float32 accumulation on both paths); the reference
product and the error are jitted too.

Timing: one warm-up (compiling) call of each, then `--repeats` rounds that call every variant
`--inner` times in a row, the order reversed every other round; each variant's time is the
median over rounds of the mean call. The script prints a table and ends with one JSON line:
per shape and `M`, each path's milliseconds, its bytes of weight read per call (packed codes
and absmax for ``pallas``; codes, absmax and the dense bfloat16 weight written and read for
``xla``), and `pallas_speedup` (xla time / pallas time). `faster` names the path that won each
case: the default stays `matmul="xla"` except where ``pallas`` wins, which this figure decides.
The process ends as soon as the JSON line is written (`_measure.end_process`).
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

from _measure import end_process, random_key  # beside this script, first on sys.path


class Case(NamedTuple):
    n_in: int  # K: the kernel's input features
    n_out: int  # N: its output features
    rows: tuple[int, ...]  # M: tokens of x


SIZES = {
    "smoke": (Case(n_in=128, n_out=64, rows=(16, 48)),),
    "accelerator": (
        Case(n_in=4096, n_out=4096, rows=(16, 8192)),
        Case(n_in=4096, n_out=14_336, rows=(16, 8192)),
    ),
}
VARIANTS = ("xla", "pallas")
# What a call that ran out of device memory says (XLA's "RESOURCE_EXHAUSTED: Out of memory
# ...", a TPU's "pjrt.OOM ... Attempting to reserve 14.22G"), lower-cased.
OUT_OF_MEMORY = ("resource_exhausted", "out of memory", "pjrt.oom")
# bfloat16 inputs and output (a relative rounding of 2^-8 = 3.9e-3 per element); both paths
# accumulate in float32. A wrong decode gives an error near 1.
TOLERANCE = 1e-2
# Why a path is not run on a backend (`jax.default_backend()`), as the table and JSON say it.
NOT_ON = {
    ("pallas", "tpu"): "not on TPU (refused: nf4_matmul_pallas has a Triton lowering only, "
    "see kernels/_nf4_matmul.py)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--size", choices=sorted(SIZES), default="accelerator")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds after one warm-up")
    p.add_argument("--inner", type=int, default=10, help="calls of each variant per round")
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("repeats", "inner"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}.")
    return args


def cell(record: dict, part: str) -> str:
    """A variant's time for `part` in the table: milliseconds, OOM, failed, or '-'."""
    if f"{part}_ms" in record:
        return f"{record[f'{part}_ms']:.3f}"
    if part in record.get("out_of_memory", ()):
        return "OOM"
    return "failed" if f"{part}_failed" in record else "-"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)  # flags are checked before JAX is imported

    import jax
    import jax.numpy as jnp

    from tunelib import peft

    quantize = jax.jit(lambda kernel: peft.nf4_quantize(kernel, transpose=True))
    dense_of = jax.jit(lambda weight: weight.dequantize(jnp.float32))

    @jax.jit
    def reference_product(x, dense):
        return jnp.matmul(x.astype(jnp.float32), dense, precision=jax.lax.Precision.HIGHEST)

    @jax.jit
    def relative_error(y, reference):
        y = y.astype(jnp.float32)
        return jnp.linalg.norm(y - reference) / jnp.linalg.norm(reference)

    def paths(weight, backend: str):
        """Per variant that runs on `backend`: (forward, forward and backward) as users call
        them, and the weight."""
        out = {}
        for variant in VARIANTS:
            if (variant, backend) in NOT_ON:
                continue
            product = peft.lora(lambda x, w: x @ w)

            # The weight is an argument, not a closed-over constant (XLA would fold its
            # decoding into the program at compile time).
            def forward(x, w, product=product):
                return product(x, w)

            def loss(x, w, cotangent, product=product):
                return jnp.vdot(product(x, w).astype(jnp.float32), cotangent)

            variant_weight = dataclasses.replace(weight, matmul=variant)
            out[variant] = (jax.jit(forward), jax.jit(jax.value_and_grad(loss)), variant_weight)
        return out

    def time_calls(calls: dict, repeats: int, inner: int) -> tuple[dict, dict]:
        """The median milliseconds of each call, and the error of each call whose warm-up
        failed (out of device memory: on a v5e the XLA path's forward and backward at
        4,096 x 14,336 and M 8,192 once asked for 14.2 GB, before the NF4 decoding was laid
        out by rows of blocks); those are left out of the timing."""
        failed = {}
        for name, (fn, fn_args) in calls.items():
            try:
                jax.block_until_ready(fn(*fn_args))
            except Exception as e:  # reported in the table and the JSON; the run goes on
                failed[name] = f"{type(e).__name__}: {str(e)[:500]}"
        calls = {name: call for name, call in calls.items() if name not in failed}
        seconds = {name: [] for name in calls}
        names = list(calls)
        for round_index in range(repeats):
            for name in names if round_index % 2 == 0 else names[::-1]:
                fn, fn_args = calls[name]
                start = time.perf_counter()
                for _ in range(inner):
                    result = fn(*fn_args)
                jax.block_until_ready(result)
                seconds[name].append((time.perf_counter() - start) / inner)
        return {name: 1e3 * statistics.median(runs) for name, runs in seconds.items()}, failed

    started = time.perf_counter()

    def progress(message: str) -> None:
        """A line on stderr as each stage ends, so a run cut off by a time limit says where."""
        print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr, flush=True)

    def write(results: list, correct: bool) -> str:
        line = json.dumps({
            "benchmark": "nf4_matmul", "size": args.size, "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "key_impl": str(jax.random.key_impl(random_key(0))),
            "repeats": args.repeats, "inner": args.inner, "tolerance": TOLERANCE,
            "correct": correct, "cases": results,
        })  # fmt: skip
        if args.json_out is not None:  # after every case: a cut-off run keeps what it measured
            args.json_out.write_text(line + "\n")
        return line

    results, correct = [], True
    backend = jax.default_backend()
    key = random_key(0)
    for case in SIZES[args.size]:
        key, kw = jax.random.split(key)
        kernel = 0.02 * jax.random.normal(kw, (case.n_in, case.n_out), jnp.float32)
        kernel = kernel.astype(jnp.bfloat16)  # dequantised to bfloat16, as a bf16 model's
        weight = jax.block_until_ready(quantize(kernel))
        progress(f"{case.n_in} x {case.n_out}: quantised")
        by_variant = paths(weight, backend)
        dense = dense_of(weight)
        codes_bytes = sum(x.nbytes for x in jax.tree.leaves(weight) if hasattr(x, "nbytes"))
        for m in case.rows:
            key, kx, kc = jax.random.split(key, 3)
            x = jax.random.normal(kx, (m, case.n_in), jnp.float32).astype(jnp.bfloat16)
            cotangent = jax.random.normal(kc, (m, case.n_out), jnp.float32)
            reference = reference_product(x, dense)
            row = {"n_in": case.n_in, "n_out": case.n_out, "m": m, "variants": {}}
            calls = {}
            for variant in VARIANTS:
                if variant not in by_variant:
                    row["variants"][variant] = {"skipped": NOT_ON[variant, backend]}
                    progress(f"M={m} {variant}: {NOT_ON[variant, backend]}")
                    continue
                forward, backward, w = by_variant[variant]
                record = row["variants"].setdefault(variant, {})
                try:
                    error = float(relative_error(forward(x, w), reference))
                except Exception as e:  # a path that does not compile here is reported
                    record["failed"] = f"{type(e).__name__}: {str(e)[:500]}"
                    correct = False
                    progress(f"M={m} {variant}: failed ({type(e).__name__})")
                    continue
                progress(f"M={m} {variant}: forward compiled and checked, error {error:.2e}")
                record["relative_error"] = error
                record["passed"] = error <= TOLERANCE
                correct &= record["passed"]
                if record["passed"]:
                    calls[f"{variant}/forward"] = (forward, (x, w))
                    calls[f"{variant}/forward+backward"] = (backward, (x, w, cotangent))
            times, failed = time_calls(calls, args.repeats, args.inner)
            for name, error in failed.items():
                progress(f"M={m} {name}: not timed ({error.splitlines()[0][:200]})")
            progress(f"M={m}: timed")
            dense_bytes = case.n_in * case.n_out * 2
            for variant, record in row["variants"].items():
                if "skipped" in record:
                    continue
                record["weight_bytes_read"] = codes_bytes + (
                    2 * dense_bytes if variant == "xla" else 0
                )
                for part in ("forward", "forward+backward"):
                    if f"{variant}/{part}" in times:
                        record[f"{part}_ms"] = times[f"{variant}/{part}"]
                    elif f"{variant}/{part}" in failed:
                        error = failed[f"{variant}/{part}"]
                        record[f"{part}_failed"] = error
                        if any(s in error.lower() for s in OUT_OF_MEMORY):
                            record.setdefault("out_of_memory", []).append(part)
                        else:  # a path that runs out of memory is not wrong; one that breaks is
                            correct = False
            for part in ("forward", "forward+backward"):
                xla_ms = row["variants"]["xla"].get(f"{part}_ms")
                pallas_ms = row["variants"]["pallas"].get(f"{part}_ms")  # absent when skipped
                if xla_ms and pallas_ms:
                    row[f"pallas_speedup_{part}"] = xla_ms / pallas_ms
                    row[f"faster_{part}"] = "pallas" if pallas_ms < xla_ms else "xla"
            results.append(row)
            write(results, correct)

    header = f"{'K x N':>13} {'M':>6} {'path':>7} {'rel err':>9} {'fwd ms':>9} {'fwd+bwd ms':>11}"
    print(f"{jax.default_backend()} ({jax.devices()[0].device_kind}), bfloat16 x, NF4 weight")
    print(header)
    for row in results:
        for variant, r in row["variants"].items():
            if "skipped" in r:
                print(
                    f"{row['n_in']:>6} x {row['n_out']:<6}{row['m']:>6} {variant:>7} {r['skipped']}"
                )
                continue
            err = f"{r['relative_error']:.2e}" if "relative_error" in r else "FAILED"
            fwd, both = (cell(r, part) for part in ("forward", "forward+backward"))
            print(
                f"{row['n_in']:>6} x {row['n_out']:<6}{row['m']:>6} {variant:>7} {err:>9} "
                f"{fwd:>9} {both:>11}"
            )
    print(write(results, correct))
    return 0 if correct else 1


if __name__ == "__main__":
    end_process(main())
