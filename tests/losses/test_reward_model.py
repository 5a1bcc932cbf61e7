import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, float_arrays, own_checks, raises_naming
from tests.losses import _preference_refs as ref
from tunelib import losses

bradley_terry_loss = jax.jit(losses.bradley_terry_loss)

B = 4
rewards = st.tuples(*[float_arrays((B,), -10.0, 10.0)] * 2)


def test_fixed_values_in_closed_form():
    chosen, rejected = np.array([1.5, -0.5, 2.0], np.float32), np.array([0.5, 0.0, 2.0], np.float32)
    assert_close(bradley_terry_loss(chosen, rejected), np.log1p(np.exp([-1.0, 0.5, 0.0])))
    margin = np.array([1.0, -0.5, 0.5], np.float32)
    assert_close(
        bradley_terry_loss(chosen, rejected, margin=margin), np.log1p(np.exp([0.0, 0.0, 0.5]))
    )
    centred = bradley_terry_loss(chosen, rejected, centering_weight=0.01)
    assert_close(centred, np.log1p(np.exp([-1.0, 0.5, 0.0])) + 0.01 * np.array([4.0, 0.25, 16.0]))


@given(rewards, st.floats(-3.0, 3.0), st.floats(-5.0, 5.0))
def test_properties(pair, margin, shift):
    chosen, rejected = pair
    loss = np.asarray(bradley_terry_loss(chosen, rejected))
    assert np.all(loss >= 0)
    assert_close(loss, ref.bradley_terry(chosen, rejected), rtol=1e-5, atol=1e-6)
    # Only the reward difference matters without centring; the margin shifts it.
    moved = bradley_terry_loss(chosen + np.float32(shift), rejected + np.float32(shift))
    assert_close(moved, loss, rtol=1e-4, atol=1e-4)
    with_margin = bradley_terry_loss(chosen, rejected, margin=margin)
    assert_close(
        with_margin, bradley_terry_loss(chosen - np.float32(margin), rejected), rtol=1e-4, atol=1e-4
    )
    # log 2 for equal rewards and no margin; the centring term only adds.
    assert_close(bradley_terry_loss(chosen, chosen), np.full(B, np.log(2)))
    assert np.all(np.asarray(bradley_terry_loss(chosen, rejected, centering_weight=0.05)) >= loss)


def test_centring_pulls_the_reward_sum_to_zero():
    chosen, rejected = jnp.array([3.0, 1.0]), jnp.array([2.0, -2.0])
    grad = jax.grad(
        lambda c, r: losses.bradley_terry_loss(c, r, centering_weight=0.1).sum(), (0, 1)
    )
    plain = jax.grad(lambda c, r: losses.bradley_terry_loss(c, r).sum(), (0, 1))
    extra = [
        np.asarray(g) - np.asarray(p)
        for g, p in zip(grad(chosen, rejected), plain(chosen, rejected), strict=True)
    ]
    # d/dr_w and d/dr_l of 0.1 (r_w + r_l)^2 are both 0.2 (r_w + r_l).
    assert_close(extra[0], 0.2 * np.array([5.0, -1.0]), rtol=1e-5)
    assert_close(extra[1], 0.2 * np.array([5.0, -1.0]), rtol=1e-5)


def test_margin_errors():
    chosen = jnp.zeros(3)
    with raises_naming("margin"):
        losses.bradley_terry_loss(chosen, chosen, margin=jnp.zeros(2))
    with own_checks():
        with raises_naming("margin", "(2,)", "(3,)", error=ValueError):
            losses.bradley_terry_loss(chosen, chosen, margin=jnp.zeros(2))
        with raises_naming("margin", error=TypeError):
            losses.bradley_terry_loss(chosen, chosen, margin=jnp.zeros(3, jnp.int32))
