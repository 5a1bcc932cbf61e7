import operator
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._helpers import own_checks, raises_naming
from tunelib.data import (
    OPERATIONS,
    arithmetic_split,
    last_number,
    preference_pairs,
    problem_in_words,
    verify_answer,
)

PROMPT = re.compile(r"(0|[1-9]\d*)([+*-])(0|[1-9]\d*)=")
APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def ref_answer(prompt: str, max_digits: int, operations) -> str:
    """Parse `a<op>b=` and compute the answer with Python integers."""
    match = PROMPT.fullmatch(prompt)
    assert match, prompt
    a, op, b = match.groups()
    assert op in operations and len(a) <= max_digits and len(b) <= max_digits
    return str(APPLY[op](int(a), int(b)))


def check_problems(problems, max_digits, operations):
    for problem in problems:
        assert set(problem) == {"prompt", "answer"}
        assert problem["answer"] == ref_answer(problem["prompt"], max_digits, operations)


operation_sets = st.lists(st.sampled_from(OPERATIONS), min_size=1, max_size=3, unique=True)


# Each example shuffles up to 30,000 problems twice: fewer examples than the profile's.
@settings(max_examples=12)
@given(st.integers(0, 2**40), st.integers(1, 2), operation_sets, st.integers(0, 60), st.data())
def test_split_properties(seed, max_digits, operations, num_train, data):
    num_heldout = data.draw(st.integers(0, 30))
    train, heldout = arithmetic_split(
        num_train=num_train,
        num_heldout=num_heldout,
        seed=seed,
        max_digits=max_digits,
        operations=operations,
    )
    assert (len(train), len(heldout)) == (num_train, num_heldout)
    train_prompts = [p["prompt"] for p in train]
    heldout_prompts = {p["prompt"] for p in heldout}
    assert len(set(train_prompts)) == num_train and len(heldout_prompts) == num_heldout
    assert heldout_prompts.isdisjoint(train_prompts)
    check_problems(train + heldout, max_digits, operations)
    again = arithmetic_split(
        num_train=num_train,
        num_heldout=num_heldout,
        seed=seed,
        max_digits=max_digits,
        operations=operations[::-1],
    )
    assert again == (train, heldout)


def test_fixed_values_and_seeds():
    train, heldout = arithmetic_split(num_train=4000, num_heldout=200, seed=0)
    assert (len(train), len(heldout)) == (4000, 200)
    check_problems(train + heldout, 2, ("+",))
    assert {p["prompt"] for p in heldout}.isdisjoint(p["prompt"] for p in train)
    assert arithmetic_split(num_train=4000, num_heldout=200, seed=0) == (train, heldout)
    other = arithmetic_split(num_train=4000, num_heldout=200, seed=1)
    assert other[0] != train and other[1] != heldout
    # Uniform over operand values: most operands of a 2-digit task have 2 digits, and 1-digit
    # ones occur too.
    lengths = [len(a) for p in train for a in PROMPT.fullmatch(p["prompt"]).group(1, 3)]
    assert 0.05 < lengths.count(1) / len(lengths) < 0.15


@pytest.mark.parametrize("max_digits", [2, 4])
def test_heldout_does_not_depend_on_num_train_and_train_sets_nest(max_digits):
    small_train, heldout = arithmetic_split(
        num_train=50, num_heldout=30, seed=3, max_digits=max_digits
    )
    large_train, same_heldout = arithmetic_split(
        num_train=500, num_heldout=30, seed=3, max_digits=max_digits
    )
    assert same_heldout == heldout
    assert large_train[:50] == small_train


def test_negative_answers_are_written_with_minus():
    train, _ = arithmetic_split(num_train=60, num_heldout=0, max_digits=1, operations=("-",))
    negative = [p for p in train if p["answer"].startswith("-")]
    assert negative, "subtraction of one-digit operands gives some negative answers"
    check_problems(train, 1, ("-",))
    assert all(not p["answer"].startswith("-0") for p in train)


def test_whole_space_and_count_errors():
    train, heldout = arithmetic_split(num_train=150, num_heldout=50, max_digits=1, operations="+-")
    every = {f"{a}{op}{b}=" for a in range(10) for b in range(10) for op in "+-"}
    assert {p["prompt"] for p in train + heldout} == every
    with raises_naming("201", "200", "num_train=151", "num_heldout=50", error=ValueError):
        arithmetic_split(num_train=151, num_heldout=50, max_digits=1, operations="+-")
    with raises_naming("num_train", error=ValueError):
        arithmetic_split(num_train=-1, num_heldout=0)
    with raises_naming("num_heldout", error=ValueError):
        arithmetic_split(num_train=0, num_heldout=-3)
    with raises_naming("max_digits", error=ValueError):
        arithmetic_split(num_train=1, num_heldout=0, max_digits=0)
    for bad in [("/",), (), ("+", "+")]:
        with raises_naming("operations", error=ValueError):
            arithmetic_split(num_train=1, num_heldout=0, operations=bad)


def test_large_max_digits_is_fast():
    start = time.perf_counter()
    train, heldout = arithmetic_split(
        num_train=2000, num_heldout=100, max_digits=30, operations=OPERATIONS
    )
    assert time.perf_counter() - start < 2.0
    check_problems(train + heldout, 30, OPERATIONS)
    assert {p["prompt"] for p in heldout}.isdisjoint(p["prompt"] for p in train)


def is_near_miss(rejected: str, answer: str) -> bool:
    """Off by 1, 2 or 10, or the same number of digits with exactly one digit different."""
    y, r = int(answer), int(rejected)
    if abs(r - y) in (1, 2, 10):
        return True
    a, b = str(abs(y)), str(abs(r))
    return len(a) == len(b) and sum(x != z for x, z in zip(a, b, strict=True)) == 1


@given(st.lists(st.integers(-(10**6), 10**6), min_size=1, max_size=20), st.integers(0, 2**32))
def test_preference_pairs_properties(answers, seed):
    problems = [{"prompt": f"p{i}=", "answer": str(y)} for i, y in enumerate(answers)]
    pairs = preference_pairs(problems, seed=seed)
    assert pairs == preference_pairs(problems, seed=seed)
    assert len(pairs) == len(problems)
    for problem, pair in zip(problems, pairs, strict=True):
        assert set(pair) == {"prompt", "chosen", "rejected"}
        assert pair["prompt"] == problem["prompt"] and pair["chosen"] == problem["answer"]
        assert pair["rejected"] != pair["chosen"]
        # A canonical integer: no leading zero, no "-0".
        assert re.fullmatch(r"0|-?[1-9]\d*", pair["rejected"]), pair
        assert is_near_miss(pair["rejected"], pair["chosen"]), pair
        if int(pair["chosen"]) >= 0:
            assert int(pair["rejected"]) >= 0


def test_preference_pairs_on_the_task():
    train, _ = arithmetic_split(num_train=500, num_heldout=0, operations=OPERATIONS)
    pairs = preference_pairs(train, seed=0)
    assert all(p["rejected"] != p["chosen"] for p in pairs)
    assert preference_pairs(train, seed=1) != pairs
    # Both kinds of near miss occur.
    slips = sum(abs(int(p["rejected"]) - int(p["chosen"])) in (1, 2, 10) for p in pairs)
    assert 100 < slips < 400
    with raises_naming("problem 1", error=ValueError):
        preference_pairs([train[0], {"prompt": "1+1=", "answer": "two"}])
    with raises_naming("problem 0", error=ValueError):
        preference_pairs([{"answer": "2"}])
    with own_checks(), raises_naming("problem 2", error=ValueError):
        preference_pairs([train[0], train[1], "1+1=2"])


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("55", "55", True),
        ("-4", "-4", True),
        ("56", "55", False),
        (" 55", "55", False),
        ("55 ", "55", False),
        ("", "55", False),
        ("055", "55", False),
    ],
)
def test_verify_answer(completion, answer, expected):
    assert verify_answer(completion, answer) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("85", "85"),
        ("47 + 38 = 85.", "85"),
        ("The answer is -9", "-9"),
        ("47 - 56 = -9, so -9.", "-9"),
        ("It is 1,024.", "1024"),
        ("1,2", "2"),  # not a thousands group: two numbers
        ("12345", "12345"),
        ("no number", None),
        ("", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("85", "85", True),
        (" 85 ", "85", True),
        ("To add them: 47 + 38 = 85", "85", True),
        ("85, or maybe 86", "85", False),  # the last number counts
        ("To add 47 and 38, we", "85", False),
        ("-4", "-4", True),
        ("4", "-4", False),
    ],
)
def test_verify_answer_reads_the_last_number(completion, answer, expected):
    assert verify_answer(completion, answer, read="last_number") is expected


def test_verify_answer_names_an_unknown_reading():
    with own_checks(), raises_naming("read", "'first'", "exact", "last_number", error=ValueError):
        verify_answer("1", "1", read="first")


def test_problem_in_words_asks_each_operation():
    train, _ = arithmetic_split(num_train=60, num_heldout=0, seed=3, operations=("+", "-", "*"))
    for problem in train:
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", problem["prompt"]).groups()
        assert problem_in_words(problem) == [{"role": "user", "content": f"What is {a} {op} {b}?"}]
    with raises_naming("'12+'", error=ValueError):
        problem_in_words({"prompt": "12+", "answer": "12"})
