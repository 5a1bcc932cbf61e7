"""Shared prompts in `completion_logps`: each prompt run once for its group of completions,
which attend to its keys and values, gives the log-probs and gradients of the pass over
every prompt and completion concatenated, in every decoder family."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from einops import repeat

from tests._helpers import assert_within_float32_rounding, raises_naming, x64_copies
from tests.models.test_moe import CONFIG as MOE_FIELDS
from tests.rollout.test_completion import PROMPT_WHERE, PROMPTS
from tests.rollout.test_sampler import CONFIG as DENSE
from tests.rollout.test_sampler import float64_twin, make_model
from tunelib import peft
from tunelib.models import PROJECTION_KERNELS, DecoderConfig
from tunelib.rollout import completion_logps

GROUP, NEW = 2, 3
MOE = DecoderConfig(**MOE_FIELDS)
# (config, adapters, replayed routing). The dense decoder unrolled, without adapters, is
# `test_completion`'s; an MoE replays its routing, so that no near tie between the float32
# and float64 passes can pick other experts on some CPU.
CASES = {
    "dense-scanned-lora": (dataclasses.replace(DENSE, scan_layers=True), True, False),
    "moe-scanned-replay": (dataclasses.replace(MOE, scan_layers=True), False, True),
}


def completions(config: DecoderConfig, seed: int = 5):
    """GROUP completions of NEW tokens per prompt of PROMPTS (stopped early or not), per-token
    weights for a loss, and a random routing record: one per prompt for its real and padded
    columns, repeated over its group as the sampler records it, and one per row after it."""
    rng = np.random.default_rng(seed)
    rows, prompt_len = len(PROMPTS) * GROUP, PROMPTS.shape[1]
    tokens = rng.integers(0, config.vocab_size, (rows, NEW))
    where = np.cumprod(rng.random(tokens.shape) < 0.8, axis=1).astype(bool)
    where[:, 0] = True
    weights = rng.standard_normal(tokens.shape)
    moe, k = sum(config.moe_layers), config.num_experts_per_tok

    def experts(*shape):
        draws = rng.random((*shape, moe, config.num_experts))
        return np.argsort(draws, axis=-1)[..., :k].astype(np.int32)  # k distinct experts

    prompt_routing = repeat(experts(len(PROMPTS), prompt_len), "b p m k -> (b g) p m k", g=GROUP)
    routing = np.concatenate([prompt_routing, experts(rows, NEW)], axis=1)
    return tokens, where, weights, routing


def loss(graphdef, share, lora, params, adapters, arrays):
    """A weighted sum of the log-probs and entropies, under adapters when `lora`."""
    prompts, prompt_where, tokens, where, weights, routing = arrays
    score = peft.lora(completion_logps) if lora else completion_logps
    if lora:
        params = peft.apply_lora(params, adapters)
    logps, entropy = score(
        graphdef, params, prompts, prompt_where, tokens, where, temperature=0.7,
        with_entropy=True, share_prompts=share, routing=routing,
    )  # fmt: skip
    return (weights * logps).sum() + 0.1 * entropy.sum(), (logps, entropy)


run = jax.jit(jax.value_and_grad(loss, argnums=(3, 4), has_aux=True), static_argnums=(0, 1, 2))


@pytest.mark.parametrize(("config", "lora", "replay"), CASES.values(), ids=CASES.keys())
def test_equal_the_concatenated_pass_in_values_and_gradients(config, lora, replay):
    """Log-probs, entropies and the gradients with respect to the parameters (and the LoRA
    adapters) of GROUP completions after each of prompts padded to different lengths. The two
    passes sum in different orders (the completions' attention over the cache), so in
    float32 they agree to a rounding whose size depends on the CPU: the shared pass is held
    within 4x the concatenated pass's distance from the same weights in float64. (The shared
    pass does not run in float64: under x64 the cache's index and slice starts mix int32 and
    int64.)"""
    graphdef, params = make_model(seed=3, config=config)
    tokens, where, weights, routing = completions(config)
    arrays = (PROMPTS, PROMPT_WHERE, tokens, where, weights, routing if replay else None)
    adapters = None
    if lora:
        rules = [peft.LoraRule(pattern=PROJECTION_KERNELS, rank=2)]
        adapters = peft.init_lora(params, rules, key=jax.random.key(0))
        rng = np.random.default_rng(1)  # B != 0, so the adapters change the values
        adapters = jax.tree.map(
            lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype), adapters
        )
    shared = run(graphdef, True, lora, params, adapters, arrays)
    full = run(graphdef, False, lora, params, adapters, arrays)
    graphdef64, params64 = float64_twin(params, config)
    with jax.enable_x64(True):
        adapters64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), adapters)
        arrays64 = (*x64_copies(*arrays[:5]), arrays[5])
        exact = run(graphdef64, False, lora, params64, adapters64, arrays64)
    assert {x.dtype for x in jax.tree.leaves(exact)} == {jnp.dtype(jnp.float64)}
    assert {x.dtype for x in jax.tree.leaves((shared, full))} == {jnp.dtype(jnp.float32)}
    assert_within_float32_rounding(shared, full, exact)
    (_, (logps, _)), grads = shared
    assert np.all(np.asarray(logps)[~where] == 0) and not where.all()
    assert len(jax.tree.leaves(grads)) == len(jax.tree.leaves((params, adapters)))


def test_a_groups_prompt_routing_must_be_one_record():
    """A concrete routing whose rows of one group send a real prompt token to other experts
    is refused with shared prompts; at a padded prompt token, or per row without sharing, it
    is accepted."""
    config = MOE
    graphdef, params = make_model(seed=3, config=config)
    tokens, where, _, routing = completions(config)
    data = (PROMPTS, PROMPT_WHERE, tokens, where)

    def shape(routing, share=True):  # traced parameters, a concrete routing: checked
        def score(params):
            return completion_logps(graphdef, params, *data, routing=routing, share_prompts=share)

        return jax.eval_shape(score, params).shape

    padded = routing.copy()  # prompt 0's first column is padding
    padded[1, 0] = padded[1, 0, :, ::-1]
    assert shape(padded) == tokens.shape
    real = routing.copy()  # prompt 1's last token, in the second row of its group
    chosen = real[GROUP + 1, -NEW - 1, 0]
    real[GROUP + 1, -NEW - 1, 0] = np.setdiff1d(np.arange(config.num_experts), chosen)[:2]
    with raises_naming("routing", "prompt 1", "share_prompts=False"):
        completion_logps(graphdef, params, *data, routing=real)
    assert shape(real, share=False) == tokens.shape
