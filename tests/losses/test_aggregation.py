import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, assert_traced_once, own_checks, raises_naming
from tests.logprobs.test_sequence import pack, padded_sequences
from tunelib import losses
from tunelib.losses import AGGREGATION_MODES

aggregate = jax.jit(losses.aggregate, static_argnames="mode")


def ref_aggregate(values, where, mode, norm_constant=None):
    """Float64 reference written from each paper's formula, row by row."""
    values = np.asarray(values, np.float64)
    rows = [values[i][where[i]] for i in range(values.shape[0])]
    rows = [r for r in rows if r.size > 0]
    if not rows:
        return 0.0
    if mode == "token_mean":
        return np.concatenate(rows).mean()
    if mode == "seq_mean_token_mean":
        return np.mean([r.mean() for r in rows])
    if mode == "global_token_mean":
        return np.concatenate(rows).sum() / norm_constant
    return np.mean([r.sum() / norm_constant for r in rows])


MERGING_MODES = [m for m in AGGREGATION_MODES if m != "global_token_mean"]


def mode_kwargs(mode):
    return (
        {"norm_constant": 7.0} if mode in ("seq_mean_token_sum_norm", "global_token_mean") else {}
    )


@st.composite
def batches(draw, dyadic=False):
    b, t = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    if dyadic:  # multiples of 1/8 below 2**10: every partial sum is exact in float32
        ints = draw(st.lists(st.integers(-8192, 8192), min_size=b * t, max_size=b * t))
        values = np.array(ints, np.float32).reshape(b, t) / 8
    else:
        floats = st.floats(-10, 10, allow_nan=False, width=32)
        values = np.array(draw(st.lists(floats, min_size=b * t, max_size=b * t)), np.float32)
        values = values.reshape(b, t)
    mask_bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    where = np.array(mask_bits).reshape(b, t)
    if draw(st.booleans()):
        where[draw(st.integers(0, b - 1))] = False  # at least one empty row
    return values, where


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@given(batches())
def test_matches_reference(mode, batch):
    values, where = batch
    out = aggregate(values, mode=mode, where=where, **mode_kwargs(mode)).mean()
    assert_close(out, ref_aggregate(values, where, mode, 7.0), rtol=1e-5, atol=1e-5)


def split_points(draw, b):
    cuts = sorted(draw(st.lists(st.integers(0, b), max_size=3)))
    return [0, *cuts, b]


@pytest.mark.parametrize("mode", MERGING_MODES)
@given(batches(dyadic=True), st.data())
def test_micro_batches_equal_full_batch_exactly_float32(mode, batch, data):
    values, where = batch
    edges = split_points(data.draw, values.shape[0])
    full = aggregate(values, mode=mode, where=where, **mode_kwargs(mode))
    parts = [
        aggregate(values[a:b], mode=mode, where=where[a:b], **mode_kwargs(mode))
        for a, b in itertools.pairwise(edges)
        if b > a
    ]
    accumulated = parts[0]
    for part in parts[1:]:
        accumulated = accumulated.merge(part)
    if mode == "seq_mean_token_mean":
        # Per-row means (x / n) are not dyadic; the numerators agree to rounding only.
        assert_close(accumulated.mean(), full.mean(), rtol=1e-6, atol=1e-6)
    else:
        assert accumulated.mean() == full.mean()
    assert accumulated.count == full.count


@pytest.mark.parametrize("mode", MERGING_MODES)
@given(batches(), st.integers(1, 4))
def test_micro_batches_equal_full_batch_exactly_float64(mode, batch, k):
    values, where = batch
    with jax.enable_x64(True):
        values = values.astype(np.float64)
        chunks = np.array_split(np.arange(values.shape[0]), min(k, values.shape[0]))
        full = aggregate(values, mode=mode, where=where, **mode_kwargs(mode))
        parts = [
            aggregate(values[c], mode=mode, where=where[c], **mode_kwargs(mode)) for c in chunks
        ]
        total = functools.reduce(losses.Aggregate.merge, parts)
        assert full.total.dtype == jnp.float64
        assert_close(total.mean(), full.mean(), rtol=1e-13, atol=1e-13)
        assert total.count == full.count


@functools.partial(jax.jit, static_argnames="edges")
def global_shares(values, where, n_global, *, edges):
    """Each micro-batch's global_token_mean share and its gradient, and the full batch's
    token_mean and its gradient: one compilation per example, not one per operation."""

    def share(x, a, b):
        return losses.aggregate(
            x[a:b], mode="global_token_mean", norm_constant=n_global, where=where[a:b]
        ).mean()

    def full(x):
        return losses.aggregate(x, mode="token_mean", where=where).mean()

    pairs = list(itertools.pairwise(edges))
    shares = [share(values, a, b) for a, b in pairs if b > a]
    grads = [jax.grad(share)(values, a, b) for a, b in pairs]
    return shares, grads, full(values), jax.grad(full)(values)


@given(batches(dyadic=True), st.data())
def test_global_token_mean_shares_add_up_to_the_full_batch_token_mean(batch, data):
    values, where = batch
    edges = split_points(data.draw, values.shape[0])
    n_global = float(where.sum())
    shares, grads, full, full_grad = global_shares(values, where, n_global, edges=tuple(edges))
    if n_global == 0:
        assert all(share == 0 for share in shares)
        return
    assert_close(sum(float(share) for share in shares), float(full), rtol=1e-6, atol=1e-6)
    # Gradients computed per micro-batch and summed equal the full batch's.
    assert_close(sum(np.asarray(g) for g in grads), full_grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_empty_rows_are_left_out_and_empty_batch_is_zero(mode):
    values = np.array([[1.0, 2.0], [jnp.nan, jnp.inf]], np.float32)
    where = np.array([[True, True], [False, False]])
    with_empty = aggregate(values, mode=mode, where=where, **mode_kwargs(mode))
    without = aggregate(values[:1], mode=mode, where=where[:1], **mode_kwargs(mode))
    assert with_empty == without
    nothing = aggregate(values, mode=mode, where=np.zeros((2, 2), bool), **mode_kwargs(mode))
    assert nothing.mean() == 0.0 and nothing.total == 0.0
    # The global count is the caller's; every other mode counts nothing.
    assert nothing.count == (7.0 if mode == "global_token_mean" else 0.0)
    grad = jax.grad(lambda x: aggregate(x, mode=mode, where=where, **mode_kwargs(mode)).mean())(
        jnp.asarray(values)
    )
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad[1]) == 0)


def test_modes_differ_as_the_papers_say():
    values = np.array([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]], np.float32)
    where = np.array([[True] * 4, [True, False, False, False]])
    assert aggregate(values, mode="token_mean", where=where).mean() == 9.0 / 5
    assert aggregate(values, mode="seq_mean_token_mean", where=where).mean() == 3.0
    out = aggregate(values, mode="seq_mean_token_sum_norm", norm_constant=4, where=where).mean()
    assert out == (4.0 / 4 + 5.0 / 4) / 2


def test_no_retrace_with_traced_constant():
    values = jnp.ones((3, 4))
    where = jnp.array([[True] * 4, [True, False, False, False], [False] * 4])
    assert_traced_once(
        lambda x, c, m: losses.aggregate(
            x, mode="seq_mean_token_sum_norm", norm_constant=c, where=m
        ).mean(),
        [((values, jnp.float32(c), where), {}) for c in (2.0, 8.0)],
    )
    jitted = jax.jit(
        lambda x, c: losses.aggregate(x, mode="seq_mean_token_sum_norm", norm_constant=c)
    )
    assert jitted(values, 2.0).mean() == 2.0
    assert jitted(values, 4.0).mean() == 1.0


def test_errors():
    values = jnp.ones((2, 3))
    with raises_naming("mode"):
        losses.aggregate(values, mode="mean")
    with raises_naming("norm_constant"):
        losses.aggregate(values, mode="seq_mean_token_sum_norm")
    with raises_naming("norm_constant"):
        losses.aggregate(values, mode="token_mean", norm_constant=3.0)
    with raises_naming("where"):
        losses.aggregate(values, mode="token_mean", where=jnp.ones((2, 2), bool))
    with own_checks():
        with raises_naming("values", "[B, T]", error=ValueError):
            losses.aggregate(jnp.ones((2, 3, 4)), mode="token_mean")
        with raises_naming("norm_constant", error=ValueError):
            losses.aggregate(values, mode="seq_mean_token_sum_norm", norm_constant=0.0)


@functools.partial(jax.jit, static_argnames="mode")
def padded_and_packed(values, where, packed, packed_where, segments, *, mode):
    """(total, count, gradient of the mean) for the padded batch and for the packed one."""
    out = []
    for x, kwargs in (
        (values, {"where": where}),
        (packed, {"where": packed_where, "segment_ids": segments}),
    ):

        def reduce(x, kwargs=kwargs):
            return losses.aggregate(x, mode=mode, **mode_kwargs(mode), **kwargs)

        result = reduce(x)
        out.append((result.total, result.count, jax.grad(lambda x: reduce(x).mean())(x)))
    return out


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@given(padded_sequences())
def test_packed_rows_equal_padded_rows(mode, data):
    values, where, lengths = data
    packed, packed_where, segments, index = pack(values, where, lengths)
    values = np.where(where, values, np.nan).astype(np.float32)
    packed = np.where(packed_where, packed, np.nan).astype(np.float32)
    (total, count, grad), (p_total, p_count, p_grad) = padded_and_packed(
        values, where, packed, packed_where, segments, mode=mode
    )
    assert_close(p_total, total, rtol=1e-6, atol=1e-6)
    assert p_count == count
    used = segments > 0
    assert_close(np.asarray(p_grad)[used], np.asarray(grad).reshape(-1)[index[used]], atol=1e-6)
    assert np.all(np.asarray(p_grad)[~used] == 0)


def test_segments_integer_masks_and_errors():
    values = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    segments = jnp.array([[1, 1, 2, 0], [1, 2, 3, 4]])
    where = jnp.array([[1, 1, 1, 0], [1, 1, 0, 1]])
    # Sequences (1, 2), (3), (5), (6), (8): their token means, then their mean.
    out = aggregate(values, mode="seq_mean_token_mean", where=where, segment_ids=segments)
    assert (out.total, out.count) == (1.5 + 3.0 + 5.0 + 6.0 + 8.0, 5.0)
    # The token modes do not see segments; an integer 0/1 mask counts like the boolean one.
    for mode in ("token_mean", "seq_mean_token_mean"):
        np.testing.assert_array_equal(
            aggregate(values, mode=mode, where=where),
            aggregate(values, mode=mode, where=where == 1),
        )
    token = aggregate(values, mode="token_mean", where=where, segment_ids=segments)
    assert (token.total, token.count) == (1.0 + 2 + 3 + 5 + 6 + 8, 6.0)
    with raises_naming("where", "2", error=ValueError):
        losses.aggregate(values, mode="token_mean", where=where * 2)
    with raises_naming("segment_ids", "5", error=ValueError):
        losses.aggregate(values, mode="seq_mean_token_mean", segment_ids=segments + 1)
    with raises_naming("segment_ids"):
        losses.aggregate(values, mode="token_mean", segment_ids=segments[:, :3])
