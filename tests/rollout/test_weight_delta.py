import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import raises_naming
from tunelib.rollout import WeightDelta, apply_weight_delta, fingerprint, weight_delta

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int8, np.float64]


def tree(rng, dtype):
    return {
        "layers": [rng.normal(size=(4, 6)).astype(dtype), rng.normal(size=(6,)).astype(dtype)],
        "embed": rng.normal(size=(5, 3)).astype(dtype),
    }


def leaves(t):
    return [t["embed"], *t["layers"]]  # tree order: the keys sorted


def differing(a, b) -> int:
    return int(np.sum(a.reshape(-1).view(f"u{a.itemsize}") != b.reshape(-1).view(f"u{b.itemsize}")))


@given(st.sampled_from(DTYPES), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0), st.booleans())
def test_applying_the_delta_gives_the_current_tree_bit_for_bit(dtype, seed, share, flip):
    rng = np.random.default_rng(seed)
    before = tree(rng, dtype)
    after = {"layers": [x.copy() for x in before["layers"]], "embed": before["embed"].copy()}
    for leaf in leaves(after):
        flat = leaf.reshape(-1)
        picked = rng.uniform(size=flat.size) < share
        flat[picked] = rng.normal(size=picked.sum()).astype(dtype)
        if flip:  # a sign flip of one element (0.0 becomes -0.0 for a float)
            flat[0] = -flat[0]
    snapshot = [x.tobytes() for x in leaves(before)]
    delta = weight_delta(before, after)
    assert delta.changed == sum(map(differing, leaves(before), leaves(after)))
    assert delta.nbytes == delta.changed * (np.dtype(dtype).itemsize + 4)  # int32 positions
    assert delta.fingerprint == int(fingerprint(after))
    rebuilt = apply_weight_delta(before, delta)
    for got, want in zip(leaves(rebuilt), leaves(after), strict=True):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    assert [x.tobytes() for x in leaves(before)] == snapshot  # `previous` is not changed


@given(st.sampled_from(DTYPES), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0))
def test_a_bound_on_bytes_returns_the_delta_within_it_and_none_past_it(dtype, seed, share):
    rng = np.random.default_rng(seed)
    before = tree(rng, dtype)
    after = {"layers": [x.copy() for x in before["layers"]], "embed": before["embed"].copy()}
    for leaf in leaves(after):
        bits = leaf.reshape(-1).view(f"u{leaf.itemsize}")  # the leaf's own memory
        picked = rng.uniform(size=bits.size) < share
        bits[picked] = ~bits[picked]  # every bit flipped: each picked element changed
    unbounded = weight_delta(before, after)
    bounded = weight_delta(before, after, max_bytes=unbounded.nbytes)  # exactly at the bound
    assert bounded.fingerprint == unbounded.fingerprint
    for got, want in zip(bounded.positions + bounded.values, unbounded.positions + unbounded.values,
                         strict=True):  # fmt: skip
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    if unbounded.nbytes:  # one byte less: the whole tree is cheaper, no delta
        assert weight_delta(before, after, max_bytes=unbounded.nbytes - 1) is None


def test_nans_and_signed_zeros_are_compared_as_bits():
    before = {"w": np.array([np.nan, 0.0, 1.0, np.nan], np.float32)}
    after = {"w": np.array([np.nan, -0.0, 1.0, 2.0], np.float32)}
    delta = weight_delta(before, after)
    assert delta.positions[0].tolist() == [1, 3]  # the unchanged NaN is not sent
    rebuilt = apply_weight_delta(before, delta)["w"]
    assert rebuilt.tobytes() == after["w"].tobytes() and np.signbit(rebuilt[1])


def test_an_unchanged_tree_gives_an_empty_delta():
    rng = np.random.default_rng(0)
    weights = tree(rng, np.float32)
    delta = weight_delta(weights, weights)
    assert delta.changed == 0 and delta.nbytes == 0
    rebuilt = apply_weight_delta(weights, delta)
    assert rebuilt["embed"] is not weights["embed"]
    assert rebuilt["embed"].tobytes() == weights["embed"].tobytes()


def test_a_delta_applied_to_other_weights_is_refused():
    rng = np.random.default_rng(1)
    first, second = tree(rng, np.float32), tree(rng, np.float32)
    third = {"layers": [x.copy() for x in second["layers"]], "embed": second["embed"].copy()}
    third["embed"][0, 0] += 1.0  # one element changed: the rest must come from `previous`
    delta = weight_delta(second, third)
    with raises_naming("not those it was made against", "send the whole weights"):
        apply_weight_delta(first, delta)
    assert apply_weight_delta(first, delta, check=False)["embed"].shape == (5, 3)


@pytest.mark.parametrize(
    ("current", "names"),
    [
        ({"w": np.zeros(3, np.float32), "v": np.zeros(2, np.float32)}, ["structure"]),
        ({"w": np.zeros(4, np.float32)}, ["leaf 0", "float32[3]", "float32[4]"]),
        ({"w": np.zeros(3, np.float16)}, ["leaf 0", "float16[3]"]),
    ],
)
def test_trees_that_do_not_match_are_refused_naming_what_differs(current, names):
    with raises_naming(*names):
        weight_delta({"w": np.zeros(3, np.float32)}, current)


def test_a_delta_for_another_tree_is_refused():
    delta = weight_delta({"w": np.zeros(3, np.float32)}, {"w": np.ones(3, np.float32)})
    with raises_naming("1 leaves, previous 2"):
        apply_weight_delta({"w": np.zeros(3, np.float32), "v": np.zeros(3)}, delta)
    bad = delta._replace(positions=(np.array([7], np.int32),))
    with raises_naming("outside leaf 0"):
        apply_weight_delta({"w": np.zeros(3, np.float32)}, bad, check=False)


def test_a_receiver_shapes_the_delta_from_its_counts_alone():
    rng = np.random.default_rng(2)
    before = tree(rng, ml_dtypes.bfloat16)
    after = {"layers": [x.copy() for x in before["layers"]], "embed": before["embed"].copy()}
    after["layers"][0][1, :3] += 1
    sent = weight_delta(before, after)
    counts = [p.size for p in sent.positions]
    received = WeightDelta.receiving(before, counts, sent.fingerprint)
    assert counts == [0, 3, 0] and received.fingerprint == sent.fingerprint
    for got, want in zip((*received.positions, *received.values),
                         (*sent.positions, *sent.values), strict=True):  # fmt: skip
        assert (got.shape, got.dtype) == (want.shape, want.dtype) and not got.any()
    filled = received._replace(positions=sent.positions, values=sent.values)
    assert leaves(apply_weight_delta(before, filled))[1].tobytes() == after["layers"][0].tobytes()
    with raises_naming("2 counts for the 3 leaves"):
        WeightDelta.receiving(before, [0, 3], 0)
