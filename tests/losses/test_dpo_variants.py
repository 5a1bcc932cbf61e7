"""f-DPO and LD-DPO (tunelib/losses/_dpo_variants.py), and the `[B]` contracts of the
preference objectives added with them (AlphaPO's reward shape, label-smoothed ORPO)."""

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
from tests.losses import test_preference_contracts as contracts
from tunelib import logprobs, losses

# ---------------------------------------------------------------------------------------------
# The contracts every `[B] -> [B]` preference function keeps, run on the new ones.

PAIR = contracts.PAIR
LOGP, MEAN_LOGP, ORPO_LOGP = contracts.LOGP, contracts.MEAN_LOGP, contracts.ORPO_LOGP
BETA = contracts.BETA
# The forward KL and the alpha-divergence exponentiate the log-ratios: narrower inputs keep
# their scores of a size that float32 resolves as well as the float64 reference.
NARROW = (-3.0, 0.0)


def f_dpo_spec(divergence, data_range, hyper):
    return contracts.Spec(
        losses.f_dpo_loss,
        lambda *d, **h: ref.f_dpo(*d, divergence=divergence, **h),
        PAIR,
        (data_range,) * 4,
        hyper,
        static={"divergence": divergence},
        id=f"f_dpo_loss_{divergence}",
    )


def f_scores_spec(divergence, data_range, hyper):
    return contracts.Spec(
        losses.f_dpo_scores,
        lambda lp, rlp, **h: ref.f_dpo_scores(lp, rlp, divergence=divergence, **h),
        ("logps", "ref_logps"),
        (data_range,) * 2,
        hyper,
        static={"divergence": divergence},
        id=f"f_dpo_scores_{divergence}",
    )


SPECS = [
    f_dpo_spec("reverse_kl", LOGP, {"beta": BETA}),
    f_dpo_spec("forward_kl", NARROW, {"beta": BETA}),
    f_dpo_spec("jsd", LOGP, {"beta": BETA}),
    f_dpo_spec("alpha_divergence", NARROW, {"beta": BETA, "alpha": (0.0, 1.0)}),
    f_scores_spec("forward_kl", NARROW, {}),
    f_scores_spec("jsd", LOGP, {}),
    f_scores_spec("alpha_divergence", NARROW, {"alpha": (-0.5, 1.5)}),
    contracts.Spec(
        losses.simpo_loss,
        ref.simpo,
        PAIR[:2],
        (MEAN_LOGP,) * 2,
        {
            "beta": (0.5, 10.0),
            "margin": (0.0, 5.0),
            "label_smoothing": (0.0, 0.5),
            "reward_shape": (-0.5, 1.0),
        },
        id="simpo_loss_alphapo",
    ),
    contracts.Spec(
        losses.cpo_loss,
        ref.cpo,
        PAIR[:2],
        (LOGP,) * 2,
        {"beta": BETA, "nll_weight": (0.0, 2.0), "reward_shape": (-0.2, 0.2)},
        id="cpo_loss_alphapo",
    ),
    contracts.Spec(
        losses.orpo_loss,
        ref.orpo,
        PAIR[:2],
        (ORPO_LOGP,) * 2,
        {"odds_ratio_weight": (0.0, 1.0), "label_smoothing": (0.0, 0.5)},
        id="orpo_loss_label_smoothing",
    ),
]

CONTRACTS = [
    contracts.test_fixed_values_match_reference,
    contracts.test_generated_values_match_reference,
    contracts.test_masked_equals_sliced,
    contracts.test_masked_rows_have_zero_finite_gradient,
    contracts.test_fully_masked_is_zero,
    contracts.test_finite_for_extreme_inputs,
    contracts.test_bf16_inputs_are_computed_in_float32,
    contracts.test_float64_stays_float64,
    contracts.test_vmap_and_no_retrace,
    contracts.test_errors_name_the_argument,
    contracts.test_integer_masks_count_like_boolean_masks,
]


@pytest.mark.parametrize("contract", CONTRACTS, ids=[c.__name__[5:] for c in CONTRACTS])
@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_contract(spec, contract):
    contract(spec)


# ---------------------------------------------------------------------------------------------
# f-DPO.

B = 4
pairs = st.tuples(*[float_arrays((B,), -30.0, 0.0)] * 4)
DIVERGENCES = losses.F_DPO_DIVERGENCES


@given(pairs, st.floats(*BETA))
def test_reverse_kl_is_dpo_and_alpha_interpolates(pair, beta):
    reverse = np.asarray(losses.f_dpo_loss(*pair, beta=beta))
    assert_close(reverse, losses.dpo_loss(*pair, beta=beta), rtol=1e-5, atol=1e-6)
    # The alpha-divergence is the reverse KL at alpha = 0 (exactly) and continuous there, down
    # to an alpha that float32 stores as a subnormal number.
    for alpha, tolerance in [(0.0, 0.0), (1e-40, 0.0), (1e-6, 1e-4)]:
        near = losses.f_dpo_loss(*pair, beta=beta, divergence="alpha_divergence", alpha=alpha)
        assert_close(near, reverse, rtol=tolerance, atol=tolerance)


@given(float_arrays((B,), -3.0, 3.0), float_arrays((B,), -3.0, 3.0), st.floats(*BETA))
def test_forward_kl_is_alpha_one(r_w, r_l, beta):
    zeros = np.zeros(B, np.float32)
    forward = losses.f_dpo_loss(r_w, r_l, zeros, zeros, beta=beta, divergence="forward_kl")
    alpha_one = losses.f_dpo_loss(
        r_w, r_l, zeros, zeros, beta=beta, divergence="alpha_divergence", alpha=1.0
    )
    np.testing.assert_array_equal(forward, alpha_one)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_scores_vanish_at_the_reference_and_rise_with_the_ratio(divergence):
    r = np.linspace(-6.0, 6.0, 25).astype(np.float32)
    zeros = np.zeros_like(r)
    scores = np.asarray(losses.f_dpo_scores(r, zeros, divergence=divergence, alpha=0.3))
    assert scores[12] == 0  # u = 1: every f'(1) is 0 (reverse KL without its constant 1)
    assert np.all(np.diff(scores) > 0)  # f is convex, so f' rises
    # A policy equal to the reference has margin 0 and loss log 2, whatever the completions.
    pair = [np.array([-3.0, -9.0], np.float32), np.array([-5.0, -1.0], np.float32)]
    loss = losses.f_dpo_loss(*pair, *pair, divergence=divergence, alpha=0.3)
    assert_close(loss, np.full(2, np.log(2)))
    if divergence == "jsd":  # log(2u / (1 + u)) < log 2
        assert np.all(scores < np.log(2))


def test_scores_match_tunelib_docstring_cases():
    # s at u = e: log u = 1, 1 - 1/e, log(2e / (1 + e)), (1 - e^-0.5) / 0.5.
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    expected = {
        "reverse_kl": 1.0,
        "forward_kl": 1 - np.exp(-1.0),
        "jsd": np.log(2 * np.e / (1 + np.e)),
        "alpha_divergence": (1 - np.exp(-0.5)) / 0.5,
    }
    for divergence, value in expected.items():
        assert_close(losses.f_dpo_scores(one, zero, divergence=divergence), [value], rtol=1e-6)


@given(
    float_arrays((B,), -4.0, 4.0), float_arrays((B,), -4.0, 4.0), st.floats(0.05, 0.95), st.data()
)
def test_alpha_divergence_against_trl_parametrisations(r_w, r_l, alpha, draw):
    beta = draw.draw(st.floats(*BETA))
    zeros = np.zeros(B, np.float32)
    out = losses.f_dpo_loss(
        r_w, r_l, zeros, zeros, beta=beta, divergence="alpha_divergence", alpha=alpha
    )
    u_w, u_l = np.exp(r_w.astype(np.float64)), np.exp(r_l.astype(np.float64))
    # TRL 1.16 scores (u^(a - 1) - 1) / (a - 1) for f_alpha_divergence_coef a = 1 - alpha.
    a = 1 - alpha
    trl_116 = ((u_w ** (a - 1) - 1) - (u_l ** (a - 1) - 1)) / (a - 1)
    assert_close(out, -ref.log_sigmoid(beta * trl_116), rtol=1e-4, atol=1e-5)
    # TRL 0.28 took the difference (u_l^-a - u_w^-a) / a with a = alpha itself.
    trl_028 = (u_l**-alpha - u_w**-alpha) / alpha
    assert_close(out, -ref.log_sigmoid(beta * trl_028), rtol=1e-4, atol=1e-5)


def test_scores_feed_the_other_margin_losses():
    # TRL's f_divergence_type with loss_type="hinge": relu(1 - beta (s_w - s_l)).
    rng = np.random.default_rng(0)
    c, r, rc, rr = (rng.uniform(-6, 0, 5).astype(np.float32) for _ in range(4))
    s_w = losses.f_dpo_scores(c, rc, divergence="jsd")
    s_l = losses.f_dpo_scores(r, rr, divergence="jsd")
    zeros = np.zeros(5, np.float32)
    hinge = losses.hinge_loss(s_w, s_l, zeros, zeros, beta=2.0)
    expected = np.maximum(
        0, 1 - 2.0 * (ref.f_dpo_scores(c, rc, "jsd") - ref.f_dpo_scores(r, rr, "jsd"))
    )
    assert_close(hinge, expected, rtol=1e-5, atol=1e-6)
    # And f_dpo_loss is dpo_loss on the scores.
    assert_close(
        losses.f_dpo_loss(c, r, rc, rr, beta=2.0, divergence="jsd"),
        losses.dpo_loss(s_w, s_l, zeros, zeros, beta=2.0),
        rtol=1e-6,
    )


def test_exponent_is_capped_with_zero_gradient_beyond():
    r_w = jnp.array([-79.0, -81.0, -500.0, -1e30], jnp.float32)
    zeros = jnp.zeros(4, jnp.float32)

    def score(r):
        return losses.f_dpo_scores(r, zeros, divergence="forward_kl").sum()

    scores = np.asarray(losses.f_dpo_scores(r_w, zeros, divergence="forward_kl"), np.float64)
    assert_close(scores[0], 1 - np.exp(79.0), rtol=1e-5)
    assert_close(scores[1:], np.full(3, 1 - np.exp(80.0)), rtol=1e-5)
    grad = np.asarray(jax.grad(score)(r_w))
    assert np.all(np.isfinite(grad))
    assert_close(grad[0], np.exp(79.0), rtol=1e-4)  # d/dr (1 - e^-r) = e^-r
    assert np.all(grad[1:] == 0)


def test_f_dpo_errors():
    pair = [jnp.zeros(3)] * 4
    with own_checks():
        with raises_naming("divergence", "'jsd'", error=ValueError):
            losses.f_dpo_loss(*pair, divergence="js_divergence")
        with raises_naming("divergence", error=ValueError):
            losses.f_dpo_scores(*pair[:2], divergence="kl")
        with raises_naming("beta", error=ValueError):
            losses.f_dpo_loss(*pair, beta=0.0)
        with raises_naming("alpha", error=ValueError):
            losses.f_dpo_loss(*pair, divergence="alpha_divergence", alpha=float("nan"))


# ---------------------------------------------------------------------------------------------
# LD-DPO, on per-token rows of different widths for the chosen and the rejected completions.

TC, TR = 5, 3
ld_loss = jax.jit(losses.length_desensitized_dpo_loss)
ld_logps = jax.jit(losses.length_desensitized_logps)


@st.composite
def token_batches(draw, b=3):
    """Policy and reference token log-probs of a batch of pairs, with completion masks."""
    arrays = [draw(float_arrays((b, t), -8.0, 0.0)) for t in (TC, TR, TC, TR)]
    chosen_mask, rejected_mask = draw(bool_arrays((b, TC))), draw(bool_arrays((b, TR)))
    return arrays, chosen_mask, rejected_mask


def sums(arrays, mask_c, mask_r):
    """`sequence_sum` of the policy's and the reference's chosen and rejected token rows."""
    masks = (mask_c, mask_r, mask_c, mask_r)
    return [logprobs.sequence_sum(x, where=m) for x, m in zip(arrays, masks, strict=True)]


def nan_outside(x, mask):
    return np.where(mask, x, np.nan).astype(np.float32)


@given(token_batches(), st.floats(0.0, 1.0), st.floats(*BETA))
def test_ld_matches_reference(batch, alpha, beta):
    (c, r, rc, rr), mask_c, mask_r = batch
    out = ld_loss(
        nan_outside(c, mask_c),
        nan_outside(r, mask_r),
        nan_outside(rc, mask_c),
        nan_outside(rr, mask_r),
        tail_weight=alpha,
        beta=beta,
        chosen_where=mask_c,
        rejected_where=mask_r,
    )
    expected = ref.ld_dpo(c, r, rc, rr, mask_c, mask_r, alpha, beta=beta)
    assert_close(out, expected, rtol=1e-5, atol=1e-5)
    sums = ld_logps(c, r, tail_weight=alpha, chosen_where=mask_c, rejected_where=mask_r)
    for got, want in zip(sums, ref.ld_logps(c, r, mask_c, mask_r, alpha), strict=True):
        assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_ld_fixed_values():
    # Chosen: 4 valid tokens (one masked in the middle), rejected: 2; the shared length is 2.
    chosen = np.array([[-1.0, np.nan, -2.0, -3.0, -4.0]], np.float32)
    mask_c = np.array([[True, False, True, True, True]])
    rejected = np.array([[-0.5, -0.25, np.nan]], np.float32)
    mask_r = np.array([[True, True, False]])
    c, r = ld_logps(chosen, rejected, tail_weight=0.25, chosen_where=mask_c, rejected_where=mask_r)
    assert_close(c, [-1.0 - 2.0 + 0.25 * (-3.0 - 4.0)])
    assert_close(r, [-0.75])


@given(token_batches())
def test_ld_endpoints(batch):
    """In float64: the weighted sums and the plain ones sum in different orders, which in
    float32 moved log-prob sums of 19 by 0.1 of a fixed rtol 1e-6 on this CPU."""
    arrays, mask_c, mask_r = batch
    c, r, rc, rr = (np.asarray(x, np.float64) for x in arrays)
    with jax.enable_x64(True):
        masks = {"chosen_where": mask_c, "rejected_where": mask_r}
        # tail_weight = 1: the plain sums, so the loss is DPO's.
        one = ld_logps(c, r, tail_weight=1.0, **masks)
        assert_close(one[0], logprobs.sequence_sum(c, where=mask_c), rtol=1e-13, atol=1e-13)
        assert_close(one[1], logprobs.sequence_sum(r, where=mask_r), rtol=1e-13, atol=1e-13)
        assert_close(
            ld_loss(c, r, rc, rr, tail_weight=1.0, beta=0.3, **masks),
            losses.dpo_loss(*sums((c, r, rc, rr), mask_c, mask_r), beta=0.3),
            rtol=1e-13,
            atol=1e-13,
        )
        # tail_weight = 0: DPO on both completions truncated to the shorter one's valid tokens.
        shared = np.minimum(mask_c.sum(-1), mask_r.sum(-1))
        keep_c = mask_c & (np.cumsum(mask_c, -1) <= shared[:, None])
        keep_r = mask_r & (np.cumsum(mask_r, -1) <= shared[:, None])
        truncated = sums((c, r, rc, rr), keep_c, keep_r)
        assert_close(
            ld_loss(c, r, rc, rr, tail_weight=0.0, beta=0.3, **masks),
            losses.dpo_loss(*truncated, beta=0.3),
            rtol=1e-13,
            atol=1e-13,
        )


@given(st.floats(0.0, 1.0))
def test_ld_equal_lengths_is_dpo(alpha):
    rng = np.random.default_rng(3)
    c, r, rc, rr = (rng.uniform(-5, 0, (2, 4)).astype(np.float32) for _ in range(4))
    out = ld_loss(c, r, rc, rr, tail_weight=alpha)
    assert_close(out, losses.dpo_loss(*(x.sum(-1) for x in (c, r, rc, rr))), rtol=1e-6, atol=1e-6)


def trl_ld_logps(per_token_logps, shift_completion_mask, ld_alpha):
    """TRL 1.16's `_compute_loss` with `ld_alpha`, in float64 on the concatenated batch (chosen
    rows first, then rejected, padded to one width), masked log-probs 0 as its fused head
    returns them."""
    per_token_logps = np.where(shift_completion_mask, per_token_logps, 0.0).astype(np.float64)
    comp_pos = np.cumsum(shift_completion_mask, axis=1)
    comp_lens = shift_completion_mask.sum(axis=1)
    chosen_lens, rejected_lens = np.split(comp_lens, 2)
    shared_lens = np.minimum(chosen_lens, rejected_lens)
    shared_lens = np.concatenate([shared_lens, shared_lens])[:, None]
    shared_mask = (comp_pos > 0) & (comp_pos <= shared_lens)
    tail_mask = comp_pos > shared_lens
    logps = (per_token_logps * shared_mask).sum(1) + ld_alpha * (per_token_logps * tail_mask).sum(1)
    return np.split(logps, 2)


def test_ld_matches_trl_on_a_padded_batch():
    rng = np.random.default_rng(4)
    b, t = 4, 6
    # Right-padded completions after a masked prompt, as TRL's collator builds them.
    prompt = np.array([1, 2, 0, 1])
    lengths_c, lengths_r = np.array([3, 5, 1, 2]), np.array([2, 2, 4, 0])
    positions = np.arange(t)
    mask_c = (positions >= prompt[:, None]) & (positions < (prompt + lengths_c)[:, None])
    mask_r = (positions >= prompt[:, None]) & (positions < (prompt + lengths_r)[:, None])
    c, r, rc, rr = (rng.uniform(-6, 0, (b, t)).astype(np.float32) for _ in range(4))
    masks = {"chosen_where": mask_c, "rejected_where": mask_r}
    pi = ld_logps(c, r, tail_weight=0.4, **masks)
    both = np.concatenate([mask_c, mask_r])
    for got, want in zip(pi, trl_ld_logps(np.concatenate([c, r]), both, 0.4), strict=True):
        assert_close(got, want, rtol=1e-6, atol=1e-6)
    ref_w, ref_l = trl_ld_logps(np.concatenate([rc, rr]), both, 0.4)
    pi_w, pi_l = trl_ld_logps(np.concatenate([c, r]), both, 0.4)
    trl_loss = -ref.log_sigmoid(0.1 * ((pi_w - ref_w) - (pi_l - ref_l)))
    assert_close(ld_loss(c, r, rc, rr, tail_weight=0.4, **masks), trl_loss, rtol=1e-5, atol=1e-6)


def test_ld_masked_pairs_and_tokens():
    rng = np.random.default_rng(5)
    c, r, rc, rr = (rng.uniform(-6, 0, (4, t)).astype(np.float32) for t in (TC, TR, TC, TR))
    mask_c = rng.uniform(size=(4, TC)) < 0.7
    mask_r = rng.uniform(size=(4, TR)) < 0.7
    where = np.array([True, False, True, False])
    garbage = []
    for x, m in zip((c, r, rc, rr), (mask_c, mask_r) * 2, strict=True):
        bad = np.broadcast_to(
            np.array([0.0, np.nan, -np.inf, np.inf], np.float32)[:, None], x.shape
        )
        garbage.append(np.where(m & where[:, None], x, bad).astype(np.float32))
    masks = {"chosen_where": mask_c, "rejected_where": mask_r}

    def total(arrays):
        return jnp.sum(
            losses.length_desensitized_dpo_loss(*arrays, tail_weight=0.5, where=where, **masks)
        )

    value, grads = jax.value_and_grad(total)(garbage)
    assert np.isfinite(value)
    for grad, m in zip(grads, (mask_c, mask_r) * 2, strict=True):
        grad = np.asarray(grad)
        assert np.all(np.isfinite(grad))
        assert np.all(grad[~(m & where[:, None])] == 0)
        assert np.any(grad[m & where[:, None]] != 0)
    out = np.asarray(ld_loss(*garbage, tail_weight=0.5, where=where, **masks))
    assert np.all(out[~where] == 0)
    # Masked equals sliced: each valid pair alone, with only its valid tokens.
    for i in np.flatnonzero(where):
        alone = [
            x[i][m[i]][None] for x, m in zip((c, r, rc, rr), (mask_c, mask_r) * 2, strict=True)
        ]
        assert_close(out[i], ld_loss(*alone, tail_weight=0.5), rtol=1e-6, atol=1e-6)
    # Fully masked: 0 with a zero gradient.
    none = np.zeros(4, bool)
    assert np.all(np.asarray(ld_loss(*garbage, tail_weight=0.5, where=none, **masks)) == 0)
    pair_logps = ld_logps(garbage[0], garbage[1], tail_weight=0.5, where=none, **masks)
    assert all(np.all(np.asarray(x) == 0) for x in pair_logps)


def test_ld_dtypes_vmap_and_no_retrace():
    rng = np.random.default_rng(6)
    arrays = [rng.uniform(-4, 0, (3, t)).astype(np.float32) for t in (TC, TR, TC, TR)]
    masks = {
        "chosen_where": rng.uniform(size=(3, TC)) < 0.8,
        "rejected_where": rng.uniform(size=(3, TR)) < 0.8,
    }
    full = ld_loss(*arrays, tail_weight=0.3, beta=0.5, **masks)
    assert full.dtype == jnp.float32
    low = [x.astype(jnp.bfloat16) for x in arrays]
    out = ld_loss(*low, tail_weight=0.3, beta=0.5, **masks)
    assert out.dtype == jnp.float32
    assert_close(
        out,
        ld_loss(*[np.asarray(x, np.float32) for x in low], tail_weight=0.3, beta=0.5, **masks),
        rtol=1e-6,
        atol=1e-6,
    )
    np.testing.assert_allclose(out, full, rtol=0.05, atol=0.05)
    with jax.enable_x64(True):
        wide = [jnp.asarray(x, jnp.float64) for x in arrays]
        out64 = losses.length_desensitized_dpo_loss(*wide, tail_weight=0.3, beta=0.5, **masks)
        assert out64.dtype == jnp.float64
        expected = ref.ld_dpo(
            *arrays, masks["chosen_where"], masks["rejected_where"], 0.3, beta=0.5
        )
        assert_close(out64, expected, rtol=1e-10, atol=1e-12)
    # vmap over a leading axis of batches equals one call per batch.
    stacked = [np.stack([x, x[::-1]]) for x in arrays]
    stacked_masks = {k: np.stack([m, m[::-1]]) for k, m in masks.items()}
    mapped = jax.vmap(
        lambda a, mc, mr: losses.length_desensitized_dpo_loss(
            *a, tail_weight=0.3, chosen_where=mc, rejected_where=mr
        )
    )(stacked, stacked_masks["chosen_where"], stacked_masks["rejected_where"])
    single = ld_loss(
        *[x[::-1] for x in arrays], tail_weight=0.3, **{k: m[::-1] for k, m in masks.items()}
    )
    assert_close(mapped[1], single, rtol=1e-6, atol=1e-6)

    def call(a, tail_weight, beta):
        return losses.length_desensitized_dpo_loss(*a, tail_weight=tail_weight, beta=beta, **masks)

    assert_traced_once(
        call,
        [((arrays, jnp.float32(w), jnp.float32(b)), {}) for w, b in [(0.3, 0.1), (0.9, 2.0)]],
    )


def test_ld_errors_name_the_argument():
    c, r = jnp.zeros((3, 4)), jnp.zeros((3, 2))
    with own_checks():
        with raises_naming(
            "rejected_token_logps", "(2, 2)", "chosen_token_logps", error=ValueError
        ):
            losses.length_desensitized_logps(c, r[:2], tail_weight=0.5)
        with raises_naming("ref_rejected_token_logps", "(3, 3)", error=ValueError):
            losses.length_desensitized_dpo_loss(c, r, c, jnp.zeros((3, 3)), tail_weight=0.5)
        with raises_naming("where", "(2,)", error=ValueError):
            losses.length_desensitized_logps(c, r, tail_weight=0.5, where=jnp.ones(2, bool))
        with raises_naming("chosen_where", "(3, 2)", "(3, 4)", error=ValueError):
            losses.length_desensitized_logps(
                c, r, tail_weight=0.5, chosen_where=jnp.ones((3, 2), bool)
            )
        with raises_naming("chosen_token_logps", "[B, T]", error=ValueError):
            losses.length_desensitized_logps(c[0], r, tail_weight=0.5)
        with raises_naming("rejected_token_logps", error=TypeError):
            losses.length_desensitized_logps(c, r.astype(jnp.int32), tail_weight=0.5)
        with raises_naming("tail_weight", "[0, 1]", error=ValueError):
            losses.length_desensitized_logps(c, r, tail_weight=1.5)
        with raises_naming("beta", error=ValueError):
            losses.length_desensitized_dpo_loss(c, r, c, r, tail_weight=0.5, beta=-1.0)
    with pytest.raises(TypeError):
        losses.length_desensitized_logps(c, r)  # tail_weight has no default
