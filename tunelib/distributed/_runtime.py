"""Joining JAX's multi-controller runtime: `jax.distributed.initialize`, once per process."""

import dataclasses
import os
import socket
import time

import jax

# What `tunelib.launch` (and anyone starting processes by hand) sets for each process; the
# coordinator's address goes in JAX's own `JAX_COORDINATOR_ADDRESS`.
NUM_PROCESSES = "TUNELIB_NUM_PROCESSES"
PROCESS_ID = "TUNELIB_PROCESS_ID"
COORDINATOR = "JAX_COORDINATOR_ADDRESS"
# Cluster managers JAX detects by itself, and the variable that says a job has several tasks.
_CLUSTERS = {
    "SLURM": "SLURM_NTASKS",
    "Open MPI": "OMPI_COMM_WORLD_SIZE",
}


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where this process stands in the run.

    Attributes:
      process_index: this process's rank, `jax.process_index()`.
      process_count: the processes in the run, `jax.process_count()`.
      local_devices: this process's devices.
      devices: every process's devices, in `jax.devices()` order (what meshes span).
      coordinator: the coordinator's `host:port`, or None for a single process.
    """

    process_index: int
    process_count: int
    local_devices: tuple[jax.Device, ...]
    devices: tuple[jax.Device, ...]
    coordinator: str | None

    @property
    def is_main(self) -> bool:
        """Whether this is process 0, the one that logs, plots and prints."""
        return self.process_index == 0


_started: dict[str, object] = {}


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 120,
) -> Runtime:
    """Join the run's processes through `jax.distributed.initialize`, or stay alone.

    Which run this process belongs to comes from, in order:

    1. the arguments (all three, or none);
    2. the variables `tunelib.launch` sets (`JAX_COORDINATOR_ADDRESS`,
       `TUNELIB_NUM_PROCESSES`, `TUNELIB_PROCESS_ID`), for local runs;
    3. a SLURM job of several tasks, or an Open MPI job of several ranks: JAX reads the
       coordinator, the process count and the rank from their variables itself (a TPU pod's
       VMs likewise, when `JAX_COORDINATOR_ADDRESS` is unset, with `TUNELIB_NUM_PROCESSES`
       unset too: call `jax.distributed.initialize()` yourself there, or set the three);
    4. otherwise this is the only process and nothing is initialised.

    On CPU the processes' collectives go through Gloo (`jax_cpu_collectives_implementation`),
    so several processes on one machine behave like hosts. It may be called again: a second
    call with the same run returns the same `Runtime`; another run is an error, since JAX
    joins one run per process.

    Args:
      coordinator_address: `host:port` of process 0's coordinator service.
      num_processes: the number of processes.
      process_id: this process's rank in `[0, num_processes)`.
      timeout_s: how long to try to reach the coordinator before giving up.

    Returns:
      The `Runtime` of this process.

    Raises:
      ValueError: for a partial or invalid set of arguments or variables.
      ConnectionError: when the coordinator cannot be reached in `timeout_s`, naming the
        address and this process's rank.

    Examples:
      Alone (no launcher, no cluster), nothing is initialised:

      >>> from tunelib import distributed
      >>> runtime = distributed.initialize()
      >>> runtime.process_count, runtime.is_main
      (1, True)
    """
    given = (coordinator_address, num_processes, process_id)
    if any(x is not None for x in given) and None in given:
        raise ValueError(
            "initialize: give coordinator_address, num_processes and process_id together "
            f"(got {coordinator_address!r}, {num_processes!r}, {process_id!r})."
        )
    if coordinator_address is None:
        coordinator_address, num_processes, process_id = _from_environment()
    key = (coordinator_address, num_processes, process_id)
    if "key" in _started:
        if _started["key"] != key:
            raise ValueError(
                f"initialize was already called for the run {_started['key']}; a process "
                f"joins one run, not also {key}."
            )
        return _runtime(coordinator_address)
    if num_processes is not None or _cluster() is not None:
        _join(coordinator_address, num_processes, process_id, timeout_s)
    _started["key"] = key
    return _runtime(coordinator_address if num_processes is not None else None)


def launched_process_count() -> int:
    """How many processes this process's run has, as `initialize` will find them, read from
    the launcher's or the cluster's variables without starting JAX's runtime or backend.

    A process about to start another JAX program (a recipe that trains its start model
    first) asks this instead of `jax.process_count()`, which opens the process's devices: on
    a TPU host only one process may hold the chips, so the child could not open them.

    Returns:
      The process count `initialize` joins (1 for a process alone).

    Raises:
      ValueError: for a partial or invalid set of the launcher's variables.

    Examples:
      >>> from tunelib import distributed
      >>> distributed.launched_process_count()
      1
    """
    _, count, _ = _from_environment()
    if count is not None:
        return count
    cluster = _cluster()
    return int(os.environ[_CLUSTERS[cluster]]) if cluster is not None else 1


def _from_environment() -> tuple[str | None, int | None, int | None]:
    count, rank = os.environ.get(NUM_PROCESSES), os.environ.get(PROCESS_ID)
    if count is None and rank is None:
        return None, None, None
    address = os.environ.get(COORDINATOR)
    if count is None or rank is None or not address:
        raise ValueError(
            f"{NUM_PROCESSES}, {PROCESS_ID} and {COORDINATOR} must be set together; got "
            f"{count!r}, {rank!r} and {address!r}."
        )
    try:
        count_i, rank_i = int(count), int(rank)
    except ValueError:
        raise ValueError(f"{NUM_PROCESSES} and {PROCESS_ID} must be integers, got "
                         f"{count!r} and {rank!r}.") from None  # fmt: skip
    if count_i < 1 or not 0 <= rank_i < count_i:
        raise ValueError(
            f"{PROCESS_ID}={rank_i} must be in [0, {NUM_PROCESSES}={count_i}), and "
            f"{NUM_PROCESSES} >= 1."
        )
    return address, count_i, rank_i


def _cluster() -> str | None:
    """The cluster manager of a job of several tasks that JAX detects by itself, if any."""
    for name, variable in _CLUSTERS.items():
        if int(os.environ.get(variable, "1") or 1) > 1:
            return name
    return None


def _join(address, count, rank, timeout_s) -> None:
    if count == 1:
        return  # one process: nothing to join
    # CPU devices' cross-process collectives through Gloo (GPUs and TPUs are unaffected).
    # Set before the backend starts: asking it which platform it runs on would start it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if address is not None and rank:
        # JAX aborts the whole process (a fatal log, no exception) when the coordinator never
        # answers, so a process other than the coordinator's first checks that it listens.
        _wait_for(address, rank, timeout_s)
    try:
        jax.distributed.initialize(address, count, rank, initialization_timeout=timeout_s)
    except Exception as error:  # JAX raises its runtime's error type, with gRPC's message
        where = address or os.environ.get(COORDINATOR) or f"the {_cluster()} job's coordinator"
        who = f"process {rank}" if rank is not None else "this process"
        raise ConnectionError(
            f"{who} could not join the run at {where} within {timeout_s} s: "
            f"{str(error).splitlines()[0]}"
        ) from None


def _wait_for(address: str, rank: int, timeout_s: float) -> None:
    """Return once something accepts connections at `address` (`host:port`), or raise a
    `ConnectionError` naming it and `rank` after `timeout_s` seconds."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except (OSError, ValueError) as error:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"process {rank} could not join the run at {address} within "
                    f"{timeout_s} s: nothing accepts connections there ({error})."
                ) from None
        time.sleep(0.2)


def _runtime(coordinator: str | None) -> Runtime:
    return Runtime(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_devices=tuple(jax.local_devices()),
        devices=tuple(jax.devices()),
        coordinator=coordinator if jax.process_count() > 1 else None,
    )
