"""Grain pipelines that turn validated records into fixed-shape NumPy batches."""

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import grain
import numpy as np
from jaxtyping import Bool, Int

from tunelib.data._records import (
    OnInvalid,
    RecordKind,
    check_max_length,
    check_on_invalid,
    validate_records,
)
from tunelib.data._tokenizer import Tokenizer

_logger = logging.getLogger(__name__)

# Records are encoded lazily in the calling thread: the work per record is tiny, and a reader
# thread pool would cost more than it saves. Wrap the dataset in
# `grain.experimental.ThreadPrefetchIterDataset` to prefetch batches in the background.
_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def _sequence_arrays(
    prompt: str, completion: str, tokenizer: Tokenizer, max_length: int
) -> dict[str, np.ndarray]:
    """The four `[max_length]` rows of one prompt and completion (see `sft_dataset`)."""
    prompt_ids = tokenizer.encode(prompt)
    sequence = [tokenizer.bos_id, *prompt_ids, *tokenizer.encode(completion), tokenizer.eos_id]
    n = len(sequence) - 1
    tokens = np.full(max_length, tokenizer.pad_id, np.int32)
    targets = np.full(max_length, tokenizer.pad_id, np.int32)
    tokens[:n] = sequence[:-1]
    targets[:n] = sequence[1:]
    # Target t is sequence[t + 1]: the completion starts at target len(prompt_ids).
    where = np.zeros(max_length, np.bool_)
    where[len(prompt_ids) : n] = True
    attention_where = np.zeros(max_length, np.bool_)
    attention_where[:n] = True
    return {
        "tokens": tokens,
        "targets": targets,
        "where": where,
        "attention_where": attention_where,
    }


def _sft_example(
    record: Mapping[str, Any], *, tokenizer: Tokenizer, max_length: int
) -> dict[str, np.ndarray]:
    return _sequence_arrays(record["prompt"], record["completion"], tokenizer, max_length)


def _preference_example(
    record: Mapping[str, Any], *, tokenizer: Tokenizer, max_length: int
) -> dict[str, dict[str, np.ndarray]]:
    return {
        side: _sequence_arrays(record["prompt"], record[side], tokenizer, max_length)
        for side in ("chosen", "rejected")
    }


def _batched_dataset(
    records: Iterable[Any],
    kind: RecordKind,
    encode: Callable[..., dict],
    tokenizer: Tokenizer,
    *,
    max_length: int,
    batch_size: int,
    seed: int,
    shuffle: bool,
    num_epochs: int | None,
    drop_remainder: bool,
    on_invalid: OnInvalid,
) -> grain.IterDataset:
    """Validate `records`, then source -> map -> shuffle -> repeat -> batch with Grain."""
    check_on_invalid(on_invalid)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 or None (repeat forever), got {num_epochs}.")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must lie in [0, 2**32), got {seed}.")
    kept, report = validate_records(
        records, kind=kind, tokenizer=tokenizer, max_length=max_length, on_invalid=on_invalid
    )
    if report.num_skipped:
        _logger.warning(
            "%s_dataset skipped %d invalid records: %s", kind, report.num_skipped, report.skipped
        )
    if not kept:
        raise ValueError(f"records holds no valid {kind} record.")
    if drop_remainder and num_epochs is not None and len(kept) * num_epochs < batch_size:
        raise ValueError(
            f"{len(kept)} records x num_epochs={num_epochs} cannot fill one batch of "
            f"batch_size={batch_size} with drop_remainder=True."
        )
    ds = grain.MapDataset.source(kept).map(
        functools.partial(encode, tokenizer=tokenizer, max_length=max_length)
    )
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    return ds.to_iter_dataset(_READ_OPTIONS).batch(batch_size, drop_remainder=drop_remainder)


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
) -> grain.IterDataset:
    r"""A Grain dataset of SFT batches from `{"prompt", "completion"}` records.

    Each record becomes the sequence $s = (\mathrm{BOS}, x_1..x_P, y_1..y_C, \mathrm{EOS})$
    of $n = P + C + 2 \le$ `max_length` tokens, laid out for next-token prediction:

    $$
    \mathrm{tokens}_t = s_t, \quad \mathrm{targets}_t = s_{t+1}, \qquad 0 \le t < n - 1,
    \qquad \mathrm{where}_t = [\,P \le t < n - 1\,]
    $$

    with prompt $x$ = `record["prompt"]` and completion $y$ = `record["completion"]` encoded
    by `tokenizer`. EOS is the last target, never an input; positions $t \ge n - 1$ hold
    `pad_id` in both `tokens` and `targets`. `where` is True exactly where the target is a
    completion token or the EOS (so the model learns to stop), and `attention_where` is True on
    the $n - 1$ real input tokens. For `"12+7="` / `"19"`:

    ```
    t                0    1    2    3    4    5    6    7    8   ...
    tokens           BOS  1    2    +    7    =    1    9    pad ...
    targets          1    2    +    7    =    1    9    EOS  pad ...
    where            .    .    .    .    .    x    x    x    .   ...
    attention_where  x    x    x    x    x    x    x    x    .   ...
    ```

    Records are checked first with `validate_records(kind="sft")`. The pipeline is Grain's
    `MapDataset.source -> map (encode) -> shuffle -> repeat`, read as an `IterDataset` and
    batched. Each epoch is shuffled differently (Grain folds the epoch into the seed), the
    order is a deterministic function of `seed`, and batches may span an epoch boundary.

    Args:
      records: `{"prompt": str, "completion": str}` dicts (other fields are ignored).
      tokenizer: a `CharTokenizer` or any `Tokenizer`.
      max_length: the most tokens a full sequence may have, BOS and EOS included; also the
        width of every batch array.
      batch_size: rows per batch.
      seed: shuffle seed in `[0, 2**32)`.
      shuffle: shuffle the records (a different order every epoch); False keeps input order.
      num_epochs: passes over the data; None (the default) repeats forever.
      drop_remainder: drop a final partial batch (the default), so every batch has the same
        static shape; only the very last batch of a finite run can be partial.
      on_invalid: `"raise"` on the first invalid record, or `"skip"` it (the skipped counts
        are logged as a warning); see `validate_records`.

    Returns:
      A `grain.IterDataset`. Iterating it gives dicts of NumPy arrays, all
      `[batch_size, max_length]`: `"tokens"` and `"targets"` int32, `"where"` and
      `"attention_where"` bool. The iterator's `get_state()` is a JSON-serialisable dict, and
      `set_state` on a fresh iterator of the same dataset resumes the identical stream (Grain's
      `grain.checkpoint.CheckpointSave` stores it in an Orbax checkpoint).

    Raises:
      RecordError: for an invalid record with `on_invalid="raise"`.
      ValueError: for no valid record, or a finite run too short for one full batch.

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
    """
    return _batched_dataset(
        records,
        "sft",
        _sft_example,
        tokenizer,
        max_length=max_length,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        num_epochs=num_epochs,
        drop_remainder=drop_remainder,
        on_invalid=on_invalid,
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
) -> grain.IterDataset:
    """A Grain dataset of preference batches from `{"prompt", "chosen", "rejected"}` records.

    Each side is laid out exactly as an SFT example (see `sft_dataset`) with the same prompt
    and `chosen` or `rejected` as the completion, so `where` marks the response tokens and
    EOS of that side. Both sides of a pair sit on the same row, and both must fit `max_length`
    (BOS + prompt + response + EOS), or the record is invalid. Shuffling, epochs, batching and
    checkpointing are those of `sft_dataset`.

    Args:
      records: `{"prompt": str, "chosen": str, "rejected": str}` dicts, as from
        `preference_pairs`.
      tokenizer: a `CharTokenizer` or any `Tokenizer`.
      max_length: the most tokens either full sequence may have; the width of every array.
      batch_size: pairs per batch.
      seed: shuffle seed in `[0, 2**32)`.
      shuffle: shuffle the pairs (a different order every epoch).
      num_epochs: passes over the data; None (the default) repeats forever.
      drop_remainder: drop a final partial batch (the default).
      on_invalid: `"raise"` or `"skip"`; see `validate_records`.

    Returns:
      A `grain.IterDataset` of `{"chosen": {...}, "rejected": {...}}`, each side a dict with
      `"tokens"`, `"targets"` (int32), `"where"` and `"attention_where"` (bool), all
      `[batch_size, max_length]`.

    Examples:
      >>> from tunelib.data import CharTokenizer, preference_dataset
      >>> pair = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
      >>> ds = preference_dataset([pair], CharTokenizer(), max_length=7, batch_size=1)
      >>> batch = next(iter(ds))
      >>> print(batch["chosen"]["targets"], batch["rejected"]["targets"])
      [[ 4 13  4 16  5  2  0]] [[ 4 13  4 16  6  2  0]]
      >>> print(batch["chosen"]["where"].astype(int))
      [[0 0 0 0 1 1 0]]
    """
    return _batched_dataset(
        records,
        "preference",
        _preference_example,
        tokenizer,
        max_length=max_length,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        num_epochs=num_epochs,
        drop_remainder=drop_remainder,
        on_invalid=on_invalid,
    )


def encode_prompts(
    prompts: Sequence[str], tokenizer: Tokenizer, *, max_length: int
) -> tuple[Int[np.ndarray, "B T"], Bool[np.ndarray, "B T"]]:
    """Left-padded BOS + prompt token ids for sampling, with the mask of real tokens.

    Left padding puts the last prompt token of every row in the last column, where decoding
    continues.

    Args:
      prompts: `B` prompt strings.
      tokenizer: a `CharTokenizer` or any `Tokenizer`.
      max_length: `T`, the width; BOS + prompt must fit in it.

    Returns:
      `(tokens, where)`: `[B, T]` int32 ids (`pad_id`, then BOS and the prompt) and the
      `[B, T]` bool mask, True on BOS and prompt tokens.

    Raises:
      ValueError: naming the prompt index when a prompt does not fit or has a character the
        tokenizer does not know.

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
        if not isinstance(prompt, str):
            raise TypeError(f"prompts[{index}] must be a str, got {type(prompt).__name__}.")
        try:
            ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
        except ValueError as error:
            raise ValueError(f"prompts[{index}]: {error}") from None
        if len(ids) > max_length:
            raise ValueError(
                f"prompts[{index}] needs {len(ids)} tokens with BOS, more than "
                f"max_length={max_length}."
            )
        tokens[index, max_length - len(ids) :] = ids
        where[index, max_length - len(ids) :] = True
    return tokens, where
