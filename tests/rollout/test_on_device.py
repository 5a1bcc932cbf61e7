"""The KV-cache sampler on the accelerator: greedy decoding against the argmax of a full
forward pass of the same model, and its behaviour log-probs against float64; partial
rollouts (`continue_rollout`), each token against the pass of the weights that drew it.

Part of the accelerator tier (docs/tpu.md): skipped where JAX has no GPU or TPU.
"""

import jax
import numpy as np
import pytest

from tests._accelerator import on_host
from tests._precision import assert_within, elementwise_errors, softmax, softmax_errors
from tests.rollout.test_sampler import (
    PROMPT_WHERE,
    PROMPTS,
    completion_logits,
    float64_twin,
    make_model,
)
from tunelib.models import DecoderConfig
from tunelib.rollout import SamplingConfig, continue_rollout, sample

pytestmark = pytest.mark.accelerator

# A float32 decoder with grouped-query attention, its weights large enough for peaked
# next-token distributions (`make_model`).
CONFIG = DecoderConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    use_qk_norm=True,
)
STEPS = 48


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_greedy_decoding_is_the_argmax_of_the_full_forward_pass(precision):
    """48 greedy tokens for each of three prompts (left-padded, full, right-padded) from the
    cached prefill and decode loop, each the argmax of an uncached forward pass where the
    passes' rounding cannot decide otherwise (`assert_each_token_is_its_weights_argmax`)."""
    graphdef, params = make_model(0, CONFIG)
    greedy = SamplingConfig(max_new_tokens=STEPS, temperature=0.0)
    with jax.default_matmul_precision(precision):
        out = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0), greedy)
    assert np.asarray(out.where).all()
    assert_each_token_is_its_weights_argmax(graphdef, [params], out, np.zeros(out.tokens.shape),
                                            precision)  # fmt: skip


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_partial_rollouts_take_each_token_from_the_weights_of_its_segment(precision):
    """Greedy partial rollouts: 16 tokens with one model's weights, then 32 with another's
    (`continue_rollout`, the prompt and the tokens so far prefilled again under the new
    weights), checked as the sampler is above, each token against the full pass of the
    weights that drew it."""
    graphdef, old = make_model(0, CONFIG)
    _, new = make_model(1, CONFIG)
    greedy = SamplingConfig(max_new_tokens=STEPS, temperature=0.0)
    with jax.default_matmul_precision(precision):
        out = None
        for version, (params, steps) in enumerate([(old, 16), (new, STEPS - 16)]):
            out = continue_rollout(graphdef, params, PROMPTS, PROMPT_WHERE, out,
                                   jax.random.key(version), greedy, steps=steps,
                                   policy_version=version)  # fmt: skip
    versions = np.asarray(out.token_versions)
    assert np.asarray(out.where).all() and (versions == (np.arange(STEPS) >= 16)).all()
    assert_each_token_is_its_weights_argmax(graphdef, [old, new], out, versions, precision)


def assert_each_token_is_its_weights_argmax(graphdef, weights, out, versions, precision):
    """Greedy `out`, token t drawn by `weights[versions[t]]`, against one uncached forward
    pass of each of `weights` over the prompts and those tokens, on the accelerator at
    `precision` and in float64 on the host.

    The decoder's rounding is not derived from its operands (norms, attention and products
    in a chain); it is measured: E, the largest distance of the accelerator's full pass from
    the float64 pass. The cached pass computes the same function with the same products in
    another order, so its logits are taken to be within 2E of float64. Then each greedy token
    is a float64 argmax up to 2 (2E); where the float64 top two are further apart than that,
    it is the argmax of both passes; and its log-prob is within the log-softmax bound of
    2 (2E) (`tests._precision`) of the float64 one. With float32 products ("highest") most
    steps are that far apart; at the default precision (one bfloat16 pass on a TPU) the
    decoder's rounding is of the size of many of this model's gaps (on a v5e 35 % of the
    steps were further apart than 4E), and only those steps are held to the argmax."""
    tokens, versions = np.asarray(out.tokens), np.asarray(versions)
    assert tokens.shape == (len(PROMPTS), STEPS)
    with jax.default_matmul_precision(precision):  # the accelerator's full passes
        passes = [completion_logits(graphdef, params, out) for params in weights]
    exacts = []
    with on_host():
        for params in weights:
            model64 = float64_twin(jax.device_get(params), CONFIG)
            with jax.enable_x64(True):
                exacts.append(completion_logits(*model64, out))
    measured = max(float(np.abs(p - e).max()) for p, e in zip(passes, exacts, strict=True))
    delta = 2 * measured  # the cached pass's logits, taken to be within this of float64
    # Each token's logits: those of the weights that drew it.
    pick = versions[..., None] == np.arange(len(weights))[:, None, None, None]
    exact = np.select(list(pick), exacts)
    logits = np.select(list(pick), passes)

    chosen = np.take_along_axis(exact, tokens[..., None], -1)[..., 0]
    assert np.all(chosen >= exact.max(-1) - 2 * delta)
    top2 = np.sort(exact, axis=-1)[..., -2:]
    decided = top2[..., 1] - top2[..., 0] > 2 * delta
    assert decided.mean() > 0.5 if precision == "highest" else decided.any(), decided.mean()
    argmax = exact.argmax(-1)
    np.testing.assert_array_equal(tokens[decided], argmax[decided])
    np.testing.assert_array_equal(logits.argmax(-1)[decided], argmax[decided])

    sm = softmax(exact.reshape(-1, CONFIG.vocab_size))
    errors = softmax_errors(sm, delta, elementwise_errors(), tiles=1)
    rows = np.arange(tokens.size)
    assert_within(
        np.asarray(out.logps).reshape(-1),
        sm.logp[rows, tokens.reshape(-1)],
        errors.logp[rows, tokens.reshape(-1)],
        what="behaviour log-probs",
    )
