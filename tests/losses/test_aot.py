import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, float_arrays, own_checks, raises_naming
from tests.losses import _preference_refs as ref
from tunelib import losses

aot_loss = jax.jit(losses.aot_loss, static_argnames="paired")

B = 6
pairs = st.tuples(*[float_arrays((B,), -30.0, 0.0)] * 4)
modes = pytest.mark.parametrize("paired", [False, True])


def valid_mean(loss, where):
    return float(np.sum(loss)) / max(int(np.sum(where)), 1)


@modes
@given(pairs, st.permutations(range(B)), st.floats(0.05, 2.0), st.floats(0.0, 0.5))
def test_invariant_to_the_order_of_the_batch(paired, pair, order, beta, eps):
    order = np.array(order)
    loss = aot_loss(*pair, beta=beta, label_smoothing=eps, paired=paired)
    permuted = aot_loss(*(x[order] for x in pair), beta=beta, label_smoothing=eps, paired=paired)
    np.testing.assert_array_equal(permuted, loss)
    assert_close(
        loss, ref.aot(*pair, beta=beta, label_smoothing=eps, paired=paired), rtol=1e-4, atol=1e-4
    )


@modes
@given(pairs, st.floats(0.05, 2.0), st.floats(0.0, 0.5))
def test_one_pair_is_dpo(paired, pair, beta, eps):
    one = [x[:1] for x in pair]
    assert_close(
        aot_loss(*one, beta=beta, label_smoothing=eps, paired=paired),
        losses.dpo_loss(*one, beta=beta, label_smoothing=eps),
        rtol=1e-5,
        atol=1e-5,
    )


def test_quantiles_are_matched_not_pairs():
    # Unpaired: r_w = (3, -1), r_l = (0, 2); sorted (-1, 3) against (0, 2): deltas (-1, 1).
    r_w, r_l = np.array([3.0, -1.0], np.float32), np.array([0.0, 2.0], np.float32)
    zeros = np.zeros(2, np.float32)
    loss = aot_loss(r_w, r_l, zeros, zeros, beta=1.0)
    assert_close(loss, -ref.log_sigmoid(np.array([-1.0, 1.0])))
    # Paired: policy margins (3, -1) against reference margins (1, -1): sorted deltas (0, 2).
    chosen, rejected = np.array([3.0, -1.0], np.float32), zeros
    ref_chosen, ref_rejected = np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)
    loss = aot_loss(chosen, rejected, ref_chosen, ref_rejected, beta=1.0, paired=True)
    assert_close(loss, -ref.log_sigmoid(np.array([0.0, 2.0])))


@modes
def test_masked_rows_take_no_part_in_the_sort(paired):
    rng = np.random.default_rng(0)
    pair = [rng.uniform(-20, 0, 6).astype(np.float32) for _ in range(4)]
    where = np.array([True, False, True, True, False, True])
    sliced = aot_loss(*(x[where] for x in pair), beta=0.5, paired=paired)
    for bad in (np.nan, -np.inf, np.inf, -1e30, 1e30):
        garbage = [np.where(where, x, np.float32(bad)) for x in pair]
        loss = aot_loss(*garbage, beta=0.5, paired=paired, where=where)
        # Valid ranks first, equal to the batch without the masked rows; masked ranks 0.
        assert_close(loss[:4], sliced, rtol=1e-6, atol=1e-7)
        assert np.all(np.asarray(loss[4:]) == 0)
        assert_close(valid_mean(loss, where), np.mean(sliced), rtol=1e-6)


@modes
def test_gradient_reaches_each_valid_row_once(paired):
    rng = np.random.default_rng(1)
    pair = [jnp.asarray(rng.uniform(-20, 0, 5), jnp.float32) for _ in range(4)]
    where = jnp.array([True, True, False, True, True])
    pair[0] = pair[0].at[2].set(jnp.nan)

    def mean_loss(chosen):
        loss = losses.aot_loss(chosen, *pair[1:], beta=0.5, paired=paired, where=where)
        return jnp.sum(loss) / jnp.sum(where)

    grad = np.asarray(jax.grad(mean_loss)(pair[0]))
    assert np.all(np.isfinite(grad)) and grad[2] == 0
    # Each chosen row sits at exactly one rank, so its gradient is that rank's d loss / d delta.
    assert np.all(grad[np.asarray(where)] < 0)


def test_unpaired_identical_distributions_give_log_2():
    # Chosen and rejected log-ratios with the same values in a different order.
    r = np.array([-3.0, 0.5, 2.0, -1.0], np.float32)
    zeros = np.zeros(4, np.float32)
    assert_close(aot_loss(r, r[::-1], zeros, zeros, beta=0.7), np.full(4, np.log(2)))


def test_hyperparameter_errors():
    pair = [jnp.zeros(3)] * 4
    with own_checks():
        with raises_naming("beta", error=ValueError):
            losses.aot_loss(*pair, beta=0.0)
        with raises_naming("label_smoothing", error=ValueError):
            losses.aot_loss(*pair, label_smoothing=-0.1)
