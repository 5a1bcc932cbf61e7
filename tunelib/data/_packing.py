"""Sequence packing: several sequences share a row of a batch, told apart by segment ids.

The packing itself is Grain's first-fit packer (`grain.experimental.FirstFitPackIterDataset`);
this module lays its output out as tunelib's packed batch.
"""

import functools

import grain
import numpy as np

# The per-token arrays of an example before packing, each `[n]` for its `n` columns.
KEYS = ("tokens", "targets", "where", "attention_where", "positions", "segment_ids")


def segments(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The next-token rows of one example's sequences, one after the other, with the
    position of each token in its sequence and its sequence's number in the example (1, 2)."""
    out = {key: np.concatenate([row[key] for row in rows]) for key in rows[0]}
    out["positions"] = np.concatenate(
        [np.arange(len(row["tokens"]), dtype=np.int32) for row in rows]
    )
    out["segment_ids"] = np.concatenate(
        [np.full(len(row["tokens"]), number, np.int32) for number, row in enumerate(rows, 1)]
    )
    return out


def _finish(row: dict[str, np.ndarray], *, per_example: int) -> dict[str, np.ndarray]:
    """Grain's packed row as tunelib's: one `segment_ids` numbering every sequence of the row."""
    example = row["tokens_segment_ids"]  # 1, 2, ... per packed example, 0 on padding
    segment_ids = np.where(example > 0, per_example * (example - 1) + row["segment_ids"], 0)
    return {
        "tokens": row["tokens"],
        "targets": row["targets"],
        "where": row["where"],
        "attention_where": row["attention_where"],
        "segment_ids": segment_ids.astype(np.int32),
        "positions": row["positions"],
    }


def check_max_segments(max_segments: int, *, per_example: int) -> None:
    if max_segments < per_example or max_segments % per_example:
        what = "an even number >= 2 (a pair is two segments)" if per_example == 2 else ">= 1"
        raise ValueError(f"max_segments must be {what}, got {max_segments}.")


def pack(
    ds: grain.IterDataset,
    *,
    max_length: int,
    num_rows: int,
    max_segments: int,
    per_example: int,
    pad_id: int,
) -> grain.IterDataset:
    """Pack the examples of `ds` (dicts of `KEYS`, see `segments`) into rows of `max_length`.

    Grain's first-fit packer fills `num_rows` rows at a time: each example goes into the first
    row with room for all of it and fewer than `max_segments` segments, and once one fits in
    none the rows are emitted in order. An example of `per_example` sequences (a preference
    pair is two) is never split across rows. Padding holds `pad_id` in `tokens` and
    `targets`, False in the masks and 0 in `positions` and `segment_ids`. `max_segments` is
    a multiple of `per_example` (`check_max_segments`).
    """
    padding = {key: False if key.endswith("where") else 0 for key in KEYS}
    padding.update(tokens=pad_id, targets=pad_id)
    packed = grain.experimental.FirstFitPackIterDataset(
        ds,
        length_struct=dict.fromkeys(KEYS, max_length),
        num_packing_bins=num_rows,
        shuffle_bins=False,
        padding_struct=padding,
        max_sequences_per_bin=max_segments // per_example,
    )
    return packed.map(functools.partial(_finish, per_example=per_example))
