import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._helpers import assert_traced_once, bool_arrays, float_arrays, own_checks
from tunelib import rollout
from tunelib.rollout._processors import _nucleus_threshold

# Jitted once per shape (hypothesis draws from a few shapes only); the numeric hyperparameters
# are traced, so new values of p or min_p do not recompile.
top_k_filter = jax.jit(rollout.top_k_filter, static_argnames="k")
top_p_filter = jax.jit(rollout.top_p_filter)
min_p_filter = jax.jit(rollout.min_p_filter)
process_logits = jax.jit(rollout.process_logits, static_argnames=("top_k", "forbidden_tokens"))

SHAPES = [(1, 1), (2, 7), (3, 64)]
# A token whose cumulative probability lies this close to p (float32 sums over <= 64 terms are
# off by less than 1e-5), or whose log-probability ratio to the argmax lies this close to
# log(min_p) (relative: float32 logits near 256 are 1.5e-5 apart), is decided by rounding, not
# by the definition: the comparisons with the float64 references let it go either way.
TOL = 1e-5


# ------------------------------------------------------------------ float64 references


def ref_probs(logits):
    x = np.asarray(logits, np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def ref_top_k(logits, k):
    """Keep every logit >= the k-th largest of its row."""
    x = np.asarray(logits, np.float64)
    kth = -np.sort(-x, axis=-1)[:, min(k, x.shape[-1]) - 1, None]
    return np.where(x >= kth, x, -np.inf)


def ref_top_p_sorted(logits, p):
    """Holtzman et al.: sort by probability, keep each token whose cumulative probability
    before it is < p (the token that crosses p included). Also returns that mass per token."""
    x = np.asarray(logits, np.float64)
    probs = ref_probs(x)
    order = np.argsort(-probs, axis=-1, kind="stable")
    cumulative = np.cumsum(np.take_along_axis(probs, order, axis=-1), axis=-1)
    before = np.empty_like(probs)
    np.put_along_axis(before, order, cumulative - np.take_along_axis(probs, order, -1), -1)
    return np.where((before < p) | (p >= 1), x, -np.inf), before


def ref_top_p_ties(logits, p):
    """The tie-inclusive nucleus: keep v iff the mass strictly more probable than v is < p."""
    x = np.asarray(logits, np.float64)
    probs = ref_probs(x)
    above = np.sum(np.where(probs[:, None, :] > probs[:, :, None], probs[:, None, :], 0), -1)
    return np.where((above < p) | (p >= 1), x, -np.inf), above


def ref_min_p(logits, min_p):
    """Keep pi_v >= min_p * max pi. Also returns log(pi_v / max pi)."""
    x = np.asarray(logits, np.float64)
    probs = ref_probs(x)
    top = probs.max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return np.where(probs >= min_p * top, x, -np.inf), np.log(probs / top)


def ref_process(logits, temperature, top_k, top_p, min_p, forbidden):
    x = np.array(logits, np.float64)
    x[:, list(forbidden)] = -np.inf
    x = x / temperature
    if top_k is not None:
        x = ref_top_k(x, top_k)
    if top_p is not None:
        x = ref_top_p_sorted(x, top_p)[0]
    if min_p is not None:
        x = ref_min_p(x, min_p)[0]
    return x


def f32(x: float) -> float:
    """The value a Python hyperparameter takes inside the float32 computation."""
    return float(np.float32(x))


# ------------------------------------------------------------------ generated logits


TIED_VALUES = [-3.0, -1.0, 0.0, 0.5, 2.0]


@st.composite
def logits(draw, ties: bool = False):
    """`[B, V]` float32 logits, some entries -inf (never a whole row).

    Without `ties` the finite logits of a row are distinct and at least 1/256 apart (a shuffled
    cumulative sum of gaps), so their float32 probabilities are distinct too; with `ties` they
    come from five values, so most rows hold ties, at the maximum as well.
    """
    b, v = draw(st.sampled_from(SHAPES))
    if ties:
        x = draw(hnp.arrays(np.float32, (b, v), elements=st.sampled_from(TIED_VALUES)))
    else:
        gaps = draw(float_arrays((b, v), 1 / 64, 1.0)).astype(np.float64)
        scale = draw(st.floats(0.25, 4.0))
        offset = draw(st.floats(-10.0, 10.0))
        rows = [np.cumsum(g)[draw(st.permutations(range(v)))] for g in gaps]
        x = (offset + scale * np.stack(rows)).astype(np.float32)
    masked = draw(bool_arrays((b, v)))
    masked[masked.all(axis=1), 0] = False
    return np.where(masked, -np.inf, x).astype(np.float32)


def assert_filtered(out, x):
    """`out` is `x` with some tokens at -inf, float32, and the argmax (with its ties) kept."""
    out, x = np.asarray(out), np.asarray(x, np.float32)
    assert out.dtype == np.float32 and out.shape == x.shape
    kept = np.isfinite(out)
    assert np.all(np.isfinite(x)[kept]), "kept a token outside the support"
    np.testing.assert_array_equal(out[kept], x[kept])
    assert np.all(out[~kept] == -np.inf)
    top = x == x.max(axis=-1, keepdims=True)
    assert np.all(kept[top]), "removed the argmax or a token tied with it"


def assert_same_kept(out, expected, *, mass=None, cutoff=None, tol=0.0):
    """`out` keeps the tokens `expected` keeps, except that a token whose decisive `mass` lies
    within `tol` of `cutoff` may go either way: rounding, not the definition, decides it."""
    same = np.isfinite(out) == np.isfinite(expected)
    if mass is not None:
        with np.errstate(invalid="ignore"):  # -inf - -inf at forbidden tokens for min_p = 0
            same |= np.abs(mass - cutoff) <= tol
    assert same.all(), f"tokens {np.argwhere(~same).tolist()} differ from the reference"


# ------------------------------------------------------------------ top-k


def test_top_k_fixed_values():
    x = np.array([[3.0, 1.0, 2.0, 0.0], [1.0, 2.0, 2.0, -np.inf]], np.float32)
    np.testing.assert_array_equal(
        top_k_filter(x, k=2), [[3.0, -np.inf, 2.0, -np.inf], [-np.inf, 2.0, 2.0, -np.inf]]
    )
    np.testing.assert_array_equal(top_k_filter(x, k=4), x)  # k >= V keeps all
    np.testing.assert_array_equal(top_k_filter(x, k=9), x)


K_VALUES = st.sampled_from([1, 2, 5, 7, 63, 64, 70])


@given(logits(ties=True) | logits(), K_VALUES)
def test_top_k_matches_reference(x, k):
    out = top_k_filter(x, k=k)
    assert_filtered(out, x)
    np.testing.assert_array_equal(out, ref_top_k(x, k))
    kept, support = np.isfinite(out).sum(-1), np.isfinite(x).sum(-1)
    assert np.all(kept >= np.minimum(k, support))  # more only through ties at the k-th value


@given(logits(), K_VALUES)
def test_top_k_keeps_exactly_k_without_ties(x, k):
    kept, support = np.isfinite(top_k_filter(x, k=k)).sum(-1), np.isfinite(x).sum(-1)
    np.testing.assert_array_equal(kept, np.minimum(k, support))


# ------------------------------------------------------------------ top-p


def test_top_p_fixed_values():
    x = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]], np.float32))
    for p, kept in [(0.3, 1), (0.49, 1), (0.51, 2), (0.79, 2), (0.81, 3), (0.96, 4), (1.0, 4)]:
        out = np.asarray(top_p_filter(x, p))
        np.testing.assert_array_equal(np.isfinite(out).sum(-1), [kept, kept], err_msg=f"{p=}")
        assert_same_kept(out, ref_top_p_sorted(x, p)[0])  # no tolerance: far from the cutoffs


@given(logits(), st.floats(0.01, 1.0) | st.just(1.0))
def test_top_p_matches_sort_reference(x, p):
    expected, before = ref_top_p_sorted(x, f32(p))
    out = top_p_filter(x, p)
    assert_filtered(out, x)
    assert_same_kept(out, expected, mass=before, cutoff=f32(p), tol=TOL)


@given(logits(ties=True), st.floats(0.01, 1.0))
def test_top_p_keeps_every_token_tied_with_the_crossing_one(x, p):
    expected, above = ref_top_p_ties(x, f32(p))
    out = np.asarray(top_p_filter(x, p))
    assert_filtered(out, x)
    assert_same_kept(out, expected, mass=above, cutoff=f32(p), tol=TOL)
    # A superset of what a sort-based filter keeps, whatever order it breaks ties in.
    by_sort, before = ref_top_p_sorted(x, f32(p))
    assert np.all(np.isfinite(out) | ~np.isfinite(by_sort) | (np.abs(before - f32(p)) <= TOL))


@pytest.mark.parametrize("vocab", [1000, 32000])
def test_top_p_large_vocabulary_matches_sort_reference(vocab):
    """The bisection's 30 steps on long, flat and peaked rows against the float64 sort."""
    rng = np.random.default_rng(vocab)
    scales = np.array([0.3, 1.0, 3.0, 10.0])[:, None]
    x = (scales * rng.standard_normal((4, vocab))).astype(np.float32)
    for p in (0.5, 0.9, 0.99):
        out = np.asarray(top_p_filter(x, p))
        assert_filtered(out, x)
        expected, before = ref_top_p_sorted(x, f32(p))
        # float32 sums over up to 32000 terms: allow more rounding, a few tokens of a flat row.
        assert_same_kept(out, expected, mass=before, cutoff=f32(p), tol=1e-5 * vocab / 1000)
        assert np.all(np.abs(np.isfinite(out).sum(-1) - np.isfinite(expected).sum(-1)) <= 3)


def test_top_p_at_one_keeps_everything():
    x = np.array([[0.0, -1e4, -np.inf, 30.0]], np.float32)
    np.testing.assert_array_equal(rollout.top_p_filter(x, 1), x)  # Python 1: the shortcut
    np.testing.assert_array_equal(top_p_filter(x, 1.0), x)  # traced 1: no shortcut


def test_top_p_crossing_mass_equal_to_p_stops_there():
    """Holtzman's cumulative mass >= p, at equality. No float32 softmax of distinct logits is
    exact, so this checks the threshold search on exactly representable probabilities."""
    probs = jnp.array([[0.5, 0.25, 0.125, 0.0625, 0.0625]], jnp.float32)
    for p, threshold in [(0.5, 0.5), (0.75, 0.25), (0.875, 0.125), (0.9375, 0.0625)]:
        assert _nucleus_threshold(probs, jnp.float32(p)) == threshold, f"{p=}"
    assert _nucleus_threshold(probs, jnp.float32(0.76)) == 0.125


def test_top_p_small_p_keeps_the_argmax_and_its_ties():
    x = np.array([[1.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    expected = [[-np.inf, 3.0, 3.0, -np.inf], [0.0, 0.0, 0.0, 0.0]]
    np.testing.assert_array_equal(top_p_filter(x, 1e-6), expected)


# ------------------------------------------------------------------ min-p


def test_min_p_fixed_values():
    x = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    for min_p, kept in [(0.0, 4), (0.05, 4), (0.11, 3), (0.31, 2), (0.7, 1), (1.0, 1)]:
        out = min_p_filter(x, min_p)
        assert np.isfinite(out).sum() == kept, f"{min_p=}"
        assert_same_kept(out, ref_min_p(x, min_p)[0])  # no tolerance: far from the cutoffs


@given(logits(ties=True) | logits(), st.floats(0.0, 1.0))
def test_min_p_matches_reference(x, min_p):
    expected, log_ratio = ref_min_p(x, f32(min_p))
    out = min_p_filter(x, min_p)
    assert_filtered(out, x)
    with np.errstate(divide="ignore"):
        cutoff = np.log(f32(min_p))
    tol = TOL * np.maximum(1.0, np.abs(log_ratio))
    assert_same_kept(out, expected, mass=log_ratio, cutoff=cutoff, tol=tol)


def test_min_p_keeps_a_token_exactly_at_the_threshold():
    log_quarter = float(jnp.log(jnp.float32(0.25)))  # the float32 log min_p_filter computes
    x = np.array([[0.0, log_quarter, log_quarter - 1e-3]], np.float32)
    np.testing.assert_array_equal(min_p_filter(x, 0.25), [[0.0, log_quarter, -np.inf]])


def test_min_p_at_zero_keeps_everything():
    x = np.array([[0.0, -1e4, -np.inf, 30.0]], np.float32)
    np.testing.assert_array_equal(rollout.min_p_filter(x, 0), x)  # Python 0: the shortcut
    np.testing.assert_array_equal(min_p_filter(x, 0.0), x)  # traced 0: log 0 = -inf


# ------------------------------------------------------------------ temperature, forbid


def test_temperature_scale_values():
    x = np.array([[2.0, -1.0, -np.inf, 0.0]], np.float32)
    for temperature in (0.25, 1.0, 3.0):
        np.testing.assert_allclose(
            jax.jit(rollout.temperature_scale)(x, temperature), x.astype(np.float64) / temperature
        )


def test_forbid_tokens_values():
    x = np.array([[3.0, 1.0, 2.0], [0.0, 5.0, -1.0]], np.float32)
    forbid = jax.jit(rollout.forbid_tokens, static_argnames="token_ids")
    expected = [[-np.inf, 1.0, -np.inf], [-np.inf, 5.0, -np.inf]]
    np.testing.assert_array_equal(forbid(x, token_ids=(0, 2, 2)), expected)
    np.testing.assert_array_equal(forbid(x, token_ids=()), x)


# ------------------------------------------------------------------ composition


def test_process_logits_matches_reference_chain():
    rng = np.random.default_rng(0)
    x = (2.0 * rng.standard_normal((4, 50))).astype(np.float32)
    settings = [
        dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, forbidden=(3, 7)),
        dict(temperature=1.5, top_k=None, top_p=0.95, min_p=None, forbidden=()),
        dict(temperature=1.0, top_k=5, top_p=None, min_p=0.2, forbidden=(0,)),
        dict(temperature=1.0, top_k=None, top_p=None, min_p=None, forbidden=()),
    ]
    for s in settings:
        out = process_logits(
            x, temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"],
            min_p=s["min_p"], forbidden_tokens=s["forbidden"],
        )  # fmt: skip
        expected = ref_process(x, *s.values())
        assert_same_kept(out, expected)
        finite = np.isfinite(expected)
        np.testing.assert_allclose(np.asarray(out)[finite], expected[finite], rtol=1e-6)


@settings(max_examples=10)  # eager calls: slower per example than the jitted filters
@given(logits(), st.floats(0.2, 3.0), st.integers(1, 8), st.floats(0.05, 1.0), st.floats(0, 1))
def test_process_logits_is_the_chain_in_order(x, temperature, k, p, min_p):
    # Both eager, so that the same operations run on both sides.
    chained = rollout.min_p_filter(
        rollout.top_p_filter(rollout.top_k_filter(rollout.temperature_scale(x, temperature), k), p),
        min_p,
    )
    out = rollout.process_logits(x, temperature=temperature, top_k=k, top_p=p, min_p=min_p)
    np.testing.assert_array_equal(out, chained)
    assert np.any(np.isfinite(out), axis=-1).all()


def test_filters_see_the_tempered_distribution():
    x = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)  # softmax 0.64, 0.24, 0.09, 0.03
    assert np.isfinite(process_logits(x, top_p=0.6)).sum() == 1
    assert np.isfinite(process_logits(x, temperature=4.0, top_p=0.6)).sum() == 2
    # top-p measures its mass over what top-k kept: [0.73, 0.27] reaches 0.7 with one token.
    assert np.isfinite(process_logits(x, top_p=0.7)).sum() == 2
    assert np.isfinite(process_logits(x, top_k=2, top_p=0.7)).sum() == 1
    # A forbidden argmax is gone before the filters run; they keep the best allowed token.
    out = process_logits(x, top_p=0.01, forbidden_tokens=(0,))
    np.testing.assert_array_equal(out, [[-np.inf, 1.0, -np.inf, -np.inf]])


# ------------------------------------------------------------------ jit, dtypes


def test_no_recompilation_for_new_hyperparameter_values():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 16)), jnp.float32)

    def process(x, **hyperparameters):
        return rollout.process_logits(x, top_k=6, forbidden_tokens=(1,), **hyperparameters)

    assert_traced_once(
        process,
        [
            ((x,), dict(temperature=jnp.float32(t), top_p=jnp.float32(p), min_p=jnp.float32(m)))
            for t, p, m in [(0.7, 0.9, 0.05), (1.3, 0.5, 0.0), (1.0, 1.0, 0.3)]
        ],
    )
    for fn, values in [
        (rollout.temperature_scale, (0.5, 2.0)),
        (rollout.top_p_filter, (0.3, 0.95)),
        (rollout.min_p_filter, (0.1, 0.6)),
    ]:
        assert_traced_once(fn, [((x, jnp.float32(value)), {}) for value in values])


def test_static_hyperparameters_under_jit():
    x = np.random.default_rng(2).standard_normal((3, 20)).astype(np.float32)
    names = ("temperature", "top_k", "top_p", "min_p", "forbidden_tokens")
    static = jax.jit(rollout.process_logits, static_argnames=names)
    kwargs = dict(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05, forbidden_tokens=(4, 5))
    out, traced = static(x, **kwargs), process_logits(x, **kwargs)
    assert_same_kept(out, traced)
    np.testing.assert_allclose(out, traced, rtol=1e-6)
    assert_same_kept(out, ref_process(x, 0.8, 10, 0.9, 0.05, (4, 5)))


@pytest.mark.parametrize(
    "fn",
    [
        functools.partial(rollout.temperature_scale, temperature=0.7),
        functools.partial(top_k_filter, k=3),
        functools.partial(top_p_filter, p=0.8),
        functools.partial(min_p_filter, min_p=0.1),
        functools.partial(rollout.forbid_tokens, token_ids=(2,)),
        functools.partial(process_logits, temperature=0.7, top_k=5, top_p=0.9, min_p=0.01),
    ],
)
def test_bf16_input_computes_in_float32(fn):
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 12)) * 3, jnp.bfloat16)
    out = fn(x)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, fn(x.astype(jnp.float32)))


# ------------------------------------------------------------------ errors


def test_temperature_errors_say_zero_is_greedy():
    x = np.zeros((1, 3), np.float32)
    for temperature in (0, 0.0, -0.5):
        with pytest.raises(ValueError, match=r"temperature must be > 0, got -?0.*greedy"):
            rollout.temperature_scale(x, temperature)
        with pytest.raises(ValueError, match=r"temperature must be > 0.*greedy"):
            rollout.process_logits(x, temperature=temperature)
    with pytest.raises(ValueError, match="temperature must be finite, got inf"):
        rollout.temperature_scale(x, float("inf"))


def test_filter_argument_errors():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        rollout.top_k_filter(x, 0)
    with pytest.raises(ValueError, match="top_k must be >= 1, got -2"):
        rollout.process_logits(x, top_k=-2)
    with own_checks(), pytest.raises(TypeError, match=r"k must be a Python int.*got 2.5"):
        rollout.top_k_filter(x, 2.5)
    for p in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=rf"p must lie in \(0, 1\], got {p}"):
            rollout.top_p_filter(x, p)
        with pytest.raises(ValueError, match=rf"top_p must lie in \(0, 1\], got {p}"):
            rollout.process_logits(x, top_p=p)
    for min_p in (-0.1, 1.5):
        with pytest.raises(ValueError, match=rf"min_p must lie in \[0, 1\], got {min_p}"):
            rollout.min_p_filter(x, min_p)
    with pytest.raises(ValueError, match=r"forbidden_tokens holds token id 4, outside \[0, 4\)"):
        rollout.forbid_tokens(x, (1, 4))
    with pytest.raises(ValueError, match=r"forbidden_tokens holds token id -1"):
        rollout.process_logits(x, forbidden_tokens=(-1,))
    with pytest.raises(ValueError, match="forbidden_tokens forbids all 4 tokens"):
        rollout.forbid_tokens(x, (3, 2, 1, 0, 1))
    with own_checks():
        with pytest.raises(ValueError, match=r"logits must have shape \[B, V\].*\(4,\)"):
            rollout.top_p_filter(np.zeros(4, np.float32), 0.5)
        with pytest.raises(TypeError, match=r"logits must be a floating-point array.*int32"):
            rollout.top_k_filter(np.zeros((2, 4), np.int32), 2)


VALID = dict(
    vocab_size=6, temperature=0.7, top_k=3, top_p=0.9, min_p=0.05, forbidden_tokens=(0,),
    stop_tokens=(5,),
)  # fmt: skip


@pytest.mark.parametrize(
    "changes",
    [
        dict(temperature=0.0),  # greedy
        dict(temperature=2, top_k=None, top_p=None, min_p=None),
        dict(top_k=100, top_p=1, min_p=0),  # bounds that keep every token
        dict(min_p=1.0, forbidden_tokens=(0, 1, 2, 3, 4), stop_tokens=()),
        dict(forbidden_tokens=[1, 1], stop_tokens=[0, 5]),
    ],
)
def test_check_sampling_args_accepts_valid_configurations(changes):
    assert rollout.check_sampling_args(**{**VALID, **changes}) is None


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (dict(vocab_size=0), ValueError, "vocab_size must be >= 1, got 0"),
        (dict(temperature=-0.1), ValueError, r"temperature must be >= 0 \(0 = greedy.*got -0.1"),
        (dict(temperature=float("inf")), ValueError, "temperature must be finite, got inf"),
        (dict(temperature=float("nan")), ValueError, "temperature must be >= 0.*got nan"),
        (dict(top_k=0), ValueError, "top_k must be >= 1, got 0"),
        (dict(top_p=0.0), ValueError, r"top_p must lie in \(0, 1\], got 0.0"),
        (dict(top_p=1.01), ValueError, r"top_p must lie in \(0, 1\], got 1.01"),
        (dict(min_p=-0.5), ValueError, r"min_p must lie in \[0, 1\], got -0.5"),
        (dict(min_p=2), ValueError, r"min_p must lie in \[0, 1\], got 2"),
        (dict(forbidden_tokens=(6,)), ValueError, r"forbidden_tokens holds token id 6, outside"),
        (dict(forbidden_tokens=(-1,)), ValueError, r"forbidden_tokens holds token id -1"),
        (dict(stop_tokens=(2, 9)), ValueError, r"stop_tokens holds token id 9, outside \[0, 6\)"),
        (dict(forbidden_tokens=tuple(range(6))), ValueError, "forbids all 6 tokens"),
    ],
)
def test_check_sampling_args_value_errors(changes, error, match):
    with pytest.raises(error, match=match):
        rollout.check_sampling_args(**{**VALID, **changes})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(vocab_size=6.0), "vocab_size must be an int, got 6.0"),
        (dict(temperature="hot"), "temperature must be a real number, got 'hot'"),
        (dict(top_k=2.5), "top_k must be a Python int >= 1.*got 2.5 of type float"),
        (dict(top_k=True), "top_k must be a Python int >= 1.*got True of type bool"),
        (dict(top_p="0.9"), "top_p must be a real number, got '0.9'"),
        (dict(min_p=[0.1]), r"min_p must be a real number, got \[0.1\]"),
        (dict(forbidden_tokens=3), "forbidden_tokens must be a tuple of int token ids, got 3"),
        (dict(forbidden_tokens=(1.0,)), "forbidden_tokens must hold int token ids, got 1.0"),
        (dict(stop_tokens=("eos",)), "stop_tokens must hold int token ids, got 'eos'"),
    ],
)
def test_check_sampling_args_type_errors(changes, match):
    with own_checks(), pytest.raises(TypeError, match=match):
        rollout.check_sampling_args(**{**VALID, **changes})
