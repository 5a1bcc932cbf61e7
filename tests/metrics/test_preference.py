import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import (
    assert_close,
    assert_traced_once,
    bool_arrays,
    float_arrays,
    own_checks,
    raises_naming,
)
from tests.losses import _preference_refs as ref
from tunelib import losses, metrics

preference_accuracy = jax.jit(metrics.preference_accuracy)
implicit_rewards = jax.jit(metrics.implicit_rewards)

B = 6
# Few distinct values, so that ties are common.
coarse = float_arrays((B,), -2.0, 2.0).map(lambda x: np.round(x).astype(np.float32))


@given(coarse, coarse, bool_arrays((B,)))
def test_accuracy_is_the_fraction_of_valid_pairs_ranked_right(chosen, rejected, where):
    garbage = np.where(where, chosen, np.nan).astype(np.float32)
    accuracy = float(preference_accuracy(garbage, rejected, where=where))
    assert 0 <= accuracy <= 1
    assert_close(accuracy, ref.preference_accuracy(chosen[where], rejected[where]), rtol=1e-6)
    # Swapping the roles counts the other strict side: the two never sum past 1.
    swapped = float(preference_accuracy(rejected, garbage, where=where))
    ties = np.mean(chosen[where] == rejected[where]) if where.any() else 1.0
    assert_close(accuracy + swapped, 1 - ties, rtol=1e-6, atol=1e-7)


def test_ties_are_not_correct_and_an_empty_batch_is_zero():
    rewards = jnp.array([0.5, -1.0, 2.0])
    assert preference_accuracy(rewards, rewards) == 0.0
    assert preference_accuracy(rewards, rewards - 1.0) == 1.0
    assert preference_accuracy(rewards, rewards - 1.0, where=jnp.zeros(3, bool)) == 0.0
    out = preference_accuracy(rewards, jnp.array([0.0, -1.0, 3.0]))
    assert out.shape == () and out.dtype == jnp.float32
    assert_close(out, 1 / 3)
    assert_traced_once(
        metrics.preference_accuracy,
        [((rewards, rewards - d), {"where": jnp.array([True, True, False])}) for d in (1.0, -1.0)],
    )


@given(float_arrays((B,), -30.0, 0.0), float_arrays((B,), -30.0, 0.0), st.floats(0.01, 5.0))
def test_implicit_rewards_and_margins(logps, ref_logps, beta):
    chosen = implicit_rewards(logps, ref_logps, beta=beta)
    assert_close(chosen, ref.implicit_rewards(logps, ref_logps, beta), rtol=1e-5, atol=1e-5)
    rejected = implicit_rewards(ref_logps, logps, beta=beta)
    margins = metrics.reward_margins(chosen, rejected)
    assert_close(margins, 2 * ref.implicit_rewards(logps, ref_logps, beta), rtol=1e-5, atol=1e-5)
    # The DPO loss is -log sigmoid of the implicit reward margin (here against a zero reward).
    zeros = np.zeros(B, np.float32)
    dpo = losses.dpo_loss(logps, zeros, ref_logps, zeros, beta=beta)
    assert_close(dpo, -ref.log_sigmoid(np.asarray(chosen)), rtol=1e-4, atol=1e-5)


def test_errors():
    rewards = jnp.zeros(3)
    with raises_naming("rejected_rewards"):
        metrics.preference_accuracy(rewards, jnp.zeros(4))
    with own_checks():
        with raises_naming("rejected_rewards", "(4,)", error=ValueError):
            metrics.preference_accuracy(rewards, jnp.zeros(4))
        with raises_naming("where", error=TypeError):
            metrics.preference_accuracy(rewards, rewards, where=jnp.ones(3))
        with raises_naming("beta", error=ValueError):
            metrics.implicit_rewards(rewards, rewards, beta=0.0)
    with raises_naming("beta", error=TypeError):
        metrics.implicit_rewards(rewards, rewards)


def test_integer_masks_count_like_boolean_masks():
    chosen, rejected = jnp.array([1.0, -2.0, 0.5]), jnp.array([0.0, -1.0, 2.0])
    where = np.array([True, True, False])
    for fn in (metrics.preference_accuracy, metrics.reward_margins):
        np.testing.assert_array_equal(
            fn(chosen, rejected, where=where.astype(np.int32)), fn(chosen, rejected, where=where)
        )
    with raises_naming("where", "3", error=ValueError):
        metrics.reward_margins(chosen, rejected, where=np.array([1, 3, 0]))
