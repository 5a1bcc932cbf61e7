"""maj@k (tunelib/metrics/_evaluation.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_traced_once, own_checks, raises_naming
from tunelib import metrics

majority_at_k = jax.jit(metrics.majority_at_k, static_argnames="k")


def ref_majority_at_k(answers, correct, where, k):
    """Count the votes of the first k kept samples; ties go to the answer seen first."""
    out = []
    for row, ok, kept in zip(answers, correct, where, strict=True):
        votes, first = {}, {}
        for j in range(k):
            if kept[j]:
                votes[row[j]] = votes.get(row[j], 0) + 1
                first.setdefault(row[j], j)
        if not votes:
            out.append(0.0)
            continue
        best = max(votes.values())
        winner = min(first[a] for a in votes if votes[a] == best)
        out.append(float(ok[winner]))
    return np.array(out)


@st.composite
def votes(draw, consistent):
    """`[B, n]` answers from few ids (ties are common), correctness, a mask and k."""
    b, n = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    k = draw(st.integers(1, n))

    def grid(elements):
        return np.array(draw(st.lists(elements, min_size=b * n, max_size=b * n))).reshape(b, n)

    answers = grid(st.integers(0, 3)).astype(np.int32)
    if consistent:  # graded as a verifier would: one correct answer id per prompt
        correct = (
            answers == np.array(draw(st.lists(st.integers(0, 3), min_size=b, max_size=b)))[:, None]
        )
    else:
        correct = grid(st.booleans())
    return answers, correct, grid(st.booleans()), k


@given(votes(consistent=True))
def test_matches_reference(data):
    answers, correct, where, k = data
    out = majority_at_k(answers, correct, k=k, where=where)
    assert out.shape == (answers.shape[0],) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, ref_majority_at_k(answers, correct, where, k))
    # Relabelling the answers changes nothing; only the first k samples vote.
    relabelled = majority_at_k(7 - 2 * answers, correct, k=k, where=where)
    np.testing.assert_array_equal(relabelled, out)
    later = np.concatenate([answers, (answers + 1) % 4], axis=1)
    extended = majority_at_k(
        later, np.concatenate([correct, ~correct], 1), k=k, where=np.tile(where, 2)
    )
    np.testing.assert_array_equal(extended, out)


@given(votes(consistent=False))
def test_takes_the_earliest_sample_of_the_winner(data):
    answers, correct, where, k = data
    out = majority_at_k(answers, correct, k=k, where=where)
    np.testing.assert_array_equal(out, ref_majority_at_k(answers, correct, where, k))


def test_fixed_values_ties_and_no_retrace():
    answers = np.array([[7, 3, 3, 7, 3], [5, 6, 6, 5, 5], [2, 9, 9, 2, 4], [1, 1, 1, 1, 1]])
    gold = np.array([[7], [5], [2], [1]])
    correct = (answers == gold).astype(np.int32)
    np.testing.assert_array_equal(majority_at_k(answers, correct, k=5), [0, 1, 1, 1])
    # A 2-2 tie among the first 4 goes to the answer seen first (7, 5, 2).
    np.testing.assert_array_equal(majority_at_k(answers, correct, k=4), [1, 1, 1, 1])
    where = np.array([[0, 1, 1, 1, 1], [1] * 5, [1] * 5, [0] * 5], np.int32)
    np.testing.assert_array_equal(majority_at_k(answers, correct, k=5, where=where), [0, 1, 1, 0])
    assert_traced_once(
        lambda a, c: metrics.majority_at_k(a, c, k=3),
        [((answers + s, correct), {}) for s in (0, 1)],
    )


def test_errors_name_the_argument():
    answers, correct = np.zeros((2, 3), np.int32), np.ones((2, 3), bool)
    with raises_naming("k", "n = 3", error=ValueError):
        metrics.majority_at_k(answers, correct, k=4)
    with raises_naming("k", error=TypeError):
        metrics.majority_at_k(answers, correct, k=None)
    with own_checks():
        with raises_naming("answers", error=TypeError):
            metrics.majority_at_k(answers.astype(np.float32), correct, k=1)
        with raises_naming("answers", "[B, n]", error=ValueError):
            metrics.majority_at_k(np.zeros(3, np.int32), correct[0], k=1)
        with raises_naming("correct", "(2, 2)", "(2, 3)", error=ValueError):
            metrics.majority_at_k(answers, correct[:, :2], k=1)
        with raises_naming("where", error=ValueError):
            metrics.majority_at_k(answers, correct, k=1, where=np.ones((3, 2), bool))
