"""Which policy sampled a rollout: a fingerprint of the parameters the sampler ran, and a
ledger with which a trainer checks it."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree, UInt32

# Multipliers of the hash: Knuth's 2^32 / golden ratio (odd) for positions, and FNV-1a's
# 32-bit prime and offset basis to fold the leaves in order.
_GOLDEN = 0x9E3779B1
_FNV_PRIME, _FNV_BASIS = 0x01000193, 0x811C9DC5


class StalePolicyError(ValueError):
    """A rollout that was not sampled by a policy version the trainer accepts: too old, from
    the future, without a stamp, or stamped with a fingerprint that is not its version's
    (the sampler did not run the parameters it was said to run)."""


def _bits(leaf) -> jax.Array:
    """A leaf's elements as uint32 words: the bits of each element (two words for 8-byte
    types), widened for narrower types."""
    x = jnp.asarray(leaf)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    bits = jax.dtypes.itemsize_bits(x.dtype)
    if x.dtype == jnp.bool_ or bits < 8:  # int4, uint4: their values, 16 distinct ones
        return x.astype(jnp.int32).view(jnp.uint32)
    if bits >= 32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8-byte types: [..., 2]
    unsigned = jnp.uint8 if bits == 8 else jnp.uint16
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


@jax.jit
def _fingerprint(leaves: list) -> jax.Array:
    digest = jnp.uint32(_FNV_BASIS)
    for number, leaf in enumerate(leaves):
        words = _bits(leaf).ravel()
        position = jax.lax.iota(jnp.uint32, words.size)
        # An odd weight per position: the weighted sum changes whenever one word does.
        weights = (position * jnp.uint32(_GOLDEN) + jnp.uint32(2 * number)) | jnp.uint32(1)
        leaf_digest = jnp.sum(words * weights, dtype=jnp.uint32)
        for part in (jnp.uint32(words.size), leaf_digest):  # the leaf's size, then its words
            digest = (digest ^ part) * jnp.uint32(_FNV_PRIME)
    return digest


def fingerprint(params: PyTree) -> UInt32[Array, ""]:
    r"""A 32-bit fingerprint of a tree of arrays: cheap, exact, and the same wherever it is
    computed.

    Each leaf $\ell$ is read as 32-bit words $w_{\ell,i}$ (its elements' bits; bfloat16 and
    int8 widened, 8-byte types as two words) and summed with an odd weight per position,
    modulo $2^{32}$; the leaves' word counts and sums are folded in tree order (FNV-1a's
    multiply-xor):

    $$
    d_\ell = \sum_i w_{\ell,i}\,\big((\phi\, i + 2\ell) \lor 1\big) \bmod 2^{32},
    \qquad h \leftarrow (h \oplus d_\ell)\, p \bmod 2^{32},
    $$

    with $\phi$ = 0x9E3779B1 and $p$ the FNV prime. Integer sums are associative, so the
    result does not depend on the order of the reduction: the same parameters give the same
    fingerprint on any device count, sharding or process, bit for bit. An odd weight is
    invertible modulo $2^{32}$, so changing any one element (any bit of it) always changes
    the fingerprint; several changes collide with probability about $2^{-32}$. It reads the
    parameters once, as one decode step does.

    Use it to tell which parameters produced a rollout: `tunelib.rollout.sample` and
    `run_episodes` stamp their output with the fingerprint of the parameters they ran when
    given a `policy_version`, and `PolicyLedger` checks the stamp against what the trainer
    handed out. For a base with LoRA adapters (`tunelib.peft.apply_lora`) the base's arrays
    (float or quantised) and the adapters are all read.

    Args:
      params: a pytree of arrays (parameters, adapters, an `nnx.State`, LoRA-wrapped
        weights); any dtype, sharded or not.

    Returns:
      A uint32 scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.rollout import fingerprint
      >>> params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4, jnp.bfloat16)}
      >>> bool(fingerprint(params) == fingerprint({"w": jnp.ones((3, 4)),
      ...                                           "b": jnp.zeros(4, jnp.bfloat16)}))
      True
      >>> nudged = {**params, "w": params["w"].at[2, 1].add(1e-6)}  # one element
      >>> bool(fingerprint(params) == fingerprint(nudged))
      False
    """
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError("fingerprint needs at least one array; the tree has no leaves.")
    return _fingerprint(leaves)


def _hex(value) -> str:
    return f"{int(np.asarray(value)) & 0xFFFFFFFF:#010x}"


class PolicyLedger:
    """The policy versions a trainer has handed to its sampler, by fingerprint: checks that a
    rollout was sampled by a version it accepts, with that version's parameters.

    A trainer calls `record(version, params)` with the parameters it hands to the sampler
    (version = the number of updates behind them), and `check(policy_version, fingerprint,
    version=...)` with a rollout's stamp (`Rollout.policy_version`, `Rollout.fingerprint`)
    before it trains on it. The check fails, with a `StalePolicyError` of one line, when the
    rollout has no stamp, its version is ahead of the trainer's or more than
    `max_staleness` updates behind it, the version was never recorded, or its fingerprint
    is not the recorded one: the sampler ran other parameters than those it was said to run,
    such as adapters that were updated but never delivered to it (the failure of
    verl #7495, https://github.com/volcengine/verl/issues/7495). The message names the
    version whose parameters the sampler did run, when the ledger holds it.

    Only the last `max_staleness + 1` versions are kept (a fingerprint is 4 bytes).

    Args:
      max_staleness: how many updates behind the trainer a rollout's version may be, s >= 0
        (0: synchronous, the version the trainer is at).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.rollout import PolicyLedger, StalePolicyError, fingerprint
      >>> ledger = PolicyLedger(max_staleness=1)
      >>> old, new = {"a": jnp.zeros(3)}, {"a": jnp.ones(3)}
      >>> _ = ledger.record(0, old); _ = ledger.record(1, new)
      >>> ledger.check(1, fingerprint(new), version=1)   # the right parameters: passes
      >>> try:
      ...     ledger.check(1, fingerprint(old), version=1)   # stamped 1, sampled with 0's
      ... except StalePolicyError as e:
      ...     print(str(e).split(",")[0])
      rollout stamped policy version 1 was sampled with the parameters of version 0
    """

    def __init__(self, max_staleness: int = 0):
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int):
            raise TypeError(f"max_staleness must be an int, got {max_staleness!r}.")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be at least 0, got {max_staleness}.")
        self.max_staleness = max_staleness
        self._versions: collections.OrderedDict[int, int] = collections.OrderedDict()

    def record(self, version: int, params: PyTree) -> int:
        """Record that the parameters `params` are policy version `version` (handed to the
        sampler); returns their fingerprint as an int."""
        digest = int(np.asarray(fingerprint(params)))
        self.record_fingerprint(version, digest)
        return digest

    def record_fingerprint(self, version: int, digest) -> None:
        """Record version `version` by a fingerprint already computed (`fingerprint(params)`),
        as a trainer does that computes it where the parameters are."""
        version = int(version)
        if self._versions and version < next(reversed(self._versions)):
            raise ValueError(
                f"policy version {version} recorded after version "
                f"{next(reversed(self._versions))}: versions only go up."
            )
        self._versions[version] = int(np.asarray(digest)) & 0xFFFFFFFF
        while len(self._versions) > self.max_staleness + 1:
            self._versions.popitem(last=False)

    def recorded(self) -> dict[int, int]:
        """The versions it holds (the last `max_staleness + 1` recorded), each with its
        fingerprint as an int, oldest first: what a checkpoint keeps, to record again with
        `record_fingerprint` in a resumed run.

        Examples:
          >>> import jax.numpy as jnp
          >>> from tunelib.rollout import PolicyLedger
          >>> ledger = PolicyLedger(max_staleness=1)
          >>> for v in range(3):
          ...     _ = ledger.record(v, {"a": jnp.full(3, v)})
          >>> list(ledger.recorded())   # the last two
          [1, 2]
        """
        return dict(self._versions)

    def check(self, policy_version, fingerprint, *, version: int) -> None:
        """Raise `StalePolicyError` (one line) unless a rollout stamped `policy_version` and
        `fingerprint` was sampled by a version within `max_staleness` of the trainer's
        `version`, with that version's recorded parameters."""
        if policy_version is None or fingerprint is None:
            raise StalePolicyError(
                "rollout carries no policy stamp: pass policy_version= to the sampler "
                "(tunelib.rollout.sample / run_episodes) so that it records what it ran."
            )
        stamped = int(np.asarray(policy_version))
        digest = int(np.asarray(fingerprint)) & 0xFFFFFFFF
        version = int(version)
        if stamped < 0:
            raise StalePolicyError(
                f"rollout carries policy version {stamped}: it was sampled without "
                "policy_version=, so nothing says which parameters produced it."
            )
        if stamped > version:
            raise StalePolicyError(
                f"rollout of policy version {stamped} is ahead of the trainer's version "
                f"{version}: the trainer and the sampler count updates differently."
            )
        if version - stamped > self.max_staleness:
            raise StalePolicyError(
                f"rollout of policy version {stamped} is {version - stamped} updates behind "
                f"the trainer's version {version}, more than max_staleness="
                f"{self.max_staleness}."
            )
        if stamped not in self._versions:
            raise StalePolicyError(
                f"rollout of policy version {stamped}: the trainer never recorded that "
                f"version (recorded: {list(self._versions) or 'none'})."
            )
        if self._versions[stamped] != digest:
            ran = [v for v, d in self._versions.items() if d == digest]
            what = (
                f"the parameters of version {ran[-1]}"
                if ran
                else f"parameters the trainer never handed out (fingerprint {_hex(digest)})"
            )
            raise StalePolicyError(
                f"rollout stamped policy version {stamped} was sampled with {what}, not "
                f"version {stamped}'s (fingerprint {_hex(self._versions[stamped])}): the "
                "sampler did not run the policy being trained (adapters or weights not "
                "delivered to it?)."
            )


def check_version(policy_version) -> None:
    """`policy_version` is None, an int >= 0, or an integer scalar array (traced or not)."""
    if policy_version is None or isinstance(policy_version, jax.core.Tracer):
        return
    version = np.asarray(policy_version)
    if (
        isinstance(policy_version, bool)
        or version.shape != ()
        or not np.issubdtype(version.dtype, np.integer)
    ):
        raise TypeError(
            "policy_version must be an int (the updates behind the parameters), got "
            f"{policy_version!r}."
        )
    if int(version) < 0:
        raise ValueError(f"policy_version must be at least 0, got {int(version)}.")


def stamp(params: PyTree, policy_version) -> dict:
    """A rollout's stamp (`Rollout.policy_version`, `Rollout.fingerprint`): the version, as
    an int32 scalar, and the fingerprint of `params`."""
    return {
        "policy_version": jnp.asarray(policy_version, jnp.int32),
        "fingerprint": fingerprint(params),
    }
