import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import own_checks, raises_naming
from tunelib.data import DEFAULT_ALPHABET, CharTokenizer, Tokenizer

tok = CharTokenizer()
alphabet_text = st.text(alphabet=DEFAULT_ALPHABET, max_size=24)


def test_fixed_ids():
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(DEFAULT_ALPHABET) == 82
    # The arithmetic characters come first, in this order, from id 3.
    assert tok.encode("0123456789+-*= ") == list(range(3, 18))
    assert tok.encode("12+7=") == [4, 5, 13, 10, 16]
    assert tok.encode("") == []
    assert tok.decode([1, 4, 5, 13, 10, 16, 4, 12, 2, 0, 0]) == "12+7=19"
    assert isinstance(tok, Tokenizer)


@given(alphabet_text)
def test_round_trip(text):
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(3 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids, np.int32)) == text


@given(alphabet_text, alphabet_text, st.integers(0, 3))
def test_decode_skips_specials_and_stops_at_eos(text, after, num_pad):
    ids = [tok.bos_id, *tok.encode(text), tok.eos_id, *tok.encode(after), *[tok.pad_id] * num_pad]
    assert tok.decode(ids) == text
    assert tok.decode(ids, stop_at_eos=False) == text + after
    assert tok.decode([tok.pad_id] * num_pad + [tok.bos_id, *tok.encode(text)]) == text


@pytest.mark.parametrize(
    ("text", "char", "position"), [("12#3", "'#'", "position 2"), ("é", "'é'", "position 0")]
)
def test_unknown_character_is_named(text, char, position):
    with raises_naming(char, position, error=ValueError):
        tok.encode(text)


def test_decode_errors():
    with raises_naming("82", "position 1", error=ValueError):
        tok.decode([4, 82])
    with raises_naming("-1", error=ValueError):
        tok.decode([-1])
    with raises_naming("ids", "(1, 2)", error=ValueError):
        tok.decode(np.zeros((1, 2), np.int32))
    with raises_naming("ids", error=TypeError):
        tok.decode(np.array([1.0, 2.0]))
    with own_checks(), raises_naming("ids", "float64", error=TypeError):
        tok.decode(np.array([1.0, 2.0]))
    assert tok.decode([]) == ""


def test_custom_alphabet_and_equality():
    small = CharTokenizer("ab")
    assert small.vocab_size == 5
    assert small.encode("ba") == [4, 3]
    assert small.decode([1, 3, 4, 2]) == "ab"
    assert (
        small == CharTokenizer("ab") and small != tok and hash(small) == hash(CharTokenizer("ab"))
    )
    assert repr(tok) == "CharTokenizer()"
    assert repr(small) == "CharTokenizer(alphabet='ab')"
    with raises_naming("alphabet", "'a'", error=ValueError):
        CharTokenizer("aba")
    with raises_naming("alphabet", error=ValueError):
        CharTokenizer("")
    with raises_naming("text"):
        tok.encode(["1", "2"])
    with own_checks(), raises_naming("text", "list", error=TypeError):
        tok.encode(["1", "2"])
