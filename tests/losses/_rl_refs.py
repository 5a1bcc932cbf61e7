"""Float64 NumPy references for the policy-gradient losses, and the contracts they all keep.

The references work on one row at a time, on float64 copies of that row's valid tokens, and
share no code with `tunelib`; each is written from its paper's formula. `TokenContracts` holds
the tests every `[B, T] -> [B, T]` function of this family must pass; a test module subclasses
it and provides a module-scoped `spec` fixture.
"""

import dataclasses
from collections.abc import Callable

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

# ---------------------------------------------------------------------------------------------
# References (one row of valid tokens at a time).


def sigmoid(x):
    """1 / (1 + e^-x) without overflow."""
    return np.exp(-np.logaddexp(0.0, -np.asarray(x, np.float64)))


def ratio(logps, old, level="token", log_ratio_clamp=20.0):
    """PPO's token ratio, or GSPO's length-normalised sequence ratio on every token."""
    log_ratio = np.asarray(logps, np.float64) - np.asarray(old, np.float64)
    c = log_ratio_clamp
    if level == "token":
        return np.exp(np.clip(log_ratio, -c, c))
    return np.full(log_ratio.shape, np.exp(np.clip(log_ratio.mean(), -c, c)))


def ppo(
    logps,
    old,
    adv,
    level="token",
    epsilon_low=0.2,
    epsilon_high=0.2,
    dual_clip=None,
    ratio_cap=None,
    log_ratio_clamp=20.0,
):
    """-min(r A, clip(r) A); ratio capped in both terms; dual clip bounds A < 0 by -c A."""
    r = ratio(logps, old, level, log_ratio_clamp)
    adv = np.asarray(adv, np.float64)
    clipped = np.clip(r, 1 - epsilon_low, 1 + epsilon_high)
    if ratio_cap is not None:
        r, clipped = np.minimum(r, ratio_cap), np.minimum(clipped, ratio_cap)
    loss = -np.minimum(r * adv, clipped * adv)
    if dual_clip is not None:
        loss = np.where(adv < 0, np.minimum(loss, -dual_clip * adv), loss)
    return loss


def cispo(logps, old, adv, level="token", epsilon_low=1.0, epsilon_high=None, ratio_cap=None):
    """MiniMax-M1: -sg(clip(r, 1 - eps_low, U)) A log pi, U = C or 1 + eps_high (3 by
    default); r the token ratio or GSPO's sequence ratio (the weight has no gradient, so
    GSPO-token's ratio is the sequence one)."""
    high = (
        ratio_cap if ratio_cap is not None else 1 + (3.0 if epsilon_high is None else epsilon_high)
    )
    r = ratio(logps, old, "token" if level == "token" else "sequence", log_ratio_clamp=np.inf)
    weight = np.clip(r, 1 - epsilon_low, high)
    return -weight * np.asarray(adv, np.float64) * np.asarray(logps, np.float64)


def sapo(logps, old, adv, level="token", tau_pos=1.0, tau_neg=1.05, log_ratio_clamp=20.0):
    """SAPO: -(4 / tau) sigmoid(tau (r - 1)) A, tau by the sign of A; r per token or GSPO's
    sequence ratio."""
    r = ratio(logps, old, "token" if level == "token" else "sequence", log_ratio_clamp)
    adv = np.asarray(adv, np.float64)
    tau = np.where(adv > 0, tau_pos, tau_neg)
    return -(4 / tau) * sigmoid(tau * (r - 1)) * adv


def vespo(
    logps,
    old,
    adv,
    weights=None,
    k_pos=2.0,
    lambda_pos=3.0,
    k_neg=3.0,
    lambda_neg=2.0,
    log_ratio_clamp=20.0,
):
    """VESPO: -sg(phi(w)) A log pi with phi(w) = w^k e^(lambda (1 - w)) and w the product of
    the token ratios (times the importance weights), in the authors' clipped log space."""
    logps, old, adv = (np.asarray(x, np.float64) for x in (logps, old, adv))
    c, floor = log_ratio_clamp, np.log(1e-8)
    log_w = np.clip(logps - old, -c, c).sum()
    if weights is not None:
        log_w += np.clip(np.log(np.maximum(np.asarray(weights, np.float64), 1e-8)), floor, c).sum()
    w = np.exp(np.clip(log_w, floor, c))
    k = np.where(adv >= 0, k_pos, k_neg)
    lam = np.where(adv >= 0, lambda_pos, lambda_neg)
    phi = w**k * np.exp(lam * (1 - w))
    return -phi * adv * logps


def off_policy_mask(logps, sampler, adv, threshold):
    """DeepSeek-V3.2 eq. 9: 0 where A < 0 and mean(log pi_sampler - log pi) > delta."""
    drift = np.mean(np.asarray(sampler, np.float64) - np.asarray(logps, np.float64))
    return np.where((np.asarray(adv) < 0) & (drift > threshold), 0.0, 1.0)


def importance_weights(logps, sampler, level="token", mode="truncate", cap=2.0, floor=None):
    """TIS min(rho, C) or MIS rho 1[floor <= rho <= C]; rho per token, product or geo-mean."""
    log_rho = np.asarray(logps, np.float64) - np.asarray(sampler, np.float64)
    if level == "sequence":
        log_rho = np.full(log_rho.shape, log_rho.sum())
    elif level == "geometric":
        log_rho = np.full(log_rho.shape, log_rho.mean())
    rho = np.exp(log_rho)
    if mode == "truncate":
        return np.minimum(rho, cap)
    keep = (rho <= cap) & (rho >= (0.0 if floor is None else floor))
    return np.where(keep, rho, 0.0)


def value(values, old_values, returns, epsilon_low=0.2, epsilon_high=0.2):
    """PPO2: 0.5 max((V - R)^2, (clip(V, V_old - eps_low, V_old + eps_high) - R)^2)."""
    v, v_old, ret = (np.asarray(x, np.float64) for x in (values, old_values, returns))
    low = -np.inf if epsilon_low is None else v_old - epsilon_low
    high = np.inf if epsilon_high is None else v_old + epsilon_high
    return 0.5 * np.maximum((v - ret) ** 2, (np.clip(v, low, high) - ret) ** 2)


def rows(where, *arrays):
    """Per row, the float64 valid entries of each array (`[B]` arrays repeat per token)."""
    where = np.asarray(where)
    out = []
    for i in range(where.shape[0]):
        row = []
        for x in arrays:
            x = np.asarray(x, np.float64)
            row.append(np.full(where[i].sum(), x[i]) if x.ndim == 1 else x[i][where[i]])
        out.append(row)
    return out


def per_token(reference, where, *arrays, **hyper):
    """The row-wise `reference` placed on the valid tokens, 0 elsewhere."""
    where = np.asarray(where)
    out = np.zeros(where.shape)
    for i, row in enumerate(rows(where, *arrays)):
        if where[i].any():
            out[i, where[i]] = reference(*row, **hyper)
    return out


# ---------------------------------------------------------------------------------------------
# Contracts of the `[B, T] -> [B, T]` functions.


@dataclasses.dataclass(frozen=True)
class Spec:
    """How to call one per-token function and what it must equal.

    `names` are its data arguments in order and `ranges` their generated ranges; an entry
    `("near", j, lo, hi)` draws the argument as data argument `j` plus an offset in
    `[lo, hi]` (a behaviour log-prob near the current one). An argument named `advantages` is
    drawn as `[B]` or `[B, T]`. `hyper` holds the ranges of the numeric hyperparameters
    (keywords, traced under jit), `static` fixed keywords, `reference` the row-wise float64
    reference and `build` maps the data list to positional arguments (to insert a None).
    `differentiable` is False for stop-gradient outputs, whose gradient must vanish.
    """

    fn: Callable
    reference: Callable
    names: tuple[str, ...]
    ranges: tuple[tuple, ...]
    hyper: dict[str, tuple[float, float]]
    static: dict = dataclasses.field(default_factory=dict)
    build: Callable = tuple
    differentiable: bool = True
    id: str = ""

    def __post_init__(self):
        object.__setattr__(self, "jitted", jax.jit(self.call))

    def call(self, data, hyper, where=None):
        return self.fn(*self.build(list(data)), **hyper, **self.static, where=where)

    def expected(self, data, hyper, where):
        return per_token(self.reference, where, *data, **hyper, **self.static)

    def middle(self):
        return {k: (lo + hi) / 2 for k, (lo, hi) in self.hyper.items()}

    def lows(self):
        return {k: lo for k, (lo, _) in self.hyper.items()}

    def highs(self):
        return {k: hi for k, (_, hi) in self.hyper.items()}


def draw_data(spec, b, t, uniform, per_sequence, bound=None):
    """Data in each argument's range; `uniform(lo, hi, shape)` supplies the numbers.

    With `bound`, ranges are clipped to [-bound, bound] and offsets to [-bound/4, bound/4].
    """
    data = []
    for name, r in zip(spec.names, spec.ranges, strict=True):
        shape = (b,) if name == "advantages" and per_sequence else (b, t)
        near = r[0] == "near"
        lo, hi = r[2:] if near else r
        if bound is not None:
            limit = bound / 4 if near else bound
            lo, hi = max(lo, -limit), min(hi, limit)
        x = np.asarray(uniform(lo, hi, shape), np.float32)
        data.append((data[r[1]] + x).astype(np.float32) if near else x)
    return data


def fixed_data(spec, b=3, t=5, seed=0, per_sequence=False, bound=None):
    """Uniform data in each argument's range (see `draw_data` for `bound`)."""
    rng = np.random.default_rng(seed)
    return draw_data(spec, b, t, rng.uniform, per_sequence, bound)


@st.composite
def problems(draw, spec):
    # A few shapes, single row and single token included: each one compiles the function again.
    b, t = draw(st.sampled_from([(1, 1), (1, 4), (2, 3), (3, 4)]))
    per_sequence = "advantages" in spec.names and draw(st.booleans())
    data = draw_data(
        spec, b, t, lambda lo, hi, shape: draw(float_arrays(shape, lo, hi)), per_sequence
    )
    hyper = {k: draw(st.floats(lo, hi)) for k, (lo, hi) in spec.hyper.items()}
    return data, hyper, draw(bool_arrays((b, t)))


def nan_where_masked(data, where):
    """Every `[B, T]` array NaN on masked tokens (a `[B]` array NaN on empty rows)."""
    out = []
    for x in data:
        mask = where if x.ndim == 2 else where.any(-1)
        out.append(np.where(mask, x, np.nan).astype(np.float32))
    return out


def compacted(data, where):
    """Each row's valid tokens moved to the front and the empty tail cut off."""
    n = where.sum(-1)
    t = max(int(n.max()), 1)
    order = np.argsort(~where, axis=-1, kind="stable")[:, :t]
    new_where = np.arange(t)[None, :] < n[:, None]
    out = []
    for x in data:
        if x.ndim == 2:
            x = np.where(new_where, np.take_along_axis(x, order, -1), 0).astype(np.float32)
        out.append(x)
    return out, new_where


class TokenContracts:
    """Tests every per-token function passes; subclass with a module-scoped `spec` fixture."""

    def test_fixed_values_match_reference(self, spec):
        where = np.array([[True] * 5, [True, True, False, True, False], [False] * 5])
        for per_sequence in (False, True):
            data = fixed_data(spec, per_sequence=per_sequence)
            out = spec.call(data, spec.middle(), where)
            assert out.dtype == jnp.float32 and out.shape == (3, 5)
            assert_close(out, spec.expected(data, spec.middle(), where), rtol=1e-5, atol=1e-5)

    @given(st.data())
    def test_generated_values_match_reference(self, spec, data):
        arrays, hyper, where = data.draw(problems(spec))
        out = spec.jitted(nan_where_masked(arrays, where), hyper, where)
        assert_close(out, spec.expected(arrays, hyper, where), rtol=1e-4, atol=1e-4)

    @given(st.data())
    def test_masked_equals_sliced(self, spec, data):
        arrays, hyper, where = data.draw(problems(spec))
        masked = np.asarray(spec.jitted(nan_where_masked(arrays, where), hyper, where))
        assert np.all(masked[~where] == 0)
        if where.any():
            sliced_data, sliced_where = compacted(arrays, where)
            sliced = np.asarray(spec.jitted(sliced_data, hyper, sliced_where))
            np.testing.assert_allclose(sliced[sliced_where], masked[where], rtol=1e-6, atol=1e-6)

    def test_masked_tokens_have_zero_finite_gradient(self, spec):
        where = np.array([[True, False, True, False], [False, False, False, False]])
        bad = np.array([[0.0, np.nan, 0.0, -np.inf], [np.inf, np.nan, -np.inf, 1e30]])
        for per_sequence in (False, True):
            # Small inputs keep every ratio inside the trust region, so the valid tokens get a
            # gradient.
            data = fixed_data(spec, b=2, t=4, seed=1, per_sequence=per_sequence, bound=0.1)
            data = [
                np.where(where, x, bad).astype(np.float32)
                if x.ndim == 2
                else np.array([x[0], np.nan], np.float32)
                for x in data
            ]
            value, grads = jax.value_and_grad(
                lambda d: jnp.sum(spec.call(d, spec.middle(), where))
            )(data)
            assert np.isfinite(value)
            for x, grad in zip(data, grads, strict=True):
                assert np.all(np.isfinite(grad))
                assert np.all(np.asarray(grad)[~(where if x.ndim == 2 else where.any(-1))] == 0)
            if spec.differentiable:
                assert np.any(np.asarray(grads[0])[where] != 0)
            else:
                assert all(np.all(np.asarray(g) == 0) for g in grads)

    def test_fully_masked_is_zero(self, spec):
        data = [
            np.full((3,) if name == "advantages" else (3, 4), np.nan, np.float32)
            for name in spec.names
        ]
        where = np.zeros((3, 4), bool)
        assert np.all(np.asarray(spec.call(data, spec.middle(), where)) == 0)
        grads = jax.grad(lambda d: jnp.sum(spec.call(d, spec.middle(), where)))(data)
        assert all(np.all(np.asarray(g) == 0) for g in grads)

    def test_finite_for_extreme_inputs(self, spec):
        # Log-probs from -1e4 to 0 (log-ratios up to 1e4 in magnitude), advantages and values
        # up to 1e3, at the smallest, middle and largest hyperparameters.
        rng = np.random.default_rng(2)
        data = []
        for name in spec.names:
            if "logps" in name:
                x = -rng.uniform(0, 1e4, (2, 6))
                x[0, :3] = -1e4, 0.0, -1e-30
            else:
                x = rng.uniform(-1e3, 1e3, (2, 6))
            data.append(x.astype(np.float32))
        for hyper in (spec.lows(), spec.middle(), spec.highs()):
            value, grads = jax.value_and_grad(lambda d, h=hyper: jnp.sum(spec.call(d, h)))(data)
            assert np.isfinite(value), hyper
            assert all(np.all(np.isfinite(g)) for g in grads), hyper

    def test_bf16_inputs_are_computed_in_float32(self, spec):
        data = fixed_data(spec, seed=3, bound=2.0)
        low = [x.astype(jnp.bfloat16) for x in data]
        out = spec.call(low, spec.middle())
        assert out.dtype == jnp.float32
        # Exactly the float32 result on the rounded inputs: nothing is computed in bf16 ...
        rounded = [np.asarray(x, np.float32) for x in low]
        assert_close(out, spec.call(rounded, spec.middle()), rtol=1e-6, atol=1e-6)
        # ... so the only error is the rounding of the inputs to 8 significant bits: log-probs
        # in [-2, 0] and their neighbours in [-2.5, 0.5] move by at most 2^-8 and 2^-7, a token
        # log-ratio by 0.012 (its ratio by 1.2 %), a product of 5 ratios by 6 %; for results
        # up to 5 in magnitude that is within 0.05 (1 + |result|).
        full = np.asarray(spec.call(data, spec.middle()))
        np.testing.assert_allclose(out, full, rtol=0.05, atol=0.05)

    def test_float64_stays_float64(self, spec):
        data = fixed_data(spec, seed=4)
        where = np.ones((3, 5), bool)
        with jax.enable_x64(True):
            out = spec.call([jnp.asarray(x, jnp.float64) for x in data], spec.middle())
            assert out.dtype == jnp.float64
            assert_close(out, spec.expected(data, spec.middle(), where), rtol=1e-10, atol=1e-10)

    def test_vmap_and_no_retrace(self, spec):
        stacked = [
            np.stack(z) for z in zip(*(fixed_data(spec, seed=s) for s in range(3)), strict=True)
        ]
        where = np.ones((3, 3, 5), bool)
        where[1, 0, 2:] = False
        where[2] = False
        mapped = jax.vmap(lambda d, w: spec.call(d, spec.middle(), w))(stacked, where)
        for i in range(3):
            single = spec.call([x[i] for x in stacked], spec.middle(), where[i])
            assert_close(mapped[i], single, rtol=1e-6, atol=1e-6)
        calls = [
            (([x[i] for x in stacked], {k: jnp.float32(v) for k, v in hyper.items()}, where[i]), {})
            for i, hyper in enumerate([spec.middle(), spec.lows(), spec.highs()])
        ]
        assert_traced_once(spec.call, calls)

    def test_errors_name_the_argument(self, spec):
        data = fixed_data(spec, b=2, t=3)
        last = spec.names[-1]
        short = [*data[:-1], data[-1][:, :2]]
        with raises_naming(last):
            spec.call(short, spec.middle())
        with raises_naming("where"):
            spec.call(data, spec.middle(), np.ones((2, 3), np.float32))
        with own_checks():
            with raises_naming(last, "(2, 2)", "(2, 3)", error=ValueError):
                spec.call(short, spec.middle())
            with raises_naming(spec.names[0], "[B, T]", error=ValueError):
                spec.call([data[0][0], *data[1:]], spec.middle())
            with raises_naming("where", "(2,)", error=ValueError):
                spec.call(data, spec.middle(), np.ones(2, bool))
            with raises_naming(spec.names[1], error=TypeError):
                spec.call([data[0], data[1].astype(np.int32), *data[2:]], spec.middle())

    def test_integer_masks_count_like_boolean_masks(self, spec):
        data = fixed_data(spec, b=2, t=3, seed=5)
        where = np.array([[True, False, True], [True, True, False]])
        expected = np.asarray(spec.call(data, spec.middle(), where))
        out = spec.call(data, spec.middle(), where.astype(np.int32))
        np.testing.assert_array_equal(out, expected)
        with raises_naming("where", "2", error=ValueError):
            spec.call(data, spec.middle(), np.array([[1, 0, 2], [1, 1, 0]], np.int32))


def check_advantage_shapes(spec):
    """Advantages must be `[B]` or `[B, T]`; any other shape or an integer dtype is an error."""
    k = spec.names.index("advantages")
    data = fixed_data(spec, b=2, t=3)
    for bad in (np.ones(3), np.ones((2, 1)), np.ones(4), np.ones((3, 3)), np.ones((2, 3, 1))):
        bad_data = [*data[:k], bad.astype(np.float32), *data[k + 1 :]]
        with raises_naming("advantages"):
            spec.call(bad_data, spec.middle())
        with own_checks(), raises_naming("advantages", str(bad.shape), "(2,)", "(2, 3)"):
            spec.call(bad_data, spec.middle())
    with own_checks(), raises_naming("advantages", error=TypeError):
        spec.call([*data[:k], np.ones(2, np.int32), *data[k + 1 :]], spec.middle())
