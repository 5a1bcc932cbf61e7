"""Sampling on a base plus LoRA adapters, never merged: `sample` and `run_episodes` given
`peft.apply_lora(base, adapters)` for a float base and NF4, int8 and GGUF-block bases.

At temperature 0 the tokens equal those sampled from `peft.merge_lora(base, adapters)`. The
two sum their products in different orders (`xW + s(xA)B` against `x(W + sAB)`), so their
float32 logits differ by a rounding; the claim is deterministic only where no greedy token is
near a tie, which each test checks on the merged model's own logits. No dense copy of an
adapted weight is formed: `peft.MaterializationWarning` is an error throughout.
"""

import itertools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._helpers import assert_close
from tests.rollout.test_episodes import Scripted
from tests.rollout.test_sampler import full_logits, make_model
from tunelib import peft
from tunelib.models import PROJECTION_KERNELS, DecoderConfig
from tunelib.rollout import EpisodeConfig, Role, SamplingConfig, run_episodes, sample

# 256 MLP features: the plain float32 product of `down_proj` on CPU is blocked, which an
# adapted weight must never meet (it would be formed densely).
CONFIG = DecoderConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
# Left-padded and full prompts: the completion's token j is predicted at position P - 1 + j.
PROMPTS = np.array([[0, 0, 5, 9, 3], [7, 1, 4, 4, 8]], np.int32)
PROMPT_WHERE = np.array([[False, False, True, True, True], [True] * 5])
GREEDY = SamplingConfig(max_new_tokens=8, temperature=0.0)
# Far above the float32 rounding between the merged and the un-merged products (~1e-6 here).
MARGIN = 1e-3


def _ggml(params, type_name: str = "Q4_1"):
    def quantise(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if re.fullmatch(PROJECTION_KERNELS, name):
            return peft.ggml_quantize(x, type_name, transpose=True)
        return x

    return jax.tree_util.tree_map_with_path(quantise, params)


BASES = {
    "float": lambda params: params,
    "nf4": lambda params: peft.quantize_params(params, [PROJECTION_KERNELS]),
    "int8": lambda params: peft.quantize_params(params, [PROJECTION_KERNELS], format="int8"),
    "ggml_q4_1": _ggml,
}


def nonzero_adapters(base, seed: int = 0, rank: int = 4):
    """Adapters on every projection with A and B drawn (B = 0 would leave the base as is)."""
    rule = peft.LoraRule(pattern=PROJECTION_KERNELS, rank=rank)
    adapters = peft.init_lora(base, [rule], key=jax.random.key(seed))
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype), adapters
    )


def top_two_gaps(logits, predicted_at):
    """The lead of the largest logit over the runner-up at the positions `[B, N]`."""
    rows = np.arange(logits.shape[0])[:, None]
    top2 = np.sort(np.asarray(logits, np.float64)[rows, predicted_at], axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


@pytest.mark.parametrize("kind", BASES)
def test_unmerged_greedy_tokens_equal_the_merged_ones(kind):
    graphdef, params = make_model(3, CONFIG)
    base = BASES[kind](params)
    adapters = nonzero_adapters(base)
    merged = peft.merge_lora(base, adapters)
    args = (PROMPTS, PROMPT_WHERE, jax.random.key(0), GREEDY)
    with warnings.catch_warnings():
        warnings.simplefilter("error", peft.MaterializationWarning)
        # The merged (plain) program of the same shapes compiles first: the adapted one must
        # not reuse its trace.
        want = sample(graphdef, merged, *args)
        got = sample(graphdef, peft.apply_lora(base, adapters), *args)
        wrapped = peft.lora(sample)(graphdef, peft.apply_lora(base, adapters), *args)
        alone = sample(graphdef, peft.apply_lora(base, adapters), *args)  # compiled once
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(wrapped.tokens, want.tokens)
    np.testing.assert_array_equal(alone.tokens, want.tokens)
    assert_close(got.logps, want.logps, rtol=0, atol=1e-4)
    assert_close(wrapped.logps, got.logps, rtol=0, atol=1e-5)
    sequences = np.concatenate([PROMPTS, np.asarray(want.tokens)], axis=1)
    where = np.concatenate([PROMPT_WHERE, np.asarray(want.where)], axis=1)
    logits = np.asarray(full_logits(graphdef, merged, sequences, where))
    predicted_at = PROMPTS.shape[1] - 1 + np.arange(GREEDY.max_new_tokens)[None]
    np.testing.assert_array_equal(logits.argmax(-1)[:, predicted_at[0]], want.tokens)
    assert top_two_gaps(logits, predicted_at).min() > MARGIN
    # The adapters change what is sampled: the test would see a sampler that dropped them.
    base_tokens = peft.lora(sample)(graphdef, base, *args).tokens
    assert (np.asarray(base_tokens) != np.asarray(want.tokens)).any()


@pytest.fixture(scope="module")
def gguf_base(tiny_gguf_file):
    """The tiny GGUF file's model with its Q8_0 projections and embedding kept, stacked."""
    patterns = [PROJECTION_KERNELS, "embed_tokens/embedding"]
    graphdef, base, _, _ = peft.gguf_base(tiny_gguf_file, patterns=patterns, scan_layers=True)
    return graphdef, base


def test_episodes_on_a_gguf_base_equal_the_merged_ones(gguf_base):
    """Multi-turn episodes (host-side environments between jitted turns, so `run_episodes`
    cannot itself be wrapped by `peft.lora`) on the adapters over a GGUF file's blocks."""
    graphdef, base = gguf_base
    adapters = nonzero_adapters(base, seed=1)
    merged = peft.merge_lora(base, adapters)  # the tied embedding stays in its blocks
    config = EpisodeConfig(
        sampling=SamplingConfig(max_new_tokens=4, temperature=0.0),
        max_turns=3,
        max_tokens=20,
        max_observation_tokens=3,
    )
    args = (PROMPTS, PROMPT_WHERE, jax.random.key(0), config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", peft.MaterializationWarning)
        want = run_episodes(graphdef, merged, *args, [Scripted() for _ in range(2)])
        got = run_episodes(
            graphdef, peft.apply_lora(base, adapters), *args, [Scripted() for _ in range(2)]
        )
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.roles, want.roles)
    assert_close(got.logps, want.logps, rtol=0, atol=1e-4)
    assert int((np.asarray(want.roles) == Role.OBSERVATION).sum()) > 0
    # No near-tie: over the prompt and the episode's real tokens, each model token is the
    # merged model's argmax at the real position before it, ahead by MARGIN.
    sequences = np.concatenate([PROMPTS, np.asarray(want.tokens)], axis=1)
    real = np.concatenate([PROMPT_WHERE, np.asarray(want.context_where)], axis=1)
    logits = np.asarray(peft.lora(full_logits)(graphdef, merged, sequences, real))
    model = np.concatenate([np.zeros_like(PROMPT_WHERE), np.asarray(want.where)], axis=1)
    for row in range(len(PROMPTS)):
        positions = np.flatnonzero(real[row])
        before = {p: q for q, p in itertools.pairwise(positions)}
        targets = np.flatnonzero(model[row])
        at = np.array([before[p] for p in targets])
        np.testing.assert_array_equal(logits[row, at].argmax(-1), sequences[row, targets])
        assert top_two_gaps(logits[row][None], at[None]).min() > MARGIN
