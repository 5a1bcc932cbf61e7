"""Which policy sampled a rollout: `fingerprint`, the stamps of `sample` and `run_episodes`,
and `PolicyLedger`, which catches a sampler that was not given the policy being trained."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tests._helpers import own_checks
from tests.rollout.test_episodes import Scripted
from tests.rollout.test_lora_sampling import CONFIG, PROMPT_WHERE, PROMPTS
from tests.rollout.test_sampler import make_model
from tunelib import peft
from tunelib.models import PROJECTION_KERNELS
from tunelib.rollout import (
    EpisodeConfig,
    PolicyLedger,
    SamplingConfig,
    StalePolicyError,
    fingerprint,
    run_episodes,
    sample,
)

SAMPLING = SamplingConfig(max_new_tokens=4, temperature=1.0)


def numpy_fingerprint(leaves: list[np.ndarray]) -> int:
    """The documented formula, in Python integers reduced modulo 2^32 (independent of JAX)."""
    mask = 0xFFFFFFFF
    digest = 0x811C9DC5
    for number, leaf in enumerate(leaves):
        leaf = np.asarray(leaf)
        if leaf.dtype == np.bool_:
            words = leaf.astype(np.uint32).ravel()
        elif leaf.dtype.itemsize == 4 or leaf.dtype.itemsize == 8:
            words = leaf.view(np.uint32).ravel()
        else:
            words = leaf.view({1: np.uint8, 2: np.uint16}[leaf.dtype.itemsize]).ravel()
        total = 0
        for i, w in enumerate(words.tolist()):
            total += int(w) * (((0x9E3779B1 * i + 2 * number) & mask) | 1)
        for part in (words.size & mask, total & mask):
            digest = ((digest ^ part) * 0x01000193) & mask
    return digest


# Fixed shapes: each new shape would compile the fingerprint again; the values vary.
@given(
    hnp.arrays(np.float32, (3, 5)),
    hnp.arrays(np.int8, (7,)),
    st.booleans(),
)
def test_fingerprint_is_the_documented_hash(floats, ints, flag):
    leaves = [floats, ints, np.array([flag, not flag])]
    assert int(fingerprint(leaves)) == numpy_fingerprint(leaves)


def test_fingerprint_of_bfloat16_and_float64_words():
    halves = np.arange(12, dtype=np.float32).astype(jnp.bfloat16).reshape(3, 4)
    got = int(fingerprint([jnp.asarray(halves)]))
    assert got == numpy_fingerprint([halves.view(np.uint16)])
    with jax.enable_x64(True):
        doubles = np.linspace(-1, 1, 6)
        assert int(fingerprint([jnp.asarray(doubles)])) == numpy_fingerprint([doubles])


@given(st.integers(0, 59), st.integers(0, 31), st.sampled_from(["float32", "bfloat16", "int8"]))
def test_changing_any_one_element_changes_the_fingerprint(position, bit, dtype):
    """An odd weight is invertible modulo 2^32: no single change can cancel."""
    x = np.random.default_rng(0).standard_normal(60).astype(np.float32).astype(dtype)
    width = x.dtype.itemsize * 8
    words = x.view({8: np.uint8, 16: np.uint16, 32: np.uint32}[width]).copy()
    words[position] ^= np.array(1 << (bit % width), words.dtype)
    changed = words.view(x.dtype).reshape(6, 10)
    assert int(fingerprint({"w": x.reshape(6, 10)})) != int(fingerprint({"w": changed}))


def test_fingerprint_is_the_same_however_the_arrays_are_sharded():
    """Integer sums do not depend on the reduction order: bit-equal across layouts."""
    params = make_model()[1]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))

    def shard(x):
        spec = PartitionSpec(*(["a", "b"][: min(x.ndim, 2)]))
        divisible = all(x.shape[i] % mesh.shape[name] == 0 for i, name in enumerate(spec))
        return jax.device_put(x, NamedSharding(mesh, spec if divisible else PartitionSpec()))

    assert int(fingerprint(params)) == int(fingerprint(jax.tree.map(shard, params)))


def test_fingerprint_sees_sizes_and_refuses_an_empty_tree():
    assert int(fingerprint([jnp.zeros(3)])) != int(fingerprint([jnp.zeros(4)]))
    with pytest.raises(ValueError, match="no leaves"):
        fingerprint({})


def _lora(seed: int = 0):
    graphdef, base = make_model(0, CONFIG)
    rule = peft.LoraRule(pattern=PROJECTION_KERNELS, rank=4, alpha=8.0)
    adapters = peft.init_lora(base, [rule], key=jax.random.key(seed))
    # init_lora's B is zero: give the adapters a value, as training would.
    adapters = jax.tree.map(lambda x: x + 0.01 * (1 + seed), adapters)
    return graphdef, base, adapters


def test_sample_stamps_the_parameters_it_ran():
    graphdef, base, adapters = _lora()
    policy = peft.apply_lora(base, adapters)
    out = sample(graphdef, policy, PROMPTS, PROMPT_WHERE, jax.random.key(0), SAMPLING,
                 policy_version=3)  # fmt: skip
    assert out.policy_version.dtype == jnp.int32 and int(out.policy_version) == 3
    assert int(out.fingerprint) == int(fingerprint(policy))
    assert int(out.fingerprint) != int(fingerprint(peft.apply_lora(base, _lora(1)[2])))
    unstamped = sample(graphdef, policy, PROMPTS, PROMPT_WHERE, jax.random.key(0), SAMPLING)
    assert unstamped.policy_version is None and unstamped.fingerprint is None
    np.testing.assert_array_equal(unstamped.tokens, out.tokens)  # the stamp changes nothing


def test_run_episodes_stamps_the_parameters_it_ran():
    graphdef, params = make_model(0, CONFIG)
    config = EpisodeConfig(
        sampling=SamplingConfig(max_new_tokens=3, temperature=1.0), max_turns=2,
        max_tokens=12, max_observation_tokens=2,
    )  # fmt: skip
    environments = [Scripted((2,)) for _ in range(2)]
    out = run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(1), config,
                       environments, policy_version=7)  # fmt: skip
    assert int(out.policy_version) == 7 and int(out.fingerprint) == int(fingerprint(params))


@pytest.mark.parametrize("version", [-1, 1.5, True, "2", np.array([1, 2])])
def test_a_bad_policy_version_is_refused_before_sampling(version):
    graphdef, params = make_model(0, CONFIG)
    with own_checks(), pytest.raises((TypeError, ValueError), match="policy_version"):
        sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0), SAMPLING,
               policy_version=version)  # fmt: skip


class _Sync:
    """A weight sync to the sampler with the bug of verl #7495 when `deliver_once`: the
    adapters reach the sampler at the first push only, so later rollouts run the initial
    adapters while the trainer goes on updating its own."""

    def __init__(self, deliver_once: bool):
        self.deliver_once, self.adapters = deliver_once, None

    def push(self, adapters):
        if self.adapters is None or not self.deliver_once:
            self.adapters = adapters


@pytest.mark.parametrize("deliver_once", [False, True])
def test_the_ledger_catches_adapters_that_never_reach_the_sampler(deliver_once):
    """Three steps of a LoRA trainer: record the adapters handed out, sample on what the
    sampler holds, check the stamp, update. With a sync that delivers once, step 1's
    rollout ran step 0's adapters, and the check says so in one line."""
    graphdef, base, adapters = _lora()
    ledger, sync = PolicyLedger(), _Sync(deliver_once)
    for step in range(3):
        ledger.record(step, peft.apply_lora(base, adapters))
        sync.push(adapters)
        out = sample(graphdef, peft.apply_lora(base, sync.adapters), PROMPTS, PROMPT_WHERE,
                     jax.random.key(step), SAMPLING, policy_version=step)  # fmt: skip
        if deliver_once and step == 1:
            with pytest.raises(StalePolicyError) as caught:
                ledger.check(out.policy_version, out.fingerprint, version=step)
            message = str(caught.value)
            assert "\n" not in message
            assert "policy version 1 was sampled with parameters the trainer never" in message
            return
        ledger.check(out.policy_version, out.fingerprint, version=step)
        adapters = jax.tree.map(lambda x: x - 1e-3 * jnp.sign(x), adapters)  # an update
    assert not deliver_once


def test_the_ledger_names_the_version_a_stale_sampler_ran():
    """Within the staleness window the ledger still holds the old version, and names it."""
    ledger = PolicyLedger(max_staleness=2)
    versions = [{"a": jnp.full(3, float(v))} for v in range(3)]
    for v, params in enumerate(versions):
        ledger.record(v, params)
    ledger.check(1, fingerprint(versions[1]), version=2)  # one behind, the right weights
    with pytest.raises(StalePolicyError, match="parameters of version 0, not version 2's"):
        ledger.check(2, fingerprint(versions[0]), version=2)


@pytest.mark.parametrize(
    ("stamp", "version", "match"),
    [
        ((None, None), 0, "carries no policy stamp"),
        ((-1, 0), 0, "sampled without policy_version"),
        ((3, 0), 2, "ahead of the trainer's version 2"),
        ((0, 0), 2, "2 updates behind the trainer's version 2, more than max_staleness=1"),
    ],
)
def test_the_ledger_refuses_in_one_line(stamp, version, match):
    ledger = PolicyLedger(max_staleness=1)
    for v in range(version + 1):
        ledger.record(v, {"a": jnp.full(2, float(v))})
    policy_version, digest = stamp
    digest = None if digest is None else int(fingerprint({"a": jnp.zeros(2)}))
    with pytest.raises(StalePolicyError, match=match) as caught:
        ledger.check(policy_version, digest, version=version)
    assert "\n" not in str(caught.value)


def test_the_ledger_keeps_only_its_window_and_versions_only_go_up():
    ledger = PolicyLedger(max_staleness=1)
    for v in range(4):
        ledger.record(v, {"a": jnp.full(2, float(v))})
    assert list(ledger._versions) == [2, 3]
    fresh = PolicyLedger(max_staleness=1)
    fresh.record(5, {"a": jnp.zeros(2)})  # a trainer resumed at version 5
    with pytest.raises(StalePolicyError, match=r"never recorded that version \(recorded: \[5\]"):
        fresh.check(4, fingerprint({"a": jnp.zeros(2)}), version=5)
    with pytest.raises(ValueError, match="versions only go up"):
        ledger.record(1, {"a": jnp.zeros(2)})
    with pytest.raises(ValueError, match="at least 0"):
        PolicyLedger(max_staleness=-1)
    with own_checks(), pytest.raises(TypeError, match="max_staleness must be an int"):
        PolicyLedger(max_staleness=1.0)
