import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, float_arrays, own_checks, raises_naming
from tests.losses import _rl_refs as ref
from tunelib import losses

NAMES = ("values", "old_values", "returns")
RANGES = ((-4.0, 4.0), ("near", 0, -1.0, 1.0), (-4.0, 4.0))
BOUNDS = {"epsilon_low": (0.0, 1.0), "epsilon_high": (0.0, 1.5)}
UNCLIPPED = {"epsilon_low": None, "epsilon_high": None}
SPECS = [
    ref.Spec(losses.value_loss, ref.value, NAMES, RANGES, BOUNDS, id="clipped"),
    ref.Spec(losses.value_loss, ref.value, NAMES, RANGES, {}, static=UNCLIPPED, id="plain"),
]


@pytest.fixture(scope="module", params=SPECS, ids=[s.id for s in SPECS])
def spec(request):
    return request.param


class TestContracts(ref.TokenContracts):
    pass


value_loss = jax.jit(losses.value_loss)
value_grad = jax.jit(jax.grad(lambda v, *a, **k: jnp.sum(losses.value_loss(v, *a, **k))))


@st.composite
def problems(draw, shape=(3, 4)):
    values = draw(float_arrays(shape, -4.0, 4.0))
    old = (values + draw(float_arrays(shape, -1.0, 1.0))).astype(np.float32)
    return values, old, draw(float_arrays(shape, -4.0, 4.0))


@given(problems(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_clipping_is_pessimistic_and_stops_the_gradient_outside(problem, low, high):
    values, old, returns = problem
    v, v_old, ret = (x.astype(np.float64) for x in problem)
    bounds = {"epsilon_low": low, "epsilon_high": high}
    loss = np.asarray(value_loss(values, old, returns, **bounds), np.float64)
    plain = 0.5 * (v - ret) ** 2
    assert np.all(loss >= plain * (1 - 1e-6) - 1e-30)  # float32 flushes tiny squares to 0
    near = (v - v_old >= -low * (1 - 1e-5)) & (v - v_old <= high * (1 - 1e-5))
    assert_close(loss[near], plain[near], rtol=1e-5, atol=1e-6)
    assert_close(value_loss(values, old, returns, **UNCLIPPED), plain, rtol=1e-5, atol=1e-6)
    wide = {"epsilon_low": 1e3, "epsilon_high": 1e3}
    assert_close(value_loss(values, old, returns, **wide), plain, rtol=1e-5, atol=1e-6)
    # One bound None leaves that side unclipped.
    one_sided = value_loss(values, old, returns, epsilon_low=None, epsilon_high=high)
    assert_close(one_sided, ref.value(v, v_old, ret, None, high), rtol=1e-5, atol=1e-6)
    # d loss / dV is V - R where the unclipped error is the larger, else 0 (V is then outside
    # the clip range and its clipped copy is constant). Skip ties, where the choice flips.
    clipped = 0.5 * (np.clip(v, v_old - low, v_old + high) - ret) ** 2
    grad = np.asarray(value_grad(values, old, returns, **bounds))
    decided = ~np.isclose(clipped, plain, rtol=1e-5, atol=1e-6)
    expected = np.where(clipped > plain, 0.0, v - ret)
    assert_close(grad[decided], expected[decided], rtol=1e-5, atol=1e-5)


def test_old_and_returns_carry_no_policy_gradient_but_values_do():
    values = np.array([[1.0, 2.0, 0.4]], np.float32)
    old = np.array([[0.5, 0.5, 0.5]], np.float32)
    returns = np.array([[0.0, 3.0, 1.0]], np.float32)
    grads = jax.grad(lambda *a: jnp.sum(losses.value_loss(*a)), argnums=(0, 1, 2))(
        values, old, returns
    )
    # Token 1: clipped error (0.7 - 3)^2 wins, V is outside [0.3, 0.7]: no gradient to V, the
    # clip bound moves with V_old. Tokens 0 and 2: the unclipped error wins.
    assert_close(grads[0], [[1.0, 0.0, -0.6]], rtol=1e-6)
    assert_close(grads[1], [[0.0, -2.3, 0.0]], rtol=1e-6)
    assert_close(grads[2], [[-1.0, 2.3, 0.6]], rtol=1e-6)


def test_errors():
    x = np.zeros((2, 3), np.float32)
    for name in ("epsilon_low", "epsilon_high"):
        with own_checks(), raises_naming(name, error=ValueError):
            losses.value_loss(x, x, x, **{name: -0.1})
    with raises_naming("returns"):
        losses.value_loss(x, x, np.zeros(2, np.float32))
