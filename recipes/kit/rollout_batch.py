"""One batch of scored rollouts, the sampler's to the learner: `RolloutBatch`.

The synchronous recipe keeps it on the devices from the sampler to the update: only the
completions' tokens go to the host, for the verifier's text, and only the scores come back.
The disaggregated recipe moves it between processes as this process's rows on the host
(`local`), and the trainer places what it receives (`placed`); a checkpoint keeps the batches
in flight in that form too.
"""

from typing import Any, NamedTuple

import jax
import numpy as np

# The policy's stamp: host scalars, never split by rows.
_STAMP = ("version", "fingerprint")


class RolloutBatch(NamedTuple):
    """`G` sampled completions of each of `B` prompts, scored, stamped with the policy that
    sampled them. Arrays: global ones on the devices (the sampler's, `placed`'s) or this
    process's rows as NumPy (`local`'s); `routing` and `pixels` are None when absent."""

    prompt_tokens: Any  # [B, P] int32, left-padded; completion_logps repeats them per group
    prompt_where: Any  # [B, P] bool
    tokens: Any  # [B G, N] int32: the completions
    where: Any  # [B G, N] bool: their tokens (EOS included)
    logps: Any  # [B G, N] float32: the sampler's (behaviour) log-probs
    scores: Any  # [B G] float32: the reward before the recipe's mode adds to it
    right: Any  # [B G] bool: the verifier's judgement (measured, whatever the reward)
    lengths: Any  # [B G] int32
    version: Any  # int32 scalar on the host: the policy version that sampled the batch
    fingerprint: Any  # uint32 scalar on the host: that policy's fingerprint
    routing: Any = None  # [B G, P + N, M, k] int32: each token's experts (--replay-routing)
    pixels: Any = None  # {name: [B, ...]}: the prompts' images, as the model reads them

    def local(self, placement) -> "RolloutBatch":
        """This process's rows of every array, as NumPy (every process must call this)."""
        return self._map(placement.local)

    def placed(self, placement) -> "RolloutBatch":
        """The global batch, split by rows over `placement`'s devices, of this process's rows
        (`local`'s form)."""
        return self._map(placement.rows)

    def arrays(self) -> dict:
        """The arrays the learner's batch holds, by name: the stamp left out, the images'
        own names in place of `pixels`."""
        fields = {k: v for k, v in self._asdict().items() if v is not None}
        for name in (*_STAMP, "pixels"):
            fields.pop(name, None)
        return {**fields, **(self.pixels or {})}

    def saved(self) -> dict:
        """Its fields as a dict without the absent ones (`routing`, `pixels`): the form a
        checkpoint keeps; `RolloutBatch(**saved)` is the batch again."""
        return {k: v for k, v in self._asdict().items() if v is not None}

    def _map(self, rows) -> "RolloutBatch":
        """`rows` applied to every array but the stamp, which stays a host scalar."""
        out = {}
        for name, value in self._asdict().items():
            if value is None:
                out[name] = None
            elif name in _STAMP:
                out[name] = np.asarray(value)
            else:
                out[name] = jax.tree.map(rows, value)
        return RolloutBatch(**out)
