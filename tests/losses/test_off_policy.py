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


SPECS = [
    weights_spec("token", "truncate"),
    weights_spec("token", "mask", floor=True),
    weights_spec("sequence", "truncate"),
    weights_spec("sequence", "mask"),
    weights_spec("geometric", "mask", floor=True),
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
