"""`continue_rollout`: completions sampled a segment at a time, new weights between segments
(partial rollouts), every token tagged with the version that drew it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._helpers import own_checks, raises_naming
from tests.rollout.test_sampler import (
    PROMPT_WHERE,
    PROMPTS,
    assert_no_near_ties,
    completion_logits,
    make_model,
)
from tunelib.rollout import (
    SamplingConfig,
    completion_logps,
    continue_rollout,
    fingerprint,
    oldest_versions,
    sample,
)

BUDGET = 6
# float32: a prefill and a cached decode step sum in different orders (about 1e-6 here).
ROUNDING = 1e-5
GREEDY = SamplingConfig(max_new_tokens=BUDGET, temperature=0.0)
KEY = jax.random.key(0)


def greedy_with_a_stop():
    """Greedy decoding with a stop token that ends the first row's completion and no other
    row's (each row's tokens as one `sample` call draws them), and the first row's length."""
    graphdef, params = make_model()
    tokens = np.asarray(sample(graphdef, params, PROMPTS, PROMPT_WHERE, KEY, GREEDY).tokens)
    first = next(
        j
        for j in range(1, BUDGET - 1)
        if tokens[0, j] not in tokens[0, :j] and tokens[0, j] not in tokens[1:]
    )
    stop = int(tokens[0, first])
    return SamplingConfig(max_new_tokens=BUDGET, temperature=0.0, stop_tokens=(stop,)), first + 1


def segments(graphdef, weights, config, *, steps, versions=None, keys=None, group_size=1):
    """The rollout continued once per entry of `weights`, `steps` tokens at most each."""
    keys = range(len(weights)) if keys is None else keys
    versions = [None] * len(weights) if versions is None else versions
    out = None
    for params, key, version in zip(weights, keys, versions, strict=True):
        out = continue_rollout(
            graphdef, params, PROMPTS, PROMPT_WHERE, out, jax.random.key(key), config,
            steps=steps, group_size=group_size, policy_version=version,
        )  # fmt: skip
    return out


@pytest.mark.parametrize("group_size", [1, 2])
def test_segments_with_the_same_weights_are_one_sample_call(group_size):
    graphdef, params = make_model()
    config, stopped = greedy_with_a_stop()
    whole = sample(graphdef, params, PROMPTS, PROMPT_WHERE, KEY, config, group_size=group_size)
    firsts = whole._replace(tokens=whole.tokens[::group_size], where=whole.where[::group_size])
    assert_no_near_ties(graphdef, params, firsts)  # greedy tokens, not rounding's
    parts = segments(graphdef, [params] * 3, config, steps=2, group_size=group_size)
    for field in ("tokens", "where", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(parts, field), getattr(whole, field), field)
    np.testing.assert_allclose(parts.logps, whole.logps, atol=ROUNDING)
    # The first row stopped early; the others used the whole budget.
    assert np.asarray(parts.lengths)[0] == stopped < BUDGET and not np.asarray(parts.truncated)[0]
    assert np.asarray(parts.truncated)[group_size:].all()
    assert parts.token_versions is None and parts.policy_version is None


def test_each_token_is_drawn_by_the_weights_of_its_segment():
    graphdef, old = make_model(0)
    _, new = make_model(1)
    config = SamplingConfig(max_new_tokens=BUDGET, temperature=0.0)
    out = segments(graphdef, [old, new], config, steps=2, versions=[3, 4])
    # Greedy: the first two tokens are the old model's argmax, the rest the new one's, over
    # the prompt and the tokens before them (one uncached forward pass of each model), each
    # ahead of the runner-up by more than the passes' rounding (as `assert_no_near_ties`).
    tokens = np.asarray(out.tokens)
    for params, drawn in ((old, slice(0, 2)), (new, slice(2, 4))):
        logits = completion_logits(graphdef, params, out)[:, drawn]
        np.testing.assert_array_equal(tokens[:, drawn], logits.argmax(-1))
        top2 = np.sort(logits, axis=-1)[..., -2:]
        assert (top2[..., 1] - top2[..., 0]).min() > 1e-3
    # Only two segments of two tokens: the completions are unfinished, and not truncated.
    assert np.asarray(out.lengths).tolist() == [4, 4, 4] and not np.asarray(out.truncated).any()
    np.testing.assert_array_equal(out.token_versions, [[3, 3, 4, 4, 0, 0]] * 3)
    np.testing.assert_array_equal(oldest_versions(out), [3, 3, 3])
    assert int(out.policy_version) == 4 and int(out.fingerprint) == int(fingerprint(new))


def test_sampled_tokens_carry_the_log_probs_of_the_policy_that_drew_them():
    graphdef, old = make_model(0)
    _, new = make_model(1)
    config = SamplingConfig(max_new_tokens=BUDGET, temperature=1.0)
    out = segments(graphdef, [old, new, new], config, steps=2, versions=[0, 1, 1], keys=[5, 6, 7])
    # The behaviour log-prob of each token: under the weights of its version, recomputed.
    by_version = {
        version: np.asarray(
            completion_logps(graphdef, params, PROMPTS, PROMPT_WHERE, out.tokens, out.where)
        )
        for version, params in ((0, old), (1, new))
    }
    versions, where = np.asarray(out.token_versions), np.asarray(out.where)
    expected = np.where(versions == 0, by_version[0], by_version[1]) * where
    np.testing.assert_allclose(out.logps, expected, atol=ROUNDING)
    assert (versions[:, :2] == 0).all() and (versions[where & (np.arange(BUDGET) >= 2)] == 1).all()


def test_finished_completions_are_kept_as_they_are():
    graphdef, old = make_model(0)
    _, new = make_model(1)
    config, stopped = greedy_with_a_stop()
    first = segments(graphdef, [old], config, steps=stopped, versions=[0])
    out = continue_rollout(graphdef, new, PROMPTS, PROMPT_WHERE, first, jax.random.key(1),
                           config, steps=stopped, policy_version=1)  # fmt: skip
    # Row 0 stopped in the first segment: the new weights change nothing of it.
    for field in ("tokens", "where", "logps", "lengths", "truncated", "token_versions"):
        np.testing.assert_array_equal(
            np.asarray(getattr(out, field))[0], np.asarray(getattr(first, field))[0], field
        )
    assert np.asarray(first.lengths).tolist() == [stopped] * 3
    assert np.asarray(out.lengths).tolist() == [stopped, *[min(2 * stopped, BUDGET)] * 2]
    # A whole rollout that `sample` stamped: every token its version, nothing left to draw.
    whole = sample(
        graphdef, old, PROMPTS, PROMPT_WHERE, jax.random.key(0), config, policy_version=7
    )
    done = continue_rollout(
        graphdef,
        new,
        PROMPTS,
        PROMPT_WHERE,
        whole,
        jax.random.key(1),
        config,
        steps=2,
        policy_version=8,
    )
    for field in ("tokens", "where", "logps", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(done, field), getattr(whole, field), field)
    np.testing.assert_array_equal(done.token_versions, np.where(whole.where, 7, 0))
    np.testing.assert_array_equal(oldest_versions(done), [7, 7, 7])


def test_bad_arguments_are_refused_in_one_line():
    graphdef, params = make_model()
    config = SamplingConfig(max_new_tokens=BUDGET, temperature=0.0)
    key = jax.random.key(0)
    stamped = continue_rollout(
        graphdef, params, PROMPTS, PROMPT_WHERE, None, key, config, steps=2, policy_version=0
    )
    untagged = continue_rollout(graphdef, params, PROMPTS, PROMPT_WHERE, None, key, config, steps=2)
    with own_checks():
        with raises_naming("steps"):
            continue_rollout(graphdef, params, PROMPTS, PROMPT_WHERE, None, key, config, steps=0)
        with raises_naming("max_new_tokens=8", "(3, 8)"):
            longer = SamplingConfig(max_new_tokens=8, temperature=0.0)
            continue_rollout(
                graphdef,
                params,
                PROMPTS,
                PROMPT_WHERE,
                stamped,
                key,
                longer,
                steps=2,
                policy_version=1,
            )
        with raises_naming("group_size"):
            continue_rollout(
                graphdef, params, PROMPTS, PROMPT_WHERE, None, key, config, steps=2, group_size=0
            )
        with raises_naming("policy_version"):  # tags, then a segment without a version
            continue_rollout(graphdef, params, PROMPTS, PROMPT_WHERE, stamped, key, config, steps=2)
        with raises_naming("policy_version"):  # tokens of no version, then one with a version
            continue_rollout(
                graphdef,
                params,
                PROMPTS,
                PROMPT_WHERE,
                untagged,
                key,
                config,
                steps=2,
                policy_version=1,
            )
        with raises_naming("record_routing"):
            routed = stamped._replace(routing=jnp.zeros((3, 11, 1, 1), jnp.int32))
            continue_rollout(
                graphdef,
                params,
                PROMPTS,
                PROMPT_WHERE,
                routed,
                key,
                config,
                steps=2,
                policy_version=1,
            )
    with pytest.raises(ValueError, match="token_versions"):
        oldest_versions(untagged)
