"""Running on JAX's multi-controller runtime: every process runs the same program.

`initialize()` joins the processes of a run through `jax.distributed.initialize` (from the
variables `python -m tunelib.launch` sets for local runs, or a SLURM / Open MPI job's own),
with Gloo collectives on CPU, and returns this process's `Runtime`. See `docs/scale.md`.
"""

from tunelib.distributed._runtime import (
    COORDINATOR,
    NUM_PROCESSES,
    PROCESS_ID,
    Runtime,
    initialize,
)

__all__ = ["COORDINATOR", "NUM_PROCESSES", "PROCESS_ID", "Runtime", "initialize"]
