"""Running on JAX's multi-controller runtime: every process runs the same program.

`initialize()` joins the processes of a run through `jax.distributed.initialize` (from the
variables `python -m tunelib.launch` sets for local runs, or a SLURM / Open MPI job's own),
with Gloo collectives on CPU, and returns this process's `Runtime`;
`launched_process_count()` says how many processes the run has before anything starts
JAX's backend. See `docs/scale.md`.

For supervised runs (`python -m tunelib.launch --max-restarts K`): `heartbeat(step)` tells
the supervisor a process is alive, `supervision()` what it recorded of the restarts so far;
`FaultPlan` fires the faults `TUNELIB_FAULTS` asks for (tests and benchmarks of recovery),
parsed once, where a run asks it (`inject_faults` and `faults_during` read the variable at
each call); `parse_faults` reads that variable's grammar.
"""

from tunelib.distributed._faults import (
    FAULTS,
    FAULTS_LOG,
    Fault,
    FaultPlan,
    faults_during,
    fired_faults,
    inject_faults,
    parse_faults,
)
from tunelib.distributed._runtime import (
    COORDINATOR,
    NUM_PROCESSES,
    PROCESS_ID,
    Runtime,
    initialize,
    launched_process_count,
)
from tunelib.distributed._supervision import HEARTBEATS, SUPERVISION, heartbeat, supervision

__all__ = [
    "COORDINATOR",
    "FAULTS",
    "FAULTS_LOG",
    "HEARTBEATS",
    "NUM_PROCESSES",
    "PROCESS_ID",
    "SUPERVISION",
    "Fault",
    "FaultPlan",
    "Runtime",
    "faults_during",
    "fired_faults",
    "heartbeat",
    "initialize",
    "inject_faults",
    "launched_process_count",
    "parse_faults",
    "supervision",
]
