"""Disaggregated, asynchronous RL on JAX's multi-controller runtime: one process trains,
one samples, and rollouts are at most `--max-staleness` updates old.

    python -m tunelib.launch -n 2 recipes/grpo.py --max-staleness 1

Process 0 (the trainer) and process 1 (the sampler) each hold the model on their own devices
(`kit.parallel.placement(..., across_processes=False)`). Every step they meet through a
collective of JAX's own, `multihost_utils.broadcast_one_to_all` (a jitted sum over a mesh
spanning both processes; no RPC layer): the sampler's batch of scored rollouts goes to the
trainer, then the trainer's new weights go to the sampler. With staleness s = 0 the two take
turns, which is the synchronous recipe on two processes. With s >= 1 the sampler runs s
batches ahead: at step t it samples the batch of step t + s with the weights of step t - 1
while the trainer trains on the batch of step t, so sampling and training overlap, and the
batch of step j was sampled with the weights of step j - s - 1 or later (never more than s
updates old; the first s batches are sampled before the first update).

Every batch carries the policy version that sampled it (the number of updates behind its
weights) and the fingerprint of the weights the sampler ran (`tunelib.rollout.fingerprint`);
the trainer checks both against what it pushed (`tunelib.rollout.PolicyLedger`, within the
staleness bound) and logs each batch's staleness. With LoRA only the adapters are pushed:
the sampler holds the frozen base and samples on base and adapters, never merged. The
sampler's PRNG keys follow the same chain as the synchronous recipe's (`kit.loop.step_keys`),
so batch j is sampled with the key step j would use.
"""

import collections
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from tunelib.distributed import FaultPlan
from tunelib.rollout import WeightDelta, apply_weight_delta, weight_delta

from kit.loop import step_keys
from kit.parallel import AXIS, Placement
from kit.rollout_batch import RolloutBatch

TRAINER, SAMPLER = 0, 1


def role() -> int:
    """`TRAINER` (process 0) or `SAMPLER` (process 1)."""

    return TRAINER if jax.process_index() == 0 else SAMPLER


# The most bytes one collective of `exchange` carries: a tree larger than this travels in
# buckets of at most this size, so that neither process packs a second copy of all of it
# (Qwen3-0.6B's bfloat16 weights are 1.2 GB; `benchmarks/weight_push.py`).
BUCKET_BYTES = 256 * 2**20


def exchange(tree, *, source: int, bucket_bytes: int = BUCKET_BYTES):
    """`tree` as process `source` holds it, on every process (NumPy); every process calls
    this with a tree of the same shapes and dtypes (its own values are ignored unless it is
    the source). The leaves travel as buffers of bytes, several small leaves in one and a
    leaf larger than `bucket_bytes` in pieces, so that the collective runs once per bucket
    of at most `bucket_bytes`, not once per leaf. Returns the tree and the seconds the
    collectives took."""

    leaves, structure = jax.tree.flatten(tree)
    arrays = [np.asarray(x) for x in leaves]
    flat = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    out = [np.empty(a.shape, a.dtype) for a in arrays]
    seconds = 0.0
    for bucket in _buckets([a.nbytes for a in arrays], bucket_bytes):
        started = time.perf_counter()
        packed = np.concatenate([flat[i][lo:hi] for i, lo, hi in bucket])
        packed = multihost_utils.broadcast_one_to_all(packed, is_source=role() == source)
        seconds += time.perf_counter() - started
        at = 0
        for i, lo, hi in bucket:
            out[i].reshape(-1).view(np.uint8)[lo:hi] = packed[at : at + hi - lo]
            at += hi - lo
    return structure.unflatten(out), seconds


def _buckets(sizes: list[int], limit: int) -> list[list[tuple[int, int, int]]]:
    """The byte ranges `(leaf, start, end)` of leaves of `sizes` bytes, in order, grouped in
    buckets of at most `limit` bytes (a leaf larger than that cut across several)."""
    buckets, current, room = [], [], limit
    for i, size in enumerate(sizes):
        start = 0
        while start < size:
            end = min(size, start + room)
            current.append((i, start, end))
            room -= end - start
            start = end
            if room == 0:
                buckets.append(current)
                current, room = [], limit
    if current:
        buckets.append(current)
    return buckets


class Rollouts:
    """The batches between the two processes, one train step at a time.

    `sample(policy, prompts, key, version=...) -> RolloutBatch` makes a scored batch on the
    sampler (this process's rows, NumPy), stamped with its policy version and fingerprint;
    `template` is a batch of the same shapes (zeros), the trainer's side of the collective;
    `fresh_batches()` a new iterator of the run's prompts (the sampler reads s steps ahead
    with one). At every train step both
    processes call `take`, the trainer trains on what it returns, then both call `deliver` and
    `push`. The first `take` of a run fills the pipeline from the state it is given; that of
    a run resumed from a checkpoint takes the batches that were in flight when it was saved
    (`in_flight`, checkpointed with the state, then `resume`), as they were sampled, so the
    run goes on as if it had never stopped.
    """

    def __init__(
        self, staleness: int, sample: Callable, template: dict, fresh_batches, faults=None,
        bucket_bytes: int = BUCKET_BYTES,
    ):  # fmt: skip
        self.staleness = staleness
        self.bucket_bytes = bucket_bytes  # the most bytes of one collective of a push
        self.sample = sample
        self.template = template
        self.fresh_batches = fresh_batches
        self.queue: collections.deque = collections.deque()  # the trainer's batches to train
        self.ahead: Iterator | None = None  # the sampler's prompts, s steps ahead
        self.rng = None  # the sampler's key data: the train state's, s steps ahead
        self.version = 0  # the updates behind the sampler's weights
        self.pending: dict | None = None  # sampled during this step, delivered after it
        self.resumed: list[dict] | None = None  # the batches in flight at the checkpoint
        self.held = None  # with delta pushes: the weights of the last push, on both roles
        # The injected faults (`tunelib.distributed.FaultPlan`; TUNELIB_FAULTS by default).
        self.faults = faults if faults is not None else FaultPlan.from_environment()

    def take(self, policy, prompts, batches, rng, version: int) -> dict | None:
        """This step's batch on the trainer (None on the sampler). `prompts` are this step's,
        `batches` the run's data iterator, `rng` the train state's key data before this step
        and `version` the updates made so far. With s >= 1 the sampler then samples the
        batch of step t + s, while the trainer trains."""
        if self.ahead is None:  # the first step of this process: the first s batches, in turn
            self.rng, self.version = rng, version
            self.ahead = self.fresh_batches()
            self.ahead.set_state(batches.get_state())
            if self.staleness:
                firsts = [prompts] + [next(self.ahead) for _ in range(self.staleness - 1)]
                if self.resumed is not None:  # sampled before the checkpoint: the keys move on
                    for _ in firsts:
                        self.rng = step_keys(self.rng, "rollouts", "dropout")[0]
                    self.queue.extend(self.resumed)
                    self.resumed = None
                else:
                    for first in firsts:
                        self.queue.append(self._exchanged(self._sampled(policy, first)))
        if self.staleness == 0:
            self.queue.append(self._exchanged(self._sampled(policy, prompts)))
        else:
            self.pending = self._sampled(policy, next(self.ahead))
        batch = self.queue.popleft()  # both roles hold the queue; the trainer trains on it
        return batch if role() == TRAINER else None

    def deliver(self) -> None:
        """With s >= 1: the batch the sampler made during this step, to the trainer."""
        if self.staleness:
            self.queue.append(self._exchanged(self.pending))
            self.pending = None

    def push(self, weights, *, delta: bool = False):
        """The trainer's `weights` (host arrays; the sampler passes its own, of the same
        shapes and dtypes) on the sampler's host: `(weights, what the push sent)`. The
        sampler's version advances.

        With `delta`, once both processes hold the weights of the previous push, only the
        elements that changed travel (`tunelib.rollout.weight_delta`: their positions and
        values), when that is fewer bytes than the weights; the sampler rebuilds the weights
        and checks their fingerprint and version against those the trainer sent with the
        delta. The first push, and the first after a restart, send the whole weights."""
        version = self.version + 1
        with self.faults.during("push", version):
            if delta:
                out, sent = self._delta_push(weights, version)
            else:
                out, seconds = exchange(weights, source=TRAINER, bucket_bytes=self.bucket_bytes)
                sent = {"bytes": _nbytes(out), "seconds": seconds, "delta": False}
        self.held = out if delta else None
        self.version = version
        return out, sent

    def _delta_push(self, weights, version: int):
        """`push` with a delta when it is smaller: a header (the kind, the version, the
        fingerprint and each leaf's count of changed elements), then the delta or the
        weights."""
        leaves = jax.tree.leaves(weights)
        whole = _nbytes(leaves)
        header = np.zeros(3 + len(leaves), np.int64)
        change = None
        if role() == TRAINER and self.held is not None:
            # None when it would not be smaller: then its positions are never made.
            change = weight_delta(self.held, weights, max_bytes=whole - 1)
            if change is not None:
                counts = [p.size for p in change.positions]
                header[:] = [1, version, change.fingerprint, *counts]
        header, first = exchange(header, source=TRAINER)
        if not header[0]:
            out, seconds = exchange(weights, source=TRAINER, bucket_bytes=self.bucket_bytes)
            sent = header.nbytes + whole
            return out, {"bytes": sent, "seconds": first + seconds, "delta": False}
        if int(header[1]) != version:
            raise RuntimeError(f"a weight delta for version {header[1]} reached version {version}")
        if change is None:  # the sampler receives a delta of the counts the header gives
            change = WeightDelta.receiving(self.held, header[3:], header[2])
        seconds = 0.0
        if header[3:].any():  # nothing to send when no element changed
            sent, seconds = exchange(
                (change.positions, change.values), source=TRAINER, bucket_bytes=self.bucket_bytes
            )
            change = change._replace(positions=tuple(sent[0]), values=tuple(sent[1]))
        out = weights if role() == TRAINER else apply_weight_delta(self.held, change)
        sent = header.nbytes + change.nbytes
        return out, {"bytes": sent, "seconds": first + seconds, "delta": True}

    def in_flight(self) -> dict:
        """The `staleness` batches sampled for the steps after this one (`template`'s while
        the pipeline is not filled), stacked, with `filled`: what a checkpoint keeps."""
        filled = len(self.queue) == self.staleness and self.pending is None
        batches = list(self.queue) if filled else [self.template] * self.staleness
        stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)
        return {"batches": stacked.saved(), "filled": np.bool_(filled)}

    def resume(self, saved: dict) -> None:
        """Take the batches a checkpoint kept (`in_flight`) as the first steps' batches of
        this process, in place of sampling them again with the restored weights."""
        if not bool(np.asarray(saved["filled"])):
            return
        batches = RolloutBatch(**jax.tree.map(np.asarray, saved["batches"]))
        self.resumed = [jax.tree.map(lambda x, i=i: x[i], batches) for i in range(self.staleness)]

    def _sampled(self, policy, prompts) -> dict:

        if role() != SAMPLER:
            return self.template
        self.rng, key, _ = step_keys(self.rng, "rollouts", "dropout")  # the recipe's chain
        return self.sample(policy, prompts, key, version=self.version)

    def _exchanged(self, batch: dict) -> dict:
        return exchange(batch, source=SAMPLER)[0]


def everywhere():
    """A placement over every device of every process (`kit.parallel.Placement`), for what
    both roles hold together: checkpoints and the final model."""

    mesh = jax.sharding.Mesh(np.array(jax.devices()), (AXIS,))
    index, count = jax.process_index(), jax.process_count()
    return Placement(mesh, index, count, index, count)


def shared(tree, placement):
    """The trainer's `tree` (arrays on its own devices) on every device of `placement`
    (`everywhere()`): every process calls this."""

    host, _ = exchange(jax.tree.map(np.asarray, tree), source=TRAINER)
    return placement.replicate(host)


def own(tree, placement):
    """A tree on every device of every process (`shared`, a restored checkpoint) on this
    process's own devices (`placement`)."""

    return placement.replicate(jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree))


def _nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))
