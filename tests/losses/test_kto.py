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
from tunelib import losses

kto_loss = jax.jit(losses.kto_loss)
kto_reference_point = jax.jit(losses.kto_reference_point)

B = 5
logps = float_arrays((B,), -30.0, 0.0)


@given(logps, logps, bool_arrays((B,)))
def test_reference_point_is_the_clamped_mean_log_ratio(kl_logps, ref_kl_logps, where):
    garbage_kl = np.where(where, kl_logps, np.nan).astype(np.float32)
    z = float(kto_reference_point(garbage_kl, ref_kl_logps, where=where))
    assert z >= 0
    expected = ref.kto_reference_point(kl_logps[where], ref_kl_logps[where])
    assert_close(z, expected, rtol=1e-5, atol=1e-5)


def test_reference_point_is_never_negative_and_carries_no_gradient():
    kl_logps = jnp.array([-10.0, -12.0, -9.0])
    assert kto_reference_point(kl_logps, kl_logps + 1.0) == 0.0  # mean log-ratio -1, clamped
    assert_close(kto_reference_point(kl_logps, kl_logps - 2.0), 2.0)
    grads = jax.grad(lambda a, b: losses.kto_reference_point(a, b), argnums=(0, 1))(
        kl_logps, kl_logps - 2.0
    )
    assert all(np.all(np.asarray(g) == 0) for g in grads)
    assert kto_reference_point(kl_logps, kl_logps - 2.0, where=jnp.zeros(3, bool)) == 0.0
    assert_traced_once(
        losses.kto_reference_point,
        [((kl_logps, kl_logps - d), {"where": jnp.array([True, False, True])}) for d in (1.0, 3.0)],
    )


@given(
    logps,
    logps,
    bool_arrays((B,)),
    st.floats(0.0, 5.0),
    st.floats(0.05, 2.0),
    st.floats(0.1, 3.0),
    st.floats(0.1, 3.0),
)
def test_loss_is_bounded_by_the_class_weight(lp, ref_lp, desirable, z, beta, w_d, w_u):
    loss = np.asarray(
        kto_loss(
            lp,
            ref_lp,
            desirable,
            reference_point=z,
            beta=beta,
            desirable_weight=w_d,
            undesirable_weight=w_u,
        )
    )
    weight = np.where(desirable, w_d, w_u)
    assert np.all(loss >= 0) and np.all(loss <= weight * (1 + 1e-6))
    # At r = z each completion is half way: lambda_y / 2.
    at_z = kto_loss(
        lp,
        lp - np.float32(z),
        desirable,
        reference_point=z,
        beta=beta,
        desirable_weight=w_d,
        undesirable_weight=w_u,
    )
    assert_close(at_z, weight / 2, rtol=1e-4, atol=1e-5)


def test_desirable_falls_and_undesirable_rises_with_the_log_ratio():
    r = jnp.linspace(-10.0, 10.0, 9)
    zeros = jnp.zeros(9)

    def loss(r, desirable):
        return losses.kto_loss(r, zeros, jnp.full(9, desirable), reference_point=0.5, beta=0.3)

    assert np.all(np.diff(np.asarray(loss(r, True))) < 0)
    assert np.all(np.diff(np.asarray(loss(r, False))) > 0)
    d_desirable = jax.grad(lambda r: loss(r, True).sum())(r)
    # d/dr of sigmoid(-beta (r - z)).
    s = ref.sigmoid(0.3 * (np.asarray(r) - 0.5))
    assert_close(d_desirable, -0.3 * s * (1 - s), rtol=1e-5, atol=1e-7)


def test_reference_point_gets_no_gradient_through_the_loss():
    lp, ref_lp = jnp.array([-3.0, -5.0]), jnp.array([-4.0, -4.0])
    desirable = jnp.array([True, False])
    grad = jax.grad(lambda z: losses.kto_loss(lp, ref_lp, desirable, reference_point=z).sum())(1.0)
    assert grad == 0.0


def test_weights_scale_each_class():
    lp, ref_lp = jnp.array([-3.0, -5.0, -2.0]), jnp.array([-4.0, -4.0, -2.5])
    desirable = jnp.array([True, False, True])
    base = np.asarray(kto_loss(lp, ref_lp, desirable, reference_point=0.2))
    weighted = kto_loss(
        lp, ref_lp, desirable, reference_point=0.2, desirable_weight=1.33, undesirable_weight=0.5
    )
    assert_close(weighted, base * np.array([1.33, 0.5, 1.33]), rtol=1e-6)


def test_errors():
    lp = jnp.zeros(3)
    with raises_naming("desirable"):
        losses.kto_loss(lp, lp, jnp.ones(3, jnp.int32), reference_point=0.0)
    with own_checks():
        with raises_naming("desirable", "boolean", error=TypeError):
            losses.kto_loss(lp, lp, jnp.ones(3, jnp.int32), reference_point=0.0)
        with raises_naming("beta", error=ValueError):
            losses.kto_loss(lp, lp, jnp.ones(3, bool), reference_point=0.0, beta=0.0)
        with raises_naming("ref_kl_logps", "(2,)", error=ValueError):
            losses.kto_reference_point(lp, jnp.zeros(2))
    with raises_naming("reference_point", error=TypeError):
        losses.kto_loss(lp, lp, jnp.ones(3, bool))
