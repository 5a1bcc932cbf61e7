"""WPO's pair weights (tunelib/losses/_preference_weighting.py)."""

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
from tunelib import logprobs, losses

wpo_weights = jax.jit(losses.wpo_weights, static_argnames="max_weight")
TC, TR, V = 5, 3, 6


def log_sum_sq(log_probs):
    return jax.nn.logsumexp(2 * log_probs, axis=-1)


def from_logits(logits, targets):
    """Token log-probs of `targets` and the log sum of squared probabilities, from logits."""
    log_probs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    return logprobs.token_logps(logits, targets), log_sum_sq(log_probs)


@st.composite
def batches(draw, b=3):
    """Logits and sampled-or-not targets of the chosen and rejected completions, with masks."""
    logits_c = draw(float_arrays((b, TC, V), -4.0, 4.0))
    logits_r = draw(float_arrays((b, TR, V), -4.0, 4.0))
    targets_c = np.asarray(draw(st.lists(st.integers(0, V - 1), min_size=b * TC, max_size=b * TC)))
    targets_r = np.asarray(draw(st.lists(st.integers(0, V - 1), min_size=b * TR, max_size=b * TR)))
    mask_c, mask_r = draw(bool_arrays((b, TC))), draw(bool_arrays((b, TR)))
    return (
        (logits_c, targets_c.reshape(b, TC), mask_c),
        (logits_r, targets_r.reshape(b, TR), mask_r),
    )


def trl_weights(logits_c, targets_c, mask_c, logits_r, targets_r, mask_r, clamp):
    """TRL's WPO weights in float64 from the logits: 1.16 (no clamp) and up to 0.28 (clamp 1)."""

    def mean_aligned(logits, targets, mask):
        logits = np.asarray(logits, np.float64)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        token = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
        adjust = np.log((np.exp(log_probs) ** 2).sum(-1))
        return ((token - adjust) * mask).sum(-1) / np.maximum(mask.sum(-1), 1)

    weights = np.exp(mean_aligned(logits_c, targets_c, mask_c)) * np.exp(
        mean_aligned(logits_r, targets_r, mask_r)
    )
    return np.minimum(weights, 1.0) if clamp else weights


@given(batches())
def test_weights_match_trl_and_reference(batch):
    (logits_c, targets_c, mask_c), (logits_r, targets_r, mask_r) = batch
    c, c_norms = from_logits(logits_c, targets_c)
    r, r_norms = from_logits(logits_r, targets_r)
    masks = {"chosen_where": mask_c, "rejected_where": mask_r}
    uncapped = wpo_weights(c, r, c_norms, r_norms, max_weight=None, **masks)
    capped = wpo_weights(c, r, c_norms, r_norms, **masks)
    trl_args = (logits_c, targets_c, mask_c, logits_r, targets_r, mask_r)
    assert_close(uncapped, trl_weights(*trl_args, clamp=False), rtol=1e-5, atol=1e-7)
    assert_close(capped, trl_weights(*trl_args, clamp=True), rtol=1e-5, atol=1e-7)
    expected = ref.wpo_weights(c, r, c_norms, r_norms, mask_c, mask_r, max_weight=None)
    assert_close(uncapped, expected, rtol=1e-5, atol=1e-7)


def test_fixed_values():
    # One pair: the chosen tokens' log(p / sum p^2) average to 0.5, the rejected ones' to -2.
    c, c_norms = np.array([[-1.0, -2.0]], np.float32), np.array([[-1.5, -2.5]], np.float32)
    r, r_norms = np.array([[-3.0]], np.float32), np.array([[-1.0]], np.float32)
    out = wpo_weights(c, r, c_norms, r_norms, max_weight=None)
    assert_close(out, [np.exp(0.5 - 2.0)], rtol=1e-6)
    assert_close(wpo_weights(c, c, c_norms, c_norms, max_weight=2.0), [2.0])  # e^1 capped at 2
    assert_close(wpo_weights(c, c, c_norms, c_norms), [1.0])  # the default cap, 1


def test_uniform_policy_weighs_every_pair_one():
    # Under a uniform policy p = 1/V everywhere, so p / sum_v p^2 = 1 for every token.
    logits_c, logits_r = np.zeros((2, TC, V), np.float32), np.zeros((2, TR, V), np.float32)
    rng = np.random.default_rng(0)
    c, c_norms = from_logits(logits_c, rng.integers(0, V, (2, TC)))
    r, r_norms = from_logits(logits_r, rng.integers(0, V, (2, TR)))
    assert_close(wpo_weights(c, r, c_norms, r_norms, max_weight=None), np.ones(2), rtol=1e-6)


def test_likely_completions_weigh_more():
    logits = np.array([[[3.0, 0.0, 0.0, 0.0]] * 3], np.float32)
    likely, norms = from_logits(logits, np.zeros((1, 3), np.int32))
    unlikely, _ = from_logits(logits, np.ones((1, 3), np.int32))
    w_likely = wpo_weights(likely, likely, norms, norms, max_weight=None)
    w_unlikely = wpo_weights(unlikely, unlikely, norms, norms, max_weight=None)
    assert float(w_likely[0]) > 1 > float(w_unlikely[0])


def test_no_gradient_and_masks():
    rng = np.random.default_rng(1)
    c, c_norms = (jnp.asarray(rng.uniform(-4, 0, (4, TC)), jnp.float32) for _ in range(2))
    r, r_norms = (jnp.asarray(rng.uniform(-4, 0, (4, TR)), jnp.float32) for _ in range(2))
    mask_c = rng.uniform(size=(4, TC)) < 0.7
    mask_r = rng.uniform(size=(4, TR)) < 0.7
    mask_r[2] = False  # an empty rejected completion: its factor is 1
    where = np.array([True, True, True, False])
    masks = {"chosen_where": mask_c, "rejected_where": mask_r, "where": where}
    bad = np.array([np.nan, -np.inf, np.inf, np.nan], np.float32)[:, None]
    garbage = [
        jnp.where(m & where[:, None], x, bad)
        for x, m in ((c, mask_c), (r, mask_r), (c_norms, mask_c), (r_norms, mask_r))
    ]
    out = np.asarray(wpo_weights(*garbage, max_weight=None, **masks))
    assert np.all(np.isfinite(out)) and out[3] == 0
    expected = ref.wpo_weights(c, r, c_norms, r_norms, mask_c, mask_r, max_weight=None)
    assert_close(out[:3], expected[:3], rtol=1e-5)
    assert_close(out[2], np.exp(np.mean((c - c_norms)[2][mask_c[2]])), rtol=1e-5)
    # Masked equals sliced: each pair alone with only its valid tokens.
    for i in (0, 1):
        alone = [x[i][m[i]][None] for x, m in zip(garbage, (mask_c, mask_r) * 2, strict=True)]
        assert_close(out[i], wpo_weights(*alone, max_weight=None), rtol=1e-6)
    # The weights carry no gradient, so a weighted loss differentiates only through the loss.

    def weighted(arrays):
        w = losses.wpo_weights(*arrays, **masks)
        per_pair = losses.dpo_loss(
            jnp.sum(jnp.where(mask_c, arrays[0], 0), -1),
            jnp.sum(jnp.where(mask_r, arrays[1], 0), -1),
            jnp.zeros(4),
            jnp.zeros(4),
            where=where,
        )
        return jnp.sum(w * per_pair)

    grads = jax.grad(weighted)(garbage)
    assert all(np.all(np.isfinite(g)) for g in grads)
    assert np.all(np.asarray(grads[2]) == 0) and np.all(np.asarray(grads[3]) == 0)
    assert np.any(np.asarray(grads[0]) != 0)
    # Fully masked: 0.
    none = {**masks, "where": np.zeros(4, bool)}
    assert np.all(np.asarray(wpo_weights(*garbage, **none)) == 0)


def test_dtypes_vmap_and_no_retrace():
    rng = np.random.default_rng(2)
    arrays = [rng.uniform(-3, 0, (3, t)).astype(np.float32) for t in (TC, TR, TC, TR)]
    full = wpo_weights(*arrays, max_weight=None)
    low = [x.astype(jnp.bfloat16) for x in arrays]
    out = wpo_weights(*low, max_weight=None)
    assert out.dtype == jnp.float32
    rounded = [np.asarray(x, np.float32) for x in low]
    assert_close(out, wpo_weights(*rounded, max_weight=None), rtol=1e-6)
    np.testing.assert_allclose(out, full, rtol=0.05)
    with jax.enable_x64(True):
        out64 = losses.wpo_weights(*[jnp.asarray(x, jnp.float64) for x in arrays], max_weight=None)
        assert out64.dtype == jnp.float64
        masks = (np.ones((3, TC), bool), np.ones((3, TR), bool))
        assert_close(out64, ref.wpo_weights(*arrays, *masks, max_weight=None), rtol=1e-12)
    stacked = [np.stack([x, x[::-1]]) for x in arrays]
    mapped = jax.vmap(lambda a: losses.wpo_weights(*a))(stacked)
    assert_close(mapped[1], wpo_weights(*[x[::-1] for x in arrays]), rtol=1e-6)
    calls = [((arrays,), {"cap": jnp.float32(cap)}) for cap in (0.5, 2.0)]
    assert_traced_once(lambda a, cap: losses.wpo_weights(*a, max_weight=cap), calls)


def test_errors_name_the_argument():
    c, r = jnp.zeros((3, 4)), jnp.zeros((3, 2))
    with own_checks():
        with raises_naming("max_weight", error=ValueError):
            losses.wpo_weights(c, r, c, r, max_weight=0.0)
        with raises_naming("chosen_log_sum_sq_probs", "(3, 2)", error=ValueError):
            losses.wpo_weights(c, r, r, r)
        with raises_naming("rejected_token_logps", "rows", error=ValueError):
            losses.wpo_weights(c, r[:2], c, r[:2])
        with raises_naming("rejected_where", "(3, 4)", error=ValueError):
            losses.wpo_weights(c, r, c, r, rejected_where=jnp.ones((3, 4), bool))
        with raises_naming("rejected_log_sum_sq_probs", error=TypeError):
            losses.wpo_weights(c, r, c, r.astype(jnp.int32))
