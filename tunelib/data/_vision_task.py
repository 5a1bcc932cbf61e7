"""The built-in vision task: shapes to count and digits to add, drawn on small canvases."""

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageDraw

VISION_QUESTIONS = ("count", "sum")
_SHAPES = ("circle", "square")
_COLOURS = ((200, 30, 30), (30, 120, 200), (30, 150, 60), (120, 60, 160), (20, 20, 20))
# The lit segments of each digit on a seven-segment display: a top, b top right,
# c bottom right, d bottom, e bottom left, f top left, g middle.
_SEGMENTS = (
    "abcdef",
    "bc",
    "abdeg",
    "abcdg",
    "bcfg",
    "acdfg",
    "acdefg",
    "abc",
    "abcdefg",
    "abcdfg",
)
_GRID = 4  # shapes sit in distinct cells of a 4 x 4 grid


def _segment_boxes(x: int, y: int, width: int, height: int, thick: int) -> dict[str, tuple]:
    middle = y + height // 2
    right = x + width
    bottom = y + height
    return {
        "a": (x + thick, y, right - thick, y + thick),
        "b": (right - thick, y + thick, right, middle),
        "c": (right - thick, middle, right, bottom - thick),
        "d": (x + thick, bottom - thick, right - thick, bottom),
        "e": (x, middle, x + thick, bottom - thick),
        "f": (x, y + thick, x + thick, middle),
        "g": (x + thick, middle - thick // 2, right - thick, middle + thick - thick // 2),
    }


def _draw_digit(draw: PIL.ImageDraw.ImageDraw, digit: int, box: tuple, colour: tuple) -> None:
    x, y, width, height = box
    boxes = _segment_boxes(x, y, width, height, max(2, width // 4))
    for segment in _SEGMENTS[digit]:
        left, top, right, bottom = boxes[segment]
        draw.rectangle((left, top, right - 1, bottom - 1), fill=colour)


def _count_problem(
    rng: random.Random, size: int, max_count: int, max_distractors: int
) -> tuple[tuple, str, str]:
    """Circles and squares in distinct grid cells; the question asks for one of the shapes."""
    asked = rng.choice(_SHAPES)
    counts = {asked: rng.randint(1, max_count)}
    other = _SHAPES[1 - _SHAPES.index(asked)]
    counts[other] = rng.randint(0, max_distractors)
    cells = rng.sample(range(_GRID * _GRID), counts[asked] + counts[other])
    cell = size // _GRID
    shapes = []
    for shape, where in zip([asked] * counts[asked] + [other] * counts[other], cells, strict=True):
        # A pixel of margin in each cell keeps shapes in neighbouring cells apart.
        radius = rng.randint(cell // 4, cell // 2 - 2)
        cx = (where % _GRID) * cell + rng.randint(radius + 1, cell - radius - 2)
        cy = (where // _GRID) * cell + rng.randint(radius + 1, cell - radius - 2)
        shapes.append((shape, cx, cy, radius, rng.choice(_COLOURS)))
    question = f"How many {asked}s are there?"
    return ("count", tuple(shapes)), question, str(counts[asked])


def _sum_problem(rng: random.Random, size: int) -> tuple[tuple, str, str]:
    """Two digits side by side; the question asks for their sum."""
    width, height = size * 5 // 16, size * 9 // 16
    digits = []
    for half in (0, 1):
        x = half * size // 2 + rng.randint(1, size // 2 - width - 1)
        y = rng.randint(1, size - height - 1)
        digits.append((rng.randrange(10), x, y, rng.choice(_COLOURS)))
    question = "What is the sum of the two numbers shown?"
    return ("sum", tuple(digits)), question, str(digits[0][0] + digits[1][0])


def _render(key: tuple, size: int) -> np.ndarray:
    image = PIL.Image.new("RGB", (size, size), (255, 255, 255))
    draw = PIL.ImageDraw.Draw(image)
    kind, items = key
    if kind == "count":
        for shape, cx, cy, radius, colour in items:
            box = (cx - radius, cy - radius, cx + radius, cy + radius)
            if shape == "circle":
                draw.ellipse(box, fill=colour)
            else:
                draw.rectangle(box, fill=colour)
    else:
        width, height = size * 5 // 16, size * 9 // 16
        for digit, x, y, colour in items:
            _draw_digit(draw, digit, (x, y, width, height), colour)
    return np.asarray(image)


def vision_counting_split(
    *,
    num_train: int,
    num_heldout: int,
    seed: int = 0,
    size: int = 64,
    max_count: int = 4,
    max_distractors: int | None = None,
    questions: Sequence[str] = VISION_QUESTIONS,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    r"""Disjoint train and held-out sets of pictures with a question and an integer answer.

    Each problem is one RGB image of `size` x `size` pixels on white and one question:

    * `"count"`: circles and squares, each in its own cell of a 4 x 4 grid (a random radius,
      place in the cell and colour; no two shapes touch); "How many circles are there?"
      (or squares), with $1 \le n_{\mathrm{asked}} \le$ `max_count` and
      $0 \le n_{\mathrm{other}} \le$ `max_distractors` (the shapes not asked for, by
      default up to `max_count`; with `max_distractors=0` the picture holds the asked shape
      only, and counting it is counting what is drawn); the answer is $n_{\mathrm{asked}}$;
    * `"sum"`: two digits $a, b \in \{0, \dots, 9\}$ drawn as on a seven-segment display,
      one in each half of the picture at a random place and colour; "What is the sum of
      the two numbers shown?", the answer $a + b$.

    The kind of each problem is drawn uniformly from `questions`. Problems are drawn until
    `num_heldout + num_train` distinct pictures are found (a drawing repeated is drawn
    again); the first `num_heldout` are the held-out set and the next `num_train` the
    training set, so no held-out picture occurs in training, the held-out set does not
    depend on `num_train`, and a larger `num_train` extends a smaller one. Everything is
    drawn by PIL without fonts or anti-aliasing, so the pictures are a deterministic
    function of the arguments. `verify_answer(completion, answer, read="last_number")` is
    the task's reward.

    Args:
      num_train: number of training problems.
      num_heldout: number of held-out problems.
      seed: the split is a deterministic function of `seed` and the other arguments.
      size: the side of the pictures in pixels, >= 32.
      max_count: the most shapes of one kind in a picture, 1 to 8.
      max_distractors: the most shapes of the kind not asked for, 0 to 8 (None:
        `max_count`).
      questions: a non-empty subset of `("count", "sum")`.

    Returns:
      `(train, heldout)`: lists of RL image records (`validate_image_records(kind="rl")`),
      `{"images": [uint8 [size, size, 3]], "prompt": [{"role": "user", "content":
      [{"type": "image"}, {"type": "text", "text": question}]}], "answer": "3"}`.
      `write_image_records` saves them as PNG files and JSON lines.

    Raises:
      ValueError: for a negative count, a `size` below 32, a `max_count` outside 1..8, a
        `max_distractors` outside 0..8 or unknown questions.

    Examples:
      >>> from tunelib.data import vision_counting_split
      >>> train, heldout = vision_counting_split(num_train=3, num_heldout=1, seed=1)
      >>> for problem in train + heldout:
      ...     print(problem["prompt"][0]["content"][1]["text"], problem["answer"])
      How many circles are there? 3
      How many squares are there? 3
      What is the sum of the two numbers shown? 15
      How many circles are there? 3
      >>> heldout[0]["images"][0].shape, heldout[0]["images"][0].dtype
      ((64, 64, 3), dtype('uint8'))
    """
    for name, value in (("num_train", num_train), ("num_heldout", num_heldout)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}.")
    if size < 32:
        raise ValueError(f"size must be >= 32 pixels, got {size}.")
    if not 1 <= max_count <= _GRID * _GRID // 2:
        raise ValueError(f"max_count must be in 1..{_GRID * _GRID // 2}, got {max_count}.")
    max_distractors = max_count if max_distractors is None else max_distractors
    if not 0 <= max_distractors <= _GRID * _GRID // 2:
        raise ValueError(
            f"max_distractors must be in 0..{_GRID * _GRID // 2}, got {max_distractors}."
        )
    questions = tuple(questions)
    if not questions or any(q not in VISION_QUESTIONS for q in questions):
        raise ValueError(
            f"questions must be a non-empty subset of {VISION_QUESTIONS}, got {questions}."
        )
    rng = random.Random(seed)
    seen: set[tuple] = set()
    problems = []
    while len(problems) < num_heldout + num_train:
        if rng.choice(questions) == "count":
            key, question, answer = _count_problem(rng, size, max_count, max_distractors)
        else:
            key, question, answer = _sum_problem(rng, size)
        if key in seen:
            continue
        seen.add(key)
        content = [{"type": "image"}, {"type": "text", "text": question}]
        problems.append(
            {
                "images": [_render(key, size)],
                "prompt": [{"role": "user", "content": content}],
                "answer": answer,
            }
        )
    return problems[num_heldout:], problems[:num_heldout]
