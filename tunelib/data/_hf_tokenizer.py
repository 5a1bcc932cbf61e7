"""A Hugging Face tokenizer (`tokenizer.json`) with the special tokens and chat template of its
checkpoint."""

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, SupportsIndex

import numpy as np
import tokenizers

_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


class HFTokenizer:
    """A `tokenizers.Tokenizer` with its checkpoint's special tokens and chat template.

    Build one with `HFTokenizer.from_directory(path)` for a checkpoint directory, which reads
    `tokenizer.json` through the `tokenizers` library and the special tokens and chat
    template from the files beside it (see there), or directly from the parts.

    `encode` adds no special tokens, as the data pipelines add them themselves: `bos_id`
    (only when `add_bos`, that is when the tokenizer's own post-processing prepends one, as
    Llama's does and Qwen's does not) and `eos_id`. Text rendered by a chat template is
    encoded as is, because the template writes its special tokens itself (as `transformers`
    does). It satisfies the `Tokenizer` protocol when the tokenizer has a BOS.

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
          ValueError: naming the file and field, for a special token the vocabulary lacks, no
            EOS anywhere, or token ids the model's embedding does not have.
        """
        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json.")
        inner = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
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
            template = (directory / "chat_template.jinja").read_text()
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
        data = json.loads(path.read_text())
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
