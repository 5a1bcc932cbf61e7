"""Contracts every `[B] -> [B]` preference loss and diagnostic keeps, one parametrized test each.

Each `Spec` says how to call one function on generated `[B]` float data and which float64
reference (tests/losses/_preference_refs.py) it must match. The per-loss properties live in the
test module of each loss.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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

PAIR = ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps")
LOGP = (-30.0, 0.0)
MEAN_LOGP = (-5.0, 0.0)
ORPO_LOGP = (-8.0, -(2.0**-20))  # mean log-probs, < 0; bounds exact in float32


def positional(data, names):
    return tuple(data), {}


@dataclasses.dataclass(frozen=True)
class Spec:
    """How to call one function and what it must equal.

    `names` are the data arguments in order, `ranges` their generated ranges, `hyper` the
    ranges of the numeric hyperparameters (passed as keywords, traced under jit), `build`
    maps the data list to `(args, kwargs)` and `reference` takes the float64 valid rows and the
    hyperparameters. `per_rank` marks AOT, whose output is indexed by rank, not by row.
    """

    fn: Callable
    reference: Callable
    names: tuple[str, ...]
    ranges: tuple[tuple[float, float], ...]
    hyper: dict[str, tuple[float, float]]
    static: dict = dataclasses.field(default_factory=dict)
    build: Callable = positional
    per_rank: bool = False
    id: str = ""

    def __post_init__(self):
        object.__setattr__(self, "jitted", jax.jit(self.call))

    def call(self, data, hyper, where=None):
        args, kwargs = self.build(list(data), self.names)
        return self.fn(*args, **kwargs, **hyper, **self.static, where=where)

    def expected(self, data, hyper, where):
        """The reference on the valid rows, placed by row (or by rank), 0 elsewhere."""
        where = np.asarray(where)
        out = np.zeros(where.shape)
        valid = [np.asarray(x, np.float64)[where] for x in data]
        if where.any():
            values = self.reference(*valid, **hyper)
            if self.per_rank:
                out[: where.sum()] = values
            else:
                out[where] = values
        return out

    def middle(self):
        return {k: (lo + hi) / 2 for k, (lo, hi) in self.hyper.items()}


def with_desirable(data, names):
    return (data[0], data[1], data[2] > 0), {}


def with_chosen_nll(data, names):
    return (data[0], data[1]), {"chosen_nll": data[2]}


def with_margin(data, names):
    return (data[0], data[1]), {"margin": data[2]}


def pair_spec(fn, reference, hyper, **kw):
    return Spec(fn, reference, PAIR, (LOGP,) * 4, hyper, id=kw.pop("id", fn.__name__), **kw)


BETA = (0.05, 2.0)
SPECS = [
    pair_spec(losses.dpo_loss, ref.dpo, {"beta": BETA, "label_smoothing": (0.0, 0.5)}),
    pair_spec(
        losses.robust_dpo_loss, ref.robust_dpo, {"beta": BETA, "label_smoothing": (0.0, 0.45)}
    ),
    pair_spec(losses.ipo_loss, ref.ipo, {"beta": BETA}),
    pair_spec(losses.hinge_loss, ref.hinge, {"beta": BETA}),
    pair_spec(losses.exo_loss, ref.exo, {"beta": BETA, "label_smoothing": (1e-4, 0.3)}),
    pair_spec(losses.discopop_loss, ref.discopop, {"beta": (0.01, 1.0), "tau": (0.02, 0.5)}),
    pair_spec(losses.nca_loss, ref.nca, {"beta": BETA}),
    pair_spec(losses.bco_pair_loss, ref.bco_pair, {"beta": BETA, "delta": (-2.0, 2.0)}),
    pair_spec(losses.sppo_hard_loss, ref.sppo_hard, {"beta": BETA}),
    pair_spec(losses.apo_zero_loss, ref.apo_zero, {"beta": BETA}),
    pair_spec(losses.apo_down_loss, ref.apo_down, {"beta": BETA}),
    pair_spec(
        losses.aot_loss,
        lambda *d, **h: ref.aot(*d, **h, paired=False),
        {"beta": BETA, "label_smoothing": (0.0, 0.5)},
        per_rank=True,
        id="aot_unpaired",
    ),
    pair_spec(
        losses.aot_loss,
        lambda *d, **h: ref.aot(*d, **h, paired=True),
        {"beta": BETA, "label_smoothing": (0.0, 0.5)},
        static={"paired": True},
        per_rank=True,
        id="aot_paired",
    ),
    Spec(
        losses.length_normalized_dpo_loss,
        ref.length_normalized_dpo,
        (*PAIR, "chosen_lengths", "rejected_lengths"),
        (LOGP,) * 4 + ((1.0, 40.0),) * 2,
        {"beta": (0.5, 10.0)},
        id="length_normalized_dpo_loss",
    ),
    Spec(
        losses.simpo_loss,
        ref.simpo,
        PAIR[:2],
        (MEAN_LOGP,) * 2,
        {"beta": (0.5, 10.0), "margin": (0.0, 5.0), "label_smoothing": (0.0, 0.5)},
        id="simpo_loss",
    ),
    Spec(
        losses.cpo_loss,
        ref.cpo,
        PAIR[:2],
        (LOGP,) * 2,
        {"beta": BETA, "label_smoothing": (0.0, 0.5), "nll_weight": (0.0, 2.0)},
        id="cpo_loss",
    ),
    Spec(
        losses.cpo_loss,
        lambda c, r, nll, **h: ref.cpo(c, r, chosen_nll=nll, **h),
        (*PAIR[:2], "chosen_nll"),
        (LOGP, LOGP, (0.0, 5.0)),
        {"beta": BETA, "nll_weight": (0.0, 2.0)},
        build=with_chosen_nll,
        id="cpo_loss_chosen_nll",
    ),
    Spec(
        losses.orpo_loss,
        ref.orpo,
        PAIR[:2],
        (ORPO_LOGP,) * 2,
        {"odds_ratio_weight": (0.0, 1.0)},
        id="orpo_loss",
    ),
    Spec(
        losses.orpo_loss,
        lambda c, r, nll, **h: ref.orpo(c, r, chosen_nll=nll, **h),
        (*PAIR[:2], "chosen_nll"),
        (ORPO_LOGP, ORPO_LOGP, (0.0, 5.0)),
        {"odds_ratio_weight": (0.0, 1.0)},
        build=with_chosen_nll,
        id="orpo_loss_chosen_nll",
    ),
    Spec(
        losses.orpo_log_odds_ratio,
        ref.orpo_log_odds_ratio,
        PAIR[:2],
        (ORPO_LOGP,) * 2,
        {},
        id="orpo_log_odds_ratio",
    ),
    Spec(
        losses.kto_loss,
        lambda lp, rlp, d, reference_point, beta, desirable_weight, undesirable_weight: ref.kto(
            lp, rlp, d > 0, reference_point, beta, desirable_weight, undesirable_weight
        ),
        ("logps", "ref_logps", "desirable"),
        (LOGP, LOGP, (-1.0, 1.0)),
        {
            "reference_point": (0.0, 5.0),
            "beta": BETA,
            "desirable_weight": (0.5, 2.0),
            "undesirable_weight": (0.5, 2.0),
        },
        build=with_desirable,
        id="kto_loss",
    ),
    Spec(
        losses.bradley_terry_loss,
        ref.bradley_terry,
        ("chosen_rewards", "rejected_rewards"),
        ((-10.0, 10.0),) * 2,
        {"margin": (-2.0, 2.0), "centering_weight": (0.0, 0.1)},
        id="bradley_terry_loss",
    ),
    Spec(
        losses.bradley_terry_loss,
        lambda c, r, m, **h: ref.bradley_terry(c, r, margin=m, **h),
        ("chosen_rewards", "rejected_rewards", "margin"),
        ((-10.0, 10.0), (-10.0, 10.0), (0.0, 3.0)),
        {"centering_weight": (0.0, 0.1)},
        build=with_margin,
        id="bradley_terry_loss_margins",
    ),
    Spec(
        metrics.implicit_rewards,
        ref.implicit_rewards,
        ("logps", "ref_logps"),
        (LOGP, LOGP),
        {"beta": BETA},
        id="implicit_rewards",
    ),
    Spec(
        metrics.reward_margins,
        lambda c, r: np.subtract(c, r),
        ("chosen_rewards", "rejected_rewards"),
        ((-10.0, 10.0),) * 2,
        {},
        id="reward_margins",
    ),
]
parametrize_specs = pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])


def fixed_data(spec, b=5, seed=0, bound=np.inf):
    """Uniform data in each argument's range, clipped to [-bound, bound]."""
    rng = np.random.default_rng(seed)
    ranges = [(max(lo, -bound), min(hi, bound)) for lo, hi in spec.ranges]
    return [rng.uniform(lo, hi, b).astype(np.float32) for lo, hi in ranges]


@st.composite
def problems(draw, spec, max_b=4):
    b = draw(st.integers(1, max_b))
    data = [draw(float_arrays((b,), lo, hi)) for lo, hi in spec.ranges]
    # float32 values without subnormals: the function traces its hyperparameters as float32,
    # and the float64 reference must see the same number (AlphaPO's shape 5e-324 is 0 there).
    hyper = {k: float(np.float32(draw(st.floats(lo, hi, allow_subnormal=False))))
             for k, (lo, hi) in spec.hyper.items()}  # fmt: skip
    return data, hyper, draw(bool_arrays((b,)))


def nan_where_masked(data, where):
    return [np.where(where, x, np.nan).astype(np.float32) for x in data]


@parametrize_specs
def test_fixed_values_match_reference(spec):
    data = fixed_data(spec)
    out = spec.call(data, spec.middle())
    assert out.dtype == jnp.float32 and out.shape == (5,)
    assert_close(out, spec.expected(data, spec.middle(), np.ones(5, bool)), rtol=1e-5, atol=1e-5)


@parametrize_specs
@given(st.data())
def test_generated_values_match_reference(spec, draw):
    data, hyper, where = draw.draw(problems(spec))
    out = spec.jitted(nan_where_masked(data, where), hyper, where)
    assert_close(out, spec.expected(data, hyper, where), rtol=1e-4, atol=1e-4)


@parametrize_specs
@given(st.data())
def test_masked_equals_sliced(spec, draw):
    data, hyper, where = draw.draw(problems(spec))
    masked = np.asarray(spec.jitted(nan_where_masked(data, where), hyper, where))
    k = int(where.sum())
    if k:
        sliced = np.asarray(spec.jitted([x[where] for x in data], hyper, np.ones(k, bool)))
        kept = masked[:k] if spec.per_rank else masked[where]
        np.testing.assert_allclose(kept, sliced, rtol=1e-6, atol=1e-6)
    dropped = masked[k:] if spec.per_rank else masked[~where]
    assert np.all(dropped == 0)


@parametrize_specs
def test_masked_rows_have_zero_finite_gradient(spec):
    data = fixed_data(spec, b=5, seed=1)
    where = np.array([True, False, True, False, False])
    bad = np.array([0.0, np.nan, 0.0, -np.inf, np.inf], np.float32)
    data = [np.where(where, x, bad).astype(np.float32) for x in data]
    value, grads = jax.value_and_grad(lambda d: jnp.sum(spec.call(d, spec.middle(), where)))(data)
    assert np.isfinite(value)
    for grad in grads:
        assert np.all(np.isfinite(grad))
        assert np.all(np.asarray(grad)[~where] == 0)
    # The gradient reaches the valid rows through at least one argument.
    assert any(np.any(np.asarray(g)[where] != 0) for g in grads)


@parametrize_specs
def test_fully_masked_is_zero(spec):
    data = [np.full(3, np.nan, np.float32) for _ in spec.names]
    where = np.zeros(3, bool)
    assert np.all(np.asarray(spec.call(data, spec.middle(), where)) == 0)
    grads = jax.grad(lambda d: jnp.sum(spec.call(d, spec.middle(), where)))(data)
    assert all(np.all(np.asarray(g) == 0) for g in grads)


@parametrize_specs
def test_finite_for_extreme_inputs(spec):
    # Inputs up to 1e4 in magnitude, of either sign unless the argument is non-negative (token
    # counts, NLLs, margins), end points included; with the smallest, middle and largest
    # hyperparameters.
    rng = np.random.default_rng(2)
    data = []
    for lo, _ in spec.ranges:
        lo, hi = (lo if lo >= 0 else -1e4), 1e4
        x = rng.uniform(lo, hi, 8)
        x[:3] = lo, hi, 0.0 if lo <= 0 else hi
        data.append(x.astype(np.float32))
    lows = {k: lo for k, (lo, _) in spec.hyper.items()}
    highs = {k: hi for k, (_, hi) in spec.hyper.items()}
    for hyper in (lows, spec.middle(), highs):
        value, grads = jax.value_and_grad(lambda d, h=hyper: jnp.sum(spec.call(d, h)))(data)
        assert np.isfinite(value), hyper
        assert all(np.all(np.isfinite(g)) for g in grads), hyper


@parametrize_specs
def test_bf16_inputs_are_computed_in_float32(spec):
    data = fixed_data(spec, seed=3, bound=4.0)
    low = [x.astype(jnp.bfloat16) for x in data]
    out = spec.call(low, spec.middle())
    assert out.dtype == jnp.float32
    # Exactly the float32 result on the rounded inputs: nothing is computed in bf16 ...
    rounded = [np.asarray(x, np.float32) for x in low]
    assert_close(out, spec.call(rounded, spec.middle()), rtol=1e-6, atol=1e-6)
    # ... so the only error is the rounding of the inputs to 8 significant bits (a relative
    # 2^-8), which for |inputs| <= 4 stays within 0.05 (1 + |loss|).
    full = np.asarray(spec.call(data, spec.middle()))
    np.testing.assert_allclose(out, full, rtol=0.05, atol=0.05)


@parametrize_specs
def test_float64_stays_float64(spec):
    data = fixed_data(spec, seed=4)
    with jax.enable_x64(True):
        data64 = [jnp.asarray(x, jnp.float64) for x in data]
        out = spec.call(data64, spec.middle())
        assert out.dtype == jnp.float64
        assert_close(
            out, spec.expected(data, spec.middle(), np.ones(5, bool)), rtol=1e-10, atol=1e-10
        )


@parametrize_specs
def test_vmap_and_no_retrace(spec):
    stacked = [np.stack(z) for z in zip(*(fixed_data(spec, seed=s) for s in range(3)), strict=True)]
    where = np.array([[True] * 5, [True, False, True, True, False], [False] * 5])
    mapped = jax.vmap(lambda d, w: spec.call(d, spec.middle(), w))(stacked, where)
    for i in range(3):
        single = spec.call([x[i] for x in stacked], spec.middle(), where[i])
        assert_close(mapped[i], single, rtol=1e-6, atol=1e-6)
    calls = [
        (([x[i] for x in stacked], {k: jnp.float32(v) for k, v in hyper.items()}, where[i]), {})
        for i, hyper in enumerate(
            [spec.middle(), {k: lo for k, (lo, _) in spec.hyper.items()}, spec.middle()]
        )
    ]
    assert_traced_once(spec.call, calls)


@parametrize_specs
def test_errors_name_the_argument(spec):
    data = fixed_data(spec, b=3)
    last = spec.names[-1]
    short = [*data[:-1], data[-1][:2]]
    with raises_naming(last):
        spec.call(short, spec.middle())
    with raises_naming("where"):
        spec.call(data, spec.middle(), np.ones(3, np.float32))
    with own_checks():
        with raises_naming(last, "(2,)", "(3,)", error=ValueError):
            spec.call(short, spec.middle())
        with raises_naming(spec.names[0], "[B]", error=ValueError):
            spec.call([data[0][None], *data[1:]], spec.middle())
        with raises_naming("where", "(2,)", error=ValueError):
            spec.call(data, spec.middle(), np.ones(2, bool))
        with raises_naming(spec.names[1], error=TypeError):
            spec.call([data[0], data[1].astype(np.int32), *data[2:]], spec.middle())


@parametrize_specs
def test_integer_masks_count_like_boolean_masks(spec):
    data = fixed_data(spec, b=4, seed=5)
    where = np.array([True, False, True, True])
    expected = np.asarray(spec.call(data, spec.middle(), where))
    np.testing.assert_array_equal(spec.call(data, spec.middle(), where.astype(np.int32)), expected)
    with raises_naming("where", "2", error=ValueError):
        spec.call(data, spec.middle(), np.array([1, 0, 2, 1], np.int32))
