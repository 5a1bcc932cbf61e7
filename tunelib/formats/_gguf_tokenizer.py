"""Tokenizers from GGUF files: `gguf_tokenizer` builds an `HFTokenizer` from a file's
`tokenizer.ggml.*` metadata, and `gguf_tokenizer_metadata` gives those metadata for a tokenizer.

A GGUF file (llama.cpp's format) carries no `tokenizer.json`: its tokenizer is a list of tokens,
their types, merges (byte-level BPE) or scores (SentencePiece), special ids, and the name of the
pre-tokenizer llama.cpp runs before BPE (`tokenizer.ggml.pre`). The names map to regular
expressions in llama.cpp's `src/llama-vocab.cpp`; `_SPLITS` holds the common ones as
`tokenizers` pre-tokenizers, each a sequence of regex splits that isolate their matches, as
llama.cpp applies its list of expressions one after the other.

Only the key-value section of the file is read (`_gguf_file.read_metadata`).
"""

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from tunelib.data import HFTokenizer
from tunelib.formats._gguf_file import read_metadata

# gguf.TokenType: what each entry of `tokenizer.ggml.token_type` means.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"  # SentencePiece's "▁", which stands for a space inside a token
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")

# The regular expressions of llama.cpp's pre-tokenizers, in the spelling of the Hugging Face
# `tokenizer.json` files they come from (llama.cpp rewrites `(?i:'s|...)` case by case, and
# leaves the final `|\s+` out: text no expression matches stays a piece of its own, as with
# the `isolated` behaviour of `tokenizers`' Split, so both split text alike).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT = r"\p{N}"  # each digit alone: `tokenizers`' Digits(individual_digits=True)
_DIGITS = r"\p{N}+"  # runs of digits: Digits(individual_digits=False)


@dataclasses.dataclass(frozen=True)
class _Split:
    """One of llama.cpp's pre-tokenizers: the regexes it splits with, in order.

    `ignore_merges` (a word that is a token is that token, whatever the merges say) and
    `add_bos` (BOS starts a text when the file has no `tokenizer.ggml.add_bos_token`) are
    what llama.cpp sets with it. `names[0]` is the name `gguf_tokenizer_metadata` writes.
    """

    names: tuple[str, ...]
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_SPLITS = (
    _Split(("default",), (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, _DIGITS, "[0-9][0-9][0-9]")),
    _Split(
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling"),
        (_GPT2,),
    ),
    _Split(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        (_DIGIT, _GPT2),
    ),
    _Split(
        ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0"),
        (_LLAMA3,),
        ignore_merges=True,
        add_bos=True,
    ),
    _Split(("dbrx", "smaug-bpe"), (_LLAMA3,)),
    _Split(
        ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "solar-open"), (_QWEN2,)
    ),
    _Split(("qwen35",), (_QWEN35,)),
    _Split(("tekken",), (_TEKKEN,), ignore_merges=True, add_bos=True),
    _Split(("gpt-4o", "llama4", "minimax-m2"), (_GPT4O,)),
    _Split(("falcon",), (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    _Split(
        ("deepseek-v3",), (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _DEEPSEEK3)
    ),
)
_SPLIT_BY_NAME = {name: split for split in _SPLITS for name in split.names}
# The tokenizer kinds (`tokenizer.ggml.model`) read: byte-level BPE and SentencePiece BPE.
_MODELS = ("gpt2", "llama")
# Architectures whose SentencePiece vocabulary transformers builds another way (Gemma's spaces
# and merge order, Phi-3's prefix space): refused rather than built like Llama's.
_OTHER_SENTENCEPIECE = ("gemma", "gemma2", "gemma3", "phi3")


def _byte_spelling() -> list[str]:
    """GPT-2's spelling of the 256 bytes as printable characters.

    Printable Latin-1 bytes spell themselves; the others take the characters from U+0100 up,
    in byte order (a space is "Ġ", a newline "Ċ").
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    spelling, extra = [], 0x100
    for byte in range(256):
        if byte in printable:
            spelling.append(chr(byte))
        else:
            spelling.append(chr(extra))
            extra += 1
    return spelling


_BYTE_SPELLING = _byte_spelling()
_BYTE_ALPHABET = frozenset(_BYTE_SPELLING)


def gguf_tokenizer(path: str | os.PathLike, *, pre: str | None = None) -> HFTokenizer:
    """The tokenizer a GGUF file describes, as an `HFTokenizer`.

    Reads the `tokenizer.ggml.*` metadata: `model` (`"gpt2"`, byte-level BPE, or `"llama"`,
    SentencePiece BPE), `tokens`, `token_type`, `merges` or `scores`, `pre` (the pre-tokenizer,
    by llama.cpp's name), the special ids (`bos_token_id`, `eos_token_id`, `padding_token_id`,
    `unknown_token_id`; `eot_token_id` and `eom_token_id` become further stop ids),
    `add_bos_token`, `add_space_prefix`, and `tokenizer.chat_template`. Control and unknown
    tokens (and the special ids' tokens) become special added tokens and user-defined ones
    plain added tokens, so their text in a string encodes to their one id as in llama.cpp and
    `transformers`.

    Byte-level BPE is built from the vocabulary and merges with the pre-tokenizer that
    `tokenizer.ggml.pre` names in llama.cpp. SentencePiece vocabularies become a BPE with byte
    fallback (the `<0x..>` tokens) whose merges are the file's or, as `transformers` derives
    them, ranked by the scores of the tokens they make; "▁" stands for a space and is put
    before the text when `add_space_prefix` (the default).

    Without `add_bos_token`, BOS starts a text as llama.cpp does: for SentencePiece and for
    the Llama 3 and Tekken pre-tokenizers. `add_eos_token = true` is refused: tunelib's
    pipelines end each completion with EOS themselves and never end a prompt with it.

    Args:
      path: the `.gguf` file; only its metadata are read (a tokenizer-only file works).
      pre: the pre-tokenizer's llama.cpp name, for a byte-level file without
        `tokenizer.ggml.pre` (conversions older than May 2024, which llama.cpp runs with its
        "default"); it must agree with the file's when the file has one.

    Returns:
      The tokenizer, with the file's special tokens, `add_bos` and chat template.

    Raises:
      FileNotFoundError: when `path` does not exist.
      ValueError: naming the file, when it is not GGUF or is truncated; naming the key, when
        a required one is missing or a value is invalid; naming the value, for a tokenizer
        model or pre-tokenizer that is not supported.

    Examples:
      >>> import tempfile, gguf
      >>> from tunelib.formats import gguf_tokenizer
      >>> path = tempfile.mkdtemp() + "/tokenizer.gguf"
      >>> writer = gguf.GGUFWriter(path, "llama")
      >>> writer.add_tokenizer_model("gpt2")
      >>> writer.add_tokenizer_pre("gpt-2")
      >>> writer.add_token_list(["<|end|>", "a", "b", "ab", "Ġ", "Ġab"])
      >>> writer.add_token_types([3, 1, 1, 1, 1, 1])
      >>> writer.add_token_merges(["a b", "Ġ ab"])
      >>> writer.add_eos_token_id(0)
      >>> writer.write_header_to_file()
      >>> writer.write_kv_data_to_file()
      >>> writer.close()
      >>> tok = gguf_tokenizer(path)
      >>> tok.encode("ab ab<|end|>"), tok.eos_id, tok.add_bos
      ([3, 5, 0], 0, False)
      >>> tok.decode([3, 5, 0, 1])
      'ab ab'
    """
    path = Path(path)
    return _build(read_metadata(path), str(path), pre=pre)


class _Keys:
    """Typed access to a file's metadata; errors name the file and the key."""

    def __init__(self, metadata: Mapping[str, Any], source: str):
        self.metadata, self.source = metadata, source

    def get(self, key: str, kind: type, default: Any = None) -> Any:
        value = self.metadata.get(key, default)
        wrong_kind = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
        if value is not None and wrong_kind:
            raise ValueError(f"{self.source}: {key} is {value!r:.60}, not a {_KIND_NAMES[kind]}.")
        return value

    def require(self, key: str, kind: type) -> Any:
        if key not in self.metadata:
            raise ValueError(f"{self.source} has no {key}: it describes no tokenizer.")
        return self.get(key, kind)

    def per_token(self, key: str, kind: type, num_tokens: int) -> list | None:
        """The array `key`, one `kind` per token, or None when the file lacks it."""
        values = self.metadata.get(key)
        if values is None:
            return None
        numbers = (int, float) if kind is float else (int,)
        if (
            not isinstance(values, list)
            or len(values) != num_tokens
            or not all(isinstance(v, numbers) and not isinstance(v, bool) for v in values)
        ):
            shown = f"{len(values)} values" if isinstance(values, list) else f"{values!r:.60}"
            raise ValueError(
                f"{self.source}: {key} must hold one {_KIND_NAMES[kind]} per token "
                f"({num_tokens}), got {shown}."
            )
        return values


_KIND_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list"}


def _build(metadata: Mapping[str, Any], source: str, *, pre: str | None = None) -> HFTokenizer:
    """The tokenizer of `metadata`, the key-value fields of the GGUF file `source`."""
    keys = _Keys(metadata, source)
    model = keys.require("tokenizer.ggml.model", str)
    if model not in _MODELS:
        raise ValueError(
            f"{source}: tokenizer.ggml.model {model!r} is not supported; the supported ones "
            f"are {list(_MODELS)} (byte-level BPE and SentencePiece BPE)."
        )
    architecture = metadata.get("general.architecture")
    if model == "llama" and architecture in _OTHER_SENTENCEPIECE:
        raise ValueError(
            f"{source}: a SentencePiece vocabulary of general.architecture {architecture!r} is "
            "not supported (its spaces and merges differ from Llama's)."
        )
    tokens = keys.require("tokenizer.ggml.tokens", list)
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{source}: tokenizer.ggml.tokens must be a non-empty list of strings.")
    token_types = keys.per_token("tokenizer.ggml.token_type", int, len(tokens))
    token_types = token_types or [_NORMAL] * len(tokens)
    ids = {}
    for key in ("bos", "eos", "padding", "unknown", "eot", "eom"):
        ids[key] = keys.get(f"tokenizer.ggml.{key}_token_id", int)
        if ids[key] is not None and not 0 <= ids[key] < len(tokens):
            raise ValueError(
                f"{source}: tokenizer.ggml.{key}_token_id is {ids[key]}, outside the "
                f"{len(tokens)} tokens."
            )
    if ids["eos"] is None:
        raise ValueError(f"{source} has no tokenizer.ggml.eos_token_id: completions end with EOS.")
    if keys.get("tokenizer.ggml.add_eos_token", bool, False):
        raise ValueError(
            f"{source}: tokenizer.ggml.add_eos_token is true, which tunelib does not follow: "
            "its pipelines end each completion with EOS themselves and never end a prompt "
            "with it."
        )
    # The special ids' tokens are special whatever their type, as in transformers.
    special = {ids[key] for key in ("bos", "eos", "padding", "unknown") if ids[key] is not None}
    special |= {i for i, token_type in enumerate(token_types) if token_type in (_CONTROL, _UNKNOWN)}
    user_defined = {i for i, t in enumerate(token_types) if t == _USER_DEFINED} - special

    if model == "gpt2":
        # Added tokens keep their text; the others are spelled in the byte alphabet (a file
        # stores them so; any other is spelled byte by byte, as transformers does).
        tokens = [
            token
            if i in special or i in user_defined or set(token) <= _BYTE_ALPHABET
            else "".join(_BYTE_SPELLING[b] for b in token.encode("utf-8"))
            for i, token in enumerate(tokens)
        ]
        split = _split(keys, pre)
        inner = _byte_level_bpe(keys, tokens, split.ignore_merges)
        inner.pre_tokenizer = _pre_tokenizer(split)
        default_add_bos = split.add_bos
    else:
        inner = _sentencepiece_bpe(keys, tokens)
        default_add_bos = True
    inner.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)]
    )
    inner.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i in sorted(user_defined)]
    )

    add_bos = keys.get("tokenizer.ggml.add_bos_token", bool, default_add_bos)
    bos = None if ids["bos"] is None else tokens[ids["bos"]]
    if add_bos and bos is None:
        raise ValueError(
            f"{source}: BOS starts a text (tokenizer.ggml.add_bos_token, or llama.cpp's default) "
            "but there is no tokenizer.ggml.bos_token_id."
        )
    if add_bos:
        inner.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, ids["bos"])]
        )
    return HFTokenizer(
        inner,
        eos_token=tokens[ids["eos"]],
        bos_token=bos,
        pad_token=None if ids["padding"] is None else tokens[ids["padding"]],
        unk_token=None if ids["unknown"] is None else tokens[ids["unknown"]],
        chat_template=keys.get("tokenizer.chat_template", str),
        add_bos=add_bos,
        stop_tokens=[ids[key] for key in ("eot", "eom") if ids[key] is not None],
    )


def _split(keys: _Keys, pre: str | None) -> _Split:
    """The pre-tokenizer that `tokenizer.ggml.pre` (or `pre`) names."""
    name = keys.get("tokenizer.ggml.pre", str)
    if name is None and pre is None:
        raise ValueError(
            f"{keys.source} has no tokenizer.ggml.pre, the pre-tokenizer of its byte-level BPE "
            "(llama.cpp then runs its 'default' with a warning that generation quality "
            "degrades): pass pre= with the model's pre-tokenizer name."
        )
    if name is not None and pre is not None and pre != name:
        raise ValueError(f"{keys.source}: pre={pre!r} but tokenizer.ggml.pre is {name!r}.")
    name = name if name is not None else pre
    if name not in _SPLIT_BY_NAME:
        raise ValueError(
            f"{keys.source}: the pre-tokenizer tokenizer.ggml.pre = {name!r} is not supported; "
            f"the supported ones are {sorted(_SPLIT_BY_NAME)}."
        )
    return _SPLIT_BY_NAME[name]


def _byte_level_bpe(keys: _Keys, tokens: list[str], ignore_merges: bool) -> tokenizers.Tokenizer:
    """GPT-2's byte-level BPE of `tokens` and the file's merges (no pre-tokenizer yet)."""
    vocab = _vocab(tokens, keys.source)
    merges = _merges(keys.require("tokenizer.ggml.merges", list), vocab, keys.source)
    inner = tokenizers.Tokenizer(
        models.BPE(vocab, merges, fuse_unk=False, ignore_merges=ignore_merges)
    )
    inner.decoder = decoders.ByteLevel()
    return inner


def _sentencepiece_bpe(keys: _Keys, tokens: list[str]) -> tokenizers.Tokenizer:
    """SentencePiece's BPE as `transformers` builds it for a GGUF file: byte fallback, merges
    from the file or ranked by the scores, "▁" for a space and before the text."""
    vocab = _vocab(tokens, keys.source)
    file_merges = keys.get("tokenizer.ggml.merges", list)
    if file_merges is not None:
        merges = _merges(file_merges, vocab, keys.source)
    else:
        scores = keys.per_token("tokenizer.ggml.scores", float, len(tokens))
        if scores is None:
            raise ValueError(
                f"{keys.source} has neither tokenizer.ggml.merges nor tokenizer.ggml.scores, "
                "which its SentencePiece merges come from."
            )
        merges = _merges_from_scores(tokens, scores, vocab)
    prefix = keys.get("tokenizer.ggml.add_space_prefix", bool, True)
    inner = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    # "first": only before the text, not again after a special token inside it.
    inner.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    inner.decoder = decoders.Sequence(steps)
    return inner


def _vocab(tokens: Sequence[str], source: str) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in vocab:
            raise ValueError(
                f"{source}: tokenizer.ggml.tokens holds {token!r} twice, as ids {vocab[token]} "
                f"and {i}."
            )
        vocab[token] = i
    return vocab


def _merges(merges: Sequence[Any], vocab: Mapping[str, int], source: str) -> list[tuple[str, str]]:
    pairs = []
    for rank, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else ()
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
            raise ValueError(
                f"{source}: tokenizer.ggml.merges[{rank}] is {merge!r}, not two tokens of the "
                "vocabulary separated by a space."
            )
        pairs.append((parts[0], parts[1]))
    return pairs


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """SentencePiece merges as `transformers` derives them from a vocabulary's scores.

    Every split of a token into two tokens is a merge that makes it, ranked by the score of
    the token it makes (highest first), then by the lengths of its left and right parts
    (longest first); ties keep the order of the tokens, and of the parts' ids within a token.
    """
    candidates = []
    for token, score in zip(tokens, scores, strict=True):
        splits = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates.extend((left, right, score) for left, right in splits)
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _pre_tokenizer(split: _Split) -> pre_tokenizers.PreTokenizer:
    """`split`'s regexes as `tokenizers` pre-tokenizers, then the byte-level spelling."""
    *regexes, last = split.regexes
    steps = [
        pre_tokenizers.Digits(individual_digits=True)
        if regex == _DIGIT
        else pre_tokenizers.Digits(individual_digits=False)
        if regex == _DIGITS
        else pre_tokenizers.Split(Regex(regex), behavior="isolated")
        for regex in (regexes if last == _GPT2 else split.regexes)
    ]
    # GPT-2's regex last is `ByteLevel`'s own, as the Hugging Face files write it.
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=True, use_regex=last == _GPT2
    )
    return pre_tokenizers.Sequence([*steps, byte_level]) if steps else byte_level


def _split_regexes(state: Mapping[str, Any] | None) -> tuple[str, ...] | None:
    """The regexes a byte-level pre-tokenizer (its JSON form) splits with, or None."""
    if not state:
        return None
    steps = state["pretokenizers"] if state["type"] == "Sequence" else [state]
    *splits, last = steps
    if last["type"] != "ByteLevel" or last.get("add_prefix_space"):
        return None
    regexes = []
    for step in splits:
        if step["type"] == "Digits":
            regexes.append(_DIGIT if step["individual_digits"] else _DIGITS)
        elif (
            step["type"] == "Split"
            and step["behavior"] == "Isolated"
            and not step["invert"]
            and "Regex" in step["pattern"]
        ):
            regexes.append(step["pattern"]["Regex"])
        else:
            return None
    if last.get("use_regex", True):
        regexes.append(_GPT2)
    return tuple(regexes)


def gguf_tokenizer_metadata(tokenizer: HFTokenizer) -> dict[str, object]:
    """The `tokenizer.*` metadata of a GGUF file that holds `tokenizer`: the inverse of
    `gguf_tokenizer`.

    A byte-level BPE (a `ByteLevel` pre-tokenizer) becomes `tokenizer.ggml.model = "gpt2"`
    with the llama.cpp name of its pre-tokenizer; a SentencePiece BPE (a `Metaspace`
    pre-tokenizer and byte fallback) becomes `"llama"` with scores that rank its merges (the
    merges are written too; llama.cpp reads the scores, `transformers` and `gguf_tokenizer`
    the merges). Special added tokens are control tokens and the others user-defined;
    `<0x..>` tokens of a SentencePiece vocabulary are byte tokens and its unknown token is
    unknown. Stop ids after EOS are written as the EOT and EOM ids. Written into a file,
    `gguf_tokenizer` and `transformers` read back the same tokenizer.

    The values are Python lists, ints, bools and strings; a GGUF writer stores the ids as
    uint32, `token_type` as int32 and `scores` as float32 (what `gguf.GGUFWriter`'s
    `add_token_types`, `add_token_scores`, `add_bos_token_id`... write).

    Args:
      tokenizer: an `HFTokenizer` whose model is a BPE.

    Returns:
      The keys (`tokenizer.ggml.model`, `tokenizer.ggml.pre`, `tokenizer.ggml.tokens`,
      `tokenizer.ggml.token_type`, `tokenizer.ggml.merges`, `tokenizer.ggml.scores`,
      `tokenizer.ggml.add_space_prefix`, the `*_token_id`s, `tokenizer.ggml.add_bos_token`,
      `tokenizer.chat_template`) and their values; those that do not apply are left out.

    Raises:
      ValueError: naming what GGUF cannot hold: a model other than BPE, a normalizer, a
        pre-tokenizer llama.cpp has no name for, added tokens that strip spaces, token ids
        with gaps, more than two stop ids after EOS.

    Examples:
      >>> import tokenizers
      >>> from tokenizers import decoders, models, pre_tokenizers
      >>> from tunelib.data import HFTokenizer
      >>> from tunelib.formats import gguf_tokenizer_metadata
      >>> vocab = {"<|end|>": 0, "a": 1, "b": 2, "ab": 3, "Ġ": 4, "Ġab": 5}
      >>> inner = tokenizers.Tokenizer(models.BPE(vocab, [("a", "b"), ("Ġ", "ab")]))
      >>> inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
      >>> inner.decoder = decoders.ByteLevel()
      >>> _ = inner.add_special_tokens(["<|end|>"])
      >>> metadata = gguf_tokenizer_metadata(HFTokenizer(inner, eos_token="<|end|>"))
      >>> for key, value in metadata.items():
      ...     print(key, value)
      tokenizer.ggml.model gpt2
      tokenizer.ggml.pre gpt-2
      tokenizer.ggml.tokens ['<|end|>', 'a', 'b', 'ab', 'Ġ', 'Ġab']
      tokenizer.ggml.token_type [3, 1, 1, 1, 1, 1]
      tokenizer.ggml.merges ['a b', 'Ġ ab']
      tokenizer.ggml.eos_token_id 0
      tokenizer.ggml.add_bos_token False
    """
    if not isinstance(tokenizer, HFTokenizer):
        raise TypeError(f"tokenizer must be an HFTokenizer, got {type(tokenizer).__name__}.")
    stops = tokenizer.stop_ids[1:]
    if len(stops) > 2:
        raise ValueError(
            f"the tokenizer has {len(stops)} stop ids after EOS {list(stops)}; GGUF names two "
            "(tokenizer.ggml.eot_token_id and eom_token_id)."
        )
    inner = tokenizer.tokenizer
    state = json.loads(inner.to_str())
    model = state["model"]
    if model["type"] != "BPE":
        raise ValueError(
            f"a GGUF file holds BPE tokenizers (byte-level or SentencePiece), not {model['type']}."
        )
    if state.get("normalizer") is not None:
        raise ValueError(
            f"the tokenizer has a normalizer ({state['normalizer']['type']}), which GGUF "
            "cannot describe."
        )
    if (
        model.get("dropout")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
    ):
        raise ValueError(
            "the tokenizer's BPE has dropout, a continuing-subword prefix or an end-of-word "
            "suffix, which GGUF cannot describe."
        )
    size = inner.get_vocab_size(with_added_tokens=True)
    tokens = [inner.id_to_token(i) for i in range(size)]
    if None in tokens:
        raise ValueError(
            f"the tokenizer has no token with id {tokens.index(None)} below its "
            f"{size} ids: GGUF numbers tokens 0, 1, 2, ... without gaps."
        )
    added = inner.get_added_tokens_decoder()
    for token in added.values():
        if token.lstrip or token.rstrip or token.single_word:
            raise ValueError(
                f"the added token {token.content!r} strips spaces or matches single words only, "
                "which GGUF cannot describe."
            )
    pre_state = state.get("pre_tokenizer") or {}
    special_tokens = tokenizer.special_tokens
    # Added tokens are control or user-defined tokens; the special tokens are control tokens
    # even when not added (`gguf_tokenizer` makes them special, as transformers does).
    controls = {i for i, token in added.items() if token.special}
    controls |= {inner.token_to_id(token) for token in special_tokens.values()}
    metadata: dict[str, object] = {}
    if pre_state.get("type") == "Metaspace":
        if (
            not model.get("byte_fallback")
            or pre_state.get("split")
            or pre_state["prepend_scheme"] not in ("first", "never")
        ):
            raise ValueError(
                "a SentencePiece tokenizer in GGUF has byte fallback and a Metaspace that does "
                "not split and puts '▁' before the text only (prepend_scheme 'first') or never; "
                f"this one has {pre_state} and byte_fallback={model.get('byte_fallback')}."
            )
        unknown = special_tokens.get("unk_token")
        token_types = [
            _UNKNOWN
            if token == unknown
            else _CONTROL
            if i in controls
            else _USER_DEFINED
            if i in added
            else _BYTE
            if _BYTE_TOKEN.fullmatch(token)
            else _NORMAL
            for i, token in enumerate(tokens)
        ]
        merges = _model_merges(model)
        metadata["tokenizer.ggml.model"] = "llama"
        metadata["tokenizer.ggml.tokens"] = tokens
        metadata["tokenizer.ggml.scores"] = _scores(tokens, token_types, merges)
        metadata["tokenizer.ggml.token_type"] = token_types
        metadata["tokenizer.ggml.merges"] = [f"{left} {right}" for left, right in merges]
        metadata["tokenizer.ggml.add_space_prefix"] = pre_state["prepend_scheme"] == "first"
    else:
        regexes = _split_regexes(pre_state)
        ignore_merges = bool(model.get("ignore_merges"))
        names = [
            split.names[0]
            for split in _SPLITS
            if split.regexes == regexes and split.ignore_merges == ignore_merges
        ]
        if model.get("byte_fallback") or not names:
            raise ValueError(
                f"the tokenizer's pre-tokenizer {json.dumps(pre_state)[:300]} (with "
                f"ignore_merges={ignore_merges}) is none that llama.cpp names; the named ones "
                f"are {sorted(_SPLIT_BY_NAME)}."
            )
        metadata["tokenizer.ggml.model"] = "gpt2"
        metadata["tokenizer.ggml.pre"] = names[0]
        metadata["tokenizer.ggml.tokens"] = tokens
        metadata["tokenizer.ggml.token_type"] = [
            _CONTROL if i in controls else _USER_DEFINED if i in added else _NORMAL
            for i in range(size)
        ]
        merges = _model_merges(model)
        metadata["tokenizer.ggml.merges"] = [f"{left} {right}" for left, right in merges]
    for name, key in (
        ("bos_token", "bos"),
        ("eos_token", "eos"),
        ("unk_token", "unknown"),
        ("pad_token", "padding"),
    ):
        if name in special_tokens:
            metadata[f"tokenizer.ggml.{key}_token_id"] = inner.token_to_id(special_tokens[name])
    for key, stop in zip(("eot", "eom"), stops, strict=False):
        metadata[f"tokenizer.ggml.{key}_token_id"] = stop
    metadata["tokenizer.ggml.add_bos_token"] = tokenizer.add_bos
    if tokenizer.chat_template is not None:
        metadata["tokenizer.chat_template"] = tokenizer.chat_template
    return metadata


def _model_merges(model: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A BPE's merges from its JSON form (pairs, or "a b" strings in older `tokenizers`)."""
    merges = []
    for merge in model["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        if " " in left or " " in right:
            raise ValueError(
                f"the merge {[left, right]} holds a space, which GGUF's 'left right' merges "
                "cannot hold."
            )
        merges.append((left, right))
    return merges


def _scores(
    tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[tuple[str, str]]
) -> list[float]:
    """SentencePiece scores that rank tokens as the merges that make them.

    The token the merge of rank r makes scores -(r + 1) (its first merge, if several make it);
    other normal tokens score below every merge; control, byte, unknown and user-defined
    tokens score 0, as llama.cpp's conversions give them.
    """
    made: dict[str, int] = {}
    for rank, (left, right) in enumerate(merges):
        made.setdefault(left + right, rank)
    lowest = -float(len(merges) + 1)
    return [
        -float(made[token] + 1) if token in made else lowest if token_type == _NORMAL else 0.0
        for token, token_type in zip(tokens, token_types, strict=True)
    ]
