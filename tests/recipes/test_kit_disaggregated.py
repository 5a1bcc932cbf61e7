"""`kit.disaggregated.exchange`: trees travel in buckets of bounded bytes, small leaves
together and a large leaf in pieces, and arrive as they left (one process: its own tree)."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)

from kit import disaggregated


@given(st.lists(st.integers(0, 40), max_size=6), st.integers(1, 32))
def test_buckets_cover_every_byte_once_within_their_limit(sizes, limit):
    buckets = disaggregated._buckets(sizes, limit)
    covered = [[] for _ in sizes]
    for bucket in buckets:
        assert 0 < sum(end - start for _, start, end in bucket) <= limit
        for leaf, start, end in bucket:
            assert 0 <= start < end <= sizes[leaf]
            covered[leaf].append((start, end))
    for leaf, ranges in enumerate(covered):  # in order, contiguous, the whole leaf
        edges = [0] + [end for _, end in ranges]
        assert [start for start, _ in ranges] == edges[:-1] and edges[-1] == sizes[leaf]
    # Every bucket but the last is full: as few collectives as the bytes allow.
    assert all(sum(e - s for _, s, e in b) == limit for b in buckets[:-1])


@pytest.mark.parametrize("bucket_bytes", [7, 64, 2**20])
def test_a_tree_arrives_as_it_left_in_buckets_of_any_size(bucket_bytes):
    rng = np.random.default_rng(0)
    tree = {
        "weights": rng.standard_normal((5, 9)).astype(ml_dtypes.bfloat16),
        "empty": np.zeros((0, 3), np.float32),
        "mask": rng.random(11) < 0.5,
        "step": np.int64(7),
        "ids": (rng.integers(0, 1000, 13).astype(np.int32), np.float64(0.25)),
    }
    out, seconds = disaggregated.exchange(
        tree, source=disaggregated.TRAINER, bucket_bytes=bucket_bytes
    )
    assert seconds >= 0 and set(out) == set(tree)
    for got, sent in zip(jax_leaves(out), jax_leaves(tree), strict=True):
        assert got.dtype == np.asarray(sent).dtype and got.shape == np.shape(sent)
        as_bytes = [np.asarray(x).reshape(-1).view(np.uint8) for x in (got, sent)]
        np.testing.assert_array_equal(*as_bytes)  # bit for bit


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)
