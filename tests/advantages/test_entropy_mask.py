"""The high-entropy token mask (tunelib/advantages/_entropy_mask.py)."""

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import (
    assert_traced_once,
    bool_arrays,
    float_arrays,
    own_checks,
    raises_naming,
)
from tunelib import advantages, losses

high_entropy_mask = jax.jit(advantages.high_entropy_mask, static_argnames="selection")


def masked(x, where):
    return np.where(where, x, np.nan).astype(np.float32)


@st.composite
def entropies(draw, max_b=3, max_t=4, grid=False):
    """`[B, T]` entropies and a mask; on a grid of multiples of 1/4 when `grid` (many ties)."""
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    if grid:
        ints = draw(st.lists(st.integers(0, 12), min_size=b * t, max_size=b * t))
        values = np.array(ints, np.float32).reshape(b, t) / 4
    else:
        values = draw(float_arrays((b, t), 0.0, 10.0))
    return values, draw(bool_arrays((b, t)))


def ref_top_k(entropy, where, k):
    """The k valid tokens of largest entropy, ties to the earlier flat position."""
    flat, valid = entropy.ravel(), where.ravel()
    order = [i for i in np.lexsort((np.arange(flat.size), -flat)) if valid[i]]
    out = np.zeros(flat.size, bool)
    out[order[:k]] = True
    return out.reshape(entropy.shape)


def ref_quantile(entropy, where, rho):
    if not where.any():
        return np.zeros(where.shape, bool)
    threshold = np.quantile(entropy[where].astype(np.float64), 1 - rho)  # linear
    return where & (entropy >= threshold)


DYADIC_RHO = st.sampled_from([i / 8 for i in range(9)])


@given(entropies(grid=True), DYADIC_RHO)
def test_top_k_matches_reference(data, rho):
    entropy, where = data
    out = np.asarray(high_entropy_mask(masked(entropy, where), rho=rho, where=where))
    k = math.ceil(rho * where.sum())
    assert out.sum() == k
    np.testing.assert_array_equal(out, ref_top_k(entropy, where, k))
    if 0 < k < where.sum():  # every selected entropy >= every unselected valid one
        assert entropy[out].min() >= entropy[where & ~out].max()


@given(entropies(grid=True), DYADIC_RHO)
def test_quantile_matches_reference(data, rho):
    entropy, where = data
    out = high_entropy_mask(masked(entropy, where), rho=rho, selection="quantile", where=where)
    expected = ref_quantile(entropy, where, rho)
    np.testing.assert_array_equal(np.asarray(out), expected)
    values = entropy[where]
    if values.size and np.unique(values).size == values.size:  # distinct: the stated count
        assert expected.sum() == 1 + math.floor(rho * (values.size - 1))


RHOS = [
    Fraction(1, 3),
    *(Fraction(x) for x in ("0", "0.1", "0.2", "0.3", "0.5", "0.7", "0.9", "1")),
]


@pytest.mark.parametrize("rho", RHOS, ids=str)
def test_top_k_count_is_ceil_of_rho_n(rho):
    # Float rounding of rho (0.2 is 0.2000000029 in float32) must not add a token when rho * n
    # is an integer, for every n up to 60 valid tokens.
    entropy = np.random.default_rng(0).uniform(0, 5, (6, 10)).astype(np.float32)
    counts = []
    for n in range(61):
        where = (np.arange(60) < n).reshape(6, 10)
        out = high_entropy_mask(entropy, rho=jnp.float32(float(rho)), where=where)
        counts.append(int(np.asarray(out).sum()))
    assert counts == [math.ceil(rho * n) for n in range(61)]


def test_ties_masks_and_extremes():
    where = np.array([[True, False, True, True], [True, True, False, True]])
    tied = np.ones((2, 4), np.float32)
    out = np.asarray(high_entropy_mask(tied, rho=0.5, where=where))
    # Exactly ceil(0.5 * 6) = 3 of the tied tokens: the first three valid ones in row order.
    np.testing.assert_array_equal(out, [[True, False, True, True], [False, False, False, False]])
    # An integer 0/1 mask selects the same tokens.
    integer = advantages.high_entropy_mask(tied, rho=0.5, where=where.astype(np.int32))
    np.testing.assert_array_equal(integer, out)
    # The quantile convention keeps every token tied with the threshold.
    quantile = high_entropy_mask(tied, rho=0.5, selection="quantile", where=where)
    np.testing.assert_array_equal(np.asarray(quantile), where)
    # Masked tokens are never selected, whatever their entropy.
    wild = np.array([[0.5, np.inf, 0.1, 0.2], [0.3, 0.4, np.nan, 0.6]], np.float32)
    for selection in ("top_k", "quantile"):
        for rho in (0.0, 0.2, 0.5, 1.0):
            out = np.asarray(high_entropy_mask(wild, rho=rho, selection=selection, where=where))
            assert not np.any(out & ~where)
    assert not np.any(np.asarray(high_entropy_mask(wild, rho=0.0, where=where)))
    np.testing.assert_array_equal(np.asarray(high_entropy_mask(wild, rho=1.0, where=where)), where)
    top = high_entropy_mask(wild, rho=0.0, selection="quantile", where=where)
    np.testing.assert_array_equal(np.asarray(top), wild == 0.6)  # the maximum only
    empty = high_entropy_mask(wild, rho=0.5, where=np.zeros_like(where))
    assert not np.any(np.asarray(empty))
    empty = high_entropy_mask(wild, rho=0.5, selection="quantile", where=np.zeros_like(where))
    assert not np.any(np.asarray(empty))


def test_mask_jit_vmap_and_no_retrace():
    rng = np.random.default_rng(1)
    entropy = rng.uniform(0, 4, (3, 2, 5)).astype(np.float32)
    where = rng.uniform(size=(3, 2, 5)) < 0.7
    for selection in ("top_k", "quantile"):
        mapped = jax.jit(
            jax.vmap(
                lambda h, m, s=selection: advantages.high_entropy_mask(
                    h, rho=0.4, selection=s, where=m
                )
            )
        )(entropy, where)
        for i in range(3):
            single = high_entropy_mask(
                entropy[i], rho=jnp.float32(0.4), selection=selection, where=where[i]
            )
            np.testing.assert_array_equal(np.asarray(mapped[i]), np.asarray(single))
        assert_traced_once(
            lambda h, rho, m, s=selection: advantages.high_entropy_mask(
                h, rho=rho, selection=s, where=m
            ),
            [((entropy[0], jnp.float32(r), where[0]), {}) for r in (0.2, 0.5, 0.9)],
        )
        # The same compiled function follows the traced rho.
        counts = [
            int(
                high_entropy_mask(
                    entropy[0], rho=jnp.float32(r), selection=selection, where=where[0]
                ).sum()
            )
            for r in (0.2, 0.4, 0.9)
        ]
        assert counts[0] < counts[1] < counts[2]


def test_errors_name_the_argument():
    entropy = np.ones((2, 3), np.float32)
    with raises_naming("where"):
        advantages.high_entropy_mask(entropy, where=np.ones((2, 3), np.float32))
    with raises_naming("selection"):
        advantages.high_entropy_mask(entropy, selection="threshold")
    with own_checks():
        with raises_naming("entropy", "[B, T]", error=ValueError):
            advantages.high_entropy_mask(np.ones(3, np.float32))
        with raises_naming("entropy", error=TypeError):
            advantages.high_entropy_mask(np.ones((2, 3), np.int32))
        with raises_naming("where", "(3, 2)", "(2, 3)", error=ValueError):
            advantages.high_entropy_mask(entropy, where=np.ones((3, 2), bool))
        with raises_naming("selection", "top_k", "quantile", error=ValueError):
            advantages.high_entropy_mask(entropy, selection="threshold")
        for rho in (-0.1, 1.5):
            with raises_naming("rho", error=ValueError):
                advantages.high_entropy_mask(entropy, rho=rho)


def trl_entropy_masked_loss(per_token_loss, entropy, mask, top_entropy_quantile, loss_type):
    """TRL 1.16's `GRPOTrainer._compute_loss` with `top_entropy_quantile` (one process), in
    float64: the loss multiplied by the high-entropy mask, reduced with the completion mask."""
    loss = np.asarray(per_token_loss, np.float64)
    entropy = np.asarray(entropy, np.float64)
    mask = np.asarray(mask, np.float64)
    gathered = entropy[mask.astype(bool)]
    if gathered.size == 0:
        entropy_mask = np.zeros(mask.shape)
    else:
        threshold = np.quantile(gathered, 1 - top_entropy_quantile)  # torch.quantile: linear
        entropy_mask = ((entropy * mask >= threshold) & mask.astype(bool)).astype(np.float64)
    loss = loss * entropy_mask
    if loss_type == "grpo":
        return ((loss * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).mean()
    assert loss_type == "bnpo"
    return (loss * mask).sum() / max(mask.sum(), 1.0)


@functools.partial(jax.jit, static_argnames="mode")
def entropy_masked_losses(values, entropy, where, rho, *, mode):
    """(TRL's reduction, the mask as `where`) of `values` restricted to high-entropy tokens."""
    selected = advantages.high_entropy_mask(entropy, rho=rho, selection="quantile", where=where)
    empty_rows = "count" if mode == "seq_mean_token_mean" else "skip"
    trl = losses.aggregate(
        jnp.where(selected, values, 0.0), mode=mode, empty_rows=empty_rows, where=where
    )
    as_where = losses.aggregate(values, mode=mode, where=selected)
    return trl.mean(), as_where.mean()


@pytest.mark.parametrize(
    ("loss_type", "mode"), [("grpo", "seq_mean_token_mean"), ("bnpo", "token_mean")]
)
@given(entropies(grid=True), DYADIC_RHO, st.data())
def test_documented_call_matches_trl(loss_type, mode, data, rho, more):
    entropy, where = data
    values = more.draw(float_arrays(entropy.shape, -5.0, 5.0))
    nan = masked(values, where)  # garbage on padding
    trl, _ = entropy_masked_losses(nan, masked(entropy, where), where, rho, mode=mode)
    expected = trl_entropy_masked_loss(values, entropy, where, rho, loss_type)
    np.testing.assert_allclose(float(trl), expected, rtol=1e-5, atol=1e-5)


def test_mask_as_where_changes_the_denominators():
    # Row 0: 1 of 4 tokens selected; row 1: 2 of 2; row 2: none of 3.
    entropy = np.array([[3.0, 0.0, 0.0, 0.0], [3.0, 3.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    where = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], bool)
    values = np.array([[2.0, 1.0, 1.0, 1.0], [4.0, 6.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    rho = 0.3  # 9 valid entropies 0,0,0,1,1,1,3,3,3: the 0.7-quantile is 2.2
    for loss_type, mode, as_where_expected in (
        ("grpo", "seq_mean_token_mean", (2.0 + 5.0) / 2),
        ("bnpo", "token_mean", (2.0 + 4.0 + 6.0) / 3),
    ):
        trl, as_where = entropy_masked_losses(
            values.astype(np.float32), entropy.astype(np.float32), where, rho, mode=mode
        )
        expected = trl_entropy_masked_loss(values, entropy, where, rho, loss_type)
        np.testing.assert_allclose(float(trl), expected, rtol=1e-6)
        np.testing.assert_allclose(float(as_where), as_where_expected, rtol=1e-6)
        assert abs(float(as_where) - float(trl)) > 0.5
    # TRL: row means 2/4, 10/2 and 0/3 over all three rows; tokens: 12 over 9.
    expected_grpo = (2.0 / 4 + 10.0 / 2 + 0.0) / 3
    trl_grpo, _ = entropy_masked_losses(
        values.astype(np.float32),
        entropy.astype(np.float32),
        where,
        rho,
        mode="seq_mean_token_mean",
    )
    np.testing.assert_allclose(float(trl_grpo), expected_grpo, rtol=1e-6)
