"""The vision task: deterministic pictures whose answers can be read off the pixels."""

import numpy as np
import pytest
from scipy import ndimage

from tests._helpers import raises_naming
from tunelib.data import (
    VISION_QUESTIONS,
    read_image_records,
    validate_image_records,
    verify_answer,
    vision_counting_split,
    write_image_records,
)

# The standard seven-segment encoding, bit 0 = segment a (top) ... bit 6 = g (middle).
SEVEN_SEGMENT = (0x3F, 0x06, 0x5B, 0x4F, 0x66, 0x6D, 0x7D, 0x07, 0x7F, 0x6F)


def question(problem):
    return problem["prompt"][0]["content"][1]["text"]


def count_shapes(image):
    """Circles and squares in a picture: each separate blob, a square filling its box."""
    ink = (image != 255).any(axis=-1)
    labels, _ = ndimage.label(ink)
    counts = {"circle": 0, "square": 0}
    for blob in ndimage.find_objects(labels):
        fill = ink[blob].mean()
        counts["square" if fill == 1.0 else "circle"] += 1
        assert fill == 1.0 or fill < 0.9, fill
    return counts


def digit_mask(digit, size):
    """A digit drawn as the docstring says, here with NumPy: segments `thick` wide in a box
    of 5/16 by 9/16 of the picture."""
    width, height = size * 5 // 16, size * 9 // 16
    thick, middle = max(2, width // 4), height // 2
    boxes = [
        (0, thick, thick, width - thick),  # a: rows, then columns
        (thick, middle, width - thick, width),
        (middle, height - thick, width - thick, width),
        (height - thick, height, thick, width - thick),
        (middle, height - thick, 0, thick),
        (thick, middle, 0, thick),
        (middle - thick // 2, middle + thick - thick // 2, thick, width - thick),
    ]
    mask = np.zeros((height, width), bool)
    for bit, (top, bottom, left, right) in enumerate(boxes):
        if SEVEN_SEGMENT[digit] >> bit & 1:
            mask[top:bottom, left:right] = True
    return mask


def read_digit(half, size):
    """The digit whose mask, placed somewhere in `half` of the picture, is exactly its ink."""
    ink = (half != 255).any(axis=-1)
    found = set()
    for digit in range(10):
        mask = digit_mask(digit, size)
        for y in range(ink.shape[0] - mask.shape[0] + 1):
            for x in range(ink.shape[1] - mask.shape[1] + 1):
                if (
                    ink.sum() == mask.sum()
                    and ink[y : y + mask.shape[0], x : x + mask.shape[1]][mask].all()
                ):
                    found.add(digit)
    assert len(found) == 1, found
    return found.pop()


def test_the_split_is_deterministic_and_disjoint():
    train, heldout = vision_counting_split(num_train=12, num_heldout=4, seed=5)
    again, heldout_again = vision_counting_split(num_train=12, num_heldout=4, seed=5)
    more, heldout_more = vision_counting_split(num_train=20, num_heldout=4, seed=5)
    other, _ = vision_counting_split(num_train=12, num_heldout=4, seed=6)

    def pictures(problems):
        return [p["images"][0].tobytes() for p in problems]

    assert pictures(train) == pictures(again) and pictures(heldout) == pictures(heldout_again)
    assert [p["answer"] for p in train] == [p["answer"] for p in again]
    # Held-out does not depend on num_train; more training problems extend fewer.
    assert pictures(heldout_more) == pictures(heldout)
    assert pictures(more)[:12] == pictures(train)
    assert not set(pictures(heldout)) & set(pictures(more))
    assert len(set(pictures(more))) == 20
    assert pictures(other) != pictures(train)


@pytest.mark.parametrize("size", [32, 64])
def test_answers_are_read_off_the_pixels(size):
    train, _ = vision_counting_split(num_train=24, num_heldout=0, seed=1, size=size)
    kinds = set()
    for problem in train:
        (image,) = problem["images"]
        assert image.shape == (size, size, 3) and image.dtype == np.uint8
        text = question(problem)
        if text.startswith("How many"):
            shape = "circle" if "circles" in text else "square"
            counts = count_shapes(image)
            assert problem["answer"] == str(counts[shape]) and counts[shape] >= 1
            kinds.add(shape)
        else:
            assert text == "What is the sum of the two numbers shown?"
            a = read_digit(image[:, : size // 2], size)
            b = read_digit(image[:, size // 2 :], size)
            assert problem["answer"] == str(a + b)
            kinds.add("sum")
        assert verify_answer(
            f"There are {problem['answer']}.", problem["answer"], read="last_number"
        )
    assert kinds == {"circle", "square", "sum"}


def test_questions_and_counts_are_kept():
    train, _ = vision_counting_split(num_train=16, num_heldout=0, questions=("count",), max_count=2)
    assert all(question(p).startswith("How many") for p in train)
    assert {int(p["answer"]) for p in train} <= {1, 2}
    sums, _ = vision_counting_split(num_train=8, num_heldout=0, questions=("sum",))
    assert all("sum" in question(p) for p in sums)
    assert set(VISION_QUESTIONS) == {"count", "sum"}


@pytest.mark.parametrize("max_distractors", [0, 1])
def test_distractors_are_bounded(max_distractors):
    """`max_distractors` bounds the shapes not asked for (0: the asked shape only), read off
    the pixels; the asked shape still occurs 1 to `max_count` times."""
    train, _ = vision_counting_split(
        num_train=40, num_heldout=0, questions=("count",), max_count=3,
        max_distractors=max_distractors,
    )  # fmt: skip
    others, asked = set(), set()
    for problem in train:
        counts = count_shapes(problem["images"][0])
        shape = "circle" if "circles" in question(problem) else "square"
        assert problem["answer"] == str(counts[shape])
        asked.add(counts[shape])
        others.add(counts["square" if shape == "circle" else "circle"])
    assert asked == {1, 2, 3} and others == set(range(max_distractors + 1))


def test_records_check_and_round_trip(tmp_path):
    train, heldout = vision_counting_split(num_train=3, num_heldout=2, seed=2, size=32)
    _, report = validate_image_records(train + heldout, kind="rl")
    assert report.kept == 5
    path = write_image_records(train, tmp_path / "train.jsonl")
    read, _ = read_image_records(path, kind="rl")
    assert [r["answer"] for r in read] == [p["answer"] for p in train]
    assert [r["prompt"] for r in read] == [p["prompt"] for p in train]


def test_bad_arguments_are_named():
    with raises_naming("num_train"):
        vision_counting_split(num_train=-1, num_heldout=0)
    with raises_naming("size", "32"):
        vision_counting_split(num_train=1, num_heldout=0, size=16)
    with raises_naming("max_count"):
        vision_counting_split(num_train=1, num_heldout=0, max_count=9)
    with raises_naming("max_distractors"):
        vision_counting_split(num_train=1, num_heldout=0, max_distractors=-1)
    with raises_naming("questions", "'count'"):
        vision_counting_split(num_train=1, num_heldout=0, questions=("colour",))
