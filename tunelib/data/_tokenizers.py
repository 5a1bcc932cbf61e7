"""Tokenizers: the protocol the pipelines need, a character tokenizer for the built-in task, a
Hugging Face tokenizer (`tokenizer.json`) with its checkpoint's special tokens and chat template,
and `load_tokenizer` for a model folder holding either."""

import json
import os
import string
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, SupportsIndex, runtime_checkable

import numpy as np
import tokenizers

# Ids 0, 1, 2 are the special tokens; the alphabet follows from id 3 in this order, so the
# arithmetic characters always get ids 3..17.
DEFAULT_ALPHABET = (
    "0123456789+-*= " + string.ascii_lowercase + string.ascii_uppercase + ".,:;!?'\"()/\n"
)
# The file `CharTokenizer.save` writes into a model folder.
CHAR_TOKENIZER_FILE = "char_tokenizer.json"
_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipelines and the sampler need from a tokenizer.

    `CharTokenizer` and `HFTokenizer` implement it; any object with these members works.

    Attributes:
      vocab_size: the number of ids `encode` and `decode` use.
      bos_id: the beginning-of-sequence id, or None when the tokenizer has none.
      eos_id: the end-of-sequence id; every completion ends with it.
      pad_id: the id that fills padded positions (masked out everywhere).
      add_bos: whether a plain-text sequence starts with `bos_id` (a chat template writes its
        own special tokens).
      stop_ids: the ids that end a generation, `eos_id` first.
      chat_template: the Jinja chat template for conversations, or None.

    `encode(text)` maps text to ids without adding special tokens and raises `ValueError` for
    text it cannot encode; `decode(ids, *, stop_at_eos=True)` maps ids back to text, skipping
    special tokens and, by default, stopping at the first stop id.
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    add_bos: bool
    stop_ids: tuple[int, ...]
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[SupportsIndex], *, stop_at_eos: bool = True) -> str: ...


class CharTokenizer:
    """One token per character: pad = 0, BOS = 1, EOS = 2, then the alphabet from id 3.

    The default alphabet holds the arithmetic characters `"0123456789+-*= "` (ids 3 to 17),
    then ASCII letters and common punctuation, 82 ids in all. There is no unknown token:
    `encode` raises a `ValueError` that names a character outside the alphabet. A plain-text
    sequence starts with BOS (`add_bos` is True), EOS is the only stop id, and there is no
    chat template. `save(directory)` writes the alphabet to `char_tokenizer.json`, which
    `CharTokenizer.from_directory` and `load_tokenizer` read back.

    Args:
      alphabet: the characters, each at most once, in id order from 3.

    Examples:
      >>> from tunelib.data import CharTokenizer
      >>> tok = CharTokenizer()
      >>> tok.encode("12+7=")
      [4, 5, 13, 10, 16]
      >>> tok.decode([tok.bos_id, 4, 5, 13, 10, 16, 11, tok.eos_id, 0, 0])
      '12+7=8'
      >>> tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id, tok.stop_ids, tok.add_bos
      (82, 0, 1, 2, (2,), True)
    """

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    num_special: int = 3
    add_bos: bool = True
    stop_ids: tuple[int, ...] = (2,)
    chat_template: str | None = None

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if not isinstance(alphabet, str):
            raise TypeError(f"alphabet must be a str, got {type(alphabet).__name__}.")
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

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the tokenizer to `directory/char_tokenizer.json` (the folder is created).

        The file is a small JSON object: the alphabet and the special ids. It is written
        atomically (a temporary file renamed into place), so a model folder never holds half
        a tokenizer.

        Returns:
          The path of the file.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / CHAR_TOKENIZER_FILE
        content = {
            "alphabet": self.alphabet,
            "pad_id": self.pad_id,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(content, ensure_ascii=False, indent=2) + "\n", "utf-8")
        partial.replace(path)
        return path

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> "CharTokenizer":
        """The tokenizer `save` wrote into `directory`.

        Raises:
          FileNotFoundError: without `char_tokenizer.json`.
          ValueError: naming the file, when it is not what `save` writes.
        """
        path = Path(directory) / CHAR_TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{directory} has no {CHAR_TOKENIZER_FILE}.")
        content = _read_json(path)
        alphabet = content.get("alphabet")
        if not isinstance(alphabet, str):
            raise ValueError(f"{path}: 'alphabet' must be a string, got {alphabet!r:.80}.")
        for name in ("pad_id", "bos_id", "eos_id"):
            if content.get(name, getattr(cls, name)) != getattr(cls, name):
                raise ValueError(
                    f"{path}: {name} is {content[name]!r}, but a CharTokenizer has "
                    f"{name}={getattr(cls, name)}."
                )
        try:
            return cls(alphabet)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.alphabet == self.alphabet

    def __hash__(self) -> int:
        return hash(self.alphabet)

    def __repr__(self) -> str:
        if self.alphabet == DEFAULT_ALPHABET:
            return "CharTokenizer()"
        return f"CharTokenizer(alphabet={self.alphabet!r})"


class HFTokenizer:
    """A `tokenizers.Tokenizer` with its checkpoint's special tokens and chat template.

    Build one with `HFTokenizer.from_directory(path)` for a checkpoint directory, which reads
    `tokenizer.json` through the `tokenizers` library and the special tokens and chat
    template from the files beside it (see there), or directly from the parts. It implements
    the `Tokenizer` protocol.

    `encode` adds no special tokens, as the data pipelines add them themselves: `bos_id`
    (only when `add_bos`, that is when the tokenizer's own post-processing prepends one, as
    Llama's does and Qwen's does not) and `eos_id`. Text rendered by a chat template is
    encoded as is, because the template writes its special tokens itself (as `transformers`
    does).

    Args:
      tokenizer: the `tokenizers.Tokenizer`.
      eos_token: the end-of-sequence token (required: completions end with it).
      bos_token: the beginning-of-sequence token, or None.
      pad_token: the padding token; None means EOS pads (padded positions are masked out).
      unk_token: the unknown token, or None; passed to chat templates only.
      chat_template: the Jinja chat template, or None.
      add_bos: whether `bos_id` starts a plain-text sequence; None means what the
        tokenizer's post-processor does.
      stop_tokens: further ids that end a generation (`generation_config.json`'s
        `eos_token_id`, for example); `stop_ids` holds them after `eos_id`.

    Attributes:
      vocab_size: ids the tokenizer can produce, added tokens included (the model's
        embedding may have more rows).
      bos_id, eos_id, pad_id: the special token ids (`bos_id` may be None).
      stop_ids: the ids that end a generation, `eos_id` first.

    Examples:
      >>> import tokenizers
      >>> from tokenizers import decoders, models
      >>> from tunelib.data import HFTokenizer
      >>> vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}
      >>> inner = tokenizers.Tokenizer(models.BPE(vocab, [("a", "b")]))
      >>> inner.decoder = decoders.Fuse()
      >>> _ = inner.add_special_tokens(["<s>", "</s>"])
      >>> tok = HFTokenizer(inner, eos_token="</s>", bos_token="<s>")
      >>> tok.encode("abba"), tok.eos_id, tok.pad_id, tok.add_bos
      ([4, 3, 2], 1, 1, False)
      >>> tok.decode([4, 3, 1, 2])
      'abb'
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_token: str,
        bos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        add_bos: bool | None = None,
        stop_tokens: Iterable[int] = (),
    ):
        if not isinstance(tokenizer, tokenizers.Tokenizer):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer)}.")
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_tokens = {
            name: token
            for name, token in zip(
                _SPECIAL, (bos_token, eos_token, pad_token, unk_token), strict=True
            )
            if token is not None
        }
        ids = {name: self._id(token, name) for name, token in self.special_tokens.items()}
        if "eos_token" not in ids:
            raise ValueError("eos_token is required: completions end with it.")
        self.eos_id: int = ids["eos_token"]
        self.bos_id: int | None = ids.get("bos_token")
        self.pad_id: int = ids.get("pad_token", self.eos_id)
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a str, got {type(chat_template).__name__}.")
        self.chat_template = chat_template
        if add_bos is None:
            probe = tokenizer.encode("a", add_special_tokens=True).ids
            add_bos = self.bos_id is not None and bool(probe) and probe[0] == self.bos_id
        if add_bos and self.bos_id is None:
            raise ValueError("add_bos is True but there is no bos_token.")
        self.add_bos = bool(add_bos)
        stops = [self.eos_id]
        for token_id in stop_tokens:
            if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"stop_tokens must be ids in [0, {self.vocab_size}), got {token_id!r}."
                )
            if token_id not in stops:
                stops.append(token_id)
        self.stop_ids: tuple[int, ...] = tuple(stops)

    def _id(self, token: Any, name: str) -> int:
        if not isinstance(token, str):
            raise TypeError(f"{name} must be a str, got {token!r}.")
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{name} {token!r} is not in the tokenizer's vocabulary.")
        return token_id

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> "HFTokenizer":
        """The tokenizer of a Hugging Face checkpoint directory.

        Reads `tokenizer.json`; the special tokens (`bos_token`, `eos_token`, `pad_token`,
        `unk_token`, each a string or an `AddedToken` dict) from `tokenizer_config.json`, else
        from `special_tokens_map.json`, else EOS from `config.json`'s `eos_token_id`; the
        chat template from `chat_template.jinja` (where current `transformers` releases save
        it), else `tokenizer_config.json`'s `chat_template` (a string, or a list of named
        templates of which "default" is taken); `add_bos_token` from `tokenizer_config.json`
        when it is there; stop ids from `generation_config.json`'s `eos_token_id`. When
        `config.json` gives the model's `vocab_size`, every token id must be below it.

        Raises:
          FileNotFoundError: without `tokenizer.json`.
          ValueError: naming the file and field, for a `tokenizer.json` that does not parse, a
            special token the vocabulary lacks, no EOS anywhere, or token ids the model's
            embedding does not have.
        """
        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json.")
        try:
            inner = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as error:  # the Rust library raises a bare Exception
            raise ValueError(
                f"{directory / 'tokenizer.json'} is not a tokenizer the tokenizers library can "
                f"read ({error}): it is damaged, cut short or of another format."
            ) from None
        tokenizer_config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        model_config = _read_json(directory / "config.json")
        generation = _read_json(directory / "generation_config.json")
        tokens = {}
        for name in _SPECIAL:
            for source in (tokenizer_config, special_map):
                value = _token_content(source.get(name), name)
                if value is not None:
                    tokens[name] = value
                    break
        if "eos_token" not in tokens:
            eos = _ids(model_config.get("eos_token_id"))
            if not eos:
                raise ValueError(
                    f"{directory}: no eos_token in tokenizer_config.json or "
                    "special_tokens_map.json, and no eos_token_id in config.json."
                )
            tokens["eos_token"] = inner.id_to_token(eos[0])
        template = None
        if (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text("utf-8")
        else:
            template = _template(tokenizer_config.get("chat_template"))
        add_bos = tokenizer_config.get("add_bos_token")
        stops = [*_ids(generation.get("eos_token_id")), *_ids(model_config.get("eos_token_id"))]
        tok = cls(
            inner,
            chat_template=template,
            add_bos=add_bos if isinstance(add_bos, bool) else None,
            stop_tokens=stops,
            **tokens,
        )
        model_vocab = model_config.get("vocab_size")
        if isinstance(model_vocab, int) and tok.vocab_size > model_vocab:
            largest = max(inner.get_vocab(with_added_tokens=True).values())
            if largest >= model_vocab:
                raise ValueError(
                    f"{directory}: the tokenizer has token ids up to {largest}, but config.json's "
                    f"vocab_size is {model_vocab}: the model has no embedding for them."
                )
        return tok

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the tokenizer into `directory` as `transformers` saves one (the folder is created).

        Writes `tokenizer.json`; `tokenizer_config.json` with the special tokens,
        `add_bos_token` and the tokenizer class; and the chat template to
        `chat_template.jinja`. `HFTokenizer.from_directory` (and `load_tokenizer`) and
        `transformers.AutoTokenizer.from_pretrained` read back the same ids, special tokens,
        `add_bos` and template. Stop ids after EOS are not written: they belong to the
        model's `generation_config.json`.

        Each file is written to a temporary name and renamed into place; these files are
        replaced if the folder has them (a `chat_template.jinja` is removed when the tokenizer
        has no template, so that none is read back). Nothing else in the folder is touched.

        Returns:
          The path of `tokenizer.json`.

        Examples:
          >>> import tempfile
          >>> import tokenizers
          >>> from tokenizers import decoders, models
          >>> from tunelib.data import HFTokenizer
          >>> inner = tokenizers.Tokenizer(models.BPE({"</s>": 0, "a": 1, "b": 2}, []))
          >>> inner.decoder = decoders.Fuse()
          >>> _ = inner.add_special_tokens(["</s>"])
          >>> tok = HFTokenizer(inner, eos_token="</s>", chat_template="{{ messages }}")
          >>> folder = tempfile.mkdtemp()
          >>> tok.save(folder).name
          'tokenizer.json'
          >>> loaded = HFTokenizer.from_directory(folder)
          >>> loaded.encode("ab"), loaded.special_tokens, loaded.chat_template
          ([1, 2], {'eos_token': '</s>'}, '{{ messages }}')
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens,
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
        }
        contents = {
            "tokenizer.json": self.tokenizer.to_str(pretty=True) + "\n",
            "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=2) + "\n",
        }
        if self.chat_template is not None:
            contents["chat_template.jinja"] = self.chat_template
        for name, text in contents.items():
            partial = directory / (name + ".partial")
            partial.write_text(text, "utf-8")
            partial.replace(directory / name)
        if self.chat_template is None:
            (directory / "chat_template.jinja").unlink(missing_ok=True)
        return directory / "tokenizer.json"

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, without special tokens (special-token text is still matched)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}.")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` (no special tokens added) and each token's character span."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}.")
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Iterable[SupportsIndex], *, stop_at_eos: bool = True) -> str:
        """The text of `ids`, special tokens skipped; it stops at the first stop id by default.

        Raises:
          ValueError: naming an id outside `[0, vocab_size)` and its position.
        """
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-D, got shape {ids.shape}.")
        values = ids.tolist()
        for position, i in enumerate(values):
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} at position {position} is outside [0, {self.vocab_size})."
                )
        if stop_at_eos:
            ends = [position for position, i in enumerate(values) if i in self.stop_ids]
            values = values[: ends[0]] if ends else values
        return self.tokenizer.decode(values, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, special_tokens={self.special_tokens})"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text("utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}.")
    return data


def _token_content(value: Any, name: str) -> str | None:
    """The text of a special token given as a string or an `AddedToken` dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a string or an AddedToken dict, got {value!r}.")
    return value


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(i, int) for i in value):
        return list(value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}.")


def _template(value: Any) -> str | None:
    """`tokenizer_config.json`'s `chat_template`: a string, or named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if "default" in named:
            return named["default"]
    raise ValueError(
        "tokenizer_config.json: chat_template must be a string or a list of "
        f"{{'name', 'template'}} with a 'default' one, got {value!r:.80}."
    )


def load_tokenizer(directory: str | os.PathLike) -> HFTokenizer | CharTokenizer:
    """The tokenizer a model folder carries: a Hugging Face tokenizer or a character tokenizer.

    A folder with `tokenizer.json` (and its usual siblings) gives an `HFTokenizer`
    (`HFTokenizer.from_directory`); a folder with `char_tokenizer.json` (as
    `CharTokenizer.save` writes) gives a `CharTokenizer`.

    Args:
      directory: the model folder.

    Returns:
      The tokenizer, which implements `Tokenizer`.

    Raises:
      FileNotFoundError: naming the directory, when it holds neither file (or does not exist).
      ValueError: naming the directory, when it holds both.

    Examples:
      >>> import tempfile
      >>> from tunelib.data import CharTokenizer, load_tokenizer
      >>> folder = tempfile.mkdtemp()
      >>> _ = CharTokenizer("0123456789+=").save(folder)
      >>> load_tokenizer(folder)
      CharTokenizer(alphabet='0123456789+=')
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no tokenizer folder {directory}: it does not exist.")
    hf = (directory / "tokenizer.json").is_file()
    char = (directory / CHAR_TOKENIZER_FILE).is_file()
    if hf and char:
        raise ValueError(
            f"{directory} holds both tokenizer.json and {CHAR_TOKENIZER_FILE}: keep the one "
            "the model was trained with."
        )
    if hf:
        return HFTokenizer.from_directory(directory)
    if char:
        return CharTokenizer.from_directory(directory)
    raise FileNotFoundError(
        f"{directory} holds no tokenizer: neither tokenizer.json (a Hugging Face tokenizer) nor "
        f"{CHAR_TOKENIZER_FILE} (written by CharTokenizer.save)."
    )
