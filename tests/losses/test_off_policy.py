import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, float_arrays, own_checks, raises_naming
from tests.losses import _rl_refs as ref
from tunelib import losses

LOGP = (-8.0, 0.0)
NEAR = ("near", 0, -1.0, 1.0)
CAP = {"token": (0.5, 4.0), "sequence": (0.5, 8.0), "geometric": (0.5, 4.0)}


def weights_spec(level, mode, floor=False):
    hyper = {"cap": CAP[level]}
    if floor:
        hyper["floor"] = (0.125, 0.875)
    return ref.Spec(
        losses.truncated_importance_weights,
        ref.importance_weights,
        ("token_logps", "sampler_token_logps"),
        (LOGP, NEAR),
        hyper,
        static={"level": level, "mode": mode},
        differentiable=False,
        id=f"{level}_{mode}{'_floor' if floor else ''}",
    )


def off_policy_mask_as_floats(*args, **kwargs):
    """The boolean mask as 0/1 floats of the log-probs' compute dtype, so the contracts of
    the per-token functions apply."""
    dtype = jnp.result_type(jnp.float32, jnp.asarray(args[0]).dtype)
    return losses.off_policy_sequence_mask(*args, **kwargs).astype(dtype)


SPECS = [
    weights_spec("token", "truncate"),
    weights_spec("token", "mask", floor=True),
    weights_spec("sequence", "truncate"),
    weights_spec("sequence", "mask"),
    weights_spec("geometric", "mask", floor=True),
    ref.Spec(
        off_policy_mask_as_floats,
        ref.off_policy_mask,
        ("token_logps", "sampler_token_logps", "advantages"),
        (LOGP, NEAR, (-3.0, 3.0)),
        {"threshold": (0.0, 0.5)},
        differentiable=False,
        id="off_policy_sequence_mask",
    ),
]


@pytest.fixture(scope="module", params=SPECS, ids=[s.id for s in SPECS])
def spec(request):
    return request.param


class TestContracts(ref.TokenContracts):
    pass


weights = jax.jit(losses.truncated_importance_weights, static_argnames=("level", "mode"))


@st.composite
def problems(draw, shape=(3, 4)):
    logps = draw(float_arrays(shape, -8.0, 0.0))
    sampler = (logps + draw(float_arrays(shape, -1.0, 1.0))).astype(np.float32)
    where = draw(st.lists(st.booleans(), min_size=shape[0] * shape[1], max_size=12))
    return logps, sampler, np.array(where).reshape(shape)


@given(problems(), st.floats(0.5, 4.0), st.floats(0.125, 0.875))
def test_weights_are_bounded_and_exact_below_the_cap(problem, cap, floor):
    logps, sampler, where = problem
    rho = np.exp(logps.astype(np.float64) - sampler)
    truncated = np.asarray(weights(logps, sampler, cap=cap, where=where), np.float64)
    assert np.all(truncated <= cap * (1 + 1e-6)) and np.all(truncated[~where] == 0)
    assert_close(truncated[where], np.minimum(rho, cap)[where], rtol=1e-5)
    masked = np.asarray(
        weights(logps, sampler, mode="mask", cap=cap, floor=floor, where=where), np.float64
    )
    # A kept token keeps its exact ratio; every other token is 0.
    kept = masked != 0
    assert_close(masked[kept], rho[kept], rtol=1e-5)
    inside = (rho >= floor * (1 + 1e-5)) & (rho <= cap * (1 - 1e-5)) & where
    outside = ((rho < floor * (1 - 1e-5)) | (rho > cap * (1 + 1e-5))) | ~where
    assert np.all(kept[inside]) and not np.any(kept[outside])


def test_sequence_levels_are_product_and_geometric_mean():
    rng = np.random.default_rng(0)
    logps = rng.uniform(-3, 0, (3, 5)).astype(np.float32)
    sampler = (logps + rng.uniform(-0.2, 0.2, (3, 5))).astype(np.float32)
    where = np.arange(5)[None, :] < np.array([[5], [2], [0]])
    log_rho = np.where(where, logps.astype(np.float64) - sampler, 0).sum(-1)
    big = {"cap": 1e6, "where": where}
    product = weights(logps, sampler, level="sequence", **big)
    geometric = weights(logps, sampler, level="geometric", **big)
    n = np.maximum(where.sum(-1), 1)
    assert_close(product, np.where(where, np.exp(log_rho)[:, None], 0), rtol=1e-5)
    assert_close(geometric, np.where(where, np.exp(log_rho / n)[:, None], 0), rtol=1e-5)
    # The product is the product of the token weights.
    token = np.asarray(weights(logps, sampler, **big), np.float64)
    assert_close(product[:2, 0], [np.prod(token[i][where[i]]) for i in range(2)], rtol=1e-5)


def test_matching_sampler_gives_unit_weights():
    logps = np.random.default_rng(1).uniform(-5, 0, (2, 4)).astype(np.float32)
    where = np.array([[True, True, False, True], [False] * 4])
    for level in ("token", "sequence", "geometric"):
        for mode in ("truncate", "mask"):
            out = weights(logps, logps, level=level, mode=mode, where=where)
            assert np.array_equal(np.asarray(out), where.astype(np.float32))


def test_mask_drops_whole_sequences():
    logps = np.zeros((2, 3), np.float32)
    sampler = np.array([[0.0, -1.0, 0.0], [0.0, -0.1, 0.0]], np.float32)  # products e, 1.105
    out = weights(logps, sampler, level="sequence", mode="mask", cap=2.0)
    assert_close(out, [[0.0] * 3, [np.exp(0.1)] * 3], rtol=1e-6)


def test_weights_multiply_a_loss_without_changing_its_gradient_path():
    rng = np.random.default_rng(2)
    logps = rng.uniform(-3, 0, (2, 4)).astype(np.float32)
    sampler = (logps + rng.uniform(-1, 1, (2, 4))).astype(np.float32)
    adv = np.array([1.0, -1.0], np.float32)

    def corrected(x):
        w = losses.truncated_importance_weights(x, sampler)
        return jnp.sum(w * losses.policy_gradient_loss(x, None, adv))

    w = np.minimum(np.exp(logps.astype(np.float64) - sampler), 2.0)
    grad = jax.grad(corrected)(jnp.asarray(logps))
    assert_close(grad, -w * adv[:, None], rtol=1e-5)


def test_errors():
    logps = np.zeros((2, 3), np.float32)
    with raises_naming("mode", "truncate"):
        losses.truncated_importance_weights(logps, logps, mode="clip")
    with raises_naming("level", "geometric"):
        losses.truncated_importance_weights(logps, logps, level="sequence_token")
    with raises_naming("floor", "mask"):
        losses.truncated_importance_weights(logps, logps, floor=0.5)
    with own_checks():
        for kw in ({"cap": 0.0}, {"mode": "mask", "floor": -1.0}):
            with raises_naming(list(kw)[-1], error=ValueError):
                losses.truncated_importance_weights(logps, logps, **kw)


# --- DeepSeek-V3.2's off-policy sequence mask.

off_policy_sequence_mask = jax.jit(losses.off_policy_sequence_mask)


def test_off_policy_mask_drops_only_drifted_negative_sequences():
    logps = np.full((4, 3), -2.0, np.float32)
    # Mean drift log pi_sampler - log pi of 1.0, 0.5 (exactly the threshold), 1.0 and -1.0.
    sampler = logps + np.array([[1.0], [0.5], [1.0], [-1.0]], np.float32)
    sampler[0] += np.array([0.5, -0.5, 0.0], np.float32)  # the mean counts, not each token
    adv = np.array([-1.0, -1.0, 2.0, -1.0], np.float32)
    where = np.array([[True, True, True], [True, False, True], [True] * 3, [True] * 3])
    out = np.asarray(off_policy_sequence_mask(logps, sampler, adv, threshold=0.5, where=where))
    assert out.dtype == np.bool_
    # Dropped: drift above the threshold and a negative advantage. Kept: drift equal to the
    # threshold, a positive advantage, a negative drift.
    np.testing.assert_array_equal(out, where & np.array([[False], [True], [True], [True]]))
    assert_close(out, ref.per_token(ref.off_policy_mask, where, logps, sampler, adv, threshold=0.5))
    # A lower threshold drops the second row too.
    lower = off_policy_sequence_mask(logps, sampler, adv, threshold=0.25, where=where)
    np.testing.assert_array_equal(lower, where & np.array([[False], [False], [True], [True]]))


def test_off_policy_mask_with_per_token_advantages_decides_per_token():
    logps = np.zeros((1, 4), np.float32)
    sampler = np.ones((1, 4), np.float32)  # drift 1
    adv = np.array([[1.0, -1.0, 0.0, -0.5]], np.float32)
    out = losses.off_policy_sequence_mask(logps, sampler, adv, threshold=0.5)
    np.testing.assert_array_equal(out, [[True, False, True, False]])


def test_off_policy_mask_times_the_loss_is_trls_masked_loss():
    """TRL multiplies the per-token loss by the mask, so the dropped sequences keep their
    place in the denominators."""
    rng = np.random.default_rng(3)
    logps = rng.uniform(-3, 0, (4, 5)).astype(np.float32)
    sampler = (logps + np.array([[1.0], [0.1], [1.0], [0.0]])).astype(np.float32)
    adv = np.array([-1.0, -1.0, 1.0, 0.5], np.float32)
    where = np.arange(5)[None, :] < np.array([[5], [3], [4], [2]])
    mask = losses.off_policy_sequence_mask(logps, sampler, adv, threshold=0.5, where=where)
    loss = losses.policy_gradient_loss(logps, None, adv, where=where) * mask
    value = losses.aggregate(loss, mode="seq_mean_token_mean", where=where).mean()
    assert_close(value, np.mean([0.0, 1.0, -1.0, -0.5]), rtol=1e-6)


def test_off_policy_mask_counts_an_unscored_token_as_no_drift():
    """TRL (1.16): a NaN sampler log-prob at a counted token adds 0 to the drift and 1 to the
    length."""
    logps = np.zeros((2, 4), np.float32)
    sampler = np.array([[0.9, 0.9, 0.9, np.nan], [0.9, 0.9, 0.9, 0.0]], np.float32)
    adv = -np.ones(2, np.float32)
    for threshold, dropped in ((0.6, True), (0.7, False)):  # drift 0.675 in both rows
        out = losses.off_policy_sequence_mask(logps, sampler, adv, threshold=threshold)
        np.testing.assert_array_equal(out, np.full((2, 4), not dropped))


def test_off_policy_mask_errors():
    logps = np.zeros((2, 3), np.float32)
    adv = np.ones(2, np.float32)
    with own_checks():
        with raises_naming("threshold", error=ValueError):
            losses.off_policy_sequence_mask(logps, logps, adv, threshold=-0.1)
        with raises_naming("advantages", "(3,)", error=ValueError):
            losses.off_policy_sequence_mask(logps, logps, np.ones(3, np.float32), threshold=0.1)
