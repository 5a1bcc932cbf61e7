"""Data parallelism over every device of every process: one mesh, the same parameters on
each device, each batch split by rows.

    placement = kit.parallel.placement(config.batch_size, config.devices)  # joins processes
    params = placement.replicate(params)
    batch = placement.rows(local_rows)                # this process's rows -> global arrays

Every process runs the same recipe (`python -m tunelib.launch -n 2 recipes/sft.py`, or a
cluster's launcher). The mesh has one axis, "data", over `jax.devices()` (every process's,
process 0's first), so process p holds rows `[p * b, (p + 1) * b)` of a global batch of
`b * process_count` rows, and its Grain pipeline reads only those (`tunelib.data`'s `shard`).
The train steps are the recipes' own `jax.jit` functions: XLA sums the gradients across the
devices, so one process with four devices and two processes with two each compute the same
steps. Process 0 writes the run folder's metrics, plots and result; checkpoints are written by
every process (Orbax), each with its own data position (Grain).
"""

import dataclasses
import traceback
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from tunelib import distributed

from kit.errors import UserError

AXIS = "data"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a recipe's arrays live: `mesh` (one axis, "data"), and this process's place."""

    mesh: Any
    process_index: int
    process_count: int
    # The processes whose rows make up a batch on `mesh`: all of them for a mesh over every
    # process's devices; this process alone for a mesh of its own (a disaggregated role).
    data_index: int
    data_count: int

    @property
    def is_main(self) -> bool:
        """Process 0: the one that logs, plots, prints and writes the run folder's files."""
        return self.process_index == 0

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    @property
    def shard(self) -> tuple[int, int]:
        """`(index, count)`: this process's share of every batch, as `tunelib.data` takes it."""
        return self.data_index, self.data_count

    def replicated(self):
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def by_rows(self):
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(AXIS))

    def replicate(self, tree):
        """`tree` on every device of the mesh (every process must pass the same values)."""
        target = self.replicated()

        def put(x):
            if self.data_count == 1 or not isinstance(x, jax.Array):
                return jax.device_put(x, target)
            if x.sharding.is_equivalent_to(target, x.ndim):
                return x
            if x.is_fully_addressable:  # this process's copy, from the host (JAX moves no
                return jax.device_put(np.asarray(x), target)  # committed array across hosts)
            return jax.jit(lambda y: y, out_shardings=target)(x)  # a collective

        return jax.tree.map(put, tree)

    def rows(self, local):
        """Global arrays, split by rows over the mesh, from this process's rows of each
        (NumPy or host arrays: `[b, ...]` of a global `[b * process_count, ...]`)."""
        sharding = self.by_rows()
        if self.process_count == 1:
            # The whole tree in one batched transfer (a call for each array cost 0.75 ms of
            # host time each on a TPU v5e).
            return jax.device_put(jax.tree.map(np.asarray, local), sharding)

        def place(x):
            x = np.asarray(x)
            shape = (x.shape[0] * self.data_count, *x.shape[1:])
            return jax.make_array_from_process_local_data(sharding, x, shape)

        return jax.tree.map(place, local)

    def global_rows(self, tree, *, pad: bool = False):
        """Global arrays from the whole batch, which every process holds: each takes its own
        rows. With `pad`, rows of zeros (False in every mask) are added first so the rows
        split evenly; without, they must."""
        count = len(jax.tree.leaves(tree)[0])
        extra = -count % self.num_devices
        if extra and not pad:
            raise ValueError(f"{count} rows do not split over {self.num_devices} devices")
        if extra:
            tree = jax.tree.map(lambda x: np.concatenate([x, np.zeros_like(x[:extra])]), tree)
        share = (count + extra) // self.data_count
        first = self.data_index * share
        return self.rows(jax.tree.map(lambda x: np.asarray(x)[first : first + share], tree))

    def local(self, x) -> np.ndarray:
        """This process's rows of a global array (the rows `rows` takes from it), on the host;
        an array laid out otherwise is split by rows first (every process must call this)."""
        if not x.sharding.is_equivalent_to(self.by_rows(), x.ndim):  # moved on the devices
            x = jax.jit(lambda x: x, out_shardings=self.by_rows())(x)
        shards = sorted(x.addressable_shards, key=lambda s: s.index[0].indices(x.shape[0])[0])
        return np.concatenate([np.asarray(s.data) for s in shards])

    def fetch(self, tree):
        """The whole value of every array on every process, as NumPy."""

        def value(x):
            if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
                return np.asarray(x)
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))

        return jax.tree.map(value, tree)

    def barrier(self, name: str) -> None:
        """Wait until every process gets here (a no-op for one process)."""
        if self.process_count > 1:
            multihost_utils.sync_global_devices(name)


def _initialized():
    """`distributed.initialize()`, with one line when `JAX_PLATFORMS` names a backend JAX
    cannot start here (a platform whose plugin is not installed failed JAX's own assertion,
    a traceback; one that is installed but finds no device says so in a RuntimeError)."""
    try:
        return distributed.initialize()
    except (RuntimeError, AssertionError) as error:
        platforms = jax.config.jax_platforms
        where = traceback.extract_tb(error.__traceback__)[-1].filename  # JAX's backend set-up
        backend = where.endswith("xla_bridge.py") and (
            isinstance(error, AssertionError) or "Unable to initialize backend" in str(error)
        )
        if not platforms or not backend:
            raise
        detail = str(error).split(" (set JAX_PLATFORMS")[0] or "no such backend installed"
        raise UserError(
            f"JAX_PLATFORMS={platforms}: JAX cannot start that backend here ({detail}); set "
            "JAX_PLATFORMS to a backend this machine has (cpu, tpu, cuda), or unset it"
        ) from None


def placement(
    batch_size: int, wanted: int | None = None, *, across_processes: bool = True
) -> Placement:
    """This run's placement: joins the processes of a multi-process run (once), then a mesh
    over `wanted` devices (`--devices`; default every device of every process; with
    `across_processes=False`, every device of this process, for a role of its own). A batch
    of `batch_size` rows must split evenly over them."""
    runtime = _initialized()
    devices = list(runtime.devices if across_processes else runtime.local_devices)
    if wanted is not None:
        if runtime.process_count > 1 and across_processes and wanted != len(devices):
            raise UserError(
                f"--devices {wanted}: a run of {runtime.process_count} processes uses all "
                f"{len(devices)} of their devices; leave --devices out"
            )
        if wanted > len(devices):
            raise UserError(f"--devices {wanted}: this process has {len(devices)} devices")
        devices = devices[:wanted]
    if batch_size % len(devices):
        raise UserError(
            f"--batch-size {batch_size} does not split over {len(devices)} devices: "
            f"give a multiple of {len(devices)}"
            + ("" if runtime.process_count > 1 else " or fewer --devices")
        )
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    index, count = (runtime.process_index, runtime.process_count) if across_processes else (0, 1)
    return Placement(mesh, runtime.process_index, runtime.process_count, index, count)


def is_main() -> bool:
    """Whether this process writes the run folder's files: process 0 (always, in a
    one-process run)."""
    return jax.process_index() == 0
