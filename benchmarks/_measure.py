"""How a benchmark measures side by side: in a worker, the memory a compiled train step
holds, the time a step takes and the worker's peak RSS; in the parent, each worker's JSON
result, a variant's error against a reference, and ratios.

A module beside the scripts, not a script: `python benchmarks/<script>.py` puts this folder
first on `sys.path`, so the scripts (and their worker subprocesses) import it as `_measure`.
"""

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import numpy as np


def step_memory(compiled) -> dict[str, int]:
    """The bytes of a compiled step from its `memory_analysis()`: `temp_bytes`,
    `argument_bytes`, `output_bytes`, and `total_bytes`, everything the step holds at once:
    inputs, new outputs (donated ones reuse their inputs' buffers) and temporaries."""
    memory = compiled.memory_analysis()
    return {
        "temp_bytes": memory.temp_size_in_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "total_bytes": memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes,
    }


def step_seconds(compiled, trainable, opt_state, *inputs, repeats: int) -> list[float]:
    """The wall time of each of `repeats` train steps after one warm-up step. `compiled`
    maps `(trainable, opt_state, *inputs)` to `(trainable, opt_state, loss)`; each step
    takes the state the last one returned (donated buffers are updated in place). A step's
    outputs come from one executable and are ready together: waiting for the loss waits for
    the step (and this module needs no JAX import, so a parent process that imports it stays
    free of JAX)."""
    trainable, opt_state, value = compiled(trainable, opt_state, *inputs)
    value.block_until_ready()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        trainable, opt_state, value = compiled(trainable, opt_state, *inputs)
        value.block_until_ready()
        seconds.append(time.perf_counter() - start)
    return seconds


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes (Linux counts `ru_maxrss` in
    KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker_result(command: list[str], out: Path, *, label: str) -> dict:
    """Run a worker subprocess, `command` (which writes its result as JSON to `out`), and
    return that result; `{"failed": ...}` with the end of its stderr when it exits with an
    error (out of memory, say), so that the other variants are still measured."""
    print(f"{label} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"failed": proc.stderr.strip()[-2000:] or f"exit status {proc.returncode}"}
    return json.loads(out.read_text())


def relative_error(ours: dict, reference: dict) -> float:
    """The larger of the loss's relative error and the gradients' largest error relative to
    the largest gradient entry, of two `{"loss", "grads"}` results (leaves whose gradients
    are near zero, such as the query projections of a random model, are judged on the scale
    of the whole gradient)."""
    x = np.concatenate([np.asarray(g) for g in ours["grads"]])
    y = np.concatenate([np.asarray(g) for g in reference["grads"]])
    loss = abs(ours["loss"] - reference["loss"]) / abs(reference["loss"])
    return max(loss, float(np.abs(x - y).max() / np.abs(y).max()))


def ratio(a, b):
    """`a / b`, or None when either is missing (a variant failed) or `b` is 0."""
    return None if a is None or b is None or b == 0 else a / b


def print_result(result: dict, json_out: Path | None) -> None:
    """The result's JSON line, printed last, and written to `json_out` too when given."""
    line = json.dumps(result)
    print(line)
    if json_out is not None:
        json_out.write_text(line + "\n")


def cpu() -> dict:
    """The CPU a benchmark ran on: its model name and whether it has AVX-512 (Linux's
    `/proc/cpuinfo`; elsewhere `platform.processor()`). XLA's and PyTorch's CPU matmuls
    differ far more on some CPUs than on others, so a CPU ratio is reported with its CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"model": platform.processor() or platform.machine(), "avx512": None}
    fields = dict(line.split(":", 1) for line in text.splitlines()[:40] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = fields.get("flags", "").split()
    family = f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    return {
        "model": f"{fields.get('model name', platform.machine())} ({family})",
        "avx512": "avx512f" in flags,
    }


def random_key(seed: int):
    """A PRNG key for a benchmark's random weights and inputs, from the generator that is
    cheap to compile on the default backend: on a CPU JAX's default (threefry, so that CPU
    figures and smoke runs draw the values they always drew), on a TPU or GPU the `"rbg"`
    generator (XLA's `RngBitGenerator`, which a TPU runs in hardware).

    A benchmark's values only have to be random-looking; their generation must not cost more
    than what is measured. On a TPU v5e (jax 0.10.2, libtpu of 2026-06-15) threefry's
    `jax.random.normal` for one stacked weight of the Llama-3.2-1B shape (16 x 2048 x 8192)
    compiled in 6.3 to 16.4 s, one program per shape, the longer ones after the compiler
    retried a fusion (its log: "Successful retry compilation of fusion.26"): initialising
    that model took about a minute, the sampler part's whole limit, in some runs and not in
    others. MaxText's training and decoding entry points make `"unsafe_rbg"` JAX's default
    generator (`jax_default_prng_impl`). Each benchmark's JSON names the generator that drew
    its values (`key_impl`)."""
    import jax

    if jax.default_backend() == "cpu":
        return jax.random.key(seed)
    return jax.random.key(seed, impl="rbg")


def end_process(status: int) -> NoReturn:
    """End this process at once with `status`, its stdout and stderr flushed: for a benchmark
    whose results are written, so that it lets go of the accelerator without waiting for
    the interpreter's and the runtime's teardown.

    On a TPU v5e (jax 0.10.2, libtpu 0.0.42.1) `sampler_roofline.py` printed its table and
    its JSON and then did not exit for 80 s, until the accelerator suite's SIGINT at the
    part's limit ended it without a traceback: the process was past the point where Python
    handles signals, tearing down the arrays, executables and runtime it held (the TPU
    runtime warns that its shutdown is slow without transparent huge pages). With the
    results written nothing is left to do, and the next process to open the chip waits for
    this one; `os._exit` skips that teardown (the operating system frees the process's
    memory and closes the device), and JAX's atexit handlers (closing the backends, waiting
    for pending ordered effects) with it: every result was waited for before it was
    written, and every file is closed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
