"""Grain pipelines of Hugging Face-shaped records, tokenized by a checkpoint's own tokenizer."""

import collections
import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grain
import numpy as np
from jaxtyping import Bool, Int

from tunelib.data._chat_template import TemplateError, encode_chat
from tunelib.data._hf_records import HFRecordKind, check_hf_record, check_messages
from tunelib.data._hf_tokenizer import HFTokenizer
from tunelib.data._pipelines import _READ_OPTIONS
from tunelib.data._records import (
    OnInvalid,
    RecordError,
    RecordReport,
    check_max_length,
    check_on_invalid,
)

_logger = logging.getLogger(__name__)
Example = dict[str, Any]


def _text_sequence(
    prompt: str, completion: str, tokenizer: HFTokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """[BOS] + prompt + completion + EOS, True on the completion and EOS."""
    head = [tokenizer.bos_id] if tokenizer.add_bos else []
    prompt_ids = [*head, *tokenizer.encode(prompt)]
    completion_ids = [*tokenizer.encode(completion), tokenizer.eos_id]
    ids = np.asarray(prompt_ids + completion_ids, np.int32)
    where = np.arange(len(ids)) >= len(prompt_ids)
    return ids, where


def _sequence(
    record: Mapping[str, Any], completion: str, fmt: str, tokenizer: HFTokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """The ids and completion mask of `record`'s prompt followed by field `completion`."""
    if completion == "messages":
        return encode_chat(tokenizer, record["messages"])
    if fmt == "text":
        return _text_sequence(record["prompt"], record[completion], tokenizer)
    prompt = list(record["prompt"])
    return encode_chat(tokenizer, prompt + list(record[completion]), prompt_length=len(prompt))


def _encode(
    index: int,
    record: Any,
    kind: HFRecordKind,
    tokenizer: HFTokenizer,
    max_length: int,
) -> Example:
    fmt = check_hf_record(index, record, kind)
    if kind == "sft":
        sides = ["messages" if record.get("messages") is not None else "completion"]
    else:
        sides = ["chosen", "rejected"]
    if fmt == "chat" and tokenizer.chat_template is None:
        raise RecordError(
            index,
            sides[0],
            "template_error",
            "the record is a conversation, but the tokenizer has no chat template",
        )
    out = {}
    for field in sides:
        try:
            ids, where = _sequence(record, field, fmt, tokenizer)
        except TemplateError as error:
            raise RecordError(index, field, "template_error", f"field {field!r}: {error}") from None
        if not where[1:].any():
            raise RecordError(
                index, field, "empty", f"field {field!r} gives no token to learn after the first"
            )
        if len(ids) > max_length:
            raise RecordError(
                index,
                field,
                "too_long",
                f"field {field!r} makes the sequence {len(ids)} tokens long, more than "
                f"max_length={max_length}",
            )
        out[field] = {"ids": ids, "where": where}
    return out[sides[0]] if kind == "sft" else out


def encode_hf_records(
    records: Iterable[Any],
    tokenizer: HFTokenizer,
    *,
    kind: HFRecordKind,
    max_length: int,
    on_invalid: OnInvalid = "raise",
) -> tuple[list[Example], RecordReport]:
    """Check and tokenize SFT or preference records; each becomes ids and a completion mask.

    Every record is checked as `validate_hf_records` does, then tokenized:

    * a conversation (`messages`, or `prompt` and `completion` / `chosen` / `rejected` as
      lists of messages) by `encode_chat` with the tokenizer's chat template, the mask on
      the assistant turns (for `messages`) or on everything after the prompt;
    * strings as `[BOS] + prompt + completion + EOS` (BOS only when `tokenizer.add_bos`),
      prompt and completion tokenized separately, the mask on the completion and EOS.

    A record is also invalid when its template fails (`"template_error"`), when it leaves no
    token to learn (`"empty"`), or when a sequence is longer than `max_length` tokens
    (`"too_long"`).

    Args:
      records: `{"messages"}` or `{"prompt", "completion"}` dicts (`kind="sft"`), or
        `{"prompt", "chosen", "rejected"}` dicts (`kind="preference"`).
      tokenizer: the checkpoint's `HFTokenizer`.
      kind: `"sft"` or `"preference"`.
      max_length: the most tokens a sequence may have.
      on_invalid: `"raise"` (a `RecordError` naming the record index and field) or `"skip"`.

    Returns:
      `(examples, report)`: per kept record `{"ids": [N] int32, "where": [N] bool}` (SFT) or
      `{"chosen": {...}, "rejected": {...}}` (preference), and the `RecordReport`.
    """
    if kind not in ("sft", "preference"):
        raise ValueError(f"kind must be 'sft' or 'preference', got {kind!r}.")
    check_on_invalid(on_invalid)
    check_max_length(max_length, at_least=2)
    examples = []
    skipped: collections.Counter[str] = collections.Counter()
    for index, record in enumerate(records):
        try:
            examples.append(_encode(index, record, kind, tokenizer, max_length))
        except RecordError as error:
            if on_invalid == "raise":
                raise
            skipped[error.reason] += 1
    return examples, RecordReport(kept=len(examples), skipped=skipped)


def _layout(example: Example, *, max_length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Next-token rows of one sequence, padded to `max_length` (as `sft_dataset` lays out)."""
    ids, where = example["ids"], example["where"]
    n = len(ids) - 1
    tokens = np.full(max_length, pad_id, np.int32)
    targets = np.full(max_length, pad_id, np.int32)
    tokens[:n], targets[:n] = ids[:-1], ids[1:]
    target_where = np.zeros(max_length, np.bool_)
    target_where[:n] = where[1:]
    attention_where = np.zeros(max_length, np.bool_)
    attention_where[:n] = True
    return {
        "tokens": tokens,
        "targets": targets,
        "where": target_where,
        "attention_where": attention_where,
    }


def _pair_layout(example: Example, *, max_length: int, pad_id: int) -> dict:
    return {
        side: _layout(example[side], max_length=max_length, pad_id=pad_id)
        for side in ("chosen", "rejected")
    }


def _dataset(
    records: Iterable[Any],
    tokenizer: HFTokenizer,
    kind: HFRecordKind,
    *,
    max_length: int,
    batch_size: int,
    seed: int,
    shuffle: bool,
    num_epochs: int | None,
    drop_remainder: bool,
    on_invalid: OnInvalid,
) -> grain.IterDataset:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 or None (repeat forever), got {num_epochs}.")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must lie in [0, 2**32), got {seed}.")
    examples, report = encode_hf_records(
        records, tokenizer, kind=kind, max_length=max_length, on_invalid=on_invalid
    )
    if report.num_skipped:
        _logger.warning(
            "hf_%s_dataset skipped %d invalid records: %s",
            kind,
            report.num_skipped,
            dict(report.skipped),
        )
    if not examples:
        raise ValueError(f"records holds no valid {kind} record.")
    if drop_remainder and num_epochs is not None and len(examples) * num_epochs < batch_size:
        raise ValueError(
            f"{len(examples)} records x num_epochs={num_epochs} cannot fill one batch of "
            f"batch_size={batch_size} with drop_remainder=True."
        )
    layout = _layout if kind == "sft" else _pair_layout
    ds = grain.MapDataset.source(examples).map(
        functools.partial(layout, max_length=max_length, pad_id=tokenizer.pad_id)
    )
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    return ds.to_iter_dataset(_READ_OPTIONS).batch(batch_size, drop_remainder=drop_remainder)


def hf_sft_dataset(
    records: Iterable[Any],
    tokenizer: HFTokenizer,
    *,
    max_length: int,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    on_invalid: OnInvalid = "raise",
) -> grain.IterDataset:
    r"""A Grain dataset of SFT batches from chat or prompt-completion records.

    Each record is tokenized by `encode_hf_records` into a sequence $s$ of $n \le$
    `max_length` tokens with a completion mask $m$ (the assistant turns of a conversation,
    or the completion and EOS of strings), and laid out for next-token prediction exactly as
    `sft_dataset` lays out its records:

    $$
    \mathrm{tokens}_t = s_t, \quad \mathrm{targets}_t = s_{t+1}, \quad
    \mathrm{where}_t = m_{t+1}, \qquad 0 \le t < n - 1,
    $$

    `attention_where` True on the $n - 1$ real inputs, `pad_id` after them. Shuffling,
    epochs, batching, checkpointable iterators and skipped-record warnings are those of
    `sft_dataset`.

    Args:
      records: `{"messages": [...]}` or `{"prompt", "completion"}` dicts, for example from
        `read_records(path, kind="sft")`.
      tokenizer: the checkpoint's `HFTokenizer` (with a chat template for conversations).
      max_length: the most tokens of a sequence; the width of every array.
      batch_size: rows per batch.
      seed: shuffle seed in `[0, 2**32)`.
      shuffle: shuffle the records (a different order every epoch).
      num_epochs: passes over the data; None repeats forever.
      drop_remainder: drop a final partial batch.
      on_invalid: `"raise"` or `"skip"` (see `encode_hf_records`).

    Returns:
      A `grain.IterDataset` of dicts of `[batch_size, max_length]` arrays: `"tokens"`,
      `"targets"` (int32), `"where"`, `"attention_where"` (bool).

    Examples:
      >>> import tokenizers
      >>> from tokenizers import models, pre_tokenizers
      >>> from tunelib.data import HFTokenizer, hf_sft_dataset
      >>> vocab = {"<unk>": 0, "</s>": 1, "U:": 2, "A:": 3, **{c: 4 + i for i, c in
      ...          enumerate("0123456789+?")}}
      >>> inner = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
      >>> inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
      >>> _ = inner.add_special_tokens(["</s>", "U:", "A:"])
      >>> template = ("{% for m in messages %}{{ 'U:' if m['role'] == 'user' else 'A:' }}"
      ...             "{{ m['content'] }}{{ eos_token }}{% endfor %}")
      >>> tok = HFTokenizer(inner, eos_token="</s>", chat_template=template)
      >>> chat = {"messages": [{"role": "user", "content": "2+2?"},
      ...                      {"role": "assistant", "content": "4"}]}
      >>> batch = next(iter(hf_sft_dataset([chat], tok, max_length=10, batch_size=1)))
      >>> print(batch["tokens"], batch["targets"], batch["where"].astype(int), sep="\n")
      [[ 2  6 14  6 15  1  3  8  1  1]]
      [[ 6 14  6 15  1  3  8  1  1  1]]
      [[0 0 0 0 0 1 1 1 0 0]]
    """
    return _dataset(
        records,
        tokenizer,
        "sft",
        max_length=max_length,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        num_epochs=num_epochs,
        drop_remainder=drop_remainder,
        on_invalid=on_invalid,
    )


def hf_preference_dataset(
    records: Iterable[Any],
    tokenizer: HFTokenizer,
    *,
    max_length: int,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    on_invalid: OnInvalid = "raise",
) -> grain.IterDataset:
    """A Grain dataset of preference batches from `{"prompt", "chosen", "rejected"}` records.

    Each side is the prompt followed by that response, tokenized by `encode_hf_records` and
    laid out as `hf_sft_dataset` lays out a sequence, `where` on the response (for strings,
    also its EOS). Both sides must fit `max_length`. The rest is as `preference_dataset`.

    Args:
      records: preference records, strings or conversations (for example from
        `read_records(path, kind="preference")`).
      tokenizer: the checkpoint's `HFTokenizer`.
      max_length: the most tokens of either sequence; the width of every array.
      batch_size: pairs per batch.
      seed: shuffle seed in `[0, 2**32)`.
      shuffle: shuffle the pairs.
      num_epochs: passes over the data; None repeats forever.
      drop_remainder: drop a final partial batch.
      on_invalid: `"raise"` or `"skip"`.

    Returns:
      A `grain.IterDataset` of `{"chosen": {...}, "rejected": {...}}`, each side a dict of
      `"tokens"`, `"targets"`, `"where"`, `"attention_where"`, all `[batch_size, max_length]`.
    """
    return _dataset(
        records,
        tokenizer,
        "preference",
        max_length=max_length,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        num_epochs=num_epochs,
        drop_remainder=drop_remainder,
        on_invalid=on_invalid,
    )


def hf_prompts(
    prompts: Sequence[str | Sequence[Mapping[str, Any]]],
    tokenizer: HFTokenizer,
    *,
    max_length: int,
) -> tuple[Int[np.ndarray, "B T"], Bool[np.ndarray, "B T"]]:
    """Left-padded prompt token ids for sampling, and the mask of real tokens.

    A string prompt becomes `[BOS] + prompt` (BOS when `tokenizer.add_bos`); a conversation
    is rendered with the chat template and the generation prompt (`encode_chat(...,
    add_generation_prompt=True)`), so the model continues with an assistant turn. Left
    padding puts every prompt's last token in the last column, where decoding continues
    (`tunelib.rollout.sample`; stop on `tokenizer.stop_ids`).

    Args:
      prompts: `B` prompts, each a string or a list of messages (the `"prompt"` field of
        `read_records(path, kind="rl")` records).
      tokenizer: the checkpoint's `HFTokenizer`.
      max_length: `T`, the width; every prompt must fit.

    Returns:
      `(tokens, where)`: `[B, T]` int32 ids (`pad_id`, then the prompt) and the `[B, T]` bool
      mask, True on prompt tokens.

    Raises:
      ValueError: naming the prompt index, for a prompt that does not fit or is empty, or a
        template that fails.

    Examples:
      >>> import tokenizers
      >>> from tokenizers import models, pre_tokenizers
      >>> from tunelib.data import HFTokenizer, hf_prompts
      >>> vocab = {"<s>": 0, "</s>": 1, **{c: 2 + i for i, c in enumerate("0123456789+=")}}
      >>> inner = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
      >>> inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
      >>> tok = HFTokenizer(inner, eos_token="</s>", bos_token="<s>", add_bos=True)
      >>> tokens, where = hf_prompts(["1+1=", "12+7="], tok, max_length=7)
      >>> print(tokens, where.astype(int), sep="\\n")
      [[ 1  1  0  3 12  3 13]
       [ 1  0  3  4 12  9 13]]
      [[0 0 1 1 1 1 1]
       [0 1 1 1 1 1 1]]
    """
    check_max_length(max_length, at_least=1)
    tokens = np.full((len(prompts), max_length), tokenizer.pad_id, np.int32)
    where = np.zeros((len(prompts), max_length), np.bool_)
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = [tokenizer.bos_id] if tokenizer.add_bos else []
            ids += tokenizer.encode(prompt)
        else:
            try:
                check_messages(index, "prompt", prompt)
                ids = encode_chat(tokenizer, prompt, add_generation_prompt=True)[0].tolist()
            except RecordError as error:
                raise ValueError(f"prompts[{index}]: {error.detail}") from None
            except TemplateError as error:
                raise ValueError(f"prompts[{index}]: {error}") from None
        if not ids:
            raise ValueError(f"prompts[{index}] has no token: the sampler needs at least one.")
        if len(ids) > max_length:
            raise ValueError(
                f"prompts[{index}] needs {len(ids)} tokens, more than max_length={max_length}."
            )
        tokens[index, max_length - len(ids) :] = ids
        where[index, max_length - len(ids) :] = True
    return tokens, where
