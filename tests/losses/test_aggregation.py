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

aggregate = jax.jit(losses.aggregate, static_argnames=("mode", "empty_rows"))


def ref_aggregate(values, where, mode, norm_constant=None, empty_rows="skip"):
    """Float64 reference written from each paper's formula, row by row; an empty row is a
    sequence of loss 0 when `empty_rows` is "count"."""
    values = np.asarray(values, np.float64)
    rows = [values[i][where[i]] for i in range(values.shape[0])]
    if empty_rows == "skip" or mode in ("token_mean", "global_token_mean"):
        rows = [r for r in rows if r.size > 0]
    if not rows:
        return 0.0
    tokens = np.concatenate(rows)
    if mode == "token_mean":
        return tokens.mean() if tokens.size else 0.0
    if mode == "global_token_mean":
        return tokens.sum() / norm_constant
    if mode == "seq_mean_token_mean":
        return np.mean([r.mean() if r.size else 0.0 for r in rows])
    if mode == "seq_mean_token_sum":
        return np.mean([r.sum() for r in rows])
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


@pytest.mark.parametrize("empty_rows", ["skip", "count"])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@given(batches())
def test_matches_reference(mode, empty_rows, batch):
    values, where = batch
    kw = mode_kwargs(mode)
    out = aggregate(values, mode=mode, empty_rows=empty_rows, where=where, **kw).mean()
    expected = ref_aggregate(values, where, mode, 7.0, empty_rows)
    assert_close(out, expected, rtol=1e-5, atol=1e-5)


def split_points(draw, b):
    cuts = sorted(draw(st.lists(st.integers(0, b), max_size=3)))
    return [0, *cuts, b]


@pytest.mark.parametrize("empty_rows", ["skip", "count"])
@pytest.mark.parametrize("mode", MERGING_MODES)
@given(batches(dyadic=True), st.data())
def test_micro_batches_equal_full_batch_exactly_float32(mode, empty_rows, batch, data):
    values, where = batch
    edges = split_points(data.draw, values.shape[0])
    kw = {"mode": mode, "empty_rows": empty_rows, **mode_kwargs(mode)}
    full = aggregate(values, where=where, **kw)
    parts = [
        aggregate(values[a:b], where=where[a:b], **kw)
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


@functools.partial(jax.jit, static_argnames=("mode", "empty_rows"))
def padded_and_packed(values, where, packed, packed_where, segments, *, mode, empty_rows):
    """(total, count, gradient of the mean) for the padded batch and for the packed one."""
    out = []
    for x, kwargs in (
        (values, {"where": where}),
        (packed, {"where": packed_where, "segment_ids": segments}),
    ):

        def reduce(x, kwargs=kwargs):
            return losses.aggregate(
                x, mode=mode, empty_rows=empty_rows, **mode_kwargs(mode), **kwargs
            )

        result = reduce(x)
        out.append((result.total, result.count, jax.grad(lambda x: reduce(x).mean())(x)))
    return out


@pytest.mark.parametrize("empty_rows", ["skip", "count"])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@given(padded_sequences())
def test_packed_rows_equal_padded_rows(mode, empty_rows, data):
    # Every sequence has at least one position (some have no valid token): under "count" the
    # padded batch's rows and the packed batch's segments are the same sequences.
    values, where, lengths = data
    packed, packed_where, segments, index = pack(values, where, lengths)
    # In float64: the padded rows and the packed segments sum the same terms in different
    # orders, which in float32 moved totals of 26 by 0.2 of a fixed rtol 1e-6 on this CPU.
    values = np.where(where, values, np.nan).astype(np.float64)
    packed = np.where(packed_where, packed, np.nan).astype(np.float64)
    with jax.enable_x64(True):
        (total, count, grad), (p_total, p_count, p_grad) = padded_and_packed(
            values, where, packed, packed_where, segments, mode=mode, empty_rows=empty_rows
        )
    assert total.dtype == p_grad.dtype == jnp.float64
    assert_close(p_total, total, rtol=1e-13, atol=1e-13)
    assert p_count == count
    used = segments > 0
    assert_close(np.asarray(p_grad)[used], np.asarray(grad).reshape(-1)[index[used]], atol=1e-15)
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


# ---------------------------------------------------------------------------------------------
# The reductions of TRL and Tunix, transcribed in float64 from their code, against the one-line
# calls the docstring gives.


def trl_micro_batch_loss(
    loss,
    mask,
    loss_type,
    *,
    accumulation,
    max_completion_length=None,
    num_items_in_batch=None,
    num_processes=1,
    steps_per_generation=None,
):
    """One micro-batch's loss in TRL 1.16's `GRPOTrainer._compute_loss` (training mode)."""
    loss, mask = np.asarray(loss, np.float64), np.asarray(mask, np.float64)
    if loss_type in ("grpo", "sapo"):
        per_row = (loss * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)
        return per_row.mean() / accumulation
    if loss_type == "dr_grpo":
        return (loss * mask).sum() / (loss.shape[0] * max_completion_length) / accumulation
    if loss_type in ("dapo", "cispo"):
        normalizer = max(num_items_in_batch, 1.0) / num_processes
        normalizer = normalizer * accumulation / steps_per_generation
        return (loss * mask).sum() / normalizer
    assert loss_type == "luspo"
    return (loss * mask).sum(-1).mean() / accumulation


def trl_step_loss(micro_batches, loss_type, **kwargs):
    """The value whose gradient one optimiser step applies: each process sums its
    accumulation micro-batches' losses, and data parallelism averages the processes'."""
    accumulation = len(micro_batches[0])
    per_process = [
        sum(
            trl_micro_batch_loss(x, m, loss_type, accumulation=accumulation, **kwargs)
            for x, m in process
        )
        for process in micro_batches
    ]
    return np.mean(per_process)


def tunix_loss(loss, mask, mode, norm=None):
    """Tunix 0.1.7's `aggregate_loss` (tunix/rl/common.py) on one batch."""
    loss, mask = np.asarray(loss, np.float64), np.asarray(mask, np.float64)
    seq_mask = mask.sum(-1)
    non_zero_rows = max((seq_mask > 0).sum(), 1)
    if mode == "token-mean":
        return (loss * mask).sum() / max(mask.sum(), 1)
    if mode == "sequence-mean-token-mean":
        return ((loss * mask).sum(-1) / np.maximum(seq_mask, 1)).sum() / non_zero_rows
    if mode == "sequence-mean-token-scale":
        norm = loss.shape[-1] if norm is None else norm
        return ((loss * mask).sum(-1) / max(norm, 1e-6)).sum() / non_zero_rows
    if mode == "seq-mean-token-sum":
        kept = (seq_mask > 0).astype(np.float64)
        return ((loss * mask).sum(-1) * kept).sum() / max(kept.sum(), 1e-6)
    assert mode == "sequence-mean-token-sum-norm"
    norm = non_zero_rows if norm is None else norm
    return (loss * mask).sum() / max(norm, 1e-6)


# TRL's loss types and Tunix's modes as the docstring of `aggregate` maps them.
TRL_CALLS = {
    "grpo": {"mode": "seq_mean_token_mean", "empty_rows": "count"},
    "sapo": {"mode": "seq_mean_token_mean", "empty_rows": "count"},
    "dr_grpo": {"mode": "seq_mean_token_sum_norm", "empty_rows": "count"},
    "dapo": {"mode": "global_token_mean"},
    "cispo": {"mode": "global_token_mean"},
    "luspo": {"mode": "seq_mean_token_sum", "empty_rows": "count"},
}
TUNIX_CALLS = {
    "token-mean": {"mode": "token_mean"},
    "sequence-mean-token-mean": {"mode": "seq_mean_token_mean"},
    "sequence-mean-token-scale": {"mode": "seq_mean_token_sum_norm"},
    "seq-mean-token-sum": {"mode": "seq_mean_token_sum"},
    "sequence-mean-token-sum-norm": {"mode": "global_token_mean"},
}


@st.composite
def trl_steps(draw):
    """Per-token losses and masks of `generations` optimiser steps of `processes` x
    `accumulation` micro-batches of `rows` rows each, with empty rows."""
    processes, accumulation = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    rows, width, generations = draw(st.integers(1, 3)), draw(st.integers(1, 4)), 2
    shape = (generations, processes, accumulation, rows, width)
    size = int(np.prod(shape))
    values = np.array(
        draw(st.lists(st.floats(-10, 10, width=32), min_size=size, max_size=size)), np.float32
    ).reshape(shape)
    bits = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    where = np.array(bits).reshape(shape)
    where[..., draw(st.integers(0, rows - 1)), :] &= draw(st.booleans())  # empty rows
    return values, where


@pytest.mark.parametrize("loss_type", sorted(TRL_CALLS))
@given(trl_steps())
def test_one_line_calls_match_trl_over_a_step(loss_type, step):
    values, where = step
    max_len = 7.0
    # TRL's dapo and cispo normalise by the valid tokens of the whole generation batch (here
    # two optimiser steps, steps_per_generation = 2 x accumulation), rescaled to one step.
    accumulation = values.shape[2]
    num_items = float(where.sum())
    trl_kw = {
        "max_completion_length": max_len,
        "num_items_in_batch": num_items,
        "num_processes": values.shape[1],
        "steps_per_generation": 2 * accumulation,
    }
    nan = np.where(where, values, np.nan).astype(np.float32)  # garbage where masked
    call = dict(TRL_CALLS[loss_type])
    if loss_type == "dr_grpo":
        call["norm_constant"] = max_len
    elif call["mode"] == "global_token_mean":
        call["norm_constant"] = num_items * accumulation / (2 * accumulation)
    for generation in range(2):
        micro = [
            [(values[generation, p, k], where[generation, p, k]) for k in range(accumulation)]
            for p in range(values.shape[1])
        ]
        expected = trl_step_loss(micro, loss_type, **trl_kw)
        parts = [
            aggregate(nan[generation, p, k], where=where[generation, p, k], **call)
            for p in range(values.shape[1])
            for k in range(accumulation)
        ]
        if call["mode"] == "global_token_mean":  # each micro-batch's share, summed
            out = sum(float(part.mean()) for part in parts)
        else:  # merged numerators and denominators, divided once
            out = functools.reduce(losses.Aggregate.merge, parts).mean()
        assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", sorted(TUNIX_CALLS))
@given(batches(), st.sampled_from([None, 3.0]))
def test_one_line_calls_match_tunix(mode, batch, norm):
    values, where = batch
    nan = np.where(where, values, np.nan).astype(np.float32)
    call = dict(TUNIX_CALLS[mode])
    if mode == "sequence-mean-token-scale":  # Tunix's default norm: the width T
        call["norm_constant"] = values.shape[1] if norm is None else norm
    elif mode == "sequence-mean-token-sum-norm":  # default: the rows with a valid token
        call["norm_constant"] = max(where.any(-1).sum(), 1) if norm is None else norm
    elif norm is not None:
        return
    out = aggregate(nan, where=where, **call).mean()
    assert_close(out, tunix_loss(values, where, mode, norm), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "mode",
    ["token-mean", "sequence-mean-token-mean", "sequence-mean-token-scale", "seq-mean-token-sum"],
)
@given(batches(), st.integers(1, 3))
def test_tunix_micro_batches_average_to_the_merged_aggregate_when_denominators_agree(
    mode, batch, k
):
    # Tunix averages the micro-batches' values; that is the merged aggregate when every
    # micro-batch has the same denominator, as here: every row holds a valid token, and the
    # micro-batches have the same number of rows.
    values, where = batch
    where[:, 0] = True
    rows = (values.shape[0] // k) * k
    if rows == 0:
        return
    call = dict(TUNIX_CALLS[mode])
    if mode == "sequence-mean-token-scale":
        call["norm_constant"] = float(values.shape[1])
    if mode == "token-mean":
        where[:rows] = True  # equal token counts
    chunks = np.split(np.arange(rows), k)
    tunix = np.mean([tunix_loss(values[c], where[c], mode) for c in chunks])
    merged = functools.reduce(
        losses.Aggregate.merge, [aggregate(values[c], where=where[c], **call) for c in chunks]
    )
    assert_close(merged.mean(), tunix, rtol=1e-5, atol=1e-5)
    assert_close(merged.mean(), tunix_loss(values[:rows], where[:rows], mode), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MERGING_MODES)
def test_counted_empty_rows_are_zero_loss_sequences(mode):
    values = np.array([[1.0, 3.0], [4.0, 2.0], [np.nan, np.inf]], np.float32)
    where = np.array([[True, True], [True, False], [False, False]])
    kw = mode_kwargs(mode)
    skip = aggregate(values, mode=mode, where=where, **kw)
    count = aggregate(values, mode=mode, empty_rows="count", where=where, **kw)
    constant = kw.get("norm_constant", 1.0)
    # The same numerator; the denominator gains the empty row (times C) in the sequence modes.
    assert count.total == skip.total
    if mode == "token_mean":
        assert count.count == skip.count == 3.0
    else:
        assert (skip.count, count.count) == (2.0 * constant, 3.0 * constant)
    # Without empty rows both choices agree; with nothing valid both give 0.
    full = aggregate(values[:2], mode=mode, empty_rows="count", where=where[:2], **kw)
    assert full == aggregate(values[:2], mode=mode, where=where[:2], **kw)
    nothing = aggregate(values, mode=mode, empty_rows="count", where=np.zeros((3, 2), bool), **kw)
    assert nothing.mean() == 0.0
    grad = jax.grad(
        lambda x: aggregate(x, mode=mode, empty_rows="count", where=where, **kw).mean()
    )(jnp.asarray(values))
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad[2]) == 0)
    expected_grad = {
        "token_mean": [[1 / 3, 1 / 3], [1 / 3, 0]],
        "seq_mean_token_mean": [[1 / 6, 1 / 6], [1 / 3, 0]],
        "seq_mean_token_sum": [[1 / 3, 1 / 3], [1 / 3, 0]],
        "seq_mean_token_sum_norm": [[1 / 21, 1 / 21], [1 / 21, 0]],
    }[mode]
    assert_close(np.asarray(grad[:2]), expected_grad)


def test_counted_empty_segments_of_packed_rows():
    # Sequences (1, 2) | (3, masked) in row 0, and (masked, masked) | (5) in row 1: four
    # sequences, one without a valid token, as in the padded batch of one sequence per row.
    packed = jnp.array([[1.0, 2.0, 3.0, 9.0], [9.0, 9.0, 5.0, 0.0]])
    where = jnp.array([[True, True, True, False], [False, False, True, False]])
    segments = jnp.array([[1, 1, 2, 2], [1, 1, 2, 0]])
    padded = jnp.array([[1.0, 2.0], [3.0, 9.0], [9.0, 9.0], [5.0, 0.0]])
    padded_where = jnp.array([[True, True], [True, False], [False, False], [True, False]])
    for mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
        out = aggregate(packed, mode=mode, empty_rows="count", where=where, segment_ids=segments)
        ref = aggregate(padded, mode=mode, empty_rows="count", where=padded_where)
        assert (out.total, out.count) == (ref.total, ref.count)
        assert out.count == 4.0
    # Under "count" every segment id is checked, not only those at valid tokens.
    with raises_naming("segment_ids", "9", error=ValueError):
        losses.aggregate(
            packed,
            mode="seq_mean_token_mean",
            empty_rows="count",
            where=where,
            segment_ids=segments.at[1, 3].set(9),
        )


def test_bf16_vmap_and_no_retrace_when_counting_empty_rows():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(3, 4, 5)).astype(np.float32)
    where = rng.random((3, 4, 5)) < 0.6
    where[:, 1] = False

    def reduce(x, c, m):
        return losses.aggregate(
            x, mode="seq_mean_token_sum_norm", norm_constant=c, empty_rows="count", where=m
        ).mean()

    mapped = jax.vmap(reduce, in_axes=(0, None, 0))(values, 3.0, where)
    for i in range(3):
        assert_close(
            mapped[i],
            ref_aggregate(values[i], where[i], "seq_mean_token_sum_norm", 3.0, "count"),
            rtol=1e-5,
        )
    low = reduce(jnp.asarray(values[0], jnp.bfloat16), 3.0, where[0])
    assert low.dtype == jnp.float32
    assert_close(low, mapped[0], rtol=2e-2, atol=2e-2)
    assert_traced_once(reduce, [((values[0], jnp.float32(c), where[0]), {}) for c in (2.0, 8.0)])
    sums = jax.jit(
        lambda x, m: losses.aggregate(
            x, mode="seq_mean_token_sum", empty_rows="count", where=m
        ).mean()
    )
    assert_close(
        sums(values[0], where[0]),
        ref_aggregate(values[0], where[0], "seq_mean_token_sum", None, "count"),
        rtol=1e-5,
    )


def test_empty_rows_errors():
    values = jnp.ones((2, 3))
    with raises_naming("empty_rows"):
        losses.aggregate(values, mode="seq_mean_token_mean", empty_rows="drop")
    with own_checks(), raises_naming("empty_rows", "skip", "count", error=ValueError):
        losses.aggregate(values, mode="seq_mean_token_mean", empty_rows="drop")
    with raises_naming("norm_constant"):
        losses.aggregate(values, mode="seq_mean_token_sum", norm_constant=2.0)
