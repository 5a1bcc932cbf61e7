import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, float_arrays, own_checks
from tunelib import losses
from tunelib.losses import ROLLOUT_CORRECTIONS, RolloutCorrection

correct = jax.jit(losses.rollout_correction, static_argnames="correction")


def reference(logps, sampler, c: RolloutCorrection, where):
    """The correction from its definition, in float64, a sequence and a token at a time."""
    logps, sampler = np.asarray(logps, np.float64), np.asarray(sampler, np.float64)
    b, t = logps.shape
    weights, keep = np.zeros((b, t)), np.zeros((b, t), bool)
    for i in range(b):
        valid = [j for j in range(t) if where[i, j]]
        log_rho = {j: logps[i, j] - sampler[i, j] for j in valid}
        total = sum(log_rho.values())
        level = {
            "token": lambda j: log_rho[j],  # noqa: B023
            "sequence": lambda j: total,  # noqa: B023
            "geometric": lambda j: total / max(len(valid), 1),  # noqa: B023
        }
        vetoed = c.veto is not None and any(np.exp(r) < c.veto for r in log_rho.values())
        for j in valid:
            kept = not vetoed
            if c.reject_level is not None:
                rho = np.exp(level[c.reject_level](j))
                kept = kept and c.lower <= rho <= c.reject_upper
            if not kept:
                continue
            keep[i, j] = True
            rho = 1.0 if c.weight_level is None else np.exp(level[c.weight_level](j))
            weights[i, j] = min(rho, c.weight_cap)
    w = weights[keep]
    ess = w.sum() ** 2 / (len(w) * (w**2).sum()) if len(w) else 0.0
    rows = where.any(-1)
    return {
        "weights": weights,
        "keep": keep,
        "ess": ess,
        "rejected_tokens": (where & ~keep).sum() / max(where.sum(), 1),
        "rejected_sequences": (rows & ~keep.any(-1)).sum() / max(rows.sum(), 1),
    }


CUSTOM = [
    RolloutCorrection("token", 1.5, "sequence", 4.0, veto=0.05),
    RolloutCorrection(None, 2.0, "token", 1.5),
    RolloutCorrection("sequence", 3.0, "geometric", 1.2, 0.7),
]
CORRECTIONS = {**ROLLOUT_CORRECTIONS, **{f"custom{i}": c for i, c in enumerate(CUSTOM)}}


@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_each_correction_matches_its_definition(name):
    c = CORRECTIONS[name]
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    logps = rng.uniform(-4, 0, (16, 7)).astype(np.float32)
    # Small gaps for most rows, so that every rejection keeps some sequences and drops some.
    spread = np.where(rng.uniform(size=(16, 1)) < 0.5, 0.002, 0.6)
    sampler = (logps + rng.normal(0, 1, (16, 7)) * spread).astype(np.float32)
    where = np.arange(7)[None, :] < rng.integers(0, 8, (16, 1))
    got = correct(logps, sampler, c, where=where)
    want = reference(logps, sampler, c, where)
    # Decisions taken exactly at a bound are float32 rounding's; these draws have none.
    assert np.array_equal(np.asarray(got.keep), want["keep"])
    assert_close(got.weights, want["weights"], rtol=2e-5, atol=1e-6)
    for field in ("ess", "rejected_tokens", "rejected_sequences"):
        assert_close(getattr(got, field), want[field], rtol=2e-5, atol=1e-6)
    assert got.weights.dtype == jnp.float32 and got.keep.dtype == jnp.bool_


def test_the_presets_are_the_published_settings():
    """Each preset's levels and thresholds, as docs/rollout_correction.md cites them."""
    table = {
        name: (c.weight_level, c.weight_cap if c.weight_level else None, c.reject_level,
               (c.lower, c.reject_upper) if c.reject_level else None, c.veto)
        for name, c in ROLLOUT_CORRECTIONS.items()
    }  # fmt: skip
    assert table == {
        "token-tis": ("token", 2.0, None, None, None),
        "token-mis": ("token", 2.0, "token", (0.0, 2.0), None),
        "seq-tis": ("sequence", 2.0, None, None, None),
        "seq-mis": ("sequence", 2.0, "sequence", (0.0, 2.0), None),
        "seq-tis-rs": ("sequence", 2.0, "sequence", (0.5, 2.0), None),
        "geo-rs": (None, None, "geometric", (0.999, 1.001), 1e-4),
        "icepop": ("token", 5.0, "token", (0.5, 5.0), None),
    }


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_alone_equal_the_truncated_importance_weights(level):
    rng = np.random.default_rng(3)
    logps = rng.uniform(-4, 0, (4, 6)).astype(np.float32)
    sampler = (logps + rng.normal(0, 0.5, (4, 6))).astype(np.float32)
    where = rng.uniform(size=(4, 6)) < 0.8
    got = correct(logps, sampler, RolloutCorrection(level, 1.7), where=where)
    want = losses.truncated_importance_weights(logps, sampler, level=level, cap=1.7, where=where)
    assert_close(got.weights, want, rtol=1e-6)
    assert np.array_equal(np.asarray(got.keep), where) and float(got.rejected_tokens) == 0.0


@st.composite
def problems(draw, shape=(3, 5)):
    logps = draw(float_arrays(shape, -8.0, 0.0))
    sampler = (logps + draw(float_arrays(shape, -2.0, 2.0))).astype(np.float32)
    where = draw(st.lists(st.booleans(), min_size=15, max_size=15))
    return logps, sampler, np.array(where).reshape(shape)


@given(problems(), st.sampled_from(list(CORRECTIONS)))
def test_weights_are_bounded_kept_tokens_are_valid_and_shares_are_fractions(problem, name):
    logps, sampler, where = problem
    c = CORRECTIONS[name]
    out = correct(logps, sampler, c, where=where)
    weights, keep = np.asarray(out.weights), np.asarray(out.keep)
    assert np.all((weights >= 0) & (weights <= c.weight_cap * (1 + 1e-6)))
    assert not np.any(keep & ~where) and np.all(weights[~keep] == 0)
    for field in ("ess", "rejected_tokens", "rejected_sequences", "truncated"):
        assert 0.0 <= float(getattr(out, field)) <= 1.0 + 1e-6, field
    assert (float(out.ess) > 0) == bool(keep.any())


def test_masked_positions_may_hold_anything_and_nothing_flows_back():
    logps = np.array([[-1.0, np.nan, -np.inf], [-0.5, -0.7, np.inf]], np.float32)
    sampler = np.array([[-1.2, 0.0, -1.0], [np.nan, -0.7, -1.0]], np.float32)
    where = np.array([[True, False, False], [False, True, False]])
    for c in CORRECTIONS.values():
        out = correct(logps, sampler, c, where=where)
        for value in out:
            assert np.all(np.isfinite(np.asarray(value, np.float64)))
    grads = jax.grad(
        lambda x: jnp.sum(losses.rollout_correction(x, sampler, CUSTOM[0], where=where).weights)
    )(logps)
    assert np.array_equal(np.asarray(grads), np.zeros_like(logps))


def test_a_vetoed_token_rejects_its_whole_sequence():
    logps = np.zeros((2, 4), np.float32)
    sampler = np.zeros((2, 4), np.float32)
    sampler[0, 2] = 10.0  # the trainer finds this token e^10 times less likely
    out = correct(logps, sampler, ROLLOUT_CORRECTIONS["geo-rs"], where=None)
    assert np.array_equal(np.asarray(out.keep), [[False] * 4, [True] * 4])
    assert float(out.rejected_sequences) == 0.5 and float(out.rejected_tokens) == 0.5
    # Without the veto the same sequence is rejected by its geometric mean alone, and a
    # lenient one keeps it.
    lenient = dataclasses.replace(ROLLOUT_CORRECTIONS["geo-rs"], reject_lower=1e-9, veto=None)
    assert np.asarray(correct(logps, sampler, lenient).keep).all()


def test_float64_in_float64_out():
    with jax.enable_x64(True):
        logps = np.log(np.array([[0.5, 0.9, 0.2]]))
        sampler = np.log(np.array([[0.5, 0.3, 0.4]]))
        out = losses.rollout_correction(logps, sampler, ROLLOUT_CORRECTIONS["token-tis"])
        assert out.weights.dtype == jnp.float64 and out.ess.dtype == jnp.float64
        assert_close(out.weights, [[1.0, 2.0, 0.5]], rtol=1e-12)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"weight_level": "geometric"}, "weight_level"),
        ({"reject_level": "tokens"}, "reject_level"),
        ({"weight_level": None}, "needs weights, rejection or a veto"),
        ({"weight_cap": 0.0}, "weight_cap must be > 0"),
        ({"reject_upper": -1.0}, "reject_upper must be > 0"),
        ({"reject_level": "token", "reject_lower": 3.0}, "reject_lower must lie in"),
        ({"veto": 0.0}, "veto must be > 0"),
    ],
)
def test_impossible_settings_are_refused_when_made(settings, message):
    with own_checks(), pytest.raises(ValueError, match=message):
        RolloutCorrection(**settings)


def test_a_name_instead_of_a_setting_is_refused_naming_the_presets():
    with pytest.raises(TypeError, match="token-tis"):
        losses.rollout_correction(np.zeros((1, 2)), np.zeros((1, 2)), "token-tis")
