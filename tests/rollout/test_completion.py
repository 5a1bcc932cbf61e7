"""`completion_logps`: the log-probs of completions after their prompts, under any params."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._helpers import (
    assert_close,
    assert_traced_once,
    assert_within_float32_rounding,
    own_checks,
    raises_naming,
    x64_copies,
)
from tests.rollout.test_sampler import float64_twin, full_logits, make_model
from tunelib import peft
from tunelib.models import PROJECTION_KERNELS
from tunelib.rollout import SamplingConfig, completion_logps, sample

# Left-padded prompts of 3, 5 and 1 real tokens, and a right-padded one.
PROMPTS = np.array([[0, 0, 5, 9, 3], [7, 1, 4, 4, 8], [0, 0, 0, 0, 6], [6, 11, 2, 0, 0]])
PROMPT_WHERE = np.array(
    [[False, False, True, True, True], [True] * 5, [False] * 4 + [True], [True] * 3 + [False] * 2]
)
# Completions as the sampler leaves them: stopped (then padding), full, stopped, stopped.
TOKENS = np.array([[4, 2, 0, 0], [9, 9, 1, 3], [5, 2, 0, 0], [3, 7, 10, 2]])
WHERE = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], bool)

score = jax.jit(
    completion_logps, static_argnums=0, static_argnames=("with_entropy", "implementation")
)


@pytest.fixture(scope="module")
def model():
    return make_model(seed=2)


@pytest.fixture(scope="module")
def model64(model):
    """`model`'s weights in a float64 decoder (use under `jax.enable_x64`)."""
    return float64_twin(model[1])


def naive(graphdef, params, prompts, prompt_where, tokens, where, temperature):
    """Log-probs and entropies from the full `[R, P + N, V]` logits, in float64, with each
    completion token's predictor found by a loop over the columns."""
    p, n = prompts.shape[1], tokens.shape[1]
    both = np.concatenate([prompts, tokens], 1)
    real = np.concatenate([prompt_where, where], 1)
    logits = np.asarray(full_logits(graphdef, params, both, real), np.float64) / temperature
    logps = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))[..., None]
    logps -= logits.max(-1, keepdims=True)
    out, entropy = np.zeros(tokens.shape), np.zeros(tokens.shape)
    for r in range(len(tokens)):
        for j in range(n):
            if not where[r, j]:
                continue
            source = max(s for s in range(p + j) if real[r, s])
            out[r, j] = logps[r, source, tokens[r, j]]
            entropy[r, j] = -(np.exp(logps[r, source]) * logps[r, source]).sum()
    return out, entropy


def test_equals_the_full_logits_for_prompts_padded_either_side(model64):
    graphdef, params = model64
    arrays = x64_copies(PROMPTS, PROMPT_WHERE, TOKENS, WHERE)
    with jax.enable_x64(True):
        logps, entropy = score(graphdef, params, *arrays, temperature=0.7, with_entropy=True)
        want, want_entropy = naive(graphdef, params, *arrays, 0.7)
    assert logps.dtype == jnp.float64 and logps.shape == TOKENS.shape
    assert_close(logps, want, rtol=1e-12, atol=1e-12)
    assert_close(entropy, want_entropy, rtol=1e-12, atol=1e-12)
    # Masked positions are exactly 0; the peaked model makes the values far from uniform.
    assert np.all(np.asarray(logps)[~WHERE] == 0) and np.all(np.asarray(entropy)[~WHERE] == 0)
    assert np.ptp(want[WHERE]) > 1.0


def test_recomputes_the_samplers_logps_of_a_group(model, model64):
    """The sampler's float32 log-probs are `completion_logps`'. The two sum in different
    orders, so they agree to float32 rounding: the sampler's are held within 4x
    `completion_logps`' distance from the same weights in float64. (The sampler does not run
    in float64: under x64 its cache index and slice starts mix int32 and int64.)"""
    graphdef, params = model
    config = SamplingConfig(max_new_tokens=5, temperature=0.7, top_k=6, stop_tokens=(2,))
    out = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(3), config, group_size=2)
    logps = score(graphdef, params, PROMPTS, PROMPT_WHERE, out.tokens, out.where, temperature=0.7)
    repeated = np.repeat(PROMPTS, 2, 0), np.repeat(PROMPT_WHERE, 2, 0)
    with jax.enable_x64(True):
        exact = score(*model64, *repeated, out.tokens, out.where, temperature=0.7)
    assert logps.dtype == jnp.float32 and exact.dtype == jnp.float64
    assert_within_float32_rounding(out.logps, logps, exact)
    assert not np.asarray(out.where).all()  # some completions stopped early


def test_integer_masks_jit_and_no_recompilation(model):
    graphdef, params = model
    expected = score(graphdef, params, PROMPTS, PROMPT_WHERE, TOKENS, WHERE, temperature=0.7)
    assert expected.dtype == jnp.float32 and expected.shape == TOKENS.shape

    def fn(params, tokens, where, temperature):
        return completion_logps(
            graphdef, params, PROMPTS, PROMPT_WHERE.astype(np.int32), tokens, where,
            temperature=temperature,
        )  # fmt: skip

    # Ids under the mask are ignored, whatever they are.
    masked_changed = np.where(WHERE, TOKENS, 23)
    jitted = jax.jit(fn)
    got = jitted(params, masked_changed, WHERE.astype(np.int32), jnp.float32(0.7))
    assert_close(got, expected, rtol=0, atol=1e-6)
    rng = np.random.default_rng(0)
    calls = [
        ((params, rng.integers(0, 24, TOKENS.shape), rng.random(TOKENS.shape) < 0.7, t), {})
        for t in (jnp.float32(0.5), jnp.float32(1.3))
    ]
    assert_traced_once(fn, calls)


def test_under_lora_equals_the_merged_weights(model64):
    """In float64: x W + s (x A) B and x (W + s A B) agree to rounding there, while in float32
    their orders of summation differ by a CPU-dependent rounding."""
    graphdef, params = model64
    rules = [peft.LoraRule(pattern=PROJECTION_KERNELS, rank=2)]
    rng = np.random.default_rng(1)
    arrays = x64_copies(PROMPTS, PROMPT_WHERE, TOKENS, WHERE)

    def loss(adapters, adapted):
        if adapted:
            logps = peft.lora(completion_logps)(
                graphdef, peft.apply_lora(params, adapters), *arrays
            )
        else:
            logps = completion_logps(graphdef, peft.merge_lora(params, adapters), *arrays)
        return -logps.sum(), logps

    with jax.enable_x64(True):
        adapters = peft.init_lora(params, rules, key=jax.random.key(0))
        adapters = jax.tree.map(lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape)), adapters)
        run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
        (value, logps), grads = run(adapters, True)
        (merged_value, merged_logps), merged_grads = run(adapters, False)
        base = score(graphdef, params, *arrays)
    assert logps.dtype == jnp.float64
    assert_close(logps, merged_logps, rtol=1e-12, atol=1e-12)
    assert_close(value, merged_value, rtol=1e-12)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(merged_grads), strict=True):
        assert a.dtype == jnp.float64
        assert_close(a, b, rtol=1e-10, atol=1e-12 * float(np.abs(b).max()))
    assert float(np.abs(np.asarray(logps) - np.asarray(base)).max()) > 1e-2


def test_errors_name_the_argument(model):
    graphdef, params = model
    args = (graphdef, params, PROMPTS, PROMPT_WHERE)
    with raises_naming("tokens", "5", "4"):
        completion_logps(*args, TOKENS[:3], WHERE[:3])  # 3 rows for 4 prompts
    with own_checks():
        with raises_naming("where", "(4, 3)", error=ValueError):
            completion_logps(*args, TOKENS, WHERE[:, :3])
        with raises_naming("prompt_where", error=ValueError):
            completion_logps(graphdef, params, PROMPTS, PROMPT_WHERE[:, :2], TOKENS, WHERE)
        with raises_naming("tokens", error=ValueError):
            completion_logps(*args, TOKENS[0], WHERE[0])
        with raises_naming("implementation", error=ValueError):
            completion_logps(*args, TOKENS, WHERE, implementation="fast")


def test_shared_prompts_equal_the_concatenated_pass_in_values_and_gradients(model, model64):
    """G = 3 completions per prompt: each prompt run once into a KV cache gives the log-probs,
    entropies and parameter gradients of one pass over every prompt and completion
    concatenated (and the float64 reference's values), for fewer FLOPs. The two passes sum
    in different orders, so in float32 they agree to a rounding whose size depends on the CPU
    (on this one an entropy moved by 0.9 of a fixed 1e-5): the shared pass is held within 4x
    the concatenated pass's distance from float64. (Sharing prompts does not run in float64:
    under x64 the cache's index and slice starts mix int32 and int64.)"""
    group, rng = 3, np.random.default_rng(4)
    tokens = rng.integers(0, 24, (len(PROMPTS) * group, 4))
    where = np.cumprod(rng.random(tokens.shape) < 0.8, axis=1).astype(bool)
    where[:, 0] = True
    weights = rng.standard_normal(tokens.shape)

    # The arrays are arguments, and the float64 run's are copies: a NumPy array that a jitted
    # function closes over, or that it is given, keeps the dtype it got in the first mode.
    def loss(graphdef, params, share, arrays):
        prompts, prompt_where, tokens, where, weights = arrays
        logps, entropy = completion_logps(
            graphdef, params, prompts, prompt_where, tokens, where, temperature=0.7,
            with_entropy=True, share_prompts=share,
        )  # fmt: skip
        return (weights * logps).sum() + 0.1 * entropy.sum(), (logps, entropy)

    arrays = (PROMPTS, PROMPT_WHERE, tokens, where, weights)
    run = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True), static_argnums=(0, 2))
    shared, full = run(*model, True, arrays), run(*model, False, arrays)
    arrays64 = x64_copies(*arrays)
    with jax.enable_x64(True):
        exact = run(*model64, False, arrays64)
        repeated = np.repeat(PROMPTS, group, 0), np.repeat(PROMPT_WHERE, group, 0)
        want, want_entropy = naive(*model64, *repeated, *arrays64[2:4], 0.7)
    (_, (exact_logps, exact_entropy)), _ = exact
    assert exact_logps.dtype == jnp.float64
    assert_close(exact_logps, want, rtol=1e-12, atol=1e-12)
    assert_close(exact_entropy, want_entropy, rtol=1e-12, atol=1e-12)
    assert {x.dtype for x in jax.tree.leaves((shared, full))} == {jnp.dtype(jnp.float32)}
    assert_within_float32_rounding(shared, full, exact)
    logps = np.asarray(shared[0][1][0])
    assert np.all(logps[~where] == 0) and not where.all()

    def flops(share):
        compiled = jax.jit(loss, static_argnums=(0, 2)).lower(*model, share, arrays).compile()
        analysis = compiled.cost_analysis()
        return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]

    assert flops(True) < flops(False)
