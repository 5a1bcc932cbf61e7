"""A character-level tokenizer for the built-in synthetic tasks and for tests."""

import string
from collections.abc import Iterable
from typing import Protocol, SupportsIndex, runtime_checkable

import numpy as np

# Ids 0, 1, 2 are the special tokens; the alphabet follows from id 3 in this order, so the
# arithmetic characters always get ids 3..17.
DEFAULT_ALPHABET = (
    "0123456789+-*= " + string.ascii_lowercase + string.ascii_uppercase + ".,:;!?'\"()/\n"
)


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipelines need from a tokenizer.

    `encode` maps text to ids without special tokens and raises `ValueError` for text it cannot
    encode; the pipelines add `bos_id` and `eos_id` themselves and pad with `pad_id`.
    """

    pad_id: int
    bos_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[SupportsIndex]) -> str: ...


class CharTokenizer:
    """One token per character: pad = 0, BOS = 1, EOS = 2, then the alphabet from id 3.

    The default alphabet holds the arithmetic characters `"0123456789+-*= "` (ids 3 to 17),
    then ASCII letters and common punctuation, 82 ids in all. There is no unknown token:
    `encode` raises a `ValueError` that names a character outside the alphabet.

    Args:
      alphabet: the characters, each at most once, in id order from 3.

    Examples:
      >>> from tunelib.data import CharTokenizer
      >>> tok = CharTokenizer()
      >>> tok.encode("12+7=")
      [4, 5, 13, 10, 16]
      >>> tok.decode([tok.bos_id, 4, 5, 13, 10, 16, 11, tok.eos_id, 0, 0])
      '12+7=8'
      >>> tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id
      (82, 0, 1, 2)
    """

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    num_special: int = 3

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if not alphabet:
            raise ValueError("alphabet must not be empty.")
        repeated = sorted({ch for ch in alphabet if alphabet.count(ch) > 1})
        if repeated:
            raise ValueError(f"alphabet must hold each character once; repeated: {repeated}.")
        self.alphabet = alphabet
        self.vocab_size = self.num_special + len(alphabet)
        self._ids = {ch: self.num_special + i for i, ch in enumerate(alphabet)}

    def encode(self, text: str) -> list[int]:
        """The ids of the characters of `text`, without BOS or EOS.

        Raises:
          ValueError: naming the first character not in the alphabet and its position.
          TypeError: if `text` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}.")
        try:
            return [self._ids[ch] for ch in text]
        except KeyError:
            position = next(i for i, ch in enumerate(text) if ch not in self._ids)
            shown = text if len(text) <= 40 else text[:37] + "..."
            raise ValueError(
                f"unknown character {text[position]!r} at position {position} of {shown!r}: "
                "it is not in the tokenizer's alphabet."
            ) from None

    def decode(self, ids: Iterable[SupportsIndex], *, stop_at_eos: bool = True) -> str:
        """The text of `ids`: pad and BOS are skipped; decoding stops at the first EOS.

        Args:
          ids: a 1-D sequence (list or array) of token ids.
          stop_at_eos: if True (the default), nothing after the first EOS is decoded, which
            cuts a sampled completion at its end; if False, EOS is skipped like pad and BOS.

        Raises:
          ValueError: naming an id outside `[0, vocab_size)` and its position.
        """
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-D, got shape {ids.shape}.")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must be integers, got dtype {ids.dtype}.")
        chars = []
        for position, i in enumerate(ids.tolist()):
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} at position {position} is outside [0, {self.vocab_size})."
                )
            if i == self.eos_id and stop_at_eos:
                break
            if i >= self.num_special:
                chars.append(self.alphabet[i - self.num_special])
        return "".join(chars)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.alphabet == self.alphabet

    def __hash__(self) -> int:
        return hash(self.alphabet)

    def __repr__(self) -> str:
        if self.alphabet == DEFAULT_ALPHABET:
            return "CharTokenizer()"
        return f"CharTokenizer(alphabet={self.alphabet!r})"
