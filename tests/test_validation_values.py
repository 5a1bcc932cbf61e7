"""The shared checks of static values: numbers, intervals, ints, token ids, real arrays."""

import jax.numpy as jnp
import numpy as np
import pytest

from tunelib import _validation as v


@pytest.mark.parametrize(
    ("bounds", "value", "message"),
    [
        (dict(low=0, high=1, low_open=True), 0, r"x must lie in \(0, 1\], got 0\."),
        (dict(low=0, high=1, high_open=True), 1.0, r"x must lie in \[0, 1\), got 1.0\."),
        (dict(low=0, high=1), -0.5, r"x must lie in \[0, 1\], got -0.5\."),
        (dict(low=1), 0, r"x must be >= 1, got 0\."),
        (dict(low=0, low_open=True), 0.0, r"x must be > 0, got 0.0\."),
        (dict(high=2, high_open=True), 2, r"x must be < 2, got 2\."),
        (dict(high=2), np.float32(2.5), r"x must be <= 2, got 2.5\."),
        (dict(low=0), float("nan"), r"x must be >= 0, got nan\."),
        (
            dict(low=1, explain="why", hint="what to do"),
            0,
            r"x must be >= 1 \(why\), got 0; what to do\.",
        ),
    ],
)
def test_number_in_names_the_interval_and_its_ends(bounds, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        v.number_in(value, "x", **bounds)


def test_number_in_accepts_the_ends_it_closes_and_passes_traced_values():
    for value in (0, 0.5, 1, np.int64(1), np.float32(0.0)):
        v.number_in(value, "x", low=0, high=1)
    v.number_in(5, "x")  # no bound
    v.number_in(jnp.float32(-3.0), "x", low=0)  # an array's value is not looked at
    v.number_in("text", "x", low=0)  # the kind of value is `real_number`'s job


def test_numbers_ints_and_finiteness():
    assert v.is_real_number(np.float32(1.5)) and v.is_real_number(3)
    assert not v.is_real_number(True) and not v.is_real_number(jnp.float32(1.0))
    assert v.is_int(np.int32(3)) and not v.is_int(3.0) and not v.is_int(False)
    with pytest.raises(TypeError, match=r"^x must be a real number, got '1' of type str\.$"):
        v.real_number("1", "x")
    with pytest.raises(TypeError, match=r"^n must be an int, got 2.0 of type float\.$"):
        v.static_int(2.0, "n")
    with pytest.raises(TypeError, match=r"^n must be a count, got True of type bool\.$"):
        v.static_int(True, "n", what="a count")
    with pytest.raises(ValueError, match=r"^t must be finite, got -inf\.$"):
        v.finite_number(float("-inf"), "t")
    v.finite_number(jnp.float32(np.inf), "t")  # traced values pass


def test_token_ids():
    assert v.token_id_tuple([3, np.int64(0), 3], "ids") == (3, 0, 3)
    assert type(v.token_id_tuple((np.int64(2),), "ids")[0]) is int
    assert v.token_id_tuple((), "ids", vocab_size=4) == ()
    with pytest.raises(ValueError, match=r"^ids holds token id -1; token ids are >= 0\.$"):
        v.token_id_tuple((1, -1), "ids")
    with pytest.raises(ValueError, match=r"ids holds token id 4, outside \[0, 4\)"):
        v.token_id_tuple((1, 4), "ids", vocab_size=4)
    for bad in (3, "ab", np.array([1, 2])):
        with pytest.raises(TypeError, match="ids must be a tuple of int token ids"):
            v.token_id_tuple(bad, "ids")
    with pytest.raises(TypeError, match=r"ids must hold int token ids, got 1.0 of type float"):
        v.token_id_tuple((0, 1.0), "ids")


def test_real_arrays_ddof_and_finite_entries():
    with pytest.raises(TypeError, match=r"r must be an integer or floating-point array.*bool"):
        v.real_array(jnp.ones(2, bool), "r")
    for bad in (2, True, -1):
        with pytest.raises(ValueError, match="ddof must be 0 or 1"):
            v.check_ddof(bad)
    values, valid = v.finite_entries(
        np.array([1, 2, 3, 4], np.int32), np.array([1, 1, 0, 1], np.int8), "r"
    )
    assert values.dtype == jnp.float32
    np.testing.assert_array_equal(values, [1.0, 2.0, 0.0, 4.0])
    np.testing.assert_array_equal(valid, [True, True, False, True])
    values, valid = v.finite_entries(np.array([np.nan, 1.0, -np.inf]), None, "r")
    np.testing.assert_array_equal(values, [0.0, 1.0, 0.0])
    np.testing.assert_array_equal(valid, [False, True, False])
