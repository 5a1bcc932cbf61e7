"""Records with images, laid out for a Gemma 4 vision-language model: token rows with each
image's soft tokens in place, and the images' pixels beside them, row by row.

A record's conversation is tokenized as the text recipes tokenize it, with the image markers
expanded into begin-of-image, one image token per soft token and end-of-image
(`tunelib.data.expand_image_tokens`): with the tokenizer's chat template when it has one
(the template writes the image token where a message has an image part), else in the plain
layout of the recipes' own models: `[BOS]`, then each message's parts in order (an image
part is its marker, a text part its characters), each assistant message followed by EOS.
The assistant turns are the completion.

The images of a batch travel as rows too, `[B, M, N, 3 p^2]` pixels and `[B, M, N, 2]` patch
positions (`tunelib.data.gemma4_image_inputs`' arrays, M image slots per row; a slot without
an image has only padding patches), so every array of a batch splits by rows over devices
and processes; `model_inputs` flattens them to the model's `[B M, N, 3 p^2]`.
"""

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from tunelib.data import (
    encode_chat,
    expand_image_tokens,
    gemma4_image_inputs,
    gemma4_image_size,
    load_image,
    vision_counting_split,
)

from kit.errors import UserError

# The conversation fields of an image record, in order (SFT: `messages`, or `prompt` and
# `completion`; RL: `prompt`).
CONVERSATIONS = ("messages", "prompt", "completion")

# The pixels of the tiny model's task: patches of 8 pixels, 2 x 2 of them pooled into a soft
# token, so a picture of 64 x 64 pixels (at most 16 soft tokens: any picture is resized to
# about that many pixels) is 16 soft tokens, one per cell of the counting task's 4 x 4 grid.
PATCH_SIZE, POOLING = 8, 2


@dataclasses.dataclass(frozen=True)
class ImageLayout:
    """How a vision-language model reads images: its image tokens and its preprocessing.

    Attributes:
      image_token_id, boi_token_id, eoi_token_id: the image token and the begin- and
        end-of-image tokens around each image's run of them (None: none).
      patch_size, pooling_kernel_size: the encoder's patches and pooling window.
      max_soft_tokens: the most soft tokens an image becomes.
    """

    image_token_id: int
    boi_token_id: int | None
    eoi_token_id: int | None
    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int

    @classmethod
    def of_checkpoint(cls, hf_config: Mapping, folder: Path | None) -> "ImageLayout":
        """The layout of a Gemma 4 `config.json` (`hf_config`), with `max_soft_tokens` from
        the folder's `preprocessor_config.json` (Gemma 4's default, 280, without one)."""
        vision = hf_config.get("vision_config") or {}
        max_soft_tokens = 280
        processor = None if folder is None else folder / "preprocessor_config.json"
        if processor is not None and processor.is_file():
            max_soft_tokens = json.loads(processor.read_text()).get("max_soft_tokens", 280)
        return cls(
            hf_config["image_token_id"], hf_config.get("boi_token_id"),
            hf_config.get("eoi_token_id"), vision.get("patch_size", 16),
            vision.get("pooling_kernel_size", 3), max_soft_tokens,
        )  # fmt: skip

    def options(self) -> dict:
        """`tunelib.data.gemma4_image_inputs`' options; also what is saved in a model's
        `preprocessor_config.json` (`of_checkpoint` reads `max_soft_tokens` back)."""
        return {
            "patch_size": self.patch_size,
            "pooling_kernel_size": self.pooling_kernel_size,
            "max_soft_tokens": self.max_soft_tokens,
        }

    def soft_tokens(self, image) -> int:
        """The soft tokens `image` (anything `load_image` reads) becomes."""
        height, width = load_image(image).shape[:2]
        size = gemma4_image_size(height, width, **self.options())
        return size[0] * size[1] // (self.patch_size * self.pooling_kernel_size) ** 2


def counting_task(
    *, seed: int, num_train: int, num_heldout: int, size: int, max_count: int,
    max_distractors: int | None = None,
):  # fmt: skip
    """`(train, heldout)` RL records of `tunelib.data.vision_counting_split`'s counting
    question ("How many circles are there?"), pictures of `size` pixels."""
    return vision_counting_split(
        seed=seed, num_train=num_train, num_heldout=num_heldout, size=size,
        max_count=max_count, max_distractors=max_distractors, questions=("count",),
    )  # fmt: skip


def as_sft(record: dict) -> dict:
    """An RL record (`images`, `prompt`, `answer`) as an SFT one: the answer is the reply."""
    reply = {"role": "assistant", "content": str(record["answer"])}
    return {"images": record["images"], "messages": [*record["prompt"], reply]}


def _plain(tokenizer, messages: list, image_token_id: int) -> tuple[list, list]:
    """`[BOS]` and each message's parts (an image part its marker), each assistant message
    marked as completion and followed by EOS."""
    ids = [tokenizer.bos_id] if tokenizer.add_bos else []
    where = [False] * len(ids)
    for message in messages:
        content = message["content"]
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        reply = message["role"] == "assistant"
        for part in parts:
            image = part["type"] == "image"
            part_ids = [image_token_id] if image else tokenizer.encode(part["text"])
            ids += part_ids
            where += [reply] * len(part_ids)
        if reply:
            ids.append(tokenizer.eos_id)
            where.append(True)
    return ids, where


def encode(record: Mapping, tokenizer, layout: ImageLayout, *, prompt: bool) -> tuple:
    """`(ids, where, counts)` of an image record: its tokens with the images' soft tokens in
    place, the completion mask, and each image's soft tokens. With `prompt`, the record's
    `prompt` conversation, to be continued (the chat template's generation prompt)."""
    if prompt:
        messages = list(record["prompt"])
    elif record.get("messages") is not None:
        messages = list(record["messages"])
    else:
        messages = [*record["prompt"], *record["completion"]]
    if tokenizer.chat_template is not None:
        ids, where = encode_chat(tokenizer, messages, add_generation_prompt=prompt)
    else:
        ids, where = _plain(tokenizer, messages, layout.image_token_id)
    counts = [layout.soft_tokens(image) for image in record["images"]]
    ids, where = expand(ids, where, counts, layout)
    return ids, where, counts


def expand(ids, where, counts: list[int], layout: ImageLayout):
    """`tunelib.data.expand_image_tokens` with the layout's tokens."""
    return expand_image_tokens(
        ids, counts, image_token_id=layout.image_token_id, boi_token_id=layout.boi_token_id,
        eoi_token_id=layout.eoi_token_id, where=where,
    )  # fmt: skip


def pixels(records: list, layout: ImageLayout, slots: int) -> dict:
    """`[B, slots, N, 3 p^2]` pixel values and `[B, slots, N, 2]` patch positions of the
    records' images (slots without an image: zeros and -1)."""
    patches = layout.max_soft_tokens * layout.pooling_kernel_size**2
    width = 3 * layout.patch_size**2
    values = np.zeros((len(records), slots, patches, width), np.float32)
    positions = np.full((len(records), slots, patches, 2), -1, np.int32)
    for row, record in enumerate(records):
        if record["images"]:
            inputs = gemma4_image_inputs(record["images"], **layout.options())
            count = len(record["images"])
            values[row, :count] = inputs["pixel_values"]
            positions[row, :count] = inputs["image_position_ids"]
    return {"pixel_values": values, "image_position_ids": positions}


def sft_rows(records: list, tokenizer, layout: ImageLayout, *, length: int, slots: int) -> dict:
    """A batch of SFT rows (`tunelib.data.sft_dataset`'s layout, `length` wide) of image
    records, with their pixels (`pixels`)."""
    size = (len(records), length)
    tokens, targets = (np.full(size, tokenizer.pad_id, np.int32) for _ in range(2))
    where, attention = np.zeros(size, bool), np.zeros(size, bool)
    for row, record in enumerate(records):
        ids, mask, _ = encode(record, tokenizer, layout, prompt=False)
        n = len(ids) - 1
        tokens[row, :n], targets[row, :n] = ids[:-1], ids[1:]
        where[row, :n], attention[row, :n] = mask[1:], True
    rows = {"tokens": tokens, "targets": targets, "where": where, "attention_where": attention}
    return {**rows, **pixels(records, layout, slots)}


def prompt_rows(records: list, tokenizer, layout: ImageLayout, *, length: int, slots: int):
    """Left-padded `(tokens, where)` `[B, length]` of the records' prompts, and their images
    (`pixels`)."""
    tokens = np.full((len(records), length), tokenizer.pad_id, np.int32)
    where = np.zeros((len(records), length), bool)
    for row, record in enumerate(records):
        ids, _, _ = encode(record, tokenizer, layout, prompt=True)
        tokens[row, length - len(ids) :], where[row, length - len(ids) :] = ids, True
    return tokens, where, pixels(records, layout, slots)


def model_inputs(batch: Mapping) -> dict:
    """The model's `pixel_values` and `image_position_ids` (images flattened row by row) of
    a batch with images; nothing for a batch without."""
    if "pixel_values" not in batch:
        return {}
    return {
        name: batch[name].reshape(-1, *batch[name].shape[2:])
        for name in ("pixel_values", "image_position_ids")
    }


def lengths(records: list, tokenizer, layout: ImageLayout, *, kind: str, name: str) -> dict:
    """The widths a task's records need: `max_length` (SFT sequences), `prompt_length` and
    `slots` (images per record); a `UserError` naming the first record that cannot be laid
    out (text the tokenizer cannot encode, a template that fails)."""
    longest = {"max_length": 2, "prompt_length": 1, "slots": 1}
    for index, record in enumerate(records):
        try:
            ids, _, _ = encode(record, tokenizer, layout, prompt=kind == "rl")
        except ValueError as error:
            raise UserError(f"{name}: record {index}: {error}") from None
        key = "prompt_length" if kind == "rl" else "max_length"
        longest[key] = max(longest[key], len(ids))
        longest["slots"] = max(longest["slots"], len(record["images"]))
    return longest
