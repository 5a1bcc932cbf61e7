"""The built-in synthetic task: integer arithmetic with a held-out split and a verifier."""

import random
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

OPERATIONS = ("+", "-", "*")

_INTEGER = re.compile(r"-?\d+")
_PROMPT = re.compile(r"(\d+)([-+*])(\d+)=")
# Off-by amounts of the "small slip" near miss: a unit or two, or a dropped / extra carry.
_SLIPS = (-10, -2, -1, 1, 2, 10)


def _check_count(value: int, name: str) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}.")


def _canonical_operations(operations: Iterable[str]) -> tuple[str, ...]:
    operations = tuple(operations)
    unknown = [op for op in operations if op not in OPERATIONS]
    if not operations or unknown or len(set(operations)) != len(operations):
        raise ValueError(
            f"operations must be distinct entries of {OPERATIONS}, at least one, got {operations}."
        )
    return tuple(op for op in OPERATIONS if op in operations)


_SHUFFLE_LIMIT = 10**6


def _sample_distinct(rng: random.Random, population: int, k: int) -> list[int]:
    """`k` distinct integers of `range(population)` in random order.

    The first `j` of them do not depend on `k`, so splits with more training problems extend
    those with fewer. Populations up to a million are shuffled whole; larger ones are sampled
    by rejection without being enumerated.
    """
    if population <= _SHUFFLE_LIMIT:
        order = list(range(population))
        rng.shuffle(order)
        return order[:k]
    seen: set[int] = set()
    order = []
    while len(order) < k:
        x = rng.randrange(population)
        if x not in seen:
            seen.add(x)
            order.append(x)
    return order


def _problem(index: int, operations: tuple[str, ...], base: int) -> dict[str, str]:
    op_index, pair = divmod(index, base * base)
    a, b = divmod(pair, base)
    op = operations[op_index]
    result = a + b if op == "+" else a - b if op == "-" else a * b
    return {"prompt": f"{a}{op}{b}=", "answer": str(result)}


def arithmetic_split(
    *,
    num_train: int,
    num_heldout: int,
    seed: int = 0,
    max_digits: int = 2,
    operations: Sequence[str] = ("+",),
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    r"""Disjoint train and held-out sets of arithmetic problems `"a<op>b="` with answers.

    $$
    \mathcal{P} = \{(a, \circ, b) : 0 \le a, b < 10^D,\ \circ \in O\},
    \qquad |\mathcal{P}| = |O| \cdot 10^{2D},
    \qquad \mathrm{answer}(a, \circ, b) = a \circ b
    $$

    with $D$ = `max_digits` (operands have 1 to $D$ decimal digits, no leading zeros) and
    $O$ = `operations`; the answer is written as a decimal integer. Subtraction may give a
    negative answer, written with a leading minus sign (`"3-7="` has answer `"-4"`); operands
    are never negative, so prompts are unambiguous. `num_train + num_heldout` problems are
    drawn uniformly from $\mathcal{P}$ without replacement (by rejection when $\mathcal{P}$ is
    large, so a large `max_digits` costs nothing extra; being uniform over values, most
    operands have $D$ digits). The first `num_heldout` become the held-out set and the next
    `num_train` the training set, so no held-out problem occurs in training, the held-out set
    does not depend on `num_train`, and a larger `num_train` extends a smaller one. Problems
    are distinct by identity: `"3+4="` and `"4+3="` are different problems and may fall on
    different sides of the split.

    Args:
      num_train: number of training problems.
      num_heldout: number of held-out problems.
      seed: the split is a deterministic function of `seed` and the other arguments.
      max_digits: $D \ge 1$, the most digits an operand has.
      operations: a non-empty subset of `("+", "-", "*")`; the order does not matter.

    Returns:
      `(train, heldout)`: lists of `{"prompt": "47+8=", "answer": "55"}` dicts.

    Raises:
      ValueError: if more problems are asked for than exist, naming both counts.

    Examples:
      >>> from tunelib.data import arithmetic_split
      >>> train, heldout = arithmetic_split(
      ...     num_train=3, num_heldout=1, seed=0, max_digits=2, operations=("+", "-")
      ... )
      >>> for problem in train:
      ...     print(problem)
      {'prompt': '75+77=', 'answer': '152'}
      {'prompt': '21-58=', 'answer': '-37'}
      {'prompt': '96+12=', 'answer': '108'}
      >>> heldout
      [{'prompt': '60+6=', 'answer': '66'}]
    """
    _check_count(num_train, "num_train")
    _check_count(num_heldout, "num_heldout")
    if max_digits < 1:
        raise ValueError(f"max_digits must be >= 1, got {max_digits}.")
    operations = _canonical_operations(operations)
    base = 10**max_digits
    population = len(operations) * base * base
    wanted = num_train + num_heldout
    if wanted > population:
        raise ValueError(
            f"asked for {wanted} problems (num_train={num_train} + num_heldout={num_heldout}) "
            f"but max_digits={max_digits} with operations {operations} gives only {population} "
            "distinct problems."
        )
    indices = _sample_distinct(random.Random(seed), population, wanted)
    problems = [_problem(i, operations, base) for i in indices]
    return problems[num_heldout:], problems[:num_heldout]


def _near_miss(answer: int, rng: random.Random) -> int:
    """A wrong answer close to `answer`: off by a small slip, or one digit changed."""
    if rng.random() < 0.5:
        slip = rng.choice(_SLIPS)
        wrong = answer + slip
        # A non-negative answer gets a non-negative near miss (e.g. for addition).
        return answer - slip if answer >= 0 and wrong < 0 else wrong
    digits = str(abs(answer))
    position = rng.randrange(len(digits))
    leading = position == 0 and len(digits) > 1
    replacements = [d for d in "0123456789" if d != digits[position] and not (leading and d == "0")]
    changed = int(digits[:position] + rng.choice(replacements) + digits[position + 1 :])
    return -changed if answer < 0 else changed


def preference_pairs(
    problems: Iterable[Mapping[str, Any]], *, seed: int = 0
) -> list[dict[str, Any]]:
    r"""Preference pairs from arithmetic problems: the correct answer against a near miss.

    $$
    \mathrm{rejected} \in \{y + \delta : \delta \in \{\pm 1, \pm 2, \pm 10\}\}
    \cup \{y \text{ with one digit replaced}\}, \qquad \mathrm{chosen} = y
    $$

    with $y$ = `problem["answer"]`. Each kind of near miss is drawn with probability 1/2; a
    slip is mirrored ($y - \delta$ instead of $y + \delta$) to stay non-negative when $y$ is,
    and a digit replacement never makes a leading zero and keeps the sign. `rejected` never
    equals `chosen`.

    Args:
      problems: dicts with `"prompt"` and an integer `"answer"`, as from `arithmetic_split`.
      seed: the pairs are a deterministic function of `seed` and `problems`.

    Returns:
      A list of `{"prompt", "chosen", "rejected"}` dicts in the order of `problems`; each
      prompt as its problem has it (a string, or chat messages).

    Raises:
      ValueError: naming the problem index when a problem has no integer answer.

    Examples:
      >>> from tunelib.data import preference_pairs
      >>> problems = [{"prompt": "47+8=", "answer": "55"}, {"prompt": "3-7=", "answer": "-4"}]
      >>> for pair in preference_pairs(problems, seed=1):
      ...     print(pair)
      {'prompt': '47+8=', 'chosen': '55', 'rejected': '45'}
      {'prompt': '3-7=', 'chosen': '-4', 'rejected': '-3'}
    """
    rng = random.Random(seed)
    pairs = []
    for index, problem in enumerate(problems):
        answer = problem.get("answer") if isinstance(problem, Mapping) else None
        if not isinstance(answer, str) or not _INTEGER.fullmatch(answer) or "prompt" not in problem:
            raise ValueError(
                f"problem {index}: needs a 'prompt' and an integer 'answer' string, "
                f"got {problem!r}."
            )
        rejected = str(_near_miss(int(answer), rng))
        pairs.append({"prompt": problem["prompt"], "chosen": answer, "rejected": rejected})
    return pairs


AnswerReading = Literal["exact", "last_number"]
ANSWER_READINGS: tuple[str, ...] = AnswerReading.__args__
# An integer as a model writes one: an optional minus and digits, maybe grouped by commas.
_WRITTEN_INTEGER = re.compile(r"-?\d+(?:,\d{3})*(?!\d)")


def last_number(text: str) -> str | None:
    """The last integer written in `text`, commas between digit groups dropped, or None.

    Examples:
      >>> from tunelib.data import last_number
      >>> last_number("47 + 38 = 85."), last_number("It is 1,024"), last_number("no digits")
      ('85', '1024', None)
    """
    found = _WRITTEN_INTEGER.findall(text)
    return found[-1].replace(",", "") if found else None


def verify_answer(completion: str, answer: str, *, read: AnswerReading = "exact") -> bool:
    """Whether a completion gives the answer: the reward of the arithmetic task.

    The completion must already be cut at EOS (as the tokenizers' `decode` does). With
    `read="exact"` (the plain task, "47+8=" -> "55") it must be exactly the answer, nothing
    stripped, so `" 55"` or `"55 "` is wrong for `"55"`. With `read="last_number"` (the task
    asked in words of a chat model, which may explain before it answers) the last integer the
    completion writes (`last_number`) must equal the answer.

    Args:
      completion: the generated text after the prompt.
      answer: the reference answer, as from `arithmetic_split`.
      read: "exact" or "last_number".

    Returns:
      True when the completion gives the answer.

    Examples:
      >>> from tunelib.data import verify_answer
      >>> verify_answer("55", "55"), verify_answer("55 ", "55"), verify_answer("-4", "-4")
      (True, False, True)
      >>> verify_answer("47 + 8 = 55.", "55", read="last_number")
      True
    """
    if read == "exact":
        return completion == answer
    if read == "last_number":
        return last_number(completion) == answer
    raise ValueError(f"read must be one of {ANSWER_READINGS}, got {read!r}.")


def problem_in_words(problem: Mapping[str, Any]) -> list[dict[str, str]]:
    """An arithmetic problem as a chat model is asked it: one user message in words.

    Examples:
      >>> from tunelib.data import problem_in_words
      >>> problem_in_words({"prompt": "47+38=", "answer": "85"})
      [{'role': 'user', 'content': 'What is 47 + 38?'}]
    """
    prompt = problem.get("prompt") if isinstance(problem, Mapping) else None
    match = _PROMPT.fullmatch(prompt) if isinstance(prompt, str) else None
    if match is None:
        raise ValueError(f"problem {problem!r} is not an arithmetic problem like '47+38='.")
    a, op, b = match.groups()
    return [{"role": "user", "content": f"What is {a} {op} {b}?"}]
