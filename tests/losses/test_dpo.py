import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, float_arrays, own_checks, raises_naming
from tests.losses import _preference_refs as ref
from tunelib import losses

dpo_loss = jax.jit(losses.dpo_loss)
dpo_grads = jax.jit(
    jax.grad(
        lambda c, r, rc, rr, beta, eps: losses.dpo_loss(
            c, r, rc, rr, beta=beta, label_smoothing=eps
        ).sum(),
        argnums=(0, 1, 2, 3),
    )
)
robust_dpo_loss = jax.jit(losses.robust_dpo_loss)
length_normalized_dpo_loss = jax.jit(losses.length_normalized_dpo_loss)

B = 4
pairs = st.tuples(*[float_arrays((B,), -30.0, 0.0)] * 4)
betas = st.floats(0.05, 2.0)


def swapped(pair):
    """The same pair with its label flipped: chosen and rejected trade places."""
    chosen, rejected, ref_chosen, ref_rejected = pair
    return rejected, chosen, ref_rejected, ref_chosen


def with_margin(h):
    """Inputs whose DPO margin is exactly `h`."""
    h = jnp.asarray(h, jnp.float32)
    zeros = jnp.zeros_like(h)
    return h, zeros, zeros, zeros


def softplus(x):
    return np.log1p(np.exp(x))  # -log sigmoid(-x)


def test_fixed_values_in_closed_form():
    # h = (-10 + 14) - (-11 + 13) = 2 and h = -1.
    pair = tuple(np.array(x, np.float32) for x in ([-10, -12], [-14, -11], [-11, -12], [-13, -12]))
    assert_close(dpo_loss(*pair, beta=0.5), [softplus(-1.0), softplus(0.5)])
    smoothed = [
        0.9 * softplus(-1.0) + 0.1 * softplus(1.0),
        0.9 * softplus(0.5) + 0.1 * softplus(-0.5),
    ]
    assert_close(dpo_loss(*pair, beta=0.5, label_smoothing=0.1), smoothed)
    # rDPO = -log sigmoid(beta h) - eps / (1 - 2 eps) * beta h.
    assert_close(
        robust_dpo_loss(*pair, beta=0.5, label_smoothing=0.2),
        [softplus(-1.0) - 1 / 3, softplus(0.5) + 0.5 / 3],
    )
    for beta, eps in [(0.1, 0.0), (1.5, 0.3)]:
        assert_close(dpo_loss(*pair, beta=beta, label_smoothing=eps), ref.dpo(*pair, beta, eps))
        assert_close(
            robust_dpo_loss(*pair, beta=beta, label_smoothing=eps), ref.robust_dpo(*pair, beta, eps)
        )


@given(pairs, betas, st.floats(0.0, 10.0))
def test_dpo_properties(pair, beta, step):
    loss = np.asarray(dpo_loss(*pair, beta=beta))
    assert np.all(loss >= 0)
    # log 2 at zero margin: the policy equal to the reference, however likely the completions.
    chosen, rejected, ref_chosen, ref_rejected = pair
    assert_close(dpo_loss(chosen, rejected, chosen, rejected, beta=beta), np.full(B, np.log(2)))
    # Decreasing in the margin: raising the chosen log-prob never raises the loss.
    raised = np.asarray(
        dpo_loss(chosen + np.float32(step), rejected, ref_chosen, ref_rejected, beta=beta)
    )
    assert np.all(raised <= loss + 1e-6)


@given(pairs, betas, st.floats(0.0, 0.5))
def test_gradient_in_closed_form(pair, beta, eps):
    h = ref.margin(*pair)
    grads = dpo_grads(*pair, beta, eps)
    # d/dh of -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h).
    d_h = -beta * ((1 - eps) * ref.sigmoid(-beta * h) - eps * ref.sigmoid(beta * h))
    for grad, sign in zip(grads, (1, -1, -1, 1), strict=True):
        assert_close(grad, sign * d_h, rtol=1e-4, atol=1e-6)


@given(pairs, betas, st.floats(0.0, 0.5))
def test_label_smoothing_is_cross_entropy_against_flipped_labels(pair, beta, eps):
    mixed = (1 - eps) * np.asarray(dpo_loss(*pair, beta=beta), np.float64) + eps * np.asarray(
        dpo_loss(*swapped(pair), beta=beta), np.float64
    )
    assert_close(dpo_loss(*pair, beta=beta, label_smoothing=eps), mixed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eps", [0.05, 0.2, 0.5])
def test_conservative_dpo_minimum_is_finite(eps):
    beta = 0.5
    best = np.log((1 - eps) / eps) / beta  # sigmoid(beta h) = 1 - eps
    h = np.array([best - 0.5, best, best + 0.5], np.float32)
    loss = np.asarray(dpo_loss(*with_margin(h), beta=beta, label_smoothing=eps))
    assert loss[1] < loss[0] and loss[1] < loss[2]
    grad = jax.grad(
        lambda x: losses.dpo_loss(*with_margin(x), beta=beta, label_smoothing=eps).sum()
    )(jnp.asarray(h))
    assert abs(float(grad[1])) < 1e-6
    if eps == 0.5:  # symmetric in h, minimised at h = 0 with value log 2
        assert_close(loss[1], np.log(2))
        assert_close(loss[0], loss[2], rtol=1e-6)


@given(pairs, betas, st.floats(0.0, 0.45))
def test_robust_dpo_is_unbiased_under_label_flips(pair, beta, eps):
    # Labels flipped with probability eps: the expected rDPO loss is the clean DPO loss.
    expected = (1 - eps) * np.asarray(
        robust_dpo_loss(*pair, beta=beta, label_smoothing=eps), np.float64
    )
    expected += eps * np.asarray(
        robust_dpo_loss(*swapped(pair), beta=beta, label_smoothing=eps), np.float64
    )
    assert_close(expected, dpo_loss(*pair, beta=beta), rtol=1e-4, atol=1e-4)
    # It is DPO minus a linear term in the margin, and DPO itself at eps = 0.
    linear = eps / (1 - 2 * eps) * beta * ref.margin(*pair)
    assert_close(
        robust_dpo_loss(*pair, beta=beta, label_smoothing=eps),
        ref.dpo(*pair, beta) - linear,
        rtol=1e-4,
        atol=1e-4,
    )
    assert_close(robust_dpo_loss(*pair, beta=beta, label_smoothing=0.0), dpo_loss(*pair, beta=beta))


@given(pairs, st.tuples(*[float_arrays((B,), 1, 50)] * 2), st.floats(0.5, 10.0))
def test_length_normalized_dpo_is_dpo_on_means(pair, lengths, beta):
    lengths = [np.round(x).astype(np.int32) for x in lengths]
    chosen, rejected, ref_chosen, ref_rejected = pair
    len_c, len_r = (x.astype(np.float32) for x in lengths)
    means = (chosen / len_c, rejected / len_r, ref_chosen / len_c, ref_rejected / len_r)
    out = length_normalized_dpo_loss(*pair, *lengths, beta=beta)
    assert_close(out, dpo_loss(*means, beta=beta), rtol=1e-5, atol=1e-5)
    # Integer and float counts agree; repeating every completion k times changes nothing.
    assert_close(
        length_normalized_dpo_loss(*pair, len_c, len_r, beta=beta), out, rtol=1e-6, atol=1e-7
    )
    doubled = length_normalized_dpo_loss(*(2 * x for x in pair), 2 * len_c, 2 * len_r, beta=beta)
    assert_close(doubled, out, rtol=1e-5, atol=1e-6)


def test_length_normalized_dpo_with_unit_lengths_is_dpo():
    pair = tuple(
        np.asarray(x, np.float32) for x in ([-1.0, -2.0], [-3.0, -0.5], [-1.5, -2.0], [-2.0, -1.0])
    )
    ones = np.ones(2, np.int32)
    assert_close(length_normalized_dpo_loss(*pair, ones, ones, beta=0.7), dpo_loss(*pair, beta=0.7))
    # An empty completion (length 0, sum 0) counts as length 1: finite, as sequence_mean.
    zero = np.zeros(2, np.int32)
    empty = (np.zeros(2, np.float32), pair[1], np.zeros(2, np.float32), pair[3])
    out = length_normalized_dpo_loss(*empty, zero, ones, beta=0.7)
    assert np.all(np.isfinite(out))
    assert_close(out, length_normalized_dpo_loss(*empty, ones, ones, beta=0.7))


def test_hyperparameter_and_length_errors():
    pair = [jnp.zeros(3)] * 4
    lengths = jnp.ones(3, jnp.int32)
    with own_checks():
        for fn in (losses.dpo_loss, losses.robust_dpo_loss):
            with raises_naming("beta", error=ValueError):
                fn(*pair, beta=0.0)
        with raises_naming("label_smoothing", error=ValueError):
            losses.dpo_loss(*pair, label_smoothing=1.5)
        with raises_naming("label_smoothing", "[0, 0.5)", error=ValueError):
            losses.robust_dpo_loss(*pair, label_smoothing=0.5)
        with raises_naming("beta", error=ValueError):
            losses.length_normalized_dpo_loss(*pair, lengths, lengths, beta=-1.0)
        with raises_naming("chosen_lengths", error=TypeError):
            losses.length_normalized_dpo_loss(*pair, jnp.ones(3, bool), lengths)
        with raises_naming("rejected_lengths", "(2,)", "(3,)", error=ValueError):
            losses.length_normalized_dpo_loss(*pair, lengths, lengths[:2])
    with raises_naming("chosen_lengths"):
        losses.length_normalized_dpo_loss(*pair, jnp.ones(3, bool), lengths)


def test_docs_page_examples_run():
    """Every python block of docs/losses/preference.md runs, in order, and trains."""
    page = pathlib.Path(__file__).parents[2] / "docs" / "losses" / "preference.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    assert blocks
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(page), "exec"), namespace)
    history = namespace["history"]
    assert history[-1] < history[0]
