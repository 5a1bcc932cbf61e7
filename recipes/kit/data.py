"""A recipe's data: the built-in arithmetic task or a file of records, as one `Task`.

Either way a task is records in the usual shapes (`prompt`/`completion`, `messages`,
`prompt`/`chosen`/`rejected`, `prompt`/`answer`) and the start model's tokenizer, so the
recipes never ask where their data came from: `tunelib.data`'s pipelines take both.
Records with images (the built-in vision task, `--task vision_counting`, or a file of image
records) add an `images` list, and their batches carry the pixels (`kit.images`).
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np

from tunelib.data import (
    RecordError,
    arithmetic_split,
    encode_prompts,
    preference_dataset,
    preference_pairs,
    problem_in_words,
    read_image_records,
    read_records,
    sft_dataset,
    verify_answer,
)

from kit import images as pictures
from kit.config import holds_images
from kit.errors import UserError


def exact_match(text: str, record: dict) -> bool:
    """A completion is right when it equals the record's answer, both stripped."""
    return text.strip() == str(record["answer"]).strip()


@dataclasses.dataclass(frozen=True)
class Task:
    """Records for training and evaluation, and how to read and score them.

    Attributes:
      name: "arithmetic" or the data file.
      tokenizer: the model's tokenizer.
      train: the training records of the recipe's kind.
      heldout: held-out records of the same kind.
      problems: held-out `prompt`/`answer` records for greedy accuracy (empty when the data
        has no answers).
      correct: `correct(completion_text, problem) -> bool`, the verifier.
      max_length: tokens of a training sequence.
      prompt_length: tokens of a (left-padded) prompt for sampling.
      max_new_tokens: tokens a completion may have when sampling.
      pack_length: the width of a packed row (`--packing`): several sequences share it.
      images: for records with images, the model's `kit.images.ImageLayout`; else None.
      slots: the most images of a record (the image slots of a batch's rows).
      context: the model's context (`max_position_embeddings`): no prompt and completion
        it samples may be longer (`prompt_inputs` checks); None: not checked.
      skip_invalid: records that cannot be laid out (too long for `max_length`) are dropped
        and counted rather than refused (`--skip-invalid`, for a data file's records).
    """

    name: str
    tokenizer: object
    train: list[dict]
    heldout: list[dict]
    problems: list[dict]
    correct: Callable[[str, dict], bool]
    max_length: int
    prompt_length: int
    max_new_tokens: int
    pack_length: int
    images: object = None
    slots: int = 0
    context: int | None = None
    skip_invalid: bool = False


def _arithmetic(config, kind: str, tokenizer, num_train: int) -> Task:
    """The built-in task for `tokenizer`: "47+38=" -> "85" for a model without a chat
    template (the recipes' own models); asked in words in the chat template for a chat model
    ("What is 47 + 38?"), whose answer is the last number of its reply."""

    train, heldout = arithmetic_split(
        seed=config.seed, num_train=num_train, num_heldout=config.num_heldout,
        max_digits=config.max_digits, operations=tuple(config.operations),
    )  # fmt: skip
    chat = getattr(tokenizer, "chat_template", None) is not None
    if chat:
        train, heldout = (
            [{**r, "prompt": problem_in_words(r)} for r in records] for records in (train, heldout)
        )
    problems = heldout
    # The answers a completion must hold: the held-out ones, or the training ones without any
    # (read before the records take the recipe's form).
    answers = [r["answer"] for r in problems or train]

    def completion(answer):
        return [{"role": "assistant", "content": answer}] if chat else answer

    if kind == "sft":
        train, heldout = (
            [{"prompt": r["prompt"], "completion": completion(r["answer"])} for r in records]
            for records in (train, heldout)
        )
    elif kind == "preference":
        train, heldout = (
            [
                {**pair, **{side: completion(pair[side]) for side in ("chosen", "rejected")}}
                for pair in preference_pairs(records, seed=config.seed)
            ]
            for records in (train, heldout)
        )
    # Lengths that fit every problem: its prompt and answer, with room (a chat model's reply
    # has room for a short sentence before the number).
    digits = config.max_digits
    records = train + problems
    _, where = encode_prompts([r["prompt"] for r in records], tokenizer, max_length=4096)
    prompt_length = max(2 * digits + 4, int(where.sum(axis=1).max()))
    longest_answer = max(len(tokenizer.encode(answer)) for answer in answers)
    max_new_tokens = max(2 * digits + 4, longest_answer + 1) + (16 if chat else 0)
    read = "last_number" if chat else "exact"

    def correct(text: str, problem: dict) -> bool:
        return verify_answer(text, problem["answer"], read=read)

    # A training sequence: the prompt, the answer, and EOS or the template's closing tokens.
    max_length = prompt_length + (longest_answer + 3 if chat else max_new_tokens)
    return Task(
        "arithmetic", tokenizer, train, heldout, problems, correct,
        max_length, prompt_length, max_new_tokens,
        4 * (prompt_length + max_new_tokens),  # a packed row holds about four problems
    )  # fmt: skip


def _read(config, kind: str, reader: Callable) -> list:
    """`--data`'s records of `kind`, read by `reader` (`tunelib.data.read_records` or
    `read_image_records`): an invalid record stops the run in one line naming it, or is
    skipped and counted with `--skip-invalid`."""
    path = config.data
    on_invalid = "skip" if config.skip_invalid else "raise"
    try:
        records, report = reader(path, kind=kind, on_invalid=on_invalid)
    except RecordError as error:
        raise UserError(f"--data {path}: {error} (--skip-invalid drops invalid records)") from None
    except (ValueError, OSError) as error:  # the message names the file
        raise UserError(f"--data: {str(error).rstrip('.')}") from None
    if report.num_skipped:
        print(f"--data {path}: kept {report.kept} records, skipped {dict(report.skipped)}")
    return records


def _file(config, kind: str, tokenizer, max_new_tokens: int | None) -> Task:

    path = config.data
    records = _read(config, kind, read_records)
    if not records:
        raise UserError(f"--data {path} holds no valid {kind} record")
    held = min(config.num_heldout, len(records) // 5)
    heldout, train = records[:held], records[held:]
    problems = heldout if kind == "rl" else []
    max_new_tokens = max_new_tokens or config.max_length
    return Task(
        str(path), tokenizer, train, heldout, problems, exact_match,
        config.max_length, config.max_length, max_new_tokens, config.max_length,
    )  # fmt: skip


def _laid_out(name: str, kind: str, tokenizer, layout, records: list, problems: list) -> dict:
    """The widths of an image task: `max_length` of its SFT sequences, `prompt_length` of
    its prompts, `slots` (see `kit.images.lengths`)."""
    widths = pictures.lengths(records, tokenizer, layout, kind=kind, name=name)
    asked = pictures.lengths(problems, tokenizer, layout, kind="rl", name=name)
    return {
        "max_length": widths["max_length"],
        "prompt_length": max(widths["prompt_length"], asked["prompt_length"]),
        "slots": max(widths["slots"], asked["slots"]),
    }


def _vision_counting(config, kind: str, tokenizer, layout, num_train: int) -> Task:
    """The built-in vision task: "How many circles are there?" of a picture, answered with
    the number ("3", then EOS, for a model without a chat template; the last number of a
    chat model's reply)."""
    train, heldout = pictures.counting_task(
        seed=config.seed, num_train=num_train, num_heldout=config.num_heldout,
        size=config.image_size, max_count=config.max_count,
        max_distractors=config.max_distractors,
    )  # fmt: skip
    problems = heldout
    if kind == "sft":
        train, heldout = [pictures.as_sft(r) for r in train], [pictures.as_sft(r) for r in heldout]
    chat = tokenizer.chat_template is not None
    read = "last_number" if chat else "exact"

    def correct(text: str, problem: dict) -> bool:
        return verify_answer(text, problem["answer"], read=read)

    widths = _laid_out("vision_counting", kind, tokenizer, layout, train + heldout, problems)
    max_new_tokens = 3 + (16 if chat else 0)  # one digit and EOS, with room
    return Task(
        "vision_counting", tokenizer, train, heldout, problems, correct, widths["max_length"],
        widths["prompt_length"], max_new_tokens, widths["max_length"], layout, widths["slots"],
    )  # fmt: skip


def _image_file(config, kind: str, tokenizer, layout, max_new_tokens: int | None) -> Task:
    """`--data`'s image records (`tunelib.data.read_image_records`), each checked: a
    missing or undecodable image, or images that do not match the image parts, stops the run
    in one line naming the record (or is skipped with `--skip-invalid`)."""
    path = config.data
    records = _read(config, kind, read_image_records)
    held = min(config.num_heldout, len(records) // 5)
    heldout, train = records[:held], records[held:]
    problems = heldout if kind == "rl" else []
    widths = _laid_out(f"--data {path}", kind, tokenizer, layout, records, [])
    max_new_tokens = max_new_tokens or config.max_length
    return Task(
        str(path), tokenizer, train, heldout, problems, exact_match, widths["max_length"],
        widths["prompt_length"], max_new_tokens, widths["max_length"], layout, widths["slots"],
    )  # fmt: skip


def load_task(
    config, kind: str, model, *, data: Path | None = None, builtin: str = "arithmetic",
    num_train: int | None = None, max_new_tokens: int | None = None,
) -> Task:  # fmt: skip
    """The task of `kind` ("sft", "preference" or "rl") for `model` (a `kit.models.Model`):
    the records of the file `data` (`--data`; `config` holds `DataFile`'s flags), or the
    built-in task `builtin` (`--task`): the arithmetic one with `num_train` training
    problems (default `--num-train`), or "vision_counting" (`config` holds `VisionTask`'s
    flags). A data file's completions are sampled with up to `max_new_tokens`
    (`--max-new-tokens`; default `--max-length`). Records with images need a model that
    reads them, and every sequence must fit the model's context (its
    `max_position_embeddings`); a `UserError` otherwise."""
    tokenizer, images = model.tokenizer, model.images
    vision = builtin != "arithmetic"
    with_images = vision or (data is not None and holds_images(data))
    if with_images and images is None:
        what = f"--task {builtin}:" if vision else f"--data {data}: record 0 has images, but"
        raise UserError(
            f"{what} the model reads text only; give a Gemma 4 vision-language model "
            "(recipes/sft.py --task vision_counting trains one, or a Hugging Face gemma4 "
            "checkpoint)"
        )
    if vision:
        task = _vision_counting(config, kind, tokenizer, images, num_train or config.num_train)
    elif with_images:
        task = _image_file(config, kind, tokenizer, images, max_new_tokens)
    elif data is not None:
        task = _file(config, kind, tokenizer, max_new_tokens)
    else:
        task = _arithmetic(config, kind, tokenizer, num_train or config.num_train)
    context = model.config.max_position_embeddings
    if task.max_length > context and kind != "rl":  # rl: the sampled lengths, prompt_inputs
        raise UserError(
            f"{task.name}: sequences of {task.max_length} tokens (--max-length) are longer "
            f"than the model's context of {context} tokens (its max_position_embeddings); "
            "lower it"
        )
    skip_invalid = data is not None and config.skip_invalid  # a data file's records only
    task = dataclasses.replace(task, context=context, skip_invalid=skip_invalid)
    if len(task.train) < config.batch_size:
        raise UserError(
            f"--batch-size {config.batch_size} is larger than the {len(task.train)} training "
            f"records of {task.name}; lower it"
        )
    return task


def max_segments(task: Task) -> int:
    """A bound on the sequences a packed row holds: each takes at least two columns (a
    prompt token and a completion token), and pairs come whole (an even bound)."""
    return max(2, task.pack_length // 2 // 2 * 2)


# Batches laid out ahead by a thread of their own while the accelerator runs the steps:
# Grain reads, shuffles and lays out a record in about 0.1 ms of Python (a toy SFT batch of
# 64 rows took 6.7 ms on a TPU v5e host, against a 1.8 ms step), which would otherwise wait
# between the steps.
PREFETCH_BATCHES = 8


def batches(task: Task, placement, *, batch_size: int, seed: int, kind: str, packing: bool = False):
    """The endless training batches of `task` of `batch_size` rows, shuffled by `seed` (a
    checkpointable Grain iterator, `PREFETCH_BATCHES` ahead in a thread: close it when
    done): this process's rows of each, `placement.rows` makes the global batch of them."""

    if task.images is not None:  # records with images: shuffled, laid out batch by batch
        index, count = placement.shard
        order = grain.MapDataset.range(len(task.train)).shuffle(seed=seed).repeat()
        rows = order.batch(batch_size // count)[index::count]
        return _ahead(rows.map(lambda chosen: _image_rows(task, chosen)).to_iter_dataset())
    dataset = sft_dataset if kind == "sft" else preference_dataset
    try:
        return _ahead(
            dataset(
                task.train, task.tokenizer,
                max_length=task.pack_length if packing else task.max_length,
                batch_size=batch_size, seed=seed, packing=packing,
                max_segments=max_segments(task) if packing else None,
                on_invalid="skip" if task.skip_invalid else "raise", shard=placement.shard,
            )
        )  # fmt: skip
    except RecordError as error:
        raise _invalid(task, error) from None


def _invalid(task: Task, error: RecordError, part: str = "") -> UserError:
    """The line for a record of `task` that cannot be laid out (of its held-out records with
    `part`), with the flag that drops such records when they come from a data file."""
    hint = " (--skip-invalid drops invalid records)" if task.name != "arithmetic" else ""
    return UserError(f"{task.name}{part}: {error}{hint}")


def _ahead(dataset: grain.IterDataset):
    """An iterator of `dataset` that a thread keeps `PREFETCH_BATCHES` ahead of the reader;
    its checkpointed state is the position of the batches read, not of those laid out."""
    return iter(
        grain.experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=PREFETCH_BATCHES)
    )


def heldout_batches(task: Task, placement, *, batch_size: int, kind: str) -> list:
    """The held-out records in order, once, as batches of `batch_size` rows split over
    `placement`'s devices (every process reads them all and keeps its rows). The last batch
    is padded with empty rows (no completion token, False in every mask) to the same shape,
    so that an evaluation compiles one program, not one per batch shape."""

    if not task.heldout:
        return []
    b = batch_size
    if task.images is not None:
        batches = (
            _image_rows(task, range(i, min(i + b, len(task.heldout))), task.heldout)
            for i in range(0, len(task.heldout), b)
        )
    else:
        dataset = sft_dataset if kind == "sft" else preference_dataset
        try:  # laid out here, so that a record that does not fit is said before training
            batches = list(
                dataset(
                    task.heldout, task.tokenizer, max_length=task.max_length,
                    batch_size=b, shuffle=False, num_epochs=1, drop_remainder=False,
                    on_invalid="skip" if task.skip_invalid else "raise",
                )
            )  # fmt: skip
        except RecordError as error:
            raise _invalid(task, error, " (held out)") from None
    return [placement.global_rows(_padded(batch, b), pad=True) for batch in batches]


def _padded(batch, rows: int):
    """`batch` with rows of zeros added at the end up to `rows`."""
    extra = rows - len(jax.tree.leaves(batch)[0])
    if extra <= 0:
        return batch
    return jax.tree.map(
        lambda x: np.concatenate([x, np.zeros((extra, *x.shape[1:]), x.dtype)]), batch
    )


def _image_rows(task: Task, chosen, records: list | None = None) -> dict:
    """SFT rows of the records numbered `chosen` (of `task.train` by default), with their
    images."""
    records = task.train if records is None else records
    return pictures.sft_rows(
        [records[int(i)] for i in chosen], task.tokenizer, task.images,
        length=task.max_length, slots=task.slots,
    )  # fmt: skip


def prompts(task: Task, records: list[dict]):
    """Left-padded `(tokens, where)` of the records' prompts, `task.prompt_length` wide."""

    return encode_prompts(
        [r["prompt"] for r in records], task.tokenizer, max_length=task.prompt_length
    )


def prompt_inputs(task: Task, records: list[dict]) -> tuple:
    """`(tokens, where, images)`: the records' prompts as `prompts` lays them out, and for
    records with images their `[B, M, ...]` pixels (`kit.images.pixels`), else None. A
    prompt that, with `task.max_new_tokens` more, is longer than `task.context` is a
    `UserError`."""
    if task.images is None:
        tokens, where, pixels = (*prompts(task, records), None)
    else:
        tokens, where, pixels = pictures.prompt_rows(
            records, task.tokenizer, task.images, length=task.prompt_length, slots=task.slots
        )
    longest = int(np.asarray(where).sum(axis=1).max(initial=0))
    if task.context is not None and longest + task.max_new_tokens > task.context:
        raise UserError(
            f"{task.name}: a prompt of {longest} tokens and completions of "
            f"{task.max_new_tokens} (--max-new-tokens) are longer than the model's context "
            f"of {task.context} tokens (its max_position_embeddings); lower them"
        )
    return tokens, where, pixels


def prompts_of_rows(rows: dict, prompt_length: int):
    """The left-padded `(tokens, where)` prompts, `prompt_length` wide, of a batch of SFT rows
    (`tokens`, `where`, as `tunelib.data.sft_dataset` lays them out): each row's tokens up to
    its first completion token, which is the first target `where` counts. Jittable."""

    tokens, where = rows["tokens"], rows["where"]
    length = jnp.argmax(where, axis=1) + 1  # the prompt's last token predicts the first target
    source = jnp.arange(prompt_length)[None, :] - (prompt_length - length[:, None])
    real = source >= 0
    gathered = jnp.take_along_axis(tokens, jnp.clip(source, 0, tokens.shape[1] - 1), axis=1)
    return jnp.where(real, gathered, 0), real


def sequences_of_completions(prompt_tokens, prompt_where, tokens, where) -> dict:
    """SFT rows (`tokens`, `targets`, `where`, `attention_where`) of prompts `[B, P]`
    (left-padded) followed by their completions `[B, N]` (right-padded), as the sampler
    returns them: the model reads the concatenation, and the completion tokens are the
    targets that count. Jittable."""

    sequence = jnp.concatenate([prompt_tokens, tokens], axis=1)
    real = jnp.concatenate([prompt_where, where], axis=1)
    completion = jnp.concatenate([jnp.zeros_like(prompt_where), where], axis=1)
    return {
        "tokens": sequence[:, :-1],
        "targets": sequence[:, 1:],
        "attention_where": real[:, :-1],
        "where": completion[:, 1:],
    }
