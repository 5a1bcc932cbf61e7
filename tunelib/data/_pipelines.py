"""Grain pipelines that turn records into fixed-shape NumPy batches, padded or packed."""

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import grain
import numpy as np
from jaxtyping import Bool, Int

from tunelib.data._packing import check_max_segments, pack, segments
from tunelib.data._records import (
    Example,
    OnInvalid,
    RecordError,
    check_max_length,
    check_messages,
    check_on_invalid,
    collect,
    encode_record,
    prompt_ids,
)
from tunelib.data._tokenizers import Tokenizer

_logger = logging.getLogger(__name__)

# Records are laid out lazily in the calling thread: the work per record is tiny, and a reader
# thread pool would cost more than it saves. Wrap the dataset in
# `grain.experimental.ThreadPrefetchIterDataset` to prefetch batches in the background.
_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def _rows(sequence: Example) -> dict[str, np.ndarray]:
    """The next-token rows of a sequence of `n` tokens, each `n - 1` long (EOS is no input)."""
    ids, where = sequence["ids"], sequence["where"]
    return {
        "tokens": ids[:-1],
        "targets": ids[1:],
        "where": where[1:],
        "attention_where": np.ones(len(ids) - 1, np.bool_),
    }


def _padded(sequences: Sequence[Example], *, max_length: int, pad_id: int) -> dict:
    """`_rows` of each sequence padded to `max_length` with `pad_id` (ids) and False (masks),
    stacked: `[len(sequences), max_length]` arrays, filled in place (a batch at once costs a
    fraction of laying out its rows one by one and stacking them)."""
    rows = [_rows(sequence) for sequence in sequences]
    out = {}
    for key, first in rows[0].items():
        fill = pad_id if first.dtype != np.bool_ else False
        out[key] = np.full((len(rows), max_length), fill, first.dtype)
        for i, row in enumerate(rows):
            out[key][i, : len(row[key])] = row[key]
    return out


def _padded_pairs(examples: Sequence[Example], *, max_length: int, pad_id: int) -> dict:
    return {
        side: _padded([e[side] for e in examples], max_length=max_length, pad_id=pad_id)
        for side in ("chosen", "rejected")
    }


def _laid_out(chosen: np.ndarray, *, examples: Sequence[Example], layout: Callable) -> dict:
    """The batch of the examples at the indices `chosen`, laid out by `layout`."""
    return layout([examples[i] for i in chosen])


def _packable(example: Example) -> dict[str, np.ndarray]:
    return segments([_rows(example)])


def _packable_pair(example: Example) -> dict[str, np.ndarray]:
    return segments([_rows(example["chosen"]), _rows(example["rejected"])])


def _dataset(
    records: Iterable[Any],
    tokenizer: Tokenizer,
    kind: str,
    *,
    max_length: int,
    batch_size: int,
    seed: int,
    shuffle: bool,
    num_epochs: int | None,
    drop_remainder: bool,
    on_invalid: OnInvalid,
    packing: bool,
    max_segments: int | None,
    shard: tuple[int, int],
) -> grain.IterDataset:
    """Encode `records`, then source -> map -> shuffle -> repeat [-> pack] -> batch with Grain,
    keeping this process's `shard` of every batch."""
    check_on_invalid(on_invalid)
    check_max_length(max_length, at_least=2)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 or None (repeat forever), got {num_epochs}.")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must lie in [0, 2**32), got {seed}.")
    if packing and max_segments is None:
        raise ValueError(
            "packing=True needs max_segments, the most sequences a row may hold (the static "
            "size of a consumer's per-segment axis)."
        )
    if not packing and max_segments is not None:
        raise ValueError(f"max_segments={max_segments} is for packing=True only.")
    index, count = check_shard(shard, batch_size, drop_remainder)
    per_example = 1 if kind == "sft" else 2  # sequences: a preference pair has two
    if packing:
        check_max_segments(max_segments, per_example=per_example)
    encode = functools.partial(
        encode_record, kind=kind, tokenizer=tokenizer, max_length=max_length, packed=packing
    )
    examples, report = collect(records, on_invalid, encode)
    if report.num_skipped:
        _logger.warning(
            "%s_dataset skipped %d invalid records: %s",
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
    rows = batch_size // count
    if not packing:
        # The examples' indices shuffled, repeated and batched; batch k of this shard is batch
        # k * count + index of the whole stream, laid out at once.
        padded = _padded if kind == "sft" else _padded_pairs
        layout = functools.partial(padded, max_length=max_length, pad_id=tokenizer.pad_id)
        ds = grain.MapDataset.range(len(examples))
        ds = ds.shuffle(seed=seed) if shuffle else ds
        ds = ds.repeat(num_epochs).batch(rows, drop_remainder=drop_remainder)[index::count]
        ds = ds.map(functools.partial(_laid_out, examples=examples, layout=layout))
        return ds.to_iter_dataset(_READ_OPTIONS)
    ds = grain.MapDataset.source(examples).map(_packable if kind == "sft" else _packable_pair)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    # Packed, each shard packs every count-th example of the stream into its own rows.
    ds = pack(
        ds[index::count].to_iter_dataset(_READ_OPTIONS),
        max_length=max_length,
        num_rows=rows,
        max_segments=max_segments,
        per_example=per_example,
        pad_id=tokenizer.pad_id,
    )
    return ds.batch(rows, drop_remainder=drop_remainder)


def check_shard(shard: tuple[int, int], batch_size: int, drop_remainder: bool) -> tuple[int, int]:
    """`shard` as `(index, count)`, once it names one of `count` equal shares of a batch."""
    if not (isinstance(shard, tuple) and len(shard) == 2 and all(type(x) is int for x in shard)):
        raise ValueError(f"shard must be a tuple (index, count) of ints, got {shard!r}.")
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard {shard}: index must lie in [0, count).")
    if batch_size % count:
        raise ValueError(f"batch_size={batch_size} does not split into {count} equal shards.")
    if count > 1 and not drop_remainder:
        raise ValueError("shard with count > 1 needs drop_remainder=True (equal batches).")
    return index, count


def sft_dataset(
    records: Iterable[Any],
    tokenizer: Tokenizer,
    *,
    max_length: int,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    on_invalid: OnInvalid = "raise",
    packing: bool = False,
    max_segments: int | None = None,
    shard: tuple[int, int] = (0, 1),
) -> grain.IterDataset:
    r"""A Grain dataset of SFT batches from chat or prompt-completion records.

    Each record is tokenized by `encode_records` into a sequence $s$ of $n \le$ `max_length`
    tokens with a completion mask $m$: for strings $s = ([\mathrm{BOS}], x_1..x_P, y_1..y_C,
    \mathrm{EOS})$ with prompt $x$ = `record["prompt"]` and completion $y$ =
    `record["completion"]` (BOS when `tokenizer.add_bos`) and $m$ True on $y$ and EOS; for a
    conversation the chat template's rendering, $m$ True on the assistant turns. It is laid
    out for next-token prediction:

    $$
    \mathrm{tokens}_t = s_t, \quad \mathrm{targets}_t = s_{t+1}, \quad
    \mathrm{where}_t = m_{t+1}, \quad \mathrm{attention\_where}_t = 1, \qquad 0 \le t < n - 1.
    $$

    EOS is the last target, never an input; positions $t \ge n - 1$ hold `pad_id` in `tokens`
    and `targets` and False in the masks. `where` is True exactly where the target is a
    completion token or the EOS (so the model learns to stop). For `"12+7="` / `"19"` with a
    `CharTokenizer`:

    ```
    t                0    1    2    3    4    5    6    7    8   ...
    tokens           BOS  1    2    +    7    =    1    9    pad ...
    targets          1    2    +    7    =    1    9    EOS  pad ...
    where            .    .    .    .    .    x    x    x    .   ...
    attention_where  x    x    x    x    x    x    x    x    .   ...
    ```

    With `packing=True` several sequences share a row: each is laid out as above (so no
    target crosses from one sequence into the next) and placed after the previous ones by
    Grain's first-fit packer, which fills `batch_size` rows at a time, each with at most
    `max_segments` sequences. Two more arrays tell them apart: `segment_ids` (1, 2, ... for
    the sequences of a row in order, 0 on padding) and `positions` (0, 1, ... restarting at
    each sequence, 0 on padding). A sequence takes $n - 1$ columns, so a row holds sequences
    of $\sum (n_i - 1) \le$ `max_length` tokens; which records are valid does not change.

    The pipeline is Grain's: the records' indices `shuffle -> repeat -> batch`, each batch
    laid out at once, read as an `IterDataset`; packed, `MapDataset.source -> map (lay out)
    -> shuffle -> repeat` read as an `IterDataset`, packed and batched. Each epoch is
    shuffled differently (Grain folds the epoch into the seed), the order is a deterministic
    function of `seed`, and batches (and packed rows) may span an epoch boundary.

    Args:
      records: `{"prompt": str, "completion": str}` dicts, `{"messages": [...]}` dicts or
        prompt-completion conversations (other fields are ignored); see `validate_records`.
      tokenizer: any `Tokenizer` (`CharTokenizer`, or `HFTokenizer` with a chat template for
        conversations).
      max_length: the most tokens a full sequence may have, BOS and EOS included; also the
        width of every batch array.
      batch_size: rows per batch.
      seed: shuffle seed in `[0, 2**32)`.
      shuffle: shuffle the records (a different order every epoch); False keeps input order.
      num_epochs: passes over the data; None (the default) repeats forever.
      drop_remainder: drop a final partial batch (the default), so every batch has the same
        static shape; only the very last batch of a finite run can be partial. Packed, a
        row holds several records, so a finite run has fewer batches than
        `len(records) * num_epochs // batch_size` (possibly none).
      on_invalid: `"raise"` on the first invalid record, or `"skip"` it (the skipped counts
        are logged as a warning on the `tunelib.data` logger); see `validate_records`.
      packing: pack several sequences into each row (see above).
      max_segments: with `packing=True` (and only then, where it is required), the most
        sequences a row may hold: the static size of a consumer's per-segment axis.
      shard: `(index, count)`: keep this process's share of every batch, for a run of
        `count` processes (`(jax.process_index(), jax.process_count())`). Each batch then
        has `batch_size // count` rows: rows `[index * b, (index + 1) * b)` of the batch the
        unsharded dataset gives, so the `count` shards together are exactly that stream, and
        a process lays out only its own records. Packed, each shard packs every `count`-th
        example of the stream into its own rows (every example is still used once per
        epoch, but the rows differ from the unsharded ones). Needs `drop_remainder=True`
        when `count > 1`. The iterator's state is the shard's own.

    Returns:
      A `grain.IterDataset`. Iterating it gives dicts of NumPy arrays, all
      `[batch_size, max_length]`: `"tokens"` and `"targets"` int32, `"where"` and
      `"attention_where"` bool, and with packing `"segment_ids"` and `"positions"` int32. The
      iterator's `get_state()` is a JSON-serialisable dict, and `set_state` on a fresh
      iterator of the same dataset resumes the identical stream (Grain's
      `grain.checkpoint.CheckpointSave` stores it in an Orbax checkpoint).

    Raises:
      RecordError: for an invalid record with `on_invalid="raise"`.
      ValueError: for no valid record, a finite run too short for one full batch, or
        `packing` without `max_segments`.

    Examples:
      >>> from tunelib.data import CharTokenizer, sft_dataset
      >>> tok = CharTokenizer()
      >>> records = [{"prompt": "12+7=", "completion": "19"}]
      >>> batch = next(iter(sft_dataset(records, tok, max_length=10, batch_size=1)))
      >>> print(batch["tokens"])
      [[ 1  4  5 13 10 16  4 12  0  0]]
      >>> print(batch["targets"])
      [[ 4  5 13 10 16  4 12  2  0  0]]
      >>> print(batch["where"].astype(int))
      [[0 0 0 0 0 1 1 1 0 0]]
      >>> print(batch["attention_where"].astype(int))
      [[1 1 1 1 1 1 1 1 0 0]]

      Two records packed into one row:

      >>> records = [{"prompt": "1+2=", "completion": "3"}, {"prompt": "4+4=", "completion": "8"}]
      >>> ds = sft_dataset(records, tok, max_length=14, batch_size=1, shuffle=False,
      ...                  packing=True, max_segments=4)
      >>> batch = next(iter(ds))
      >>> print(batch["tokens"])
      [[ 1  4 13  5 16  6  1  7 13  7 16 11  0  0]]
      >>> print(batch["segment_ids"])
      [[1 1 1 1 1 1 2 2 2 2 2 2 0 0]]
      >>> print(batch["positions"])
      [[0 1 2 3 4 5 0 1 2 3 4 5 0 0]]
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
        packing=packing,
        max_segments=max_segments,
        shard=shard,
    )


def preference_dataset(
    records: Iterable[Any],
    tokenizer: Tokenizer,
    *,
    max_length: int,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    on_invalid: OnInvalid = "raise",
    packing: bool = False,
    max_segments: int | None = None,
    shard: tuple[int, int] = (0, 1),
) -> grain.IterDataset:
    """A Grain dataset of preference batches from `{"prompt", "chosen", "rejected"}` records.

    Each side is the prompt followed by that response, tokenized by `encode_records` and laid
    out exactly as an SFT example (see `sft_dataset`), so `where` marks the response tokens
    (and, for strings, the EOS) of that side. Each side must fit `max_length` on its own, or
    the record is invalid. Shuffling, epochs, batching and checkpointing are those of
    `sft_dataset`, and so is `shard`.

    Padded, both sides of a pair sit on the same row of two batches, `batch["chosen"]` and
    `batch["rejected"]`. Packed (`packing=True`), a batch is one dict as `sft_dataset`'s:
    the chosen and the rejected sequence of a pair are consecutive segments of the same row,
    chosen first, so odd `segment_ids` (1, 3, ...) are chosen and even ones rejected. A
    consumer takes per-segment sums `[B, max_segments]` and splits the columns `0::2`
    (chosen) and `1::2` (rejected); a row holds at most `max_segments // 2` pairs (so
    `max_segments` is even), and a pair whose two sides (each a token shorter than its
    sequence) together exceed `max_length` columns is invalid (`"too_long"`).

    Args:
      records: preference records, strings or conversations, as from `preference_pairs` or
        `read_records(path, kind="preference")`.
      tokenizer: any `Tokenizer`.
      max_length: the most tokens either full sequence may have; the width of every array.
      batch_size: rows per batch (pairs, when not packed).
      seed: shuffle seed in `[0, 2**32)`.
      shuffle: shuffle the pairs (a different order every epoch).
      num_epochs: passes over the data; None (the default) repeats forever.
      drop_remainder: drop a final partial batch (the default).
      on_invalid: `"raise"` or `"skip"`; see `validate_records`.
      packing: pack several pairs into each row.
      max_segments: with `packing=True` (required then), the most sequences a row may hold,
        an even number.
      shard: `(index, count)`: this process's share of every batch (see `sft_dataset`).

    Returns:
      A `grain.IterDataset` of `{"chosen": {...}, "rejected": {...}}`, each side a dict with
      `"tokens"`, `"targets"` (int32), `"where"` and `"attention_where"` (bool), all
      `[batch_size, max_length]`; packed, one dict of those and `"segment_ids"` and
      `"positions"` (int32).

    Examples:
      >>> from tunelib.data import CharTokenizer, preference_dataset
      >>> pair = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
      >>> ds = preference_dataset([pair], CharTokenizer(), max_length=7, batch_size=1)
      >>> batch = next(iter(ds))
      >>> print(batch["chosen"]["targets"], batch["rejected"]["targets"])
      [[ 4 13  4 16  5  2  0]] [[ 4 13  4 16  6  2  0]]
      >>> print(batch["chosen"]["where"].astype(int))
      [[0 0 0 0 1 1 0]]
      >>> ds = preference_dataset([pair], CharTokenizer(), max_length=14, batch_size=1,
      ...                         packing=True, max_segments=2)
      >>> batch = next(iter(ds))
      >>> print(batch["targets"])
      [[ 4 13  4 16  5  2  4 13  4 16  6  2  0  0]]
      >>> print(batch["segment_ids"])
      [[1 1 1 1 1 1 2 2 2 2 2 2 0 0]]
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
        packing=packing,
        max_segments=max_segments,
        shard=shard,
    )


def encode_prompts(
    prompts: Sequence[str | Sequence[Mapping[str, Any]]],
    tokenizer: Tokenizer,
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
      tokenizer: any `Tokenizer` (with a chat template for conversations).
      max_length: `T`, the width; every prompt must fit.

    Returns:
      `(tokens, where)`: `[B, T]` int32 ids (`pad_id`, then the prompt) and the `[B, T]` bool
      mask, True on prompt tokens.

    Raises:
      ValueError: naming the prompt index, for a prompt that does not fit, has no token,
        has text the tokenizer cannot encode, or a template that fails.

    Examples:
      >>> from tunelib.data import CharTokenizer, encode_prompts
      >>> tokens, where = encode_prompts(["12+7=", "3+4="], CharTokenizer(), max_length=8)
      >>> print(tokens)
      [[ 0  0  1  4  5 13 10 16]
       [ 0  0  0  1  6 13  7 16]]
      >>> print(where.astype(int))
      [[0 0 1 1 1 1 1 1]
       [0 0 0 1 1 1 1 1]]
    """
    check_max_length(max_length, at_least=1)
    tokens = np.full((len(prompts), max_length), tokenizer.pad_id, np.int32)
    where = np.zeros((len(prompts), max_length), np.bool_)
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str | list):
            raise TypeError(
                f"prompts[{index}] must be a str or a list of messages, "
                f"got {type(prompt).__name__}."
            )
        try:
            if isinstance(prompt, list):
                check_messages(index, "prompt", prompt)
            ids = prompt_ids(prompt, tokenizer)
        except RecordError as error:
            raise ValueError(f"prompts[{index}]: {error.detail}") from None
        except ValueError as error:
            raise ValueError(f"prompts[{index}]: {error}") from None
        if not ids:
            raise ValueError(f"prompts[{index}] has no token: the sampler needs at least one.")
        if len(ids) > max_length:
            with_bos = " with BOS" if isinstance(prompt, str) and tokenizer.add_bos else ""
            raise ValueError(
                f"prompts[{index}] needs {len(ids)} tokens{with_bos}, more than "
                f"max_length={max_length}."
            )
        tokens[index, max_length - len(ids) :] = ids
        where[index, max_length - len(ids) :] = True
    return tokens, where
