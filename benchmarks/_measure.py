"""What a benchmark worker measures of a compiled train step: the memory it holds, the time
a step takes, and the worker's peak RSS.

A module beside the scripts, not a script: `python benchmarks/<script>.py` puts this folder
first on `sys.path`, so the scripts (and their worker subprocesses) import it as `_measure`.
"""

import resource
import time


def compiled_bytes(compiled) -> dict[str, int]:
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
